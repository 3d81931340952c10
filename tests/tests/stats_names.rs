//! docs/PROTOCOL.md (section 6.6) lists every STATS counter the reference target sends, in
//! order, so that the document alone suffices to read them. This keeps the list true.

use skiff_tests::start_target;

/// The counter names in the table of section 6.6, in order.
fn documented_names() -> Vec<String> {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/PROTOCOL.md"))
        .expect("docs/PROTOCOL.md");
    let start = doc.find("target sends these, in this order").expect("the counter table's introduction");
    let end = start + doc[start..].find("tests/tests/stats_names.rs").expect("the end of the table");
    let mut names = Vec::new();
    for row in doc[start..end].lines().filter(|l| l.starts_with("| `")) {
        let first_column = row.split('|').nth(1).expect("a first column");
        names.extend(first_column.split('`').skip(1).step_by(2).map(str::to_owned));
    }
    names
}

#[test]
fn the_documented_counters_are_the_ones_the_target_sends() {
    let t = start_target(&["vol=ram:1M"], 1);
    let sent: Vec<String> = t.stats().entries.into_iter().map(|(name, _)| name).collect();
    assert_eq!(documented_names(), sent, "docs/PROTOCOL.md section 6.6 and the target disagree");
}

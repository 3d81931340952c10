/* Exercises skiff.h from C against a running target: argv[1] is HOST:PORT, argv[2] the export.
 * Prints the struct layouts first so the Rust test can compare them with its own. */
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "skiff.h"

#define QD 8
#define BS 4096

static int fail(const char *what, int rc) {
    fprintf(stderr, "%s failed: %d (%s)\n", what, rc, skiff_last_error());
    return 1;
}

int main(int argc, char **argv) {
    printf("layout completion %zu %zu %zu\n", sizeof(skiff_completion), offsetof(skiff_completion, result),
           offsetof(skiff_completion, reserved));
    printf("layout config %zu %zu %zu\n", sizeof(skiff_lane_config), offsetof(skiff_lane_config, timeout_ms),
           offsetof(skiff_lane_config, shared_lanes));
    if (argc < 3) return 2;

    skiff_lane_config cfg;
    skiff_lane_config_default(&cfg);
    cfg.queue_depth = QD;
    skiff_lane *lane = NULL;
    int rc = skiff_lane_open(argv[1], argv[2], &cfg, &lane);
    if (rc != 0) return fail("open", rc);
    printf("size %llu block %u qd %u\n", (unsigned long long)skiff_lane_size(lane), skiff_lane_block_size(lane),
           skiff_lane_queue_depth(lane));

    static unsigned char bufs[QD][BS];
    skiff_completion done[QD];
    for (int i = 0; i < QD; i++) {
        memset(bufs[i], 'a' + i, BS);
        rc = skiff_lane_submit(lane, SKIFF_OP_WRITE, i == QD - 1 ? SKIFF_FLAG_FUA : 0, (uint64_t)i * BS, bufs[i], BS, 100 + i);
        if (rc != 0) return fail("submit write", rc);
    }
    /* The queue is full now: one more is refused, not queued. */
    rc = skiff_lane_submit(lane, SKIFF_OP_FLUSH, 0, 0, NULL, 0, 999);
    if (rc != -EAGAIN) return fail("submit past the queue depth", rc);
    int got = 0;
    while (got < QD) {
        rc = skiff_lane_reap(lane, done, QD, 1);
        if (rc < 0) return fail("reap writes", rc);
        for (int i = 0; i < rc; i++)
            if (done[i].result != 0) return fail("write result", done[i].result);
        got += rc;
    }
    for (int i = 0; i < QD; i++) {
        memset(bufs[i], 0, BS);
        rc = skiff_lane_submit(lane, SKIFF_OP_READ, 0, (uint64_t)i * BS, bufs[i], BS, 200 + i);
        if (rc != 0) return fail("submit read", rc);
    }
    rc = skiff_lane_reap(lane, done, QD, QD);
    if (rc != QD) return fail("reap reads", rc);
    for (int i = 0; i < QD; i++) {
        int slot = (int)(done[i].user_data - 200);
        if (done[i].result != 0) return fail("read result", done[i].result);
        for (int b = 0; b < BS; b++)
            if (bufs[slot][b] != 'a' + slot) {
                fprintf(stderr, "read %d byte %d is %d\n", slot, b, bufs[slot][b]);
                return 1;
            }
    }
    /* Past the end: the request fails with -EINVAL, the lane goes on. */
    rc = skiff_lane_submit(lane, SKIFF_OP_READ, 0, skiff_lane_size(lane), bufs[0], BS, 300);
    if (rc != 0) return fail("submit bad read", rc);
    rc = skiff_lane_submit(lane, SKIFF_OP_FLUSH, 0, 0, NULL, 0, 301);
    if (rc != 0) return fail("submit flush", rc);
    rc = skiff_lane_reap(lane, done, QD, 2);
    if (rc != 2) return fail("reap", rc);
    for (int i = 0; i < 2; i++) {
        int want = done[i].user_data == 300 ? -EINVAL : 0;
        if (done[i].result != want) return fail("bad read / flush result", done[i].result);
    }
    if (skiff_lane_in_flight(lane) != 0) return fail("in flight after reaping all", 0);
    skiff_lane_close(lane);

    /* An unknown batching mode is refused before connecting; adaptive batching works. */
    cfg.batching = 99;
    rc = skiff_lane_open(argv[1], argv[2], &cfg, &lane);
    if (rc != -EINVAL) return fail("open with an unknown batching mode", rc);
    cfg.batching = SKIFF_BATCHING_ADAPTIVE;
    rc = skiff_lane_open(argv[1], argv[2], &cfg, &lane);
    if (rc != 0) return fail("open adaptive", rc);
    rc = skiff_lane_submit(lane, SKIFF_OP_READ, 0, 0, bufs[0], BS, 400);
    if (rc != 0) return fail("submit adaptive read", rc);
    rc = skiff_lane_reap(lane, done, QD, 1);
    if (rc != 1 || done[0].result != 0 || bufs[0][0] != 'a') return fail("adaptive read", rc);
    skiff_lane_close(lane);

    /* An unknown polling mode is refused; adaptive polling reads the same bytes. */
    skiff_lane_config_default(&cfg);
    if (cfg.poll != SKIFF_POLL_OFF || cfg.poll_spin_us != 50) return fail("poll defaults", (int)cfg.poll);
    cfg.poll = 7;
    rc = skiff_lane_open(argv[1], argv[2], &cfg, &lane);
    if (rc != -EINVAL) return fail("open with an unknown polling mode", rc);
    cfg.poll = SKIFF_POLL_ADAPTIVE;
    rc = skiff_lane_open(argv[1], argv[2], &cfg, &lane);
    if (rc != 0) return fail("open with adaptive polling", rc);
    for (int i = 0; i < 64; i++) {
        rc = skiff_lane_submit(lane, SKIFF_OP_READ, 0, 0, bufs[0], BS, 500);
        if (rc != 0) return fail("submit polled read", rc);
        rc = skiff_lane_reap(lane, done, QD, 1);
        if (rc != 1 || done[0].result != 0 || bufs[0][0] != 'a') return fail("polled read", rc);
    }
    skiff_lane_close(lane);

    /* Two handles on one shared lane (same target, export and config): what one writes, the
     * other reads; commit is a no-op and reaping waits for the doorbell or the idle rule. */
    skiff_lane_config_default(&cfg);
    cfg.shared_lanes = 1;
    skiff_lane *a = NULL, *b = NULL;
    rc = skiff_lane_open(argv[1], argv[2], &cfg, &a);
    if (rc != 0) return fail("open shared a", rc);
    rc = skiff_lane_open(argv[1], argv[2], &cfg, &b);
    if (rc != 0) return fail("open shared b", rc);
    memset(bufs[1], 'S', BS);
    rc = skiff_lane_submit(a, SKIFF_OP_WRITE, 0, 8 * BS, bufs[1], BS, 500);
    if (rc != 0) return fail("submit shared write", rc);
    rc = skiff_lane_reap(a, done, QD, 1);
    if (rc != 1 || done[0].user_data != 500 || done[0].result != 0) return fail("reap shared write", rc);
    memset(bufs[2], 0, BS);
    rc = skiff_lane_submit(b, SKIFF_OP_READ, 0, 8 * BS, bufs[2], BS, 501);
    if (rc != 0) return fail("submit shared read", rc);
    rc = skiff_lane_reap(b, done, QD, 1);
    if (rc != 1 || done[0].user_data != 501 || done[0].result != 0) return fail("reap shared read", rc);
    for (int i = 0; i < BS; i++)
        if (bufs[2][i] != 'S') return fail("shared read data", i);
    if (skiff_lane_in_flight(a) != 0 || skiff_lane_in_flight(b) != 0) return fail("shared in flight", 0);
    skiff_lane_close(a);
    skiff_lane_close(b);
    printf("shared ok\n");

    /* Direct reads: the first read earns a capability, the second is served from it. */
    skiff_lane_config_default(&cfg);
    if (cfg.directory_entries != 0) return fail("direct reads are off by default", (int)cfg.directory_entries);
    cfg.directory_entries = 64;
    rc = skiff_lane_open(argv[1], argv[2], &cfg, &lane);
    if (rc != 0) return fail("open direct", rc);
    memset(bufs[1], 'D', BS);
    rc = skiff_lane_submit(lane, SKIFF_OP_WRITE, 0, 16 * BS, bufs[1], BS, 600);
    if (rc != 0 || skiff_lane_reap(lane, done, QD, 1) != 1 || done[0].result != 0) return fail("direct write", rc);
    for (int pass = 0; pass < 2; pass++) {
        memset(bufs[2], 0, BS);
        rc = skiff_lane_submit(lane, SKIFF_OP_READ, 0, 16 * BS, bufs[2], BS, 601);
        if (rc != 0 || skiff_lane_reap(lane, done, QD, 1) != 1 || done[0].result != 0) return fail("direct read", rc);
        for (int i = 0; i < BS; i++)
            if (bufs[2][i] != 'D') return fail("direct read data", i);
    }
    skiff_lane_close(lane);
    printf("direct ok\n");

    rc = skiff_lane_open(argv[1], "no-such-export", NULL, &lane);
    if (rc == 0) return fail("open of a missing export succeeded", 0);
    printf("missing export: %d %s\n", rc, skiff_last_error());
    printf("ok\n");
    return 0;
}

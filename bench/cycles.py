#!/usr/bin/env python3
"""Where a CPU's cycles go, in the categories of the FlashNet thesis's Table 5.1.

`Recording(cpu, seconds)` runs `perf record -C cpu` (as root: kernel symbols) for a window
while the caller's load runs; `breakdown(path)` reads it back with `perf report --sort
comm,dso,sym`, drops the idle task, and sorts every symbol into one category by its name:

- networking: TCP/IP, sockets, skbs, the loopback device, softirq receive, the socket calls;
- storage: file systems, the page cache, the block layer, io_uring, splice and sendfile;
- drivers: virtio and its doorbell;
- scheduling: the scheduler, wake-ups, futexes, epoll;
- architecture: system-call entry and exit, interrupts and `*_irqrestore` (where a VM's
  pending interrupts land);
- memory: copies; memory: allocation (pages, slabs, libc's malloc);
- skiff logic: the skiff binary's own code (Rust's standard library included);
- libc and other user code; kernel, other.

Usable alone on a perf.data file:

    python3 bench/cycles.py perf.data
"""
import os
import re
import shutil
import subprocess
import sys

CATEGORIES = [
    "networking",
    "storage",
    "drivers",
    "scheduling",
    "architecture (entry, interrupts)",
    "kernel, other",
    "memory: copies",
    "memory: allocation",
    "skiff logic",
    "libc and other user code",
]

# First match wins: copies before networking (`skb_copy_datagram_iter` is a copy), interrupt
# re-enabling (`_raw_spin_unlock_irqrestore`, where a VM's pending interrupts land) before the
# lock's caller's category, and so on.
KERNEL_RULES = [
    ("memory: copies", r"copy_user|memcpy|memmove|copy_page|copy_to_iter|copy_from_iter|_copy_|copyout|copyin|rep_mov|csum_partial_copy"),
    ("drivers", r"virtio|vring|vp_notify|iowrite|ioread|virtqueue|nvme"),
    ("architecture (entry, interrupts)", r"irqrestore|irqsave|irq_enable|irqentry|^asm_|entry_SYSCALL|syscall|exit_to_user|"
                                          r"native_|apic|sysret|__x64_sys|x64_sys_call|fpregs|fpu|error_entry|"
                                          r"restore_regs|srso|retbleed|untrain|clear_bhb|mds_|common_interrupt|sysvec"),
    ("storage", r"ext4|iomap|bio|blk|io_uring|io_wq|io_read|io_issue|submit_bio|filemap|splice|pipe_|sendfile|generic_file|"
                r"page_cache|folio|mpage|jbd2|direct_io|dio_|fsnotify|vfs_read|vfs_write|rw_verify|file_|__fdget|fput|fget"),
    ("networking", r"tcp|udp|skb|sock|inet|^ip_|ipv4|ipv6|__ip|netif|net_rx|softirq|napi|dev_queue|dev_hard|loopback|dst_|"
                   r"^sk_|__sk_|neigh|nf_|netfilter|raw_v4|raw_local|__netdev|process_backlog|__dev_|validate_xmit|"
                   r"bpf|sch_|qdisc|__sys_send|__sys_recv|sendmsg|recvmsg|sendto|recvfrom"),
    ("scheduling", r"schedule|sched|futex|epoll|^ep_|wake|__switch_to|switch_mm|finish_task|pick_next|enqueue|dequeue|"
                   r"update_curr|update_load|select_task|ttwu|hrtimer|timerqueue|place_entity|set_next|put_prev|"
                   r"cpuacct|psi_|__wake|autoremove|poll|rcu"),
    ("memory: allocation", r"kmalloc|kfree|kmem_cache|slab|slub|page_frag|alloc_pages|__alloc|free_unref|"
                           r"get_page_from_freelist|__free_pages|__free_frozen|rmqueue|mem_cgroup|memcg|refill_obj|"
                           r"obj_cgroup|__page_pool|page_pool|mod_objcg|consume_obj|free_pcp|__put_page|put_page"),
]
USER_ALLOC = r"^(malloc|free|calloc|realloc|cfree|_int_malloc|_int_free|__libc_malloc|__libc_free|tcache|__rust_alloc|__rust_dealloc|__rdl_)"
USER_COPIES = r"memcpy|memmove|__memcpy|__memmove"


def category(comm, dso, sym, skiff_names=("skiff",)):
    """The category of one sample's symbol: `dso` is perf's dso column, `sym` its symbol."""
    kernel = dso.startswith("[kernel") or dso in ("[unknown]",) and sym.startswith("0xffff")
    if kernel:
        for name, pattern in KERNEL_RULES:
            if re.search(pattern, sym):
                return name
        return "kernel, other"
    if re.search(USER_COPIES, sym):
        return "memory: copies"
    if re.search(USER_ALLOC, sym):
        return "memory: allocation"
    if os.path.basename(dso) in skiff_names:
        return "skiff logic"
    return "libc and other user code"


IDLE = re.compile(r"swapper|idle")
LINE = re.compile(r"^\s*([0-9.]+)%\s+(\S+)\s+(\S+)\s+\[([k.])\]\s+(.*)$")


def samples(path):
    """(percent, comm, dso, symbol) for every row perf reports for `path`."""
    out = subprocess.run(["perf", "report", "-i", path, "--stdio", "--no-children", "--sort", "comm,dso,sym",
                          "-q", "--percent-limit", "0"], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"perf report failed:\n{out.stderr}")
    rows = []
    for line in out.stdout.splitlines():
        m = LINE.match(line)
        if m:
            pct, comm, dso, _, sym = m.groups()
            rows.append((float(pct), comm, dso, sym.strip()))
    return rows


def breakdown(path, top=12):
    """Shares of the non-idle samples by category, and the `top` symbols: {"shares":
    {category: fraction}, "busy": fraction of samples not idle, "top": [(fraction, category,
    symbol)]}."""
    rows = samples(path)
    busy = [r for r in rows if not IDLE.search(r[1])]
    total = sum(r[0] for r in busy) or 1.0
    shares = dict.fromkeys(CATEGORIES, 0.0)
    tops = []
    for pct, comm, dso, sym in busy:
        cat = category(comm, dso, sym)
        shares[cat] += pct / total
        tops.append((pct / total, cat, sym))
    tops.sort(reverse=True)
    return {"shares": shares, "busy": total / (sum(r[0] for r in rows) or 1.0), "top": tops[:top]}


class Recording:
    """`perf record -C cpu` for `seconds`, started now; `wait()` returns the data's path."""

    def __init__(self, cpu, seconds, path):
        if not shutil.which("perf"):
            raise SystemExit("perf is not installed (apt-get install linux-perf), or skip the breakdown")
        self.path = path
        self.proc = subprocess.Popen(["perf", "record", "-q", "-o", path, "-C", str(cpu), "--", "sleep", str(seconds)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def wait(self):
        _, err = self.proc.communicate()
        if self.proc.returncode != 0:
            raise SystemExit(f"perf record failed (root is needed for kernel symbols):\n{err}")
        return self.path


def main():
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    b = breakdown(sys.argv[1])
    print(f"busy: {b['busy']:.1%} of samples")
    for cat in CATEGORIES:
        print(f"{cat:34} {b['shares'][cat]:6.1%}")
    for share, cat, sym in b["top"]:
        print(f"  {share:6.1%}  {cat:34} {sym}")


if __name__ == "__main__":
    main()

/* RStore's API from C (skiff.h): argv[1] is the coordinator's URL, with two memory servers of
 * 1 MiB chunks registered. Creates a namespace, reserves and allocates 4 MiB at the bootstrap
 * address, maps it, writes and reads it back across chunks (so across servers), single bytes
 * too, and checks the errors a caller acts on. Prints "ok" at the end. */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "skiff.h"

#define MIB (1u << 20)

static int fail(const char *what, int rc) {
    fprintf(stderr, "%s failed: %d (%s)\n", what, rc, skiff_last_error());
    return 1;
}

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    skiff_rstore *r = NULL;
    int rc = skiff_rstore_connect(argv[1], &r);
    if (rc != 0) return fail("connect", rc);
    if ((rc = skiff_rstore_create_ns(r, "from-c", MIB, 1, SKIFF_SCOPE_RAM)) != 0) return fail("create_ns", rc);
    rc = skiff_rstore_create_ns(r, "from-c", MIB, 1, SKIFF_SCOPE_RAM);
    printf("create again: %d\n", rc);
    if (rc != -EEXIST) return fail("create_ns twice should be -EEXIST", rc);
    if ((rc = skiff_rstore_join_ns(r, "from-c")) != 0) return fail("join_ns", rc);
    if ((rc = skiff_rstore_join_ns(r, "nowhere")) != -ENOENT) return fail("join_ns of nothing should be -ENOENT", rc);
    if ((rc = skiff_rstore_reserve(r, "from-c", 4 * MIB)) != 0) return fail("reserve", rc);
    uint64_t addr = 99;
    if ((rc = skiff_rstore_alloc(r, "from-c", 4 * MIB, 0, SKIFF_ALLOC_AT, &addr)) != 0) return fail("alloc", rc);
    if (addr != 0) return fail("alloc at 0", (int)addr);
    if ((rc = skiff_rstore_alloc(r, "from-c", MIB, 0, SKIFF_ALLOC_AT, &addr)) != -EADDRINUSE)
        return fail("a second alloc at 0 should be -EADDRINUSE", rc);
    if ((rc = skiff_rstore_alloc(r, "from-c", MIB, 0, 0, &addr)) != -ENOSPC)
        return fail("alloc past the reserve should be -ENOSPC", rc);

    skiff_segment *s = NULL;
    if ((rc = skiff_rstore_map(r, "from-c", 0, &s)) != 0) return fail("map", rc);
    if (skiff_segment_len(s) != 4 * MIB) return fail("segment length", (int)skiff_segment_len(s));
    unsigned char *w = malloc(4 * MIB), *back = malloc(4 * MIB);
    for (uint32_t i = 0; i < 4 * MIB; i++) w[i] = (unsigned char)(i * 31 + (i >> 12));
    /* 1.5 MiB pieces straddle chunk boundaries, so servers. */
    for (uint64_t at = 0; at < 4 * MIB; at += 3 * MIB / 2) {
        uint64_t n = 4 * MIB - at < 3 * MIB / 2 ? 4 * MIB - at : 3 * MIB / 2;
        if ((rc = skiff_segment_write(s, at, w + at, n)) != 0) return fail("segment_write", rc);
    }
    memset(back, 0, 4 * MIB);
    if ((rc = skiff_segment_read(s, 0, back, 4 * MIB)) != 0) return fail("segment_read", rc);
    if (memcmp(w, back, 4 * MIB) != 0) return fail("read back", -1);
    /* Pools address bytes: three bytes across the chunk boundary (two servers), and one byte
     * whose neighbours stay as they were. */
    if (skiff_segment_block_size(s) != 1) return fail("segment block size", (int)skiff_segment_block_size(s));
    if ((rc = skiff_segment_write(s, MIB - 1, "xyz", 3)) != 0) return fail("a write across chunks", rc);
    if ((rc = skiff_segment_write(s, 100, "!", 1)) != 0) return fail("a one-byte write", rc);
    memcpy(w + MIB - 1, "xyz", 3);
    w[100] = '!';
    memset(back, 0, 4 * MIB);
    if ((rc = skiff_segment_read(s, 99, back, 3)) != 0) return fail("a three-byte read", rc);
    if (memcmp(back, w + 99, 3) != 0) return fail("the bytes around the one written", -1);
    if ((rc = skiff_segment_read(s, MIB - 2, back, 5)) != 0) return fail("a read across chunks", rc);
    if (memcmp(back, w + MIB - 2, 5) != 0) return fail("the bytes across chunks", -1);
    if ((rc = skiff_segment_read(s, 4 * MIB, back, 512)) != -EINVAL) return fail("a read past the end should be -EINVAL", rc);

    /* Asynchronously: 64 writes of 64 KiB in flight (some straddling chunks), reaped, then as
     * many reads into a buffer of their own, checked against what was written. */
    enum { N = 64, BS = 64 * 1024 };
    for (uint32_t i = 0; i < 4 * MIB; i++) w[i] = (unsigned char)(i * 7 + 3);
    for (int i = 0; i < N; i++) {
        uint64_t at = (uint64_t)i * BS + (i % 3 == 0 ? 1000 : 0);
        if (at + BS > 4 * MIB) at = 4 * MIB - BS;
        if ((rc = skiff_segment_submit(s, SKIFF_OP_WRITE, at, w + at, BS, 1000 + i)) != 0) return fail("submit write", rc);
    }
    skiff_completion done[N];
    int got = 0;
    while (got < N) {
        if ((rc = skiff_segment_reap(s, done + got, N - got, 1)) < 0) return fail("reap writes", rc);
        for (int k = got; k < got + rc; k++) {
            if (done[k].result != 0) return fail("an async write", done[k].result);
            if (done[k].user_data < 1000 || done[k].user_data >= 1000 + N) return fail("write user_data", (int)done[k].user_data);
        }
        got += rc;
    }
    if (skiff_segment_in_flight(s) != 0) return fail("in flight after reaping all", (int)skiff_segment_in_flight(s));
    /* The overlapping writes landed in some order: read back what the segment holds now with the
     * blocking call, then the same asynchronously. */
    unsigned char *now = malloc(4 * MIB);
    if ((rc = skiff_segment_read(s, 0, now, 4 * MIB)) != 0) return fail("segment_read after async writes", rc);
    for (int i = 0; i < N; i++) {
        uint64_t at = (uint64_t)i * BS;
        if ((rc = skiff_segment_submit(s, SKIFF_OP_READ, at, back + at, BS, 5000 + i)) != 0) return fail("submit read", rc);
    }
    if ((rc = skiff_segment_reap(s, done, N, N)) != N) return fail("reap reads", rc);
    for (int i = 0; i < N; i++) if (done[i].result != 0) return fail("an async read", done[i].result);
    if (memcmp(back, now, N * BS) != 0) return fail("async reads match the blocking read", -1);
    /* Each write's bytes outside the ranges of later overlapping writes are its own. */
    if (memcmp(now + BS, w + BS, 1000) != 0) return fail("async writes landed", -1);
    if ((rc = skiff_segment_submit(s, SKIFF_OP_FLUSH, 0, back, 1, 1)) != -EINVAL) return fail("a flush should be -EINVAL", rc);
    free(now);
    skiff_segment_unmap(s);
    free(w);
    free(back);

    if ((rc = skiff_rstore_free(r, "from-c", 0)) != 0) return fail("free", rc);
    if ((rc = skiff_rstore_release(r, "from-c", 4 * MIB)) != 0) return fail("release", rc);
    if ((rc = skiff_rstore_delete_ns(r, "from-c")) != 0) return fail("delete_ns", rc);
    skiff_rstore_close(r);
    puts("ok");
    return 0;
}

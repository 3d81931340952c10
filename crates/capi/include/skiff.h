/*
 * skiff.h: the C API of skiff's initiator.
 *
 * A lane is one connection to one export, used by one thread at a time. Submit requests with
 * your own buffers, ring the doorbell with skiff_lane_commit (or let the lane ring it when a
 * caravan fills), and reap completions. A buffer passed to skiff_lane_submit must stay valid
 * and untouched until its completion has been reaped: writes are sent from it, reads land in
 * it directly.
 *
 * Functions returning int return 0 (or a count) on success and a negative errno on failure;
 * skiff_last_error() then describes the failure (per thread, valid until the next call).
 *
 * Shared lanes (skiff_lane_config.shared_lanes > 0) serve many threads with few requests
 * each: each thread opens its own skiff_lane, and their requests travel in common caravans on
 * a few connections. skiff_lane_commit then does nothing (the doorbell alone decides when a
 * caravan leaves, since other threads' requests may still join it), and a full shared queue
 * makes skiff_lane_submit wait for room instead of returning -EAGAIN.
 *
 * The layouts and constants below are checked against the Rust side by
 * crates/capi/tests/c_api.rs.
 */
#ifndef SKIFF_H
#define SKIFF_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Operations (the native protocol's opcodes). */
#define SKIFF_OP_READ 1
#define SKIFF_OP_WRITE 2
#define SKIFF_OP_FLUSH 3
#define SKIFF_OP_TRIM 4
#define SKIFF_OP_WRITE_ZEROES 5

/* Request flags. */
#define SKIFF_FLAG_FUA 0x01      /* durable before the completion */
#define SKIFF_FLAG_NO_DELAY 0x02 /* ring the doorbell now */

/* How requests gather into caravans (skiff_lane_config.batching). */
#define SKIFF_BATCHING_STATIC 0   /* the doorbell policy below (i10's caravans); the default */
#define SKIFF_BATCHING_OFF 1      /* every request is sent on its own */
#define SKIFF_BATCHING_ADAPTIVE 2 /* Tyche's controller sets caravan size and doorbell delay */

/* Hybrid polling: how a wait for the target spins before it sleeps (docs/PERFORMANCE.md). */
#define SKIFF_POLL_OFF 0      /* sleep at once; the default */
#define SKIFF_POLL_HYBRID 1   /* spin poll_spin_us on every wait, then sleep */
#define SKIFF_POLL_ADAPTIVE 2 /* spin (at most poll_spin_us) only while it saves more wake-ups
                               * than it wastes; sleep on a timer through long waits */

typedef struct skiff_lane skiff_lane;

typedef struct skiff_lane_config {
    uint32_t queue_depth;       /* requests in flight at most (default 256) */
    uint32_t aggregation_reqs;  /* ring when a caravan holds this many requests (default 16) */
    uint32_t aggregation_bytes; /* ring when a caravan carries this many payload bytes (default 65536) */
    uint32_t doorbell_us;       /* ring when the oldest queued request waited this long; 0 rings at once (default 50) */
    uint32_t timeout_ms;        /* give up on an unresponsive target after this long (default 30000) */
    uint32_t batching;          /* SKIFF_BATCHING_* (default SKIFF_BATCHING_STATIC) */
    uint32_t shared_lanes;      /* 0: a lane of its own (default); N: a handle on a group of N lanes
                                 * shared by every skiff_lane opened in this process with the same
                                 * target, export and config (queue_depth is then the depth of each
                                 * shared lane, for all its handles together) */
    uint32_t reconnect_delay_ms;      /* after a lost connection, reconnect at most this far apart,
                                       * re-sending every request not yet answered; 0: no
                                       * reconnection, fail at once (default 1000) */
    uint32_t ctrl_loss_timeout_ms;    /* give up reconnecting after this long; requests then fail
                                       * with -ENOTCONN (default 60000) */
    uint32_t fast_io_fail_timeout_ms; /* fail waiting requests (-EIO) after this long while
                                       * reconnecting goes on; 0: off (default) */
    uint32_t directory_entries;       /* direct reads (docs/DIRECT_READS.md): capabilities the
                                       * lane's directory holds; 0: off (default) */
    const char *key_file;             /* authenticate with a key from this file (nbdkit's PSK
                                       * format, NAME:HEXSECRET per line); NULL: no key (default).
                                       * Read by skiff_lane_open only. */
    const char *key_name;             /* which key of key_file; NULL: its only key */
    const char *tls_certificates;     /* connect over TLS with the certificates in this
                                       * directory (ca-cert.pem, and client-cert.pem and
                                       * client-key.pem to present one); NULL: plaintext
                                       * (default). Read by skiff_lane_open only. */
    uint32_t poll;                    /* SKIFF_POLL_* (default SKIFF_POLL_OFF) */
    uint32_t poll_spin_us;            /* the spin bound of hybrid polling; 0: 50 (default 50) */
    const char *batch_log;            /* SKIFF_BATCHING_ADAPTIVE: append the controller's decisions
                                       * to this file, one JSON object a line ({"lane", "at_us",
                                       * "level", "delay_us", "bytes_per_s", "a_out"}), when the
                                       * lane closes (shared: when the group's last handle does);
                                       * NULL: none (default) */
} skiff_lane_config;

typedef struct skiff_completion {
    uint64_t user_data; /* as given to skiff_lane_submit */
    int32_t result;     /* 0, or a negative errno */
    uint32_t reserved;
} skiff_completion;

/* Fill *config with the defaults. */
void skiff_lane_config_default(skiff_lane_config *config);

/* Connect to target ("HOST:PORT" or "unix:PATH") and open the export. config may be NULL. */
int skiff_lane_open(const char *target, const char *export_name, const skiff_lane_config *config,
                    skiff_lane **out);

/* Close the lane. Requests still in flight are abandoned; their buffers are no longer used. */
void skiff_lane_close(skiff_lane *lane);

uint64_t skiff_lane_size(const skiff_lane *lane);
uint32_t skiff_lane_block_size(const skiff_lane *lane);
uint32_t skiff_lane_queue_depth(const skiff_lane *lane);

/* Queue one request. buf/len: the data of a write, the destination of a read; NULL and the
 * length for trim and write-zeroes; NULL and 0 for flush. -EAGAIN when the queue is full. */
int skiff_lane_submit(skiff_lane *lane, uint32_t op, uint32_t flags, uint64_t offset, void *buf,
                      uint32_t len, uint64_t user_data);

/* Send the open caravan now. */
int skiff_lane_commit(skiff_lane *lane);

/* Send the open caravan, wait until at least min completions (bounded by what is in flight)
 * are available, and store up to max of them in out. Returns how many were stored. */
int skiff_lane_reap(skiff_lane *lane, skiff_completion *out, uint32_t max, uint32_t min);

/* Completions not yet reaped plus requests in flight. */
uint32_t skiff_lane_in_flight(const skiff_lane *lane);

/*
 * RStore namespaces (docs/RSTORE.md): RStore's API (Trivedi's thesis, Table 6.1) over a
 * coordinator (etcd) and memory servers (skiff serve --pool). The control path (connect,
 * create/join/delete, reserve/release, alloc/free, map) talks to the coordinator; a mapped
 * segment's reads and writes go straight to the memory servers, striped, with replicas.
 * Segment offsets and lengths are any bytes on pools of skiff serve --pool (their block is one
 * byte, skiff_segment_block_size), and a one-byte write is atomic on a RAM pool: readers see the
 * old byte or the new one, and the bytes beside it are untouched. Errors as above: -EEXIST (namespace
 * exists), -ENOENT (no namespace or allocation), -ENOSPC (no capacity, or not enough
 * reserved), -EADDRINUSE (address taken), -EHOSTUNREACH (coordinator unreachable, or its
 * answer unusable), -EBUSY (other clients kept changing the namespace; try again).
 */
#define SKIFF_SCOPE_RAM 0  /* the servers' memory */
#define SKIFF_SCOPE_FILE 1 /* the servers' files */
#define SKIFF_SCOPE_FLASH 2 /* the servers' flash volumes (skiff serve --pool flash:SIZE) */
#define SKIFF_ALLOC_AT 0x01 /* skiff_rstore_alloc: at `at`, not after the last allocation */

typedef struct skiff_rstore skiff_rstore;
typedef struct skiff_segment skiff_segment;

/* Connect to the coordinator: etcd's client URLs, comma-separated. */
int skiff_rstore_connect(const char *coordinator, skiff_rstore **out);
void skiff_rstore_close(skiff_rstore *r);
int skiff_rstore_create_ns(skiff_rstore *r, const char *ns, uint64_t chunk_bytes, uint32_t replicas,
                           uint32_t scope);
int skiff_rstore_join_ns(skiff_rstore *r, const char *ns);
int skiff_rstore_delete_ns(skiff_rstore *r, const char *ns);
int skiff_rstore_reserve(skiff_rstore *r, const char *ns, uint64_t bytes);
int skiff_rstore_release(skiff_rstore *r, const char *ns, uint64_t bytes);
/* Allocate len bytes (after the last allocation, or at `at` with SKIFF_ALLOC_AT); *addr gets
 * the address. Of clients racing for one address, exactly one succeeds. */
int skiff_rstore_alloc(skiff_rstore *r, const char *ns, uint64_t len, uint64_t at, uint32_t flags,
                       uint64_t *addr);
int skiff_rstore_free(skiff_rstore *r, const char *ns, uint64_t addr);
/* Init and map the allocation at addr: a lane to each of its servers, for this thread. */
int skiff_rstore_map(skiff_rstore *r, const char *ns, uint64_t addr, skiff_segment **out);
void skiff_segment_unmap(skiff_segment *s);
uint64_t skiff_segment_len(const skiff_segment *s);
uint32_t skiff_segment_block_size(const skiff_segment *s);
int skiff_segment_read(skiff_segment *s, uint64_t offset, void *buf, uint64_t len);
int skiff_segment_write(skiff_segment *s, uint64_t offset, const void *buf, uint64_t len);

/* Asynchronous segment I/O: queue a read or a write (op SKIFF_OP_READ or SKIFF_OP_WRITE) of
 * len bytes at offset, many in flight over the segment's servers, and reap their completions
 * (user_data as given; result 0 or a negative errno). buf must stay valid and untouched until
 * the request's completion is reaped: a write's data is copied from it at submit, a read's is
 * copied into it when reaped. Do not mix with the blocking calls while requests are in flight. */
int skiff_segment_submit(skiff_segment *s, uint32_t op, uint64_t offset, void *buf, uint64_t len,
                         uint64_t user_data);
/* Wait until at least min completions (bounded by what is in flight) are available, and store
 * up to max of them in out. Returns how many were stored. */
int skiff_segment_reap(skiff_segment *s, skiff_completion *out, uint32_t max, uint32_t min);
/* Completions not yet reaped plus requests in flight. */
uint32_t skiff_segment_in_flight(const skiff_segment *s);

/* A description of the last failure on this thread ("" if none). */
const char *skiff_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* SKIFF_H */

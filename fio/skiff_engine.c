// SPDX-License-Identifier: GPL-2.0-only
/*
 * skiff_engine.c: fio ioengine "skiff", a thin adapter from fio's engine interface to skiff's
 * C API (crates/capi/include/skiff.h).
 *
 * It includes fio's internal headers (fio.h, optgroup.h), so it is GPL-2.0-only like fio;
 * the rest of skiff is Apache-2.0. fio/build.sh fetches fio's source for these headers and
 * builds this file into target/fio/skiff-engine.so; use it as
 * --ioengine=external:target/fio/skiff-engine.so.
 *
 * One lane per fio job (thread or process), opened in init, where the job runs; with
 * shared_lanes=N, a handle on N lanes the process's jobs share instead (jobs must be threads,
 * fio's thread option, to share a process). setup runs earlier, possibly in fio's parent
 * process, only to learn the export's size, on a lane of its own. All protocol
 * logic (caravans, doorbell, queue limits, errno mapping) lives in the Rust lane.
 */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fio.h"
#include "optgroup.h"

#include "skiff.h"

struct skiff_options {
	void *pad; /* fio treats an option offset of 0 as "no storage" */
	char *target;
	char *export_name;
	unsigned int aggregation_reqs;
	unsigned int aggregation_bytes;
	unsigned int doorbell_us;
	unsigned int timeout_ms;
	unsigned int batching;
	unsigned int shared_lanes;
	unsigned int reconnect_delay_ms;
	unsigned int ctrl_loss_timeout_ms;
	unsigned int fast_io_fail_timeout_ms;
	unsigned int directory_entries;
	char *key_file;
	char *key_name;
	char *tls_certificates;
	unsigned int poll;
	unsigned int poll_spin_us;
	char *batch_log;
};

/* Per-job state: the lane and the completions of the last getevents, for event(). */
struct skiff_data {
	skiff_lane *lane;
	uint64_t size_bytes;
	unsigned int events_max;
	skiff_completion *done;
	struct io_u **events;
};

/* Defaults as in skiff_lane_config_default(); shown by --enghelp. */
static struct fio_option options[] = {
	{
		.name = "target",
		.lname = "skiff target",
		.type = FIO_OPT_STR_STORE,
		.off1 = offsetof(struct skiff_options, target),
		.help = "Target to connect to: HOST:PORT or unix:PATH (required)",
		.category = FIO_OPT_C_ENGINE,
		.group = FIO_OPT_G_INVALID,
	},
	{
		.name = "export",
		.lname = "skiff export",
		.type = FIO_OPT_STR_STORE,
		.off1 = offsetof(struct skiff_options, export_name),
		.help = "Name of the export to open (required)",
		.category = FIO_OPT_C_ENGINE,
		.group = FIO_OPT_G_INVALID,
	},
	{
		.name = "aggregation",
		.lname = "skiff requests per caravan",
		.type = FIO_OPT_INT,
		.off1 = offsetof(struct skiff_options, aggregation_reqs),
		.minval = 1,
		.def = "16",
		.help = "Ring the doorbell when a caravan holds this many requests (default 16)",
		.category = FIO_OPT_C_ENGINE,
		.group = FIO_OPT_G_INVALID,
	},
	{
		.name = "aggregation_bytes",
		.lname = "skiff payload bytes per caravan",
		.type = FIO_OPT_INT,
		.off1 = offsetof(struct skiff_options, aggregation_bytes),
		.minval = 1,
		.def = "65536",
		.help = "Ring the doorbell when a caravan carries this many payload bytes (default 65536)",
		.category = FIO_OPT_C_ENGINE,
		.group = FIO_OPT_G_INVALID,
	},
	{
		.name = "doorbell_us",
		.lname = "skiff doorbell delay",
		.type = FIO_OPT_INT,
		.off1 = offsetof(struct skiff_options, doorbell_us),
		.minval = 0,
		.def = "50",
		.help = "Ring the doorbell when the oldest queued request waited this many microseconds; 0 rings at once (default 50)",
		.category = FIO_OPT_C_ENGINE,
		.group = FIO_OPT_G_INVALID,
	},
	{
		.name = "timeout_ms",
		.lname = "skiff target timeout",
		.type = FIO_OPT_INT,
		.off1 = offsetof(struct skiff_options, timeout_ms),
		.minval = 1,
		.def = "30000",
		.help = "Give up on an unresponsive target after this many milliseconds (default 30000)",
		.category = FIO_OPT_C_ENGINE,
		.group = FIO_OPT_G_INVALID,
	},
	{
		.name = "batching",
		.lname = "skiff batching",
		.type = FIO_OPT_STR,
		.off1 = offsetof(struct skiff_options, batching),
		.def = "static",
		.help = "How requests gather into caravans (default static)",
		.posval = {
			{ .ival = "static", .oval = SKIFF_BATCHING_STATIC,
			  .help = "the doorbell policy of aggregation= and doorbell_us= (i10's caravans)" },
			{ .ival = "off", .oval = SKIFF_BATCHING_OFF,
			  .help = "every request is sent on its own" },
			{ .ival = "adaptive", .oval = SKIFF_BATCHING_ADAPTIVE,
			  .help = "Tyche's controller sets caravan size and doorbell delay from throughput" },
		},
		.category = FIO_OPT_C_ENGINE,
		.group = FIO_OPT_G_INVALID,
	},
	{
		.name = "shared_lanes",
		.lname = "skiff shared lanes",
		.type = FIO_OPT_INT,
		.off1 = offsetof(struct skiff_options, shared_lanes),
		.minval = 0,
		.maxval = 1024,
		.def = "0",
		.help = "0: each job has a lane of its own (default); N: the jobs of this fio process share N lanes, "
			"their requests travelling in common caravans (use with thread, so jobs share the process)",
		.category = FIO_OPT_C_ENGINE,
		.group = FIO_OPT_G_INVALID,
	},
	{
		.name = "reconnect_delay_ms",
		.lname = "skiff reconnect delay",
		.type = FIO_OPT_INT,
		.off1 = offsetof(struct skiff_options, reconnect_delay_ms),
		.minval = 0,
		.def = "1000",
		.help = "After a lost connection, reconnect at most this many ms apart, re-sending what was not "
			"answered; 0: no reconnection (default 1000)",
		.category = FIO_OPT_C_ENGINE,
		.group = FIO_OPT_G_INVALID,
	},
	{
		.name = "ctrl_loss_timeout_ms",
		.lname = "skiff controller loss timeout",
		.type = FIO_OPT_INT,
		.off1 = offsetof(struct skiff_options, ctrl_loss_timeout_ms),
		.minval = 0,
		.def = "60000",
		.help = "Give up reconnecting after this many ms (default 60000)",
		.category = FIO_OPT_C_ENGINE,
		.group = FIO_OPT_G_INVALID,
	},
	{
		.name = "fast_io_fail_timeout_ms",
		.lname = "skiff fast I/O fail timeout",
		.type = FIO_OPT_INT,
		.off1 = offsetof(struct skiff_options, fast_io_fail_timeout_ms),
		.minval = 0,
		.def = "0",
		.help = "Fail waiting I/O after this many ms while reconnecting goes on; 0: off (default)",
		.category = FIO_OPT_C_ENGINE,
		.group = FIO_OPT_G_INVALID,
	},
	{
		.name = "directory_entries",
		.lname = "skiff direct-read directory entries",
		.type = FIO_OPT_INT,
		.off1 = offsetof(struct skiff_options, directory_entries),
		.minval = 0,
		.def = "0",
		.help = "Direct reads with capabilities: how many the lane's directory holds; 0: off (default)",
		.category = FIO_OPT_C_ENGINE,
		.group = FIO_OPT_G_INVALID,
	},
	{
		.name = "key_file",
		.lname = "skiff key file",
		.type = FIO_OPT_STR_STORE,
		.off1 = offsetof(struct skiff_options, key_file),
		.help = "Authenticate with a key from this file (NAME:HEXSECRET per line)",
		.category = FIO_OPT_C_ENGINE,
		.group = FIO_OPT_G_INVALID,
	},
	{
		.name = "key",
		.lname = "skiff key name",
		.type = FIO_OPT_STR_STORE,
		.off1 = offsetof(struct skiff_options, key_name),
		.help = "Which key of key_file (default: its only key)",
		.category = FIO_OPT_C_ENGINE,
		.group = FIO_OPT_G_INVALID,
	},
	{
		.name = "poll",
		.lname = "skiff hybrid polling",
		.type = FIO_OPT_STR,
		.off1 = offsetof(struct skiff_options, poll),
		.def = "off",
		.help = "How a wait for the target spins before it sleeps (default off)",
		.posval = {
			{ .ival = "off", .oval = SKIFF_POLL_OFF,
			  .help = "sleep at once" },
			{ .ival = "hybrid", .oval = SKIFF_POLL_HYBRID,
			  .help = "spin poll_spin_us on every wait, then sleep" },
			{ .ival = "adaptive", .oval = SKIFF_POLL_ADAPTIVE,
			  .help = "spin only while it saves more wake-ups than it wastes" },
		},
		.category = FIO_OPT_C_ENGINE,
		.group = FIO_OPT_G_INVALID,
	},
	{
		.name = "poll_spin_us",
		.lname = "skiff hybrid polling spin bound",
		.type = FIO_OPT_INT,
		.off1 = offsetof(struct skiff_options, poll_spin_us),
		.minval = 1,
		.def = "50",
		.help = "The most a wait spins under poll=hybrid or adaptive, in microseconds (default 50)",
		.category = FIO_OPT_C_ENGINE,
		.group = FIO_OPT_G_INVALID,
	},
	{
		.name = "tls_certificates",
		.lname = "skiff TLS certificates",
		.type = FIO_OPT_STR_STORE,
		.off1 = offsetof(struct skiff_options, tls_certificates),
		.help = "Connect over TLS with the certificates in this directory (ca-cert.pem; client-cert.pem and client-key.pem to present one)",
		.category = FIO_OPT_C_ENGINE,
		.group = FIO_OPT_G_INVALID,
	},
	{
		.name = "batch_log",
		.lname = "skiff batch log",
		.type = FIO_OPT_STR_STORE,
		.off1 = offsetof(struct skiff_options, batch_log),
		.help = "With batching=adaptive, append the controller's decisions to this file at the end, "
			"one JSON object a line (lane, at_us, level, delay_us, bytes_per_s, a_out)",
		.category = FIO_OPT_C_ENGINE,
		.group = FIO_OPT_G_INVALID,
	},
	{
		.name = NULL,
	},
};

/* for_io: the job's I/O lane, which may be shared and logs; not setup's, which only asks the size. */
static int skiff_open_lane(struct thread_data *td, skiff_lane **lane, int for_io)
{
	struct skiff_options *o = td->eo;
	skiff_lane_config cfg;
	int rc;

	if (!o->target || !*o->target || !o->export_name || !*o->export_name) {
		log_err("fio: skiff: the target= and export= options are required\n");
		td_verror(td, EINVAL, "skiff options");
		return 1;
	}
	skiff_lane_config_default(&cfg);
	/* A shared lane holds the requests of all its jobs: give it the most a lane may have. */
	cfg.queue_depth = o->shared_lanes ? 256 : td->o.iodepth;
	cfg.aggregation_reqs = o->aggregation_reqs;
	cfg.aggregation_bytes = o->aggregation_bytes;
	cfg.doorbell_us = o->doorbell_us;
	cfg.timeout_ms = o->timeout_ms;
	cfg.batching = o->batching;
	cfg.shared_lanes = for_io ? o->shared_lanes : 0;
	cfg.reconnect_delay_ms = o->reconnect_delay_ms;
	cfg.ctrl_loss_timeout_ms = o->ctrl_loss_timeout_ms;
	cfg.fast_io_fail_timeout_ms = o->fast_io_fail_timeout_ms;
	cfg.directory_entries = o->directory_entries;
	cfg.key_file = o->key_file && *o->key_file ? o->key_file : NULL;
	cfg.key_name = o->key_name && *o->key_name ? o->key_name : NULL;
	cfg.tls_certificates = o->tls_certificates && *o->tls_certificates ? o->tls_certificates : NULL;
	cfg.poll = o->poll;
	cfg.poll_spin_us = o->poll_spin_us;
	cfg.batch_log = for_io && o->batch_log && *o->batch_log ? o->batch_log : NULL;
	rc = skiff_lane_open(o->target, o->export_name, &cfg, lane);
	if (rc) {
		log_err("fio: skiff: cannot open %s on %s: %s\n", o->export_name, o->target,
			skiff_last_error());
		td_verror(td, -rc, "skiff_lane_open");
		return 1;
	}
	return 0;
}

/* Learn the export's size for fio's file; the lane used for I/O is opened in init. */
static int skiff_setup(struct thread_data *td)
{
	struct skiff_data *sd = td->io_ops_data;
	skiff_lane *lane;
	struct fio_file *f;
	unsigned int i;

	if (!sd) {
		sd = calloc(1, sizeof(*sd));
		if (!sd) {
			td_verror(td, ENOMEM, "calloc");
			return 1;
		}
		td->io_ops_data = sd;
	}
	/* fio needs a file to address; the export stands in for it. */
	if (!td->files_index) {
		add_file(td, td->o.filename ? td->o.filename : "skiff", 0, 0);
		td->o.nr_files = td->o.nr_files ? : 1;
		td->o.open_files++;
	}
	/* A lane of its own, just to learn the size: opening a shared group here would connect
	 * all its lanes once per job. */
	if (skiff_open_lane(td, &lane, 0))
		return 1;
	sd->size_bytes = skiff_lane_size(lane);
	skiff_lane_close(lane);

	for_each_file(td, f, i) {
		f->real_file_size = sd->size_bytes;
		fio_file_set_size_known(f);
	}
	return 0;
}

static int skiff_init(struct thread_data *td)
{
	struct skiff_data *sd = td->io_ops_data;

	if (!sd) {
		log_err("fio: skiff: init before setup\n");
		return 1;
	}
	sd->events_max = td->o.iodepth ? td->o.iodepth : 1;
	sd->done = calloc(sd->events_max, sizeof(*sd->done));
	sd->events = calloc(sd->events_max, sizeof(*sd->events));
	if (!sd->done || !sd->events) {
		td_verror(td, ENOMEM, "calloc");
		return 1;
	}
	return skiff_open_lane(td, &sd->lane, 1);
}

static void skiff_cleanup(struct thread_data *td)
{
	struct skiff_data *sd = td->io_ops_data;

	if (!sd)
		return;
	if (sd->lane)
		skiff_lane_close(sd->lane);
	free(sd->done);
	free(sd->events);
	free(sd);
	td->io_ops_data = NULL;
}

static int skiff_op(enum fio_ddir ddir, uint32_t *op)
{
	switch (ddir) {
	case DDIR_READ:
		*op = SKIFF_OP_READ;
		return 0;
	case DDIR_WRITE:
		*op = SKIFF_OP_WRITE;
		return 0;
	case DDIR_TRIM:
		*op = SKIFF_OP_TRIM;
		return 0;
	case DDIR_SYNC:
	case DDIR_DATASYNC:
	case DDIR_SYNC_FILE_RANGE:
		/* skiff has no ranged flush: the whole export is made durable. */
		*op = SKIFF_OP_FLUSH;
		return 0;
	default:
		return -EINVAL;
	}
}

static enum fio_q_status skiff_queue(struct thread_data *td, struct io_u *io_u)
{
	struct skiff_data *sd = td->io_ops_data;
	void *buf = NULL;
	uint32_t len = 0;
	uint32_t op;
	int rc;

	fio_ro_check(td, io_u);

	if (skiff_op(io_u->ddir, &op)) {
		io_u->error = EINVAL;
		return FIO_Q_COMPLETED;
	}
	if (op == SKIFF_OP_READ || op == SKIFF_OP_WRITE || op == SKIFF_OP_TRIM) {
		if (io_u->xfer_buflen > UINT32_MAX) {
			io_u->error = EINVAL;
			return FIO_Q_COMPLETED;
		}
		len = (uint32_t)io_u->xfer_buflen;
		if (op != SKIFF_OP_TRIM)
			buf = io_u->xfer_buf;
	}
	rc = skiff_lane_submit(sd->lane, op, 0, op == SKIFF_OP_FLUSH ? 0 : io_u->offset, buf, len,
			       (uint64_t)(uintptr_t)io_u);
	if (rc == -EAGAIN)
		return FIO_Q_BUSY;
	if (rc) {
		log_err("fio: skiff: submit: %s\n", skiff_last_error());
		io_u->error = -rc;
		return FIO_Q_COMPLETED;
	}
	return FIO_Q_QUEUED;
}

/*
 * fio commits after every iodepth_batch_submit I/Os, one by default. Ringing the doorbell here
 * would send caravans of one request; instead the lane rings by its own policy: when a caravan
 * is full, when the doorbell delay has passed, or when fio waits for completions (getevents
 * with min > 0 reaps, and reaping sends what is queued). So commit only keeps fio's books.
 */
static int skiff_commit(struct thread_data *td)
{
	io_u_mark_submit(td, td->io_u_queued);
	return 0;
}

/* The lane's reap has no timeout of its own: it waits for min completions (bounded by what is
 * in flight) or until the lane's timeout_ms gives up on the target. */
static int skiff_getevents(struct thread_data *td, unsigned int min, unsigned int max,
			   const struct timespec *t)
{
	struct skiff_data *sd = td->io_ops_data;
	int n, i;

	if (max > sd->events_max)
		max = sd->events_max;
	if (min > max)
		min = max;
	n = skiff_lane_reap(sd->lane, sd->done, max, min);
	if (n < 0) {
		log_err("fio: skiff: reap: %s\n", skiff_last_error());
		return n;
	}
	for (i = 0; i < n; i++) {
		struct io_u *io_u = (struct io_u *)(uintptr_t)sd->done[i].user_data;

		io_u->error = -sd->done[i].result;
		/* A short transfer does not exist in skiff: a request moves all or fails. */
		io_u->resid = io_u->error ? io_u->xfer_buflen : 0;
		sd->events[i] = io_u;
	}
	return n;
}

static struct io_u *skiff_event(struct thread_data *td, int event)
{
	struct skiff_data *sd = td->io_ops_data;

	return sd->events[event];
}

static int skiff_get_file_size(struct thread_data *td, struct fio_file *f)
{
	struct skiff_data *sd = td->io_ops_data;

	if (!sd || !sd->size_bytes)
		return 1;
	f->real_file_size = sd->size_bytes;
	fio_file_set_size_known(f);
	return 0;
}

/* The export is opened with the lane; fio's files are only names for it. */
static int skiff_open_file(struct thread_data *td, struct fio_file *f)
{
	return 0;
}

static int skiff_close_file(struct thread_data *td, struct fio_file *f)
{
	return 0;
}

static int skiff_invalidate(struct thread_data *td, struct fio_file *f)
{
	return 0;
}

/* fio looks this symbol up by name when it dlopens an external engine. */
struct ioengine_ops ioengine = {
	.name = "skiff",
	.version = FIO_IOOPS_VERSION,
	.flags = FIO_DISKLESSIO | FIO_NOEXTEND | FIO_NODISKUTIL,
	.setup = skiff_setup,
	.init = skiff_init,
	.queue = skiff_queue,
	.commit = skiff_commit,
	.getevents = skiff_getevents,
	.event = skiff_event,
	.cleanup = skiff_cleanup,
	.open_file = skiff_open_file,
	.close_file = skiff_close_file,
	.invalidate = skiff_invalidate,
	.get_file_size = skiff_get_file_size,
	.options = options,
	.option_struct_size = sizeof(struct skiff_options),
};

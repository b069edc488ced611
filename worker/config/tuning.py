"""Tuning constants: the values the worker's mechanisms run with that no operator sets.

Each was a GPUFEED_* variable once. A setting is a promise: documented, validated, kept
working from release to release, and one more thing an operator must decide is right to
leave alone. These are not decisions an operator can make better than the code: an
interval, a timeout, a queue depth or a mechanism that `auto` picks from the host. So, as
dramatiq and Ray Data do with theirs, they are module constants, each with why it has its
value, and one is promoted to a setting (worker/config/table.py) only when an operator
shows a need the value here cannot meet.

`GPUFEED_TUNING=name=value,...` (the names below in lower case) overrides them: for tests
and experiments, not a contract; a name that is not here is refused. The worker refuses
each constant's former variable with a line naming what replaced it
(`table.REMOVED_SETTINGS`).
"""

from __future__ import annotations

# --- Delivery (worker/delivery/reclaimer.py) -------------------------------------------

# A dead worker's jobs wait out the visibility timeout (300 s) before anyone may take them;
# looking every 15 s adds at most 5% to that wait, for one XAUTOCLAIM per stream a worker.
CLAIM_INTERVAL_S = 15.0
# A consumer idle an hour with nothing pending is a worker that died, not one paused by a
# slow host; raised to the visibility timeout where that is longer, so that a consumer
# still owning a job it may come back for is never removed.
CONSUMER_EXPIRY_S = 3600.0
# Entries every group has processed are only memory: trimming once a minute keeps a
# minute of traffic at most. 0 (never) is for tests that read the stream afterwards.
TRIM_INTERVAL_S = 60.0
# A replica in the same region acknowledges in milliseconds: a WAIT past a second is a
# replica that is down, which the publish logs and counts rather than waits out.
WAIT_REPLICAS_TIMEOUT_MS = 1000

# --- Observability (worker/observe/) ---------------------------------------------------

# One summary line every 10 s: 8640 lines a day a worker, often enough to see a stall in
# the log before a probe acts on /live.
STATS_INTERVAL_S = 10.0
# The event loop beats every second; 30 s without one is a blocking call or a wedged task,
# not a pause of the host.
LIVE_LOOP_STALL_S = 30.0
# The slowest batch of a served model takes seconds; one in the launch thread or on the
# device for 2 minutes is a wedged device or driver. The visibility timeout (300 s) must
# exceed the slowest batch anyway.
LIVE_LAUNCH_STALL_S = 120.0
# The visibility timeout's default: past it the answers held are reclaimed by others
# anyway, so a worker that still cannot publish is better restarted.
LIVE_WRITER_STALL_S = 300.0

# --- Images by URL (worker/fetch/) -----------------------------------------------------

# A TCP and TLS handshake within a region takes milliseconds; 5 s covers one across
# continents after a lost SYN (Linux resends it after 1 s, then 3 s).
FETCH_CONNECT_TIMEOUT_S = 5.0
# A host that sends nothing for 15 s is overloaded or gone; it is also how long a busy host
# may answer nothing before its waiting jobs are answered `fetch_failed` (host busy).
FETCH_READ_TIMEOUT_S = 15.0
# A whole fetch, retries and redirects included: the largest image accepted (50 MiB) at a
# slow 1 MB/s is under a minute, and a job should not hold its in-flight place longer.
FETCH_TIMEOUT_S = 60.0
# Three tries ride out a dropped connection or one 5xx answer; more would keep places in
# flight for a host that is down.
FETCH_RETRIES = 2
# CDN and object-store chains are one or two hops; each hop is checked like the first, so
# the bound also bounds that cost.
FETCH_MAX_REDIRECTS = 5
# Four rounds of the per-host fetches (16) may wait without an in-flight place; past it a
# host's jobs wait holding one, so one slow host cannot hold every place.
FETCH_HOST_QUEUE = 64

# --- Decode and staging (worker/lifecycle/feed_plan.py, worker/decode/) ----------------

# 0: one decode thread per CPU core, at most 16, where the worker decodes on threads
# (GPUFEED_DECODE_PROCESSES=0, or `auto` below 4 cores); above 16 threads the worker's GIL,
# not the cores, binds.
DECODE_THREADS = 0
# One slot filling, one in transfer, one on the device, one being answered: more adds
# in-flight jobs (batch x (slots + 2)) and pinned memory without adding overlap.
RING_SLOTS = 4
# Decoding a large JPEG at 1/2, 1/4 or 1/8 scale only where that still covers the model's
# input loses nothing the model sees, and most of the decode time. Off only to measure it.
DCT_SCALING = True
# `auto`: on the device with CUDA (rows at their decoded size, resized in the compiled
# step), on the decode threads on the CPU: the placement follows the device.
RESIZE = "auto"
# `auto`: the GPU's share of both JPEG decoders' rates, measured at start-up and moved while
# running toward the decoder that keeps batches waiting less. A fixed share is for tests.
GPU_DECODE_SHARE = "auto"
# `auto` reads jobs in a process of the worker's own wherever there are decode processes,
# and publishes results from one on 4 cores or more (worker/lifecycle/feed_plan.py): both
# follow the host. Pinned only by tests (a GPU host's shape on a small CI host) and the
# bench.
INTAKE = "auto"
RESULT_WRITER = "auto"
# The longest a decode may take: well above what the largest images the default limits
# admit need (docs/guarantees.md gives their decode times), so only a runaway decode
# reaches it, and the batch goes on without it.
DECODE_BUDGET_MS = 10000.0
# `auto`: 1, B/8, B/2 and B compiled, less any measured no faster than the next larger:
# measured beats any list written ahead of the device it runs on.
BATCH_SIZES = "auto"

# --- Warm start (worker/delivery/hot_list.py, worker/lifecycle/warm_start.py) ----------

# The images most often answered from the decode cache, each hit worth half every 10
# minutes: 1000 photos decoded at 224 px fit in the cache's 256 MiB with room to spare.
HOT_LIST = 1000
# A starting worker decodes the hot list for at most 30 s before it joins the group: a
# restart delays one worker by no more than that, and its first jobs find a warm cache.
WARM_START_S = 30.0

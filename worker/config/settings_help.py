"""Each worker setting's default, as people read it, and its one-line meaning.

The one source behind `python -m worker --help` (and `run --help`, `doctor --help`, ...) and
the site's configuration page (docs/reference/configuration.md, written by
`python -m worker.docs_gen`). A new setting in worker/config/settings.py gets its row here.

Meanings are Markdown: backticks, and links to the site's pages written relative to docs/
(`[Priorities](priorities.md)`). `--help` shows them as plain text (`plain`): the link's
words stay, its target goes.
"""

from __future__ import annotations

import re
from dataclasses import fields

# TOOL_VARIABLES: the GPUFEED_* variables that are no worker setting but that a worker
# accepts in its environment, each with who reads it and what it does; kept beside the check
# that accepts them, shown from here.
from worker.config.settings import DEFAULT_REDIS_URL, TOOL_VARIABLES, WorkerConfig

__all__ = ["SETTINGS", "TOOL_VARIABLES", "default", "meaning", "missing", "plain", "relink"]

# env var: (default, meaning), in markdown; in worker/config/settings.py's order.
SETTINGS: dict[str, tuple[str, str]] = {
    "REDIS_URL": (
        f"`{DEFAULT_REDIS_URL}`",
        "`redis://`, `rediss://` (TLS) or `unix://`; `redis://user:password@host:port/db` for "
        "ACL users. The password never appears in logs",
    ),
    "GPUFEED_STREAM": ("`gpufeed:jobs`", "the job stream"),
    "GPUFEED_GROUP": ("`gpufeed`", "the consumer group"),
    "GPUFEED_PRIORITIES": (
        "unset",
        "priority levels, highest first (e.g. `high,normal,low`): one job stream per level, "
        "`<GPUFEED_STREAM>:<level>`; unset or one level: the one job stream. See "
        "[Priorities](priorities.md)",
    ),
    "GPUFEED_PRIORITY_WEIGHTS": (
        "unset (`4,2,1` for three levels)",
        "each level's share of the read budget, highest first, one per level (e.g. `8,3,1`); "
        "unset: each level twice the next one's",
    ),
    "GPUFEED_TENANTS": (
        "unset",
        "tenants, each with a job stream, results stream and result hashes of its own "
        "(`<GPUFEED_STREAM>:t:<name>`, ...), read in turn by weight: `name[=weight],...`, "
        "e.g. `acme=3,globex`. The job stream itself is still read. See "
        "[Security](security.md#tenants)",
    ),
    "GPUFEED_RESULTS_STREAM": ("`gpufeed:results`", "results of jobs without `reply_to`"),
    "GPUFEED_RESULT_PREFIX": ("`gpufeed:result:`", "prefix of the result hashes"),
    "GPUFEED_DEAD_STREAM": ("`gpufeed:dead`", "the dead-letter stream"),
    "GPUFEED_RESULT_TTL_S": ("`86400`", "lifetime of a result hash"),
    "GPUFEED_RESULTS_MAXLEN": (
        "`1000000`",
        "approximate cap of each results stream (`XADD MAXLEN ~`)",
    ),
    "GPUFEED_MAX_META_BYTES": (
        "`65536`",
        "largest `meta` a job may carry (it is echoed in the result); a job over it is "
        "answered `invalid_job` naming this limit, before it is decoded. At most 67108864",
    ),
    "GPUFEED_MAX_RESULT_BYTES": (
        "`4194304`",
        "largest result (its fields, meta and answer together); a result over it is replaced "
        "by an error naming this limit (`invalid_job` when the job carries a meta, else "
        "`internal_error`), so one job can never hold up the answers of others. At least "
        "GPUFEED_MAX_META_BYTES + 16384, at most 268435456",
    ),
    "GPUFEED_WORKER_NAME": ("`<host>-<pid>`", "the consumer name in the group"),
    "GPUFEED_REDIS_CLUSTER": (
        "`auto`",
        "`on`: `REDIS_URL` names a node of a Redis Cluster (any node); `off`: a single Redis; "
        "`auto`: ask the node once at start-up (`INFO cluster`). See "
        "[Redis Cluster](cluster.md)",
    ),
    "GPUFEED_SHARDS": (
        "`1`",
        "job streams, one per hash tag (set it to the number of cluster masters); 1 keeps the "
        "names as set. The four key names must then have no `{`/`}`",
    ),
    "GPUFEED_WAIT_REPLICAS": (
        "`0`",
        "after each publish, `WAIT` for this many replicas to have the results (0: do not "
        "wait); on a timeout the results stand, logged and counted",
    ),
    "GPUFEED_WAIT_REPLICAS_TIMEOUT_MS": ("`1000`", "how long one `WAIT` may take"),
    "GPUFEED_MODEL": (
        "`resnet50`",
        "a torchvision classification model name, a model directory (a path: see "
        "[Your own model](own-model.md)), or `null`: a step that does next to nothing, "
        "for measuring gpufeed itself (8 classes `null_0`.., 64 px unless "
        "`GPUFEED_INPUT_SIZE`)",
    ),
    "GPUFEED_WEIGHTS": (
        "`DEFAULT`",
        "torchvision models: a weights name (`DEFAULT`, `IMAGENET1K_V2`, ...), a local file "
        '(a state dict, or `{"state_dict": ..., "categories": [...]}`, loaded with '
        "`weights_only=True`), or `none` for random init",
    ),
    "GPUFEED_DEVICE": ("`auto`", "`auto`, `cpu`, `cuda` or `cuda:N`"),
    "GPUFEED_PROCESSES": (
        "`1`",
        "worker processes on the one device, each its own consumer "
        "(`<GPUFEED_WORKER_NAME>-<i>`, metrics on `GPUFEED_METRICS_PORT` + i), under a "
        "supervisor that forwards signals and restarts a process that dies; see "
        "[GPU hosts](gpu-hosts.md)",
    ),
    "GPUFEED_BATCH_SIZE": (
        "`0` (auto)",
        "the largest batch shape (how many images a batch holds); auto: 64 on CUDA, 8 on CPU",
    ),
    "GPUFEED_BATCH_SIZES": (
        "`auto`",
        "the smaller batch shapes the step is also compiled for; a batch runs on the "
        "smallest that holds it (see [Concepts](concepts.md#which-batch-size-runs)). `auto`: "
        "1, B/8, B/2 and B, less any measured at start-up to be no faster than the next "
        "larger; a list such as `1,16` (the batch size is always added, at most 6 sizes); "
        "`off`: the batch size alone",
    ),
    "GPUFEED_COMPILE": (
        "`auto`",
        "`off` (eager: the rollback switch), `auto` (`reduce-overhead` on CUDA, `off` on "
        "CPU), or a `torch.compile` mode",
    ),
    "GPUFEED_PRECISION": (
        "`auto`",
        "`fp32`, `fp16`, `bf16`; auto: bf16 (or fp16) on CUDA, fp32 on CPU",
    ),
    "GPUFEED_INPUT_SIZE": (
        "`0`",
        "torchvision models: the input side; 0: the weights' own (224 for most)",
    ),
    "GPUFEED_TOP_K": ("`5`", "classes returned per image (a model directory's `top_k` wins)"),
    "GPUFEED_ALLOW_EAGER_FALLBACK": (
        "`false`",
        "start in eager mode, with an error in the log, instead of refusing when the compiled "
        "step has graph breaks or recompiles",
    ),
    "GPUFEED_DEGRADE_AFTER_S": (
        "`0` (off)",
        "switch to the cheaper degraded step while the oldest job waiting in the stream is "
        "older than this; back once it has been under half of it for as long (see "
        "[Degrade under backlog](priorities.md))",
    ),
    "GPUFEED_DEGRADE_INPUT_SIZE": (
        "`0`",
        "the degraded step: the same model at this smaller input side",
    ),
    "GPUFEED_DEGRADE_MODEL": (
        "unset",
        "the degraded step: a smaller model directory (same output kind and resize mode)",
    ),
    "GPUFEED_MAX_WAIT_MS": (
        "`10`",
        "how long a batch waits to fill before it runs padded; past it, a batch the device "
        "cannot take yet keeps filling until it can",
    ),
    "GPUFEED_DECODE_THREADS": (
        "`0`",
        "decode threads when decoding in the worker (GPUFEED_DECODE_PROCESSES=0); 0: one per "
        "CPU core, at most 16. Set, it keeps GPUFEED_DECODE_PROCESSES=auto on threads",
    ),
    "GPUFEED_DECODE_PROCESSES": (
        "`auto`",
        "decode processes writing into shared staging memory; `0`: decode threads in the "
        "worker instead; `auto`: on 4 cores or more one per core but the worker's, at most "
        "32; threads below 4 cores, where the worker's own CPU would compete with them, and "
        "where shared memory files are missing",
    ),
    "GPUFEED_RESULT_WRITER": (
        "`auto`",
        "where results are built and published: `process` (a process of the worker's own, "
        "off the worker's GIL), `loop` (on the worker's event loop) or `auto` (a process on "
        "4 cores or more, as decode processes)",
    ),
    "GPUFEED_INTAKE": (
        "`auto`",
        "where jobs are read from Redis: `process` (a process of the worker's own puts image "
        "bytes into memory shared with the decode processes, never into the worker's), "
        "`loop` (on the worker's event loop) or `auto` (a process where there are decode "
        "processes; on a Redis Cluster, one per shard, reading its master)",
    ),
    "GPUFEED_DECODE": (
        "`cpu`",
        "`cpu`, `gpu` (JPEGs decoded on the GPU) or `auto` (measured at start-up). With "
        "decode processes the GPU's hardware engines (nvImageCodec, `pip install "
        "gpufeed[gpu]`) decode GPUFEED_GPU_DECODE_SHARE of each batch's baseline JPEGs "
        "straight into its packed rows, the processes the rest; with decode threads the GPU "
        "decodes the size classes where it measured faster",
    ),
    "GPUFEED_GPU_DECODE_SHARE": (
        "`auto`",
        "with GPUFEED_DECODE=gpu|auto and decode processes: the fraction (0 to 1) of each "
        "batch's rows offered to the GPU's JPEG decoder; `auto`: the GPU's share of the "
        "two decoders' rates, both measured at start-up on photo-sized JPEGs, then moved "
        "while running toward the decoder that keeps batches waiting less",
    ),
    "GPUFEED_RESIZE": (
        "`auto`",
        "where images are resized: `device` (rows at their decoded size, resized in the "
        "compiled step), `host` (on the decode threads) or `auto` (device on CUDA, host on "
        "the CPU)",
    ),
    "GPUFEED_DCT_SCALING": (
        "`true`",
        "let libjpeg decode large JPEGs at 1/2, 1/4 or 1/8 scale when that still covers the "
        "model input",
    ),
    "GPUFEED_DECODE_CACHE_MB": (
        "`256`",
        "host memory for decoded rows of images seen before (keyed by a hash of their bytes "
        "and the job's reply stream); a repeated image skips decoding; 0: off",
    ),
    "GPUFEED_HOT_LIST": (
        "`1000`",
        "how many images the fleet's hot list keeps (`<GPUFEED_STREAM>:hot` in Redis): the "
        "`url` and `path` images answered most often from the decode cache, each hit worth "
        "half as much every 10 minutes. A starting worker decodes them into its cache before "
        "it takes a job. 0: no hot list (nothing counted, nothing warmed); off too while "
        "GPUFEED_DECODE_CACHE_MB is 0. See [Warm start](operations.md#warm-start)",
    ),
    "GPUFEED_WARM_START_S": (
        "`30`",
        "the most time a starting worker spends decoding the hot list into its cache before "
        "it joins the group (each fetch and decode bounded by what is left of it: done within "
        "a second of it); 0: start cold",
    ),
    "GPUFEED_RING_SLOTS": ("`4`", "staging slots (batches in flight between decode and results)"),
    "GPUFEED_MAX_IMAGE_BYTES": ("`52428800`", "largest encoded image accepted"),
    "GPUFEED_MAX_IMAGE_PIXELS": ("`100000000`", "largest width x height accepted"),
    "GPUFEED_MAX_DECODE_MB": (
        "`512`",
        "most memory (MiB) one decode may take for its pixels, as Pillow holds them (4 bytes a "
        "pixel for colour modes, 1 for grey and palette, 2 for 16-bit grey) at the JPEG DCT "
        "scale that would be used, plus the copy converting them to RGB, plus, for a "
        "progressive JPEG (or one of several scans), every DCT coefficient of the whole image "
        "at full size (about 3 bytes a pixel at 4:2:0), which libjpeg-turbo holds whatever "
        "the scale; estimated from the header, larger images get `image_too_large`. "
        "10000x10000 RGBA (a 390 KB PNG) needs 763 MiB",
    ),
    "GPUFEED_DECODE_BUDGET_MS": (
        "`10000`",
        "longest time one image may take to decode, counted from when a thread starts on it "
        "(with decode processes: from when a process starts on its share of a batch, the "
        "smallest images first); past it the image is answered `decode_timeout` (with "
        "processes, the rows of that share not yet decoded too) and its batch goes on (see "
        "[Guarantees](guarantees.md)). The largest images the default limits admit (100 M "
        "pixel PNG or GIF) decode in 1 to 2 s on one core of the 2-core test machine, 3 to 4 s "
        "while it is busy",
    ),
    "GPUFEED_PATH_ROOT": (
        "unset",
        "the only folder `path` jobs may read from; unset: `path` jobs are refused",
    ),
    "GPUFEED_FETCH_CONCURRENCY": ("`64`", "`url` fetches running at once"),
    "GPUFEED_FETCH_PER_HOST": (
        "`16`",
        "`url` fetches running at once against one host (or one bucket)",
    ),
    "GPUFEED_FETCH_CONNECT_TIMEOUT_S": ("`5`", "time to open a connection for a `url`"),
    "GPUFEED_FETCH_READ_TIMEOUT_S": ("`15`", "longest wait for the next bytes of an answer"),
    "GPUFEED_FETCH_TIMEOUT_S": (
        "`60`",
        "a `url` fetch in all, retries and redirects included (`fetch_timeout` after it)",
    ),
    "GPUFEED_FETCH_RETRIES": (
        "`2`",
        "retries after a timeout, a dropped connection or a 5xx answer (not after a 4xx), "
        "with exponential backoff and jitter",
    ),
    "GPUFEED_FETCH_MAX_REDIRECTS": (
        "`5`",
        "redirects followed per `url` (each hop checked like the first)",
    ),
    "GPUFEED_URL_ALLOW": (
        "unset",
        "host names (`images.internal`, `*.corp.example`) and CIDRs (`10.20.0.0/16`, "
        "`127.0.0.1`) that `url` jobs may reach although their addresses are loopback, "
        "private, link-local, reserved or multicast",
    ),
    "GPUFEED_URL_DENY": (
        "unset",
        "host names and CIDRs that `url` jobs may never reach (wins over `GPUFEED_URL_ALLOW`)",
    ),
    "GPUFEED_FETCH_HOST_QUEUE": (
        "`64`",
        "`url` jobs of one host that may wait for a fetch slot without holding an in-flight "
        "place (all hosts together: 16 times this); past it they wait holding one, or, when "
        "the host has answered nothing for `GPUFEED_FETCH_READ_TIMEOUT_S`, are answered "
        "`fetch_failed` (host busy)",
    ),
    "GPUFEED_OBJECT_ALLOW": (
        "unset (no keys)",
        "the `s3://`, `gs://`, `az://` buckets and key prefixes jobs may read: "
        "`images-*,catalog/public/`, per reply stream (and the streams under it) "
        "`tenant-a:results=s3://tenant-a`, groups separated by `;`. Unset: every key is "
        "`object_not_allowed`. See "
        "[Security](security.md)",
    ),
    "GPUFEED_VISIBILITY_TIMEOUT_S": (
        "`300`",
        "idle time after which another worker may reclaim a pending job; must exceed the "
        "slowest batch",
    ),
    "GPUFEED_MAX_DELIVERIES": ("`5`", "deliveries before a job is dead-lettered"),
    "GPUFEED_CLAIM_INTERVAL_S": (
        "`15`",
        "how often a worker looks for stale pending jobs to reclaim",
    ),
    "GPUFEED_SHUTDOWN_GRACE_S": ("`30`", "time given to in-flight jobs after SIGTERM"),
    "GPUFEED_CONSUMER_EXPIRY_S": (
        "`3600`",
        "a consumer idle this long and holding no pending job (a worker that died) is removed "
        "from the group",
    ),
    "GPUFEED_TRIM_INTERVAL_S": (
        "`60`",
        "how often the job stream is trimmed of entries every group has processed; 0: never",
    ),
    "GPUFEED_METRICS_PORT": (
        "`0`",
        "Prometheus metrics and `/ready`, `/live` on this port; 0: off",
    ),
    "GPUFEED_METRICS_HOST": (
        "`127.0.0.1`",
        "the address the metrics port listens on: loopback, so only this host can read it; "
        "`0.0.0.0` (or `::`) where Prometheus or the kubelet's probes come from elsewhere, "
        "as in the container image. Unauthenticated: see [Security](security.md)",
    ),
    "GPUFEED_LIVE_LOOP_STALL_S": (
        "`30`",
        "`/live` fails when the event loop has not run for this long (a blocking call, a "
        "wedged task); 0: not checked",
    ),
    "GPUFEED_LIVE_LAUNCH_STALL_S": (
        "`120`",
        "`/live` fails when one batch has been in the launch thread, or unfinished on the "
        "device, for this long; must exceed the slowest batch; 0: not checked",
    ),
    "GPUFEED_LIVE_WRITER_STALL_S": (
        "`300`",
        "`/live` fails when the result writer has held answers it could not publish (Redis "
        "unreachable or refusing them) for this long; the reason is logged. 0: not checked",
    ),
    "GPUFEED_STATS_INTERVAL_S": ("`10`", "interval of the worker's summary log line"),
    "GPUFEED_LOG_FORMAT": ("`auto`", "`console` (on a terminal), `json` (otherwise), or forced"),
    "GPUFEED_LOG_LEVEL": ("`info`", "`debug`, `info`, `warning`, `error`"),
}


_LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")


def relink(markdown: str, prefix: str) -> str:
    """`markdown` with each link's target prefixed (pages are named relative to docs/)."""
    return _LINK.sub(lambda m: f"[{m.group(1)}]({prefix}{m.group(2)})", markdown)


def plain(markdown: str) -> str:
    """Terminal text: no backticks, and links as their words."""
    return _LINK.sub(r"\1", markdown).replace("`", "")


def meaning(env: str) -> str:
    return plain(SETTINGS[env][1])


def default(env: str) -> str:
    return plain(SETTINGS[env][0])


def missing() -> list[str]:
    """Settings of worker/config/settings.py without a row here."""
    return [f.metadata["env"] for f in fields(WorkerConfig) if f.metadata["env"] not in SETTINGS]

"""Every setting of the worker, once: its variable, default, type, bounds or choices, meaning
and section, in one table that the rest is built from.

`WorkerConfig` (settings.py) takes each field's default from here and validates by looping
over this table; `python -m worker --help`, docs/reference/configuration.md and the checks
of deploy/systemd/worker.env.example read it too. A new setting is one entry here and one
field of `WorkerConfig` (tests/config/test_settings_table.py fails on either alone).

An entry without a variable is a tuning constant (tuning.py): a field the code reads like
any other, set only through GPUFEED_TUNING (tests and experiments; not a contract). Its
former variable is refused with the line `REMOVED_SETTINGS` gives.

Meanings are Markdown: backticks, and links to the site's pages written relative to docs/
(`[Priorities](priorities.md)`). `--help` shows them as plain text (`plain`).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import re
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from redis.exceptions import RedisError

from producer import shards, tenants, wire
from producer.priorities import parse_levels
from worker.base.errors import ConfigError
from worker.base.paths import lookup, path_problem
from worker.config import tuning
from worker.fetch.objects import object_allow_problem
from worker.fetch.policy import parse_host_list
from worker.model.manifest import looks_like_model_dir, read_manifest
from worker.model.names import check_name
from worker.model.sizes import parse_batch_sizes

TUNING_VARIABLE = "GPUFEED_TUNING"
DEFAULT_REDIS_URL = "redis://localhost:6379/0"
COMPILE_MODES = (
    "off",
    "auto",
    "default",
    "reduce-overhead",
    "max-autotune",
    "max-autotune-no-cudagraphs",
)
MAX_PROCESSES = 64
MAX_DECODE_PROCESSES = 64
# The hot list is read whole (ZREVRANGEBYSCORE) by each starting worker and doctor.
MAX_HOT_LIST = 100_000
# A result is one publish call's worth at most, well under Redis's 512 MB bulk strings;
# beside its meta it needs room for ids, timings and an error text.
MAX_META_BYTES = 64 * 1024 * 1024
MAX_RESULT_BYTES = 256 * 1024 * 1024
RESULT_HEADROOM_BYTES = 16 * 1024

# GPUFEED_* variables that are no worker setting yet may be in a worker's environment: who
# reads each and what it does.
TOOL_VARIABLES: Mapping[str, str] = MappingProxyType(
    {
        "GPUFEED_WORKER_NAME_PREFIX": (
            "read by `scripts/run-workers.sh` (`make run-worker`) on a host with several GPUs: "
            "the worker it starts on GPU N is named `<prefix>-gpu<N>`; default: the short host "
            "name"
        ),
    }
)
TUNING_HELP = (
    "tuning constants, for tests and experiments; not a contract: `name=value,...` with the "
    "lower-case names of `worker/config/tuning.py` (e.g. `claim_interval_s=0.2,"
    "stats_interval_s=0.5`). See [Tuning constants](#tuning-constants)"
)

_DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]{1,3})?")
_UNIX_PATH_BYTES = 107  # sockaddr_un's sun_path (108) less its NUL

Check = Callable[[Any], str | None]


@dataclass(frozen=True)
class Setting:
    """One setting: `problem` says, in the words after `VARIABLE: `, why a value is refused."""

    name: str  # the WorkerConfig field
    env: str | None  # None: a tuning constant (tuning.py), set only through GPUFEED_TUNING
    default: Any
    help: str  # Markdown
    group: str = ""  # its section (`section`)
    shown: str = ""  # the default as people read it, where the value alone says too little
    kind: str = ""  # "path" where the default's type does not say
    bounds: tuple[float | None, float | None] = (None, None)  # (lowest, highest), inclusive
    above: float | None = None  # exclusive: 0 reads "must be positive"
    zero: str = ""  # what 0 means, where 0 is accepted below `low`
    unit: str = ""
    note: str = ""  # added to the bounds' message, in brackets
    choices: tuple[str, ...] = ()
    required: str = ""  # the message for an empty value
    check: Check | None = None
    # Tuning constants: what the former variable set, for the line that refuses it, or
    # that line itself where the constant alone does not replace it.
    what: str = ""
    instead: str = ""

    @property
    def low(self) -> float | None:
        return self.bounds[0]

    @property
    def high(self) -> float | None:
        return self.bounds[1]

    @property
    def type_name(self) -> str:
        """The WorkerConfig field's annotation (a string, under future annotations)."""
        if self.kind == "path":
            return "Path | None"
        return type(self.default).__name__

    @property
    def label(self) -> str:
        """How an error line names it: its variable, or GPUFEED_TUNING and its name."""
        return self.env or f"{TUNING_VARIABLE} {self.name}"

    @property
    def constant(self) -> str:
        return self.name.upper()

    def given(self, value: Any) -> str:
        """How a message says where `value` came from: `GPUFEED_X=value`; for a tuning
        constant `tuning constant X` at tuning.py's value, else `GPUFEED_TUNING x=value`,
        so that no message names a variable the worker refuses."""
        if isinstance(value, bool):
            text = "true" if value else "false"
        else:
            text = number(value) if isinstance(value, int | float) else str(value)
        if self.env:
            return f"{self.env}={text}"
        if value == self.default:
            return f"tuning constant {self.constant}"
        return f"{TUNING_VARIABLE} {self.name}={text}"

    def shown_default(self) -> str:
        if self.shown:
            return self.shown
        value = self.default
        if value is None or value == "":
            return "unset"
        if isinstance(value, bool):
            return "`true`" if value else "`false`"
        return f"`{number(value) if isinstance(value, int | float) else value}`"

    def problem(self, value: Any) -> str | None:
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite number (got {value})"
        if self.required and not str(value).strip():
            return self.required
        if self.choices and value not in self.choices:
            return f"must be one of {', '.join(self.choices)} (got {shown(str(value))})"
        if not self.within(value):
            return self.bounds_rule()
        return self.check(value) if self.check is not None else None

    def within(self, value: Any) -> bool:
        if not isinstance(value, int | float) or isinstance(value, bool):
            return True
        if self.zero and value == 0:
            return True
        return not (
            (self.low is not None and value < self.low)
            or (self.high is not None and value > self.high)
            or (self.above is not None and value <= self.above)
        )

    def bounds_rule(self) -> str:
        low, high = self.low, self.high
        zero = f"0 ({self.zero})" if self.zero else "0"
        note = f" ({self.note})" if self.note else ""
        if low == 0 and high is None and self.above is None:
            return "must not be negative" + (f" (0: {self.zero})" if self.zero else "") + note
        if self.above is not None:
            text = "positive" if self.above == 0 else f"more than {number(self.above)}"
        elif low is not None and high is not None:
            text = f"between {zero if low == 0 else number(low)} and {number(high)}"
        elif low is not None:
            text = f"at least {number(low)}"
        else:
            text = f"at most {number(high or 0)}"
        if self.zero and low:
            text = f"{zero} or {text}"
        if self.unit:
            # "at least 1 second", "between 0 and 3600 seconds"
            one = (high, low) == (None, 1)
            text += f" {self.unit.removesuffix('s')}" if one else f" {self.unit}"
        return f"must be {text}{note}"


def number(value: float) -> str:
    """A bound or default as people write it: 10, not 10.0."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def shown(raw: str) -> str:
    """`raw` as an error line may show it: escaped, and cut short."""
    text = ascii(raw)
    return text if len(text) <= 80 else text[:77] + "..."


def plain_text(text: str) -> str:
    """A path or name as typed where it is plain, else as `shown` gives it."""
    return text if text.isprintable() and len(text) <= 200 else shown(text)


# --------------------------------------------------------------------- one value's checks


def redis_url_problem(url: str) -> str | None:
    """Why redis-py would refuse `url` when it connects (a port out of range, an unknown
    option, a db that is no number); None when it takes it."""
    if url.startswith("unix:"):
        # The kernel takes at most 107 bytes of socket path: a longer one would read as
        # "cannot reach Redis", and a waiting worker would wait for it for ever.
        size = len(os.fsencode(unquote(urlsplit(url).path)))
        if size > _UNIX_PATH_BYTES:
            return f"its socket path is {size} bytes, a Unix socket's at most {_UNIX_PATH_BYTES}"
    try:
        redis.ConnectionPool.from_url(url).make_connection()
    except (ValueError, TypeError, RedisError) as exc:
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return None


def _redis_url(url: str) -> str | None:
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme not in ("redis", "rediss", "unix"):
        return f"must start with redis://, rediss:// or unix:// (got scheme {scheme or 'none'!r})"
    problem = redis_url_problem(url)
    return None if problem is None else f"is not a usable Redis URL: {problem}"


def _reason(parse: Callable[[str], object], errors: type[Exception]) -> Check:
    """A check that is a parser's own error message, or None."""

    def check(raw: str) -> str | None:
        try:
            parse(raw)
        except errors as exc:
            return str(exc)
        return None

    return check


def _model(name: str) -> str | None:
    # A name torchvision does not know is refused here, with a hint, before torch.
    check_name(name)
    if looks_like_model_dir(name):
        # The manifest is small and torch-free: a wrong key stops the worker here, before
        # anything is loaded. Whether the model fits it is checked at load.
        read_manifest(name)
    return None


def _weights(weights: str) -> str | None:
    problem = path_problem(weights)
    return None if problem is None else f"{plain_text(weights)} {problem}"


def _device(device: str) -> str | None:
    if _DEVICE.fullmatch(device):
        return None
    return f"must be auto, cpu, cuda or cuda:N (got {device!r})"


def _decode_processes(setting: str) -> str | None:
    # int() refuses numbers of thousands of digits (ValueError, not a setting's one line):
    # a count that long is over the bound anyway.
    if setting == "auto" or (
        setting.isascii()
        and setting.isdigit()
        and len(setting) <= 4
        and int(setting) <= MAX_DECODE_PROCESSES
    ):
        return None
    return (
        f"must be auto, 0 (decode threads in the worker) or a number of processes up to "
        f"{MAX_DECODE_PROCESSES} (got {plain_text(setting)})"
    )


def share(text: str) -> float | str | None:
    """A GPU decode share read: "auto", a fraction in [0, 1], or None (invalid)."""
    if text == "auto":
        return "auto"
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0.0 <= value <= 1.0 else None


def _gpu_decode_share(text: str) -> str | None:
    if share(text) is not None:
        return None
    return f"must be auto or a fraction between 0 and 1 (got {plain_text(text)})"


def _path_root(root: Path | None) -> str | None:
    if root is None:
        return None
    problem = path_problem(root)
    if problem is not None:
        return f"{plain_text(str(root))} {problem}"
    st = lookup(root)
    if st is None or not stat.S_ISDIR(st.st_mode):
        return f"{plain_text(str(root))} is not a directory"
    return None


def host_list_problem(raw: str) -> str | None:
    """Why `raw` (GPUFEED_URL_ALLOW / GPUFEED_URL_DENY) is not a list of host names and
    CIDRs; None when it is."""
    try:
        parse_host_list(raw)
    except ValueError as exc:
        return str(exc)
    return None


def _host_list(raw: str) -> str | None:
    problem = host_list_problem(raw)
    if problem is None:
        return None
    return (
        f"{problem}; give host names and CIDRs separated by commas "
        "(e.g. images.internal,10.0.0.0/8)"
    )


def _object_allow(raw: str) -> str | None:
    problem = object_allow_problem(raw)
    if problem is None:
        return None
    return f"{problem}; e.g. images-*,catalog/public/;tenant-a:results=s3://tenant-a"


def _metrics_host(text: str) -> str | None:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return (
            "must be an IP address to listen on, e.g. 127.0.0.1 (this host only), 0.0.0.0 or "
            f":: (every interface), got {text!r}"
        )
    return None


def _degrade_model(path: str) -> str | None:
    if not path:
        return None
    if not looks_like_model_dir(path):
        return f"must be a model directory (a path, e.g. ./models/small), got {path!r}"
    try:
        read_manifest(path)
    except ConfigError as exc:
        return str(exc).removeprefix("GPUFEED_MODEL: ")
    return None


# ------------------------------------------------------------------------------ the table

REDIS = "Redis and the wire contract"
MODEL = "Model and device"
DEGRADE = "Degrade under backlog"
DECODE = "Decode"
FETCH = "Images by URL"
DELIVERY = "Delivery"
OBSERVE = "Observability"

_NOT_EMPTY = "must not be empty"


def public(name: str, default: Any, meaning: str, *, env: str = "", **rules: Any) -> Setting:
    """A setting: its variable is its name in upper case after GPUFEED_, unless `env` says."""
    return Setting(name, env or f"GPUFEED_{name.upper()}", default, meaning, **rules)


def tuned(name: str, meaning: str, what: str, **rules: Any) -> Setting:
    """A tuning constant: its value is tuning.py's, its only variable GPUFEED_TUNING."""
    return Setting(name, None, getattr(tuning, name.upper()), meaning, what=what, **rules)


def section(group: str, *entries: Setting) -> tuple[Setting, ...]:
    return tuple(dataclasses.replace(entry, group=group) for entry in entries)


SETTINGS: tuple[Setting, ...] = (
    *section(
        REDIS,
        public(
            "redis_url",
            DEFAULT_REDIS_URL,
            "`redis://`, `rediss://` (TLS) or `unix://`; `redis://user:password@host:port/db` for "
            "ACL users. The password never appears in logs",
            env="REDIS_URL",
            check=_redis_url,
        ),
        public("stream", wire.DEFAULT_STREAM, "the job stream", required=_NOT_EMPTY),
        public("group", wire.DEFAULT_GROUP, "the consumer group", required=_NOT_EMPTY),
        public(
            "priorities",
            "",
            "priority levels, highest first (e.g. `high,normal,low`): one job stream per level, "
            "`<GPUFEED_STREAM>:<level>`; unset or one level: the one job stream. See "
            "[Priorities](priorities.md)",
            check=_reason(parse_levels, ValueError),
        ),
        public(
            "priority_weights",
            "",
            "each level's share of the read budget, highest first, one per level (e.g. `8,3,1`); "
            "unset: each level twice the next one's",
            shown="unset (`4,2,1` for three levels)",
        ),
        public(
            "tenants",
            "",
            "tenants, each with a job stream, results stream and result hashes of its own "
            "(`<GPUFEED_STREAM>:t:<name>`, ...), read in turn by weight: `name[=weight],...`, "
            "e.g. `acme=3,globex`. The job stream itself is still read. See "
            "[Security](security.md#tenants)",
            check=_reason(tenants.parse, tenants.TenantError),
        ),
        public(
            "results_stream",
            wire.DEFAULT_RESULTS_STREAM,
            "results of jobs without `reply_to`",
            required=_NOT_EMPTY,
        ),
        public(
            "result_prefix",
            wire.DEFAULT_RESULT_PREFIX,
            "prefix of the result hashes",
            required=_NOT_EMPTY,
        ),
        public(
            "dead_stream", wire.DEFAULT_DEAD_STREAM, "the dead-letter stream", required=_NOT_EMPTY
        ),
        # Upper bounds where Redis takes the value (EXPIRE, XPENDING IDLE): past them every
        # publish, or every reclaim, would fail at run time instead of here.
        public(
            "result_ttl_s",
            86_400,
            "lifetime of a result hash",
            bounds=(1, 315_360_000),
            unit="seconds",
            note="315360000: 10 years",
        ),
        public(
            "results_maxlen",
            1_000_000,
            "approximate cap of each results stream (`XADD MAXLEN ~`)",
            bounds=(1, None),
        ),
        public(
            "max_meta_bytes",
            wire.DEFAULT_MAX_META_BYTES,
            "largest `meta` a job may carry (it is echoed in the result); a job over it is "
            "answered `invalid_job` naming this limit, before it is decoded. At most 67108864",
            bounds=(0, MAX_META_BYTES),
            zero="no meta",
        ),
        public(
            "max_result_bytes",
            wire.DEFAULT_MAX_RESULT_BYTES,
            "largest result (its fields, meta and answer together); a result over it is replaced "
            "by an error naming this limit (`invalid_job` when the job carries a meta, else "
            "`internal_error`), so one job can never hold up the answers of others. At least "
            "GPUFEED_MAX_META_BYTES + 16384, at most 268435456",
        ),
        public("worker_name", "", "the consumer name in the group", shown="`<host>-<pid>`"),
        public(
            "redis_cluster",
            "auto",
            "`on`: `REDIS_URL` names a node of a Redis Cluster (any node); `off`: a single Redis; "
            "`auto`: ask the node once at start-up (`INFO cluster`). See "
            "[Redis Cluster](cluster.md)",
            choices=shards.CLUSTER_MODES,
        ),
        public(
            "shards",
            1,
            "job streams, one per hash tag (set it to the number of cluster masters); 1 keeps the "
            "names as set. The four key names must then have no `{`/`}`",
        ),
        public(
            "wait_replicas",
            0,
            "after each publish, `WAIT` for this many replicas to have the results (0: do not "
            "wait); on a timeout the results stand, logged and counted",
            bounds=(0, 16),
            zero="do not wait",
        ),
        tuned(
            "wait_replicas_timeout_ms",
            "how long one `WAIT` for `GPUFEED_WAIT_REPLICAS` may take",
            "a replica WAIT's timeout",
            bounds=(1, 60_000),
        ),
    ),
    *section(
        MODEL,
        public(
            "model",
            "resnet50",
            "a torchvision classification model name, a model directory (a path: see "
            "[Your own model](own-model.md)), or `null`: a step that does next to nothing, "
            "for measuring gpufeed itself (8 classes `null_0`.., 64 px unless "
            "`GPUFEED_INPUT_SIZE`)",
            required="must name a torchvision model, a model directory (a path) or null",
            check=_model,
        ),
        public(
            "weights",
            "DEFAULT",
            "torchvision models: a weights name (`DEFAULT`, `IMAGENET1K_V2`, ...), a local file "
            '(a state dict, or `{"state_dict": ..., "categories": [...]}`, loaded with '
            "`weights_only=True`), or `none` for random init",
            required="must be a weights name, a file or 'none'",
            check=_weights,
        ),
        public("device", "auto", "`auto`, `cpu`, `cuda` or `cuda:N`", check=_device),
        public(
            "processes",
            1,
            "worker processes on the one device, each its own consumer "
            "(`<GPUFEED_WORKER_NAME>-<i>`, metrics on `GPUFEED_METRICS_PORT` + i), under a "
            "supervisor that forwards signals and restarts a process that dies; see "
            "[GPU hosts](gpu-hosts.md)",
            bounds=(1, MAX_PROCESSES),
            note="worker processes on the one device",
        ),
        public(
            "batch_size",
            0,
            "the largest batch shape (how many images a batch holds); auto: 64 on CUDA, 8 on CPU",
            bounds=(1, 4096),
            shown="`0` (auto)",
            zero="picks 64 on CUDA, 8 on CPU",
        ),
        public(
            "compile",
            "auto",
            "`off` (eager: the rollback switch), `auto` (`reduce-overhead` on CUDA, `off` on "
            "CPU), or a `torch.compile` mode",
            choices=COMPILE_MODES,
        ),
        public(
            "precision",
            "auto",
            "`fp32`, `fp16`, `bf16`; auto: bf16 (or fp16) on CUDA, fp32 on CPU",
            choices=("auto", "fp32", "fp16", "bf16"),
        ),
        public(
            "input_size",
            0,
            "torchvision models: the input side; 0: the weights' own (224 for most)",
            bounds=(16, 2048),
            zero="the weights' own size",
        ),
        public(
            "top_k",
            5,
            "classes returned per image (a model directory's `top_k` wins)",
            bounds=(1, 100),
        ),
        public(
            "allow_eager_fallback",
            False,
            "start in eager mode, with an error in the log, instead of refusing when the compiled "
            "step has graph breaks or recompiles",
        ),
        public(
            "max_wait_ms",
            10.0,
            "how long a batch waits to fill before it runs padded; past it, a batch the device "
            "cannot take yet keeps filling until it can",
            bounds=(0, 60_000),
        ),
        tuned(
            "batch_sizes",
            "the smaller batch shapes the step is also compiled for; a batch runs on the "
            "smallest that holds it (see [Concepts](concepts.md#which-batch-size-runs)). `auto`: "
            "1, B/8, B/2 and B, less any measured at start-up to be no faster than the next "
            "larger; a list such as `1,16` (the batch size is always added, at most 6 sizes); "
            "`off`: the batch size alone",
            "the batch shapes compiled (auto: measured)",
            check=_reason(parse_batch_sizes, ValueError),
        ),
    ),
    *section(
        DEGRADE,
        public(
            "degrade_after_s",
            0.0,
            "switch to the cheaper degraded step while the oldest job waiting in the stream is "
            "older than this; back once it has been under half of it for as long (see "
            "[Degrade under backlog](priorities.md))",
            bounds=(0, 86_400),
            shown="`0` (off)",
            zero="off",
            unit="seconds",
        ),
        public(
            "degrade_input_size",
            0,
            "the degraded step: the same model at this smaller input side",
            bounds=(16, 2048),
            zero="the degraded model's own",
        ),
        public(
            "degrade_model",
            "",
            "the degraded step: a smaller model directory (same output kind and resize mode)",
            check=_degrade_model,
        ),
    ),
    *section(
        DECODE,
        public(
            "decode_processes",
            "auto",
            "decode processes writing into shared staging memory; `0`: decode threads in the "
            "worker instead, one per CPU core (at most 16); `auto`: on 4 cores or more one per "
            "core but the worker's, at most 32; threads below 4 cores, where the worker's own "
            "CPU would compete with them, and where shared memory files are missing",
            check=_decode_processes,
        ),
        public(
            "decode",
            "cpu",
            "`cpu`, `gpu` (JPEGs decoded on the GPU) or `auto` (measured at start-up). With "
            "decode processes the GPU's hardware engines (nvImageCodec, `pip install "
            "gpufeed[gpu]`) decode a share of each batch's baseline JPEGs straight into its "
            "packed rows (the GPU's share of both decoders' rates, measured at start-up and "
            "moved while running), the processes the rest; with decode threads the GPU decodes "
            "the size classes where it measured faster",
            choices=("cpu", "gpu", "auto"),
        ),
        public(
            "decode_cache_mb",
            256,
            "host memory for decoded rows of images seen before (keyed by a hash of their bytes "
            "and the job's reply stream); a repeated image skips decoding; 0: off, and no hot "
            "list or warm start either (see [Warm start](operations.md#warm-start))",
            bounds=(0, 1_048_576),
            zero="off",
        ),
        public(
            "max_image_bytes",
            wire.DEFAULT_MAX_IMAGE_BYTES,
            "largest encoded image accepted",
            bounds=(1024, None),
        ),
        public(
            "max_image_pixels", 100_000_000, "largest width x height accepted", bounds=(1, None)
        ),
        public(
            "max_decode_mb",
            512,
            "most memory (MiB) one decode may take for its pixels, as Pillow holds them (4 bytes a "
            "pixel for colour modes, 1 for grey and palette, 2 for 16-bit grey) at the JPEG DCT "
            "scale that would be used, plus the copy converting them to RGB, plus, for a "
            "progressive JPEG (or one of several scans), every DCT coefficient of the whole image "
            "at full size (about 3 bytes a pixel at 4:2:0), which libjpeg-turbo holds whatever "
            "the scale; estimated from the header, larger images get `image_too_large`. "
            "10000x10000 RGBA (a 390 KB PNG) needs 763 MiB",
            bounds=(1, 1_048_576),
        ),
        public(
            "path_root",
            None,
            "the only folder `path` jobs may read from; unset: `path` jobs are refused",
            kind="path",
            check=_path_root,
        ),
        tuned(
            "decode_threads",
            "decode threads when the worker decodes on threads (`GPUFEED_DECODE_PROCESSES=0`, or "
            "`auto` below 4 cores); 0: one per CPU core, at most 16. Set, it keeps `auto` on "
            "threads",
            "",
            bounds=(1, 256),
            zero="picks one per CPU core, at most 16",
            instead=(
                "GPUFEED_DECODE_PROCESSES=0 decodes on threads in the worker, one per CPU core "
                "(at most 16); GPUFEED_TUNING=decode_threads=N sizes them for a test"
            ),
        ),
        tuned(
            "ring_slots",
            "staging slots (batches in flight between decode and results)",
            "the staging ring's depth",
            bounds=(2, 64),
        ),
        tuned(
            "dct_scaling",
            "let libjpeg decode large JPEGs at 1/2, 1/4 or 1/8 scale when that still covers the "
            "model input",
            "DCT-scaled JPEG decode (always on)",
        ),
        tuned(
            "resize",
            "where images are resized: `device` (rows at their decoded size, resized in the "
            "compiled step), `host` (on the decode threads) or `auto` (device on CUDA, host on "
            "the CPU)",
            "where images are resized (auto: by the device)",
            choices=("device", "host", "auto"),
        ),
        tuned(
            "gpu_decode_share",
            "with `GPUFEED_DECODE=gpu|auto` and decode processes: the fraction (0 to 1) of each "
            "batch's rows offered to the GPU's JPEG decoder; `auto`: the GPU's share of the two "
            "decoders' rates, both measured at start-up on photo-sized JPEGs, then moved while "
            "running toward the decoder that keeps batches waiting less",
            "the GPU's share of decode (auto: measured)",
            check=_gpu_decode_share,
        ),
        tuned(
            "intake",
            "where jobs are read from Redis: `process` (a process of the worker's own puts image "
            "bytes into memory shared with the decode processes, never into the worker's), "
            "`loop` (on the worker's event loop) or `auto` (a process where there are decode "
            "processes; on a Redis Cluster, one per shard, reading its master)",
            "where jobs are read (auto: by the host)",
            choices=("auto", "process", "loop"),
        ),
        tuned(
            "result_writer",
            "where results are built and published: `process` (a process of the worker's own, "
            "off the worker's GIL), `loop` (on the worker's event loop) or `auto` (a process on "
            "4 cores or more, as decode processes)",
            "where results are published (auto: by the host)",
            choices=("auto", "process", "loop"),
        ),
        tuned(
            "decode_budget_ms",
            "longest time one image may take to decode, counted from when a thread starts on it "
            "(with decode processes: from when a process starts on its share of a batch, the "
            "smallest images first); past it the image is answered `decode_timeout` (with "
            "processes, the rows of that share not yet decoded too) and its batch goes on (see "
            "[Guarantees](guarantees.md))",
            "one image's decode budget",
            bounds=(1, 3_600_000),
        ),
        tuned(
            "hot_list",
            "how many images the fleet's hot list keeps (`<GPUFEED_STREAM>:hot` in Redis): the "
            "`url` and `path` images answered most often from the decode cache, each hit worth "
            "half as much every 10 minutes. A starting worker decodes them into its cache before "
            "it takes a job. 0: no hot list (nothing counted, nothing warmed); off too while "
            "`GPUFEED_DECODE_CACHE_MB` is 0. See [Warm start](operations.md#warm-start)",
            "the hot list's size",
            bounds=(0, MAX_HOT_LIST),
            zero="no hot list",
        ),
        tuned(
            "warm_start_s",
            "the most time a starting worker spends decoding the hot list into its cache before "
            "it joins the group (each fetch and decode bounded by what is left of it: done within "
            "a second of it); 0: start cold",
            "the warm start's budget",
            bounds=(0, 3600),
            zero="start cold",
            unit="seconds",
        ),
    ),
    *section(
        FETCH,
        public("fetch_concurrency", 64, "`url` fetches running at once", bounds=(1, 4096)),
        public(
            "fetch_per_host",
            16,
            "`url` fetches running at once against one host (or one bucket)",
            bounds=(1, 4096),
            note="above GPUFEED_FETCH_CONCURRENCY it changes nothing",
        ),
        public(
            "url_allow",
            "",
            "host names (`images.internal`, `*.corp.example`) and CIDRs (`10.20.0.0/16`, "
            "`127.0.0.1`) that `url` jobs may reach although their addresses are loopback, "
            "private, link-local, reserved or multicast",
            check=_host_list,
        ),
        public(
            "url_deny",
            "",
            "host names and CIDRs that `url` jobs may never reach (wins over `GPUFEED_URL_ALLOW`)",
            check=_host_list,
        ),
        public(
            "object_allow",
            "",
            "the `s3://`, `gs://`, `az://` buckets and key prefixes jobs may read: "
            "`images-*,catalog/public/`, per reply stream (and the streams under it) "
            "`tenant-a:results=s3://tenant-a`, groups separated by `;`. Unset: every key is "
            "`object_not_allowed`. See [Security](security.md)",
            shown="unset (no keys)",
            check=_object_allow,
        ),
        tuned(
            "fetch_connect_timeout_s",
            "time to open a connection for a `url`",
            "a fetch's connect timeout",
            above=0,
            note="seconds",
        ),
        tuned(
            "fetch_read_timeout_s",
            "longest wait for the next bytes of an answer",
            "a fetch's read timeout",
            above=0,
            note="seconds",
        ),
        tuned(
            "fetch_timeout_s",
            "a `url` fetch in all, retries and redirects included (`fetch_timeout` after it)",
            "a whole fetch's timeout",
            above=0,
            note="seconds",
        ),
        tuned(
            "fetch_retries",
            "retries after a timeout, a dropped connection or a 5xx answer (not after a 4xx), "
            "with exponential backoff and jitter",
            "a fetch's retry count",
            bounds=(0, 10),
        ),
        tuned(
            "fetch_max_redirects",
            "redirects followed per `url` (each hop checked like the first)",
            "a fetch's redirect limit",
            bounds=(0, 20),
        ),
        tuned(
            "fetch_host_queue",
            "`url` jobs of one host that may wait for a fetch slot without holding an in-flight "
            "place (all hosts together: 16 times this); past it they wait holding one, or, when "
            "the host has answered nothing for `fetch_read_timeout_s`, are answered "
            "`fetch_failed` (host busy)",
            "a host's fetch queue",
            bounds=(1, 65_536),
        ),
    ),
    *section(
        DELIVERY,
        public(
            "visibility_timeout_s",
            300.0,
            "idle time after which another worker may reclaim a pending job; must exceed the "
            "slowest batch",
            bounds=(1, 604_800),
            unit="seconds",
            note="and longer than the slowest batch; 604800: 7 days",
        ),
        public("max_deliveries", 5, "deliveries before a job is dead-lettered", bounds=(1, None)),
        public(
            "shutdown_grace_s", 30.0, "time given to in-flight jobs after SIGTERM", bounds=(0, None)
        ),
        tuned(
            "claim_interval_s",
            "how often a worker looks for stale pending jobs to reclaim",
            "the reclaim interval",
            above=0,
            note="seconds",
        ),
        tuned(
            "consumer_expiry_s",
            "a consumer idle this long and holding no pending job (a worker that died) is removed "
            "from the group; never under `GPUFEED_VISIBILITY_TIMEOUT_S`",
            "a dead consumer's expiry (never under GPUFEED_VISIBILITY_TIMEOUT_S)",
            above=0,
            note="seconds",
        ),
        tuned(
            "trim_interval_s",
            "how often the job stream is trimmed of entries every group has processed; 0: never",
            "the job stream's trim interval",
            bounds=(0, None),
            zero="trimming off",
        ),
    ),
    *section(
        OBSERVE,
        public(
            "metrics_port",
            0,
            "Prometheus metrics and `/ready`, `/live` on this port; 0: off",
            bounds=(0, 65535),
            zero="metrics off",
            note="a TCP port",
        ),
        public(
            "metrics_host",
            "127.0.0.1",
            "the address the metrics port listens on: loopback, so only this host can read it; "
            "`0.0.0.0` (or `::`) where Prometheus or the kubelet's probes come from elsewhere, "
            "as in the container image. Unauthenticated: see [Security](security.md)",
            check=_metrics_host,
        ),
        public(
            "log_format",
            "auto",
            "`console` (on a terminal), `json` (otherwise), or forced",
            choices=("auto", "console", "json"),
        ),
        public(
            "log_level",
            "info",
            "`debug`, `info`, `warning`, `error`",
            choices=("debug", "info", "warning", "error"),
        ),
        tuned(
            "stats_interval_s",
            "interval of the worker's summary log line",
            "the summary log line's interval",
            above=0,
            note="seconds",
        ),
        tuned(
            "live_loop_stall_s",
            "`/live` fails when the event loop has not run for this long (a blocking call, a "
            "wedged task); 0: not checked",
            "/live's event loop stall limit",
            bounds=(1, None),
            zero="not checked",
            unit="seconds",
        ),
        tuned(
            "live_launch_stall_s",
            "`/live` fails when one batch has been in the launch thread, or unfinished on the "
            "device, for this long; 0: not checked",
            "/live's launch stall limit",
            bounds=(1, None),
            zero="not checked",
            unit="seconds",
        ),
        tuned(
            "live_writer_stall_s",
            "`/live` fails when the result writer has held answers it could not publish (Redis "
            "unreachable or refusing them) for this long; the reason is logged. 0: not checked",
            "/live's result writer stall limit",
            bounds=(1, None),
            zero="not checked",
            unit="seconds",
        ),
    ),
)

BY_NAME: Mapping[str, Setting] = MappingProxyType({s.name: s for s in SETTINGS})
PUBLIC: tuple[Setting, ...] = tuple(s for s in SETTINGS if s.env)
TUNED: tuple[Setting, ...] = tuple(s for s in SETTINGS if not s.env)
BY_ENV: Mapping[str, Setting] = MappingProxyType({str(s.env): s for s in PUBLIC})
GROUPS: tuple[str, ...] = tuple(dict.fromkeys(s.group for s in PUBLIC))


def given(name: str, value: Any) -> str:
    """Where setting or tuning constant `name`'s `value` came from (`Setting.given`)."""
    return BY_NAME[name].given(value)


# Each former variable of a tuning constant, and the line the worker refuses it with.
REMOVED_SETTINGS: Mapping[str, str] = MappingProxyType(
    {
        f"GPUFEED_{s.constant}": s.instead
        or (
            f"{s.what} is a tuning constant (worker/config/tuning.py: {s.constant}); "
            f"{TUNING_VARIABLE}={s.name}=... overrides it for a test"
        )
        for s in TUNED
    }
)


_LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")


def relink(markdown: str, prefix: str) -> str:
    """`markdown` with each link's target prefixed (pages are named relative to docs/);
    a link within the page (`#anchor`) stays as it is."""

    def target(m: re.Match[str]) -> str:
        words, to = m.group(1), m.group(2)
        return m.group(0) if to.startswith("#") else f"[{words}]({prefix}{to})"

    return _LINK.sub(target, markdown)


def plain(markdown: str) -> str:
    """Terminal text: no backticks, and links as their words."""
    return _LINK.sub(r"\1", markdown).replace("`", "")

"""The worker's configuration: one typed object, read once at start-up from env and flags.

Every setting has an environment variable (the names docs/reference/configuration.md lists
are part of the contract with operators) and may be overridden by a CLI flag of the same
name in kebab case. Invalid values raise ConfigError with one line that names the variable
and what is accepted.
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import os
import re
import socket
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

import redis
from redis.exceptions import RedisError

from producer import shards, tenants, wire
from producer.priorities import level_stream, parse_levels
from producer.shards import Shard
from worker.base.errors import ConfigError
from worker.base.paths import lookup, path_problem
from worker.config.lanes import Lanes
from worker.fetch.objects import object_allow_problem
from worker.fetch.policy import parse_host_list
from worker.model.manifest import looks_like_model_dir, read_manifest
from worker.model.names import check_name
from worker.model.sizes import parse_batch_sizes, planned_sizes

COMPILE_MODES = (
    "off",
    "auto",
    "default",
    "reduce-overhead",
    "max-autotune",
    "max-autotune-no-cudagraphs",
)
PRECISIONS = ("auto", "fp32", "fp16", "bf16")
DECODE_MODES = ("cpu", "gpu", "auto")
RESULT_WRITERS = ("auto", "process", "loop")
INTAKES = ("auto", "process", "loop")
MAX_DECODE_PROCESSES = 64
# The hot list is read whole (ZREVRANGEBYSCORE) by each starting worker and doctor.
MAX_HOT_LIST = 100_000
RESIZE_PLACEMENTS = ("device", "host", "auto")
LOG_FORMATS = ("auto", "console", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")
MAX_PROCESSES = 64
# Bounds of GPUFEED_MAX_META_BYTES and GPUFEED_MAX_RESULT_BYTES: a result is one publish
# call's worth at most, well under Redis's 512 MB bulk strings; beside its meta it needs room
# for ids, timings and an error text.
MAX_META_BYTES = 64 * 1024 * 1024
MAX_RESULT_BYTES = 256 * 1024 * 1024
RESULT_HEADROOM_BYTES = 16 * 1024
DEFAULT_REDIS_URL = "redis://localhost:6379/0"
# GPUFEED_* variables that are no worker setting yet may be in a worker's environment: who
# reads each and what it does (Markdown, as in worker/config/settings_help.py, which shows it).
TOOL_VARIABLES: Mapping[str, str] = MappingProxyType(
    {
        "GPUFEED_WORKER_NAME_PREFIX": (
            "read by `scripts/run-workers.sh` (`make run-worker`) on a host with several GPUs: "
            "the worker it starts on GPU N is named `<prefix>-gpu<N>`; default: the short host "
            "name"
        ),
    }
)
# Kubernetes gives every pod <SERVICE>_SERVICE_HOST, <SERVICE>_PORT_<n>_TCP... for each
# Service of its namespace: a Service named gpufeed-* puts those in every worker's env.
# A bare <SERVICE>_PORT counts only with its tcp://host:port value, so that a misspelt
# GPUFEED_METRIC_PORT=9100 is still refused.
_SERVICE_LINK = re.compile(
    r"GPUFEED(_[A-Z0-9_]+)?_(SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?|PORT_[0-9]+_(TCP|UDP|SCTP)"
    r"(_(PROTO|PORT|ADDR))?)"
)
_SERVICE_PORT = re.compile(r"GPUFEED(_[A-Z0-9_]+)?_PORT")
_SERVICE_URL = re.compile(r"(tcp|udp|sctp)://\S+")
_DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]{1,3})?")


def _default_worker_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class WorkerConfig:
    # Redis and the wire contract
    redis_url: str = field(default=DEFAULT_REDIS_URL, metadata={"env": "REDIS_URL"})
    stream: str = field(default=wire.DEFAULT_STREAM, metadata={"env": "GPUFEED_STREAM"})
    group: str = field(default=wire.DEFAULT_GROUP, metadata={"env": "GPUFEED_GROUP"})
    priorities: str = field(default="", metadata={"env": "GPUFEED_PRIORITIES"})
    priority_weights: str = field(default="", metadata={"env": "GPUFEED_PRIORITY_WEIGHTS"})
    tenants: str = field(default="", metadata={"env": "GPUFEED_TENANTS"})
    results_stream: str = field(
        default=wire.DEFAULT_RESULTS_STREAM, metadata={"env": "GPUFEED_RESULTS_STREAM"}
    )
    result_prefix: str = field(
        default=wire.DEFAULT_RESULT_PREFIX, metadata={"env": "GPUFEED_RESULT_PREFIX"}
    )
    dead_stream: str = field(
        default=wire.DEFAULT_DEAD_STREAM, metadata={"env": "GPUFEED_DEAD_STREAM"}
    )
    result_ttl_s: int = field(default=86_400, metadata={"env": "GPUFEED_RESULT_TTL_S"})
    results_maxlen: int = field(default=1_000_000, metadata={"env": "GPUFEED_RESULTS_MAXLEN"})
    max_meta_bytes: int = field(
        default=wire.DEFAULT_MAX_META_BYTES, metadata={"env": "GPUFEED_MAX_META_BYTES"}
    )
    max_result_bytes: int = field(
        default=wire.DEFAULT_MAX_RESULT_BYTES, metadata={"env": "GPUFEED_MAX_RESULT_BYTES"}
    )
    worker_name: str = field(default="", metadata={"env": "GPUFEED_WORKER_NAME"})
    # Redis Cluster (producer/shards.py): job streams split by hash tag, durable publishes.
    redis_cluster: str = field(default="auto", metadata={"env": "GPUFEED_REDIS_CLUSTER"})
    shards: int = field(default=1, metadata={"env": "GPUFEED_SHARDS"})
    wait_replicas: int = field(default=0, metadata={"env": "GPUFEED_WAIT_REPLICAS"})
    wait_replicas_timeout_ms: int = field(
        default=1000, metadata={"env": "GPUFEED_WAIT_REPLICAS_TIMEOUT_MS"}
    )

    # Model and device
    model: str = field(default="resnet50", metadata={"env": "GPUFEED_MODEL"})
    weights: str = field(default="DEFAULT", metadata={"env": "GPUFEED_WEIGHTS"})
    device: str = field(default="auto", metadata={"env": "GPUFEED_DEVICE"})
    processes: int = field(default=1, metadata={"env": "GPUFEED_PROCESSES"})
    batch_size: int = field(default=0, metadata={"env": "GPUFEED_BATCH_SIZE"})
    batch_sizes: str = field(default="auto", metadata={"env": "GPUFEED_BATCH_SIZES"})
    compile: str = field(default="auto", metadata={"env": "GPUFEED_COMPILE"})
    precision: str = field(default="auto", metadata={"env": "GPUFEED_PRECISION"})
    input_size: int = field(default=0, metadata={"env": "GPUFEED_INPUT_SIZE"})
    top_k: int = field(default=5, metadata={"env": "GPUFEED_TOP_K"})
    allow_eager_fallback: bool = field(
        default=False, metadata={"env": "GPUFEED_ALLOW_EAGER_FALLBACK"}
    )

    # Degrade under backlog (worker/pipeline/degrade.py): off unless GPUFEED_DEGRADE_AFTER_S is set
    degrade_after_s: float = field(default=0.0, metadata={"env": "GPUFEED_DEGRADE_AFTER_S"})
    degrade_input_size: int = field(default=0, metadata={"env": "GPUFEED_DEGRADE_INPUT_SIZE"})
    degrade_model: str = field(default="", metadata={"env": "GPUFEED_DEGRADE_MODEL"})

    # Pipeline sizing
    max_wait_ms: float = field(default=10.0, metadata={"env": "GPUFEED_MAX_WAIT_MS"})
    decode_threads: int = field(default=0, metadata={"env": "GPUFEED_DECODE_THREADS"})
    decode_processes: str = field(default="auto", metadata={"env": "GPUFEED_DECODE_PROCESSES"})
    result_writer: str = field(default="auto", metadata={"env": "GPUFEED_RESULT_WRITER"})
    intake: str = field(default="auto", metadata={"env": "GPUFEED_INTAKE"})
    decode: str = field(default="cpu", metadata={"env": "GPUFEED_DECODE"})
    gpu_decode_share: str = field(default="auto", metadata={"env": "GPUFEED_GPU_DECODE_SHARE"})
    dct_scaling: bool = field(default=True, metadata={"env": "GPUFEED_DCT_SCALING"})
    resize: str = field(default="auto", metadata={"env": "GPUFEED_RESIZE"})
    decode_cache_mb: int = field(default=256, metadata={"env": "GPUFEED_DECODE_CACHE_MB"})
    hot_list: int = field(default=1000, metadata={"env": "GPUFEED_HOT_LIST"})
    warm_start_s: float = field(default=30.0, metadata={"env": "GPUFEED_WARM_START_S"})
    ring_slots: int = field(default=4, metadata={"env": "GPUFEED_RING_SLOTS"})
    max_image_bytes: int = field(
        default=wire.DEFAULT_MAX_IMAGE_BYTES, metadata={"env": "GPUFEED_MAX_IMAGE_BYTES"}
    )
    max_image_pixels: int = field(default=100_000_000, metadata={"env": "GPUFEED_MAX_IMAGE_PIXELS"})
    max_decode_mb: int = field(default=512, metadata={"env": "GPUFEED_MAX_DECODE_MB"})
    decode_budget_ms: float = field(default=10000.0, metadata={"env": "GPUFEED_DECODE_BUDGET_MS"})
    path_root: Path | None = field(default=None, metadata={"env": "GPUFEED_PATH_ROOT"})

    # Images by URL (worker/fetch/)
    fetch_concurrency: int = field(default=64, metadata={"env": "GPUFEED_FETCH_CONCURRENCY"})
    fetch_per_host: int = field(default=16, metadata={"env": "GPUFEED_FETCH_PER_HOST"})
    fetch_connect_timeout_s: float = field(
        default=5.0, metadata={"env": "GPUFEED_FETCH_CONNECT_TIMEOUT_S"}
    )
    fetch_read_timeout_s: float = field(
        default=15.0, metadata={"env": "GPUFEED_FETCH_READ_TIMEOUT_S"}
    )
    fetch_timeout_s: float = field(default=60.0, metadata={"env": "GPUFEED_FETCH_TIMEOUT_S"})
    fetch_retries: int = field(default=2, metadata={"env": "GPUFEED_FETCH_RETRIES"})
    fetch_max_redirects: int = field(default=5, metadata={"env": "GPUFEED_FETCH_MAX_REDIRECTS"})
    url_allow: str = field(default="", metadata={"env": "GPUFEED_URL_ALLOW"})
    url_deny: str = field(default="", metadata={"env": "GPUFEED_URL_DENY"})
    fetch_host_queue: int = field(default=64, metadata={"env": "GPUFEED_FETCH_HOST_QUEUE"})
    object_allow: str = field(default="", metadata={"env": "GPUFEED_OBJECT_ALLOW"})

    # Delivery
    visibility_timeout_s: float = field(
        default=300.0, metadata={"env": "GPUFEED_VISIBILITY_TIMEOUT_S"}
    )
    max_deliveries: int = field(default=5, metadata={"env": "GPUFEED_MAX_DELIVERIES"})
    claim_interval_s: float = field(default=15.0, metadata={"env": "GPUFEED_CLAIM_INTERVAL_S"})
    shutdown_grace_s: float = field(default=30.0, metadata={"env": "GPUFEED_SHUTDOWN_GRACE_S"})
    consumer_expiry_s: float = field(default=3600.0, metadata={"env": "GPUFEED_CONSUMER_EXPIRY_S"})
    trim_interval_s: float = field(default=60.0, metadata={"env": "GPUFEED_TRIM_INTERVAL_S"})

    # Observability
    metrics_port: int = field(default=0, metadata={"env": "GPUFEED_METRICS_PORT"})
    metrics_host: str = field(default="127.0.0.1", metadata={"env": "GPUFEED_METRICS_HOST"})
    live_loop_stall_s: float = field(default=30.0, metadata={"env": "GPUFEED_LIVE_LOOP_STALL_S"})
    live_launch_stall_s: float = field(
        default=120.0, metadata={"env": "GPUFEED_LIVE_LAUNCH_STALL_S"}
    )
    live_writer_stall_s: float = field(
        default=300.0, metadata={"env": "GPUFEED_LIVE_WRITER_STALL_S"}
    )
    stats_interval_s: float = field(default=10.0, metadata={"env": "GPUFEED_STATS_INTERVAL_S"})
    log_format: str = field(default="auto", metadata={"env": "GPUFEED_LOG_FORMAT"})
    log_level: str = field(default="info", metadata={"env": "GPUFEED_LOG_LEVEL"})

    @classmethod
    def load(
        cls,
        env: Mapping[str, str] | None = None,
        overrides: Mapping[str, Any] | None = None,
    ) -> WorkerConfig:
        """Build the config: defaults, then env vars, then explicit overrides (CLI flags)."""
        env = os.environ if env is None else env
        check_unknown_variables(env)
        values: dict[str, Any] = {}
        for f in fields(cls):
            var = f.metadata["env"]
            raw = env.get(var)
            if raw is not None and raw.strip() != "":
                values[f.name] = _parse(var, raw.strip(), _FIELD_TYPES[f.name])
        for name, value in (overrides or {}).items():
            if name not in _FIELD_TYPES:
                raise ConfigError(f"unknown setting {name!r}")
            if value is None:
                continue
            if isinstance(value, str):
                values[name] = _parse(f"--{name.replace('_', '-')}", value, _FIELD_TYPES[name])
            else:
                values[name] = value
        config = cls(**values)
        config.validate()
        # `Resnet18` is resnet18: the one spelling the loader, logs and results use.
        if (model := check_name(config.model)) != config.model:
            config = _replace(config, model=model)
        if not config.worker_name:
            config = _replace(config, worker_name=_default_worker_name())
        return config

    def validate(self) -> None:
        def need(ok: bool, var: str, message: str) -> None:
            if not ok:
                raise ConfigError(f"{var}: {message}")

        for f in fields(self):
            value = getattr(self, f.name)
            # Flags and tests hand values over already typed: NaN or infinity compare false
            # (or true) with every bound below, and no duration or size means either.
            if isinstance(value, float):
                need(math.isfinite(value), _env(f.name), f"must be a finite number (got {value})")
        scheme = self.redis_url.split("://", 1)[0] if "://" in self.redis_url else ""
        need(
            scheme in ("redis", "rediss", "unix"),
            "REDIS_URL",
            f"must start with redis://, rediss:// or unix:// (got scheme {scheme or 'none'!r})",
        )
        problem = redis_url_problem(self.redis_url)
        need(problem is None, "REDIS_URL", f"is not a usable Redis URL: {problem}")
        for name in ("stream", "group", "results_stream", "result_prefix", "dead_stream"):
            need(bool(getattr(self, name)), _env(name), "must not be empty")
        need(
            self.stream != self.results_stream,
            "GPUFEED_RESULTS_STREAM",
            "must differ from GPUFEED_STREAM",
        )
        try:
            levels = parse_levels(self.priorities)
        except ValueError as exc:
            raise ConfigError(f"GPUFEED_PRIORITIES: {exc}") from None
        try:
            weights = parse_weights(self.priority_weights, len(levels))
        except ValueError as exc:
            raise ConfigError(f"GPUFEED_PRIORITY_WEIGHTS: {exc}") from None
        for lane in Lanes.of(self.stream, levels, weights):
            need(
                lane.stream not in (self.results_stream, self.dead_stream),
                "GPUFEED_PRIORITIES",
                f"level {lane.level!r}'s stream {lane.stream} is the results or dead-letter stream",
            )
        try:
            tenants.parse(self.tenants)
        except tenants.TenantError as exc:
            raise ConfigError(f"GPUFEED_TENANTS: {exc}") from None
        try:
            shards.check_cluster_mode(self.redis_cluster)
            self.shard_layout()
        except shards.ShardLayoutError as exc:
            raise ConfigError(str(exc)) from None
        # A job id is appended to the result prefix: no gpufeed key may lie under it.
        clash = shards.result_prefix_problem(self.shard_layout(), levels)
        if clash is not None:
            raise ConfigError(clash)
        # No level's stream may be a key gpufeed owns (a level `hot` would take the hot
        # list), nor may a results stream: the rule the writer applies to each reply_to.
        layout = self.shard_layout()
        fixed = shards.own_keys(self.stream, layout, (), job_space=False)
        owned = shards.own_keys(self.stream, layout, levels)
        for keys, _ in [kw for shard in layout for kw in self.key_sets(shard.index)]:
            for level in levels:
                for stream in (level_stream(self.stream, level), level_stream(keys.stream, level)):
                    taken = fixed.problem(stream)
                    need(taken is None, "GPUFEED_PRIORITIES", f"level {level!r}: {taken}")
            taken = owned.problem(keys.results_stream)
            need(taken is None, "GPUFEED_RESULTS_STREAM", f"{taken}: results cannot go there")
        need(
            0 <= self.wait_replicas <= 16,
            "GPUFEED_WAIT_REPLICAS",
            "must be between 0 (do not wait) and 16",
        )
        need(
            1 <= self.wait_replicas_timeout_ms <= 60_000,
            "GPUFEED_WAIT_REPLICAS_TIMEOUT_MS",
            "must be between 1 and 60000",
        )
        need(
            self.model.strip() != "",
            "GPUFEED_MODEL",
            "must name a torchvision model, a model directory (a path) or null",
        )
        # A name torchvision does not know is refused here, with a hint, before torch.
        check_name(self.model)
        if looks_like_model_dir(self.model):
            # The manifest is small and torch-free: a wrong key stops the worker here,
            # before anything is loaded. Whether the model fits it is checked at load.
            read_manifest(self.model)
        need(bool(self.weights), "GPUFEED_WEIGHTS", "must be a weights name, a file or 'none'")
        problem = path_problem(self.weights)
        need(problem is None, "GPUFEED_WEIGHTS", f"{_plain(self.weights)} {problem}")
        dev = self.device
        need(
            _DEVICE.fullmatch(dev) is not None,
            "GPUFEED_DEVICE",
            f"must be auto, cpu, cuda or cuda:N (got {dev!r})",
        )
        need(
            1 <= self.processes <= MAX_PROCESSES,
            "GPUFEED_PROCESSES",
            f"must be between 1 and {MAX_PROCESSES} (worker processes on the one device)",
        )
        need(
            0 <= self.batch_size <= 4096,
            "GPUFEED_BATCH_SIZE",
            "must be between 1 and 4096 (0 picks 64 on CUDA, 8 on CPU)",
        )
        try:
            sizes = parse_batch_sizes(self.batch_sizes)
            # With the batch size chosen by the device, the engine checks this at start-up.
            if sizes and self.batch_size:
                planned_sizes(sizes, self.batch_size)
        except ValueError as exc:
            need(False, "GPUFEED_BATCH_SIZES", str(exc))
        need(
            self.compile in COMPILE_MODES,
            "GPUFEED_COMPILE",
            f"must be one of {', '.join(COMPILE_MODES)} (got {self.compile!r})",
        )
        need(
            self.precision in PRECISIONS,
            "GPUFEED_PRECISION",
            f"must be one of {', '.join(PRECISIONS)} (got {self.precision!r})",
        )
        need(
            self.input_size == 0 or 16 <= self.input_size <= 2048,
            "GPUFEED_INPUT_SIZE",
            "must be 0 (the weights' own size) or between 16 and 2048",
        )
        need(1 <= self.top_k <= 100, "GPUFEED_TOP_K", "must be between 1 and 100")
        self._validate_degrade(need)
        need(0 <= self.max_wait_ms <= 60_000, "GPUFEED_MAX_WAIT_MS", "must be between 0 and 60000")
        need(
            0 <= self.decode_threads <= 256,
            "GPUFEED_DECODE_THREADS",
            "must be between 1 and 256 (0 picks one per CPU core, at most 16)",
        )
        need(
            self.decode_processes == "auto"
            or (
                self.decode_processes.isascii()
                and self.decode_processes.isdigit()
                # int() refuses numbers of thousands of digits (ValueError, not a setting's
                # one line): a count that long is over the bound anyway.
                and len(self.decode_processes) <= 4
                and int(self.decode_processes) <= MAX_DECODE_PROCESSES
            ),
            "GPUFEED_DECODE_PROCESSES",
            f"must be auto, 0 (decode threads in the worker) or a number of processes up to "
            f"{MAX_DECODE_PROCESSES} (got {_plain(self.decode_processes)})",
        )
        need(
            self.result_writer in RESULT_WRITERS,
            "GPUFEED_RESULT_WRITER",
            f"must be one of {', '.join(RESULT_WRITERS)} (got {_plain(self.result_writer)})",
        )
        need(
            self.intake in INTAKES,
            "GPUFEED_INTAKE",
            f"must be one of {', '.join(INTAKES)} (got {_plain(self.intake)})",
        )
        need(
            self.decode in DECODE_MODES,
            "GPUFEED_DECODE",
            f"must be one of {', '.join(DECODE_MODES)} (got {self.decode!r})",
        )
        need(
            _share(self.gpu_decode_share) is not None,
            "GPUFEED_GPU_DECODE_SHARE",
            f"must be auto or a fraction between 0 and 1 (got {_plain(self.gpu_decode_share)})",
        )
        need(
            self.resize in RESIZE_PLACEMENTS,
            "GPUFEED_RESIZE",
            f"must be one of {', '.join(RESIZE_PLACEMENTS)} (got {self.resize!r})",
        )
        need(
            0 <= self.decode_cache_mb <= 1_048_576,
            "GPUFEED_DECODE_CACHE_MB",
            "must be between 0 (off) and 1048576",
        )
        need(
            0 <= self.hot_list <= MAX_HOT_LIST,
            "GPUFEED_HOT_LIST",
            f"must be between 0 (no hot list) and {MAX_HOT_LIST}",
        )
        need(
            0 <= self.warm_start_s <= 3600,
            "GPUFEED_WARM_START_S",
            "must be between 0 (start cold) and 3600 seconds",
        )
        need(2 <= self.ring_slots <= 64, "GPUFEED_RING_SLOTS", "must be between 2 and 64")
        need(self.max_image_bytes >= 1024, "GPUFEED_MAX_IMAGE_BYTES", "must be at least 1024")
        need(self.max_image_pixels >= 1, "GPUFEED_MAX_IMAGE_PIXELS", "must be at least 1")
        need(
            1 <= self.max_decode_mb <= 1_048_576,
            "GPUFEED_MAX_DECODE_MB",
            "must be between 1 and 1048576",
        )
        need(
            1 <= self.decode_budget_ms <= 3_600_000,
            "GPUFEED_DECODE_BUDGET_MS",
            "must be between 1 and 3600000",
        )
        if self.path_root is not None:
            problem = path_problem(self.path_root)
            need(
                problem is None,
                "GPUFEED_PATH_ROOT",
                f"{_plain(str(self.path_root))} {problem}",
            )
            need(
                _is_dir(self.path_root),
                "GPUFEED_PATH_ROOT",
                f"{_plain(str(self.path_root))} is not a directory",
            )
        need(
            1 <= self.fetch_concurrency <= 4096,
            "GPUFEED_FETCH_CONCURRENCY",
            "must be between 1 and 4096",
        )
        need(
            1 <= self.fetch_per_host <= 4096,
            "GPUFEED_FETCH_PER_HOST",
            "must be between 1 and 4096 (above GPUFEED_FETCH_CONCURRENCY it changes nothing)",
        )
        for name in ("fetch_connect_timeout_s", "fetch_read_timeout_s", "fetch_timeout_s"):
            need(getattr(self, name) > 0, _env(name), "must be positive (seconds)")
        need(0 <= self.fetch_retries <= 10, "GPUFEED_FETCH_RETRIES", "must be between 0 and 10")
        need(
            0 <= self.fetch_max_redirects <= 20,
            "GPUFEED_FETCH_MAX_REDIRECTS",
            "must be between 0 and 20",
        )
        for name in ("url_allow", "url_deny"):
            problem = host_list_problem(getattr(self, name))
            need(
                problem is None,
                _env(name),
                f"{problem}; give host names and CIDRs separated by commas "
                "(e.g. images.internal,10.0.0.0/8)",
            )
        need(
            1 <= self.fetch_host_queue <= 65_536,
            "GPUFEED_FETCH_HOST_QUEUE",
            "must be between 1 and 65536",
        )
        problem = object_allow_problem(self.object_allow)
        need(
            problem is None,
            "GPUFEED_OBJECT_ALLOW",
            f"{problem}; e.g. images-*,catalog/public/;tenant-a:results=s3://tenant-a",
        )
        # Upper bounds where Redis takes the value (XPENDING IDLE, EXPIRE): past them every
        # reclaim, or every publish, would fail at run time instead of here.
        need(
            1 <= self.visibility_timeout_s <= 604_800,
            "GPUFEED_VISIBILITY_TIMEOUT_S",
            "must be at least 1 second (and longer than the slowest batch), at most 604800 "
            "(7 days)",
        )
        need(self.max_deliveries >= 1, "GPUFEED_MAX_DELIVERIES", "must be at least 1")
        need(self.claim_interval_s > 0, "GPUFEED_CLAIM_INTERVAL_S", "must be positive")
        need(self.shutdown_grace_s >= 0, "GPUFEED_SHUTDOWN_GRACE_S", "must not be negative")
        need(
            self.consumer_expiry_s >= self.visibility_timeout_s,
            "GPUFEED_CONSUMER_EXPIRY_S",
            "must be at least GPUFEED_VISIBILITY_TIMEOUT_S",
        )
        need(
            self.trim_interval_s >= 0,
            "GPUFEED_TRIM_INTERVAL_S",
            "must not be negative (0 turns trimming off)",
        )
        need(
            1 <= self.result_ttl_s <= 315_360_000,
            "GPUFEED_RESULT_TTL_S",
            "must be between 1 second and 315360000 (10 years)",
        )
        need(self.stats_interval_s > 0, "GPUFEED_STATS_INTERVAL_S", "must be positive (seconds)")
        need(self.results_maxlen >= 1, "GPUFEED_RESULTS_MAXLEN", "must be at least 1")
        # A result must fit one Redis bulk string (512 MB unless proto-max-bulk-len says
        # less) with room to spare, and hold its meta beside ids, timings and the answer.
        need(
            0 <= self.max_meta_bytes <= MAX_META_BYTES,
            "GPUFEED_MAX_META_BYTES",
            f"must be between 0 (no meta) and {MAX_META_BYTES}",
        )
        need(
            self.max_meta_bytes + RESULT_HEADROOM_BYTES
            <= self.max_result_bytes
            <= MAX_RESULT_BYTES,
            "GPUFEED_MAX_RESULT_BYTES",
            f"must be at least GPUFEED_MAX_META_BYTES + {RESULT_HEADROOM_BYTES} "
            f"({self.max_meta_bytes + RESULT_HEADROOM_BYTES}) and at most {MAX_RESULT_BYTES}",
        )
        need(
            0 <= self.metrics_port <= 65535,
            "GPUFEED_METRICS_PORT",
            "must be a TCP port (0 turns metrics off)",
        )
        need(
            self.metrics_port == 0 or self.metrics_port + self.processes - 1 <= 65535,
            "GPUFEED_METRICS_PORT",
            f"with GPUFEED_PROCESSES={self.processes} the processes take ports "
            f"{self.metrics_port}..{self.metrics_port + self.processes - 1}: past 65535",
        )
        need(
            _is_ip_address(self.metrics_host),
            "GPUFEED_METRICS_HOST",
            f"must be an IP address to listen on, e.g. 127.0.0.1 (this host only), 0.0.0.0 or "
            f":: (every interface), got {self.metrics_host!r}",
        )
        for name in ("live_loop_stall_s", "live_launch_stall_s", "live_writer_stall_s"):
            value = getattr(self, name)
            need(
                value == 0 or value >= 1, _env(name), "must be 0 (not checked) or at least 1 second"
            )
        need(
            self.log_format in LOG_FORMATS,
            "GPUFEED_LOG_FORMAT",
            f"must be one of {', '.join(LOG_FORMATS)}",
        )
        need(
            self.log_level in LOG_LEVELS,
            "GPUFEED_LOG_LEVEL",
            f"must be one of {', '.join(LOG_LEVELS)}",
        )

    @property
    def lanes(self) -> Lanes:
        """The job streams this worker reads: one per priority level, or the one stream.
        A new object each time: it carries the reader's share credits."""
        return self.lanes_of(self.stream)

    def lanes_of(self, stream: str) -> Lanes:
        """The lanes of one shard, by its job stream: for the operator's keys and each
        tenant's (GPUFEED_TENANTS), its priority levels' streams, which keep the shard's
        hash tag, or its one stream."""
        levels = parse_levels(self.priorities)
        weights = parse_weights(self.priority_weights, len(levels))
        index = next(i for i, s in enumerate(self.shard_layout()) if s.stream == stream)
        return Lanes.merged(
            [
                Lanes.of(keys.stream, levels, weights, plain=True, keys=keys, share=share)
                for keys, share in self.key_sets(index)
            ]
        )

    def key_sets(self, shard: int) -> list[tuple[Shard, int]]:
        """Shard `shard`'s keys: the operator's (the names as set), then each tenant's,
        with its weight (producer/tenants.py)."""
        own = self.shard_layout()[shard]
        out = [(own, 1)]
        for name, weight in tenants.parse(self.tenants):
            keys = tenants.tenant_layout(
                name,
                self.shards,
                stream=self.stream,
                results_stream=self.results_stream,
                result_prefix=self.result_prefix,
                dead_stream=self.dead_stream,
            )[shard]
            out.append((keys, weight))
        return out

    def _validate_degrade(self, need: Callable[[bool, str, str], None]) -> None:
        """The degraded step's settings; whether its input is smaller than the main step's
        is known only once the model is loaded (worker/model/degraded.py)."""
        on = self.degrade_after_s > 0
        need(
            0 <= self.degrade_after_s <= 86_400,
            "GPUFEED_DEGRADE_AFTER_S",
            "must be between 0 (off) and 86400 seconds",
        )
        cheaper = bool(self.degrade_input_size or self.degrade_model.strip())
        need(
            not on or cheaper,
            "GPUFEED_DEGRADE_AFTER_S",
            "needs the cheaper step: GPUFEED_DEGRADE_INPUT_SIZE (the same model at a smaller "
            "input size) or GPUFEED_DEGRADE_MODEL (a smaller model directory)",
        )
        for name in ("degrade_input_size", "degrade_model"):
            need(
                on or not getattr(self, name),
                _env(name),
                "applies only with GPUFEED_DEGRADE_AFTER_S (when to switch to the cheaper step)",
            )
        need(
            self.degrade_input_size == 0 or 16 <= self.degrade_input_size <= 2048,
            "GPUFEED_DEGRADE_INPUT_SIZE",
            "must be 0 (the degraded model's own) or between 16 and 2048",
        )
        need(
            self.degrade_input_size == 0
            or self.input_size == 0
            or self.degrade_input_size < self.input_size,
            "GPUFEED_DEGRADE_INPUT_SIZE",
            f"{self.degrade_input_size} must be smaller than GPUFEED_INPUT_SIZE "
            f"({self.input_size}): the degraded step is the cheaper one",
        )
        if self.degrade_model:
            need(
                looks_like_model_dir(self.degrade_model),
                "GPUFEED_DEGRADE_MODEL",
                f"must be a model directory (a path, e.g. ./models/small), got "
                f"{self.degrade_model!r}",
            )
            need(
                not self.degrade_input_size,
                "GPUFEED_DEGRADE_INPUT_SIZE",
                "does not apply with GPUFEED_DEGRADE_MODEL: a model directory names its own "
                "input size",
            )
            try:
                read_manifest(self.degrade_model)
            except ConfigError as exc:
                reason = str(exc).removeprefix("GPUFEED_MODEL: ")
                raise ConfigError(f"GPUFEED_DEGRADE_MODEL: {reason}") from None

    def shard_layout(self) -> list[Shard]:
        """The keys of each shard this worker reads (one, the names as set, by default)."""
        return shards.layout(
            self.shards,
            stream=self.stream,
            results_stream=self.results_stream,
            result_prefix=self.result_prefix,
            dead_stream=self.dead_stream,
        )

    def check_cluster_keys(self) -> None:
        """On a cluster with one shard, the four key names must share a hash tag."""
        if self.shards > 1:
            return
        try:
            shards.check_one_slot(
                stream=self.stream,
                results_stream=self.results_stream,
                result_prefix=self.result_prefix,
                dead_stream=self.dead_stream,
            )
        except shards.ShardLayoutError as exc:
            raise ConfigError(str(exc)) from None

    def redacted_url(self) -> str:
        """REDIS_URL with any password replaced, safe for logs."""
        return redact_url(self.redis_url)

    def summary(self) -> dict[str, Any]:
        """Settings worth logging at start-up (never the password)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["redis_url"] = self.redacted_url()
        out["path_root"] = str(self.path_root) if self.path_root else None
        return out


def check_unknown_variables(env: Mapping[str, str]) -> None:
    """Refuse a GPUFEED_* variable that is no setting (a misspelt one would otherwise be
    ignored without a word), naming the closest setting."""
    known = {str(f.metadata["env"]) for f in fields(WorkerConfig)} | TOOL_VARIABLES.keys()
    for var in sorted(env):
        if not var.upper().startswith("GPUFEED_") or var in known or _service_link(var, env[var]):
            continue
        close = difflib.get_close_matches(var.upper(), sorted(known), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else "see python -m worker --help"
        name = var if re.fullmatch(r"[A-Za-z0-9_]{1,80}", var) else _shown(var)
        raise ConfigError(f"{name}: no such setting ({hint}); unset it to start")


def _service_link(var: str, value: str) -> bool:
    if _SERVICE_LINK.fullmatch(var):
        return True
    return bool(_SERVICE_PORT.fullmatch(var) and _SERVICE_URL.fullmatch(value))


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


def parse_weights(raw: str, levels: int) -> tuple[int, ...]:
    """GPUFEED_PRIORITY_WEIGHTS for `levels` levels; unset: 1 each but twice the next
    level's for each level up (4,2,1 for three)."""
    if not raw.strip():
        return tuple(2 ** (levels - 1 - i) for i in range(levels))
    if levels == 0:
        raise ValueError("weights need GPUFEED_PRIORITIES with two levels or more")
    parts = [p.strip() for p in raw.split(",")]
    if not all(re.fullmatch(r"[0-9]{1,9}", p) for p in parts):
        raise ValueError(f"expected whole numbers separated by commas, got {raw!r}")
    weights = tuple(int(p) for p in parts)
    if len(weights) != levels:
        raise ValueError(
            f"{len(weights)} weights for {levels} levels: give one per level, highest first"
        )
    if any(not 1 <= w <= 1000 for w in weights):
        raise ValueError("each weight must be between 1 and 1000")
    return weights


def host_list_problem(raw: str) -> str | None:
    """Why `raw` (GPUFEED_URL_ALLOW / GPUFEED_URL_DENY) is not a list of host names and
    CIDRs; None when it is."""
    try:
        parse_host_list(raw)
    except ValueError as exc:
        return str(exc)
    return None


def _is_dir(path: Path) -> bool:
    st = lookup(path)
    return st is not None and stat.S_ISDIR(st.st_mode)


def _is_ip_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def redact_url(url: str) -> str:
    """`url` without its password, wherever redis-py would take one from: the user-info
    part (`redis://user:pw@host`) or the query string (`?password=...`)."""
    if "://" not in url:
        return url
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        creds, host = netloc.rsplit("@", 1)
        user = creds.split(":", 1)[0] if ":" in creds else ""
        netloc = f"{user}:***@{host}" if user else f"***@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode(
            [(k, "***" if k.lower() in _SECRET_PARAMS else v) for k, v in pairs], safe="*/:"
        )
    return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")


_SECRET_PARAMS = frozenset({"password", "pass", "pwd", "ssl_password"})
_UNIX_PATH_BYTES = 107  # sockaddr_un's sun_path (108) less its NUL


def _env(name: str) -> str:
    return str(WorkerConfig.__dataclass_fields__[name].metadata["env"])


def _replace(config: WorkerConfig, **changes: Any) -> WorkerConfig:
    values = {f.name: getattr(config, f.name) for f in fields(config)}
    values.update(changes)
    return WorkerConfig(**values)


# ASCII only: int() and float() also take other scripts' digits, underscores, `nan` and
# `inf`; the lengths keep int() clear of numbers too long for it.
_INT = re.compile(r"[+-]?[0-9]{1,18}")
_FLOAT = re.compile(r"[+-]?([0-9]{1,30}(\.[0-9]{0,30})?|\.[0-9]{1,30})([eE][+-]?[0-9]{1,3})?")


def _parse_int(raw: str) -> int:
    if _INT.fullmatch(raw) is None:
        raise ValueError(raw)
    return int(raw)


def _parse_float(raw: str) -> float:
    value = float(raw) if _FLOAT.fullmatch(raw) else math.nan
    if not math.isfinite(value):
        raise ValueError(raw)
    return value


def _parse_str(raw: str) -> str:
    # A variable that is not UTF-8 arrives with surrogate escapes, which Redis commands and
    # file names could not take later.
    if "\x00" in raw or any("\ud800" <= c <= "\udfff" for c in raw):
        raise ValueError(raw)
    return raw


def _parse_bool(raw: str) -> bool:
    low = raw.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true/false, 1/0, yes/no or on/off")


def _parse_path(raw: str) -> Path | None:
    if not raw:
        return None
    try:
        return Path(_parse_str(raw)).expanduser()
    except RuntimeError:  # ~user of a user who does not exist
        raise ValueError(raw) from None


_PARSERS: dict[str, Callable[[str], Any]] = {
    "str": _parse_str,
    "int": _parse_int,
    "float": _parse_float,
    "bool": _parse_bool,
    "Path | None": _parse_path,
}

# Field annotations are strings under `from __future__ import annotations`.
_FIELD_TYPES: dict[str, str] = {f.name: str(f.type) for f in fields(WorkerConfig)}


def _parse(var: str, raw: str, type_name: str) -> Any:
    parser = _PARSERS[type_name]
    try:
        return parser(raw)
    except ValueError:
        kind = {
            "int": "an integer (ASCII digits)",
            "float": "a finite number (ASCII digits)",
            "bool": "true or false",
            "Path | None": "a path (UTF-8 text; ~user of a known user)",
        }.get(type_name, "UTF-8 text without NUL")
        raise ConfigError(f"{var}: expected {kind}, got {_shown(raw)}") from None


def _plain(text: str) -> str:
    """A path or name as typed where it is plain, else as `_shown` gives it."""
    return text if text.isprintable() and len(text) <= 200 else _shown(text)


def _shown(raw: str) -> str:
    """`raw` as an error line may show it: escaped, and cut short."""
    text = ascii(raw)
    return text if len(text) <= 80 else text[:77] + "..."


def _share(text: str) -> float | str | None:
    """GPUFEED_GPU_DECODE_SHARE read: "auto", a fraction in [0, 1], or None (invalid)."""
    if text == "auto":
        return "auto"
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0.0 <= value <= 1.0 else None


def gpu_decode_share(cfg: WorkerConfig) -> float | None:
    """The share GPUFEED_GPU_DECODE_SHARE names; None: `auto` (measured at start-up)."""
    share = _share(cfg.gpu_decode_share)
    return share if isinstance(share, float) else None

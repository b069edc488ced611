"""The worker's configuration: one typed object, read once at start-up from env and flags.

Each field is one entry of worker/config/table.py, which says its variable (the names
docs/reference/configuration.md lists are part of the contract with operators), default,
bounds and meaning; a CLI flag of the same name in kebab case overrides the variable.
`validate` loops over that table, then runs the few rules that relate settings to each
other (`RULES`). Invalid values raise ConfigError with one line that names the variable and
what is accepted. The fields without a variable are tuning constants (tuning.py), set only
through GPUFEED_TUNING.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

from producer import shards, tenants
from producer.priorities import level_stream, parse_levels
from producer.shards import Shard
from worker.base.errors import ConfigError
from worker.config import table, tuning
from worker.config.lanes import Lanes
from worker.config.table import (
    COMPILE_MODES,
    DEFAULT_REDIS_URL,
    RESULT_HEADROOM_BYTES,
    TOOL_VARIABLES,
    TUNING_VARIABLE,
    shown,
)
from worker.model.names import check_name
from worker.model.sizes import parse_batch_sizes, planned_sizes

# COMPILE_MODES, DEFAULT_REDIS_URL and TOOL_VARIABLES live in the table; they are read from
# here too.
__all__ = [
    "COMPILE_MODES",
    "DEFAULT_REDIS_URL",
    "RULES",
    "TOOL_VARIABLES",
    "WorkerConfig",
    "check_unknown_variables",
    "gpu_decode_share",
    "parse_tuning",
    "parse_weights",
    "redact_url",
    "setting",
    "tuning_text",
]

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


def _default_worker_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def setting(name: str) -> Any:
    """The field of table entry `name`, with the entry's default."""
    return field(default=table.BY_NAME[name].default)


@dataclass(frozen=True)
class WorkerConfig:
    # Redis and the wire contract
    redis_url: str = setting("redis_url")
    stream: str = setting("stream")
    group: str = setting("group")
    priorities: str = setting("priorities")
    priority_weights: str = setting("priority_weights")
    tenants: str = setting("tenants")
    results_stream: str = setting("results_stream")
    result_prefix: str = setting("result_prefix")
    dead_stream: str = setting("dead_stream")
    result_ttl_s: int = setting("result_ttl_s")
    results_maxlen: int = setting("results_maxlen")
    max_meta_bytes: int = setting("max_meta_bytes")
    max_result_bytes: int = setting("max_result_bytes")
    worker_name: str = setting("worker_name")
    redis_cluster: str = setting("redis_cluster")
    shards: int = setting("shards")
    wait_replicas: int = setting("wait_replicas")
    # Model and device
    model: str = setting("model")
    weights: str = setting("weights")
    device: str = setting("device")
    processes: int = setting("processes")
    batch_size: int = setting("batch_size")
    compile: str = setting("compile")
    precision: str = setting("precision")
    input_size: int = setting("input_size")
    top_k: int = setting("top_k")
    allow_eager_fallback: bool = setting("allow_eager_fallback")
    max_wait_ms: float = setting("max_wait_ms")
    # Degrade under backlog
    degrade_after_s: float = setting("degrade_after_s")
    degrade_input_size: int = setting("degrade_input_size")
    degrade_model: str = setting("degrade_model")
    # Decode
    decode_processes: str = setting("decode_processes")
    decode: str = setting("decode")
    decode_cache_mb: int = setting("decode_cache_mb")
    max_image_bytes: int = setting("max_image_bytes")
    max_image_pixels: int = setting("max_image_pixels")
    max_decode_mb: int = setting("max_decode_mb")
    path_root: Path | None = setting("path_root")  # noqa: RUF009 (a Field, as the others)
    # Images by URL
    fetch_concurrency: int = setting("fetch_concurrency")
    fetch_per_host: int = setting("fetch_per_host")
    url_allow: str = setting("url_allow")
    url_deny: str = setting("url_deny")
    object_allow: str = setting("object_allow")
    # Delivery
    visibility_timeout_s: float = setting("visibility_timeout_s")
    max_deliveries: int = setting("max_deliveries")
    shutdown_grace_s: float = setting("shutdown_grace_s")
    # Observability
    metrics_port: int = setting("metrics_port")
    metrics_host: str = setting("metrics_host")
    log_format: str = setting("log_format")
    log_level: str = setting("log_level")
    # Tuning constants (tuning.py): read like any setting, given only by GPUFEED_TUNING
    claim_interval_s: float = setting("claim_interval_s")
    consumer_expiry_s: float = setting("consumer_expiry_s")
    trim_interval_s: float = setting("trim_interval_s")
    wait_replicas_timeout_ms: int = setting("wait_replicas_timeout_ms")
    stats_interval_s: float = setting("stats_interval_s")
    live_loop_stall_s: float = setting("live_loop_stall_s")
    live_launch_stall_s: float = setting("live_launch_stall_s")
    live_writer_stall_s: float = setting("live_writer_stall_s")
    fetch_connect_timeout_s: float = setting("fetch_connect_timeout_s")
    fetch_read_timeout_s: float = setting("fetch_read_timeout_s")
    fetch_timeout_s: float = setting("fetch_timeout_s")
    fetch_retries: int = setting("fetch_retries")
    fetch_max_redirects: int = setting("fetch_max_redirects")
    fetch_host_queue: int = setting("fetch_host_queue")
    decode_threads: int = setting("decode_threads")
    ring_slots: int = setting("ring_slots")
    dct_scaling: bool = setting("dct_scaling")
    resize: str = setting("resize")
    gpu_decode_share: str = setting("gpu_decode_share")
    intake: str = setting("intake")
    result_writer: str = setting("result_writer")
    decode_budget_ms: float = setting("decode_budget_ms")
    batch_sizes: str = setting("batch_sizes")
    hot_list: int = setting("hot_list")
    warm_start_s: float = setting("warm_start_s")

    @classmethod
    def load(
        cls,
        env: Mapping[str, str] | None = None,
        overrides: Mapping[str, Any] | None = None,
    ) -> WorkerConfig:
        """Build the config: defaults, then env vars, then explicit overrides (CLI flags,
        or any field by name from code)."""
        env = os.environ if env is None else env
        check_unknown_variables(env)
        values: dict[str, Any] = {}
        for entry in table.PUBLIC:
            raw = env.get(str(entry.env))
            if raw is not None and raw.strip() != "":
                values[entry.name] = _parse(entry.label, raw.strip(), entry.type_name)
        values.update(parse_tuning(env.get(TUNING_VARIABLE, "")))
        for name, value in (overrides or {}).items():
            given = table.BY_NAME.get(name)
            if given is None:
                raise ConfigError(f"unknown setting {name!r}")
            if value is None:
                continue
            if isinstance(value, str):
                flag = f"--{name.replace('_', '-')}" if given.env else given.label
                values[name] = _parse(flag, value, given.type_name)
            else:
                values[name] = value
        # A consumer may come back for a pending job until the visibility timeout passes:
        # an operator who lengthens that lengthens the expiry with it.
        if "consumer_expiry_s" not in values:
            visibility = values.get("visibility_timeout_s", cls.visibility_timeout_s)
            values["consumer_expiry_s"] = max(tuning.CONSUMER_EXPIRY_S, visibility)
        config = cls(**values)
        config.validate()
        # `Resnet18` is resnet18: the one spelling the loader, logs and results use.
        if (model := check_name(config.model)) != config.model:
            config = dataclasses.replace(config, model=model)
        if not config.worker_name:
            config = dataclasses.replace(config, worker_name=_default_worker_name())
        return config

    def validate(self) -> None:
        """Each setting against its entry of the table, then each rule of `RULES`."""
        for entry in table.SETTINGS:
            problem = entry.problem(getattr(self, entry.name))
            if problem is not None:
                raise ConfigError(f"{entry.label}: {problem}")
        for rule in RULES:
            rule(self)

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


# ------------------------------------------------------------ rules across settings


def _need(ok: bool, var: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{var}: {message}")


def levels_and_weights(cfg: WorkerConfig) -> None:
    """One weight per priority level, and no level's stream where results go."""
    levels = parse_levels(cfg.priorities)
    try:
        weights = parse_weights(cfg.priority_weights, len(levels))
    except ValueError as exc:
        raise ConfigError(f"GPUFEED_PRIORITY_WEIGHTS: {exc}") from None
    apart = cfg.stream != cfg.results_stream
    _need(apart, "GPUFEED_RESULTS_STREAM", "must differ from GPUFEED_STREAM")
    for lane in Lanes.of(cfg.stream, levels, weights):
        _need(
            lane.stream not in (cfg.results_stream, cfg.dead_stream),
            "GPUFEED_PRIORITIES",
            f"level {lane.level!r}'s stream {lane.stream} is the results or dead-letter stream",
        )


def shards_and_keys(cfg: WorkerConfig) -> None:
    """The shards' keys can be laid out, and none of them is a key gpufeed owns."""
    levels = parse_levels(cfg.priorities)
    try:
        layout = cfg.shard_layout()
    except shards.ShardLayoutError as exc:
        raise ConfigError(str(exc)) from None
    # A job id is appended to the result prefix: no gpufeed key may lie under it.
    clash = shards.result_prefix_problem(layout, levels)
    if clash is not None:
        raise ConfigError(clash)
    # No level's stream may be a key gpufeed owns (a level `hot` would take the hot list),
    # nor may a results stream: the rule the writer applies to each reply_to.
    fixed = shards.own_keys(cfg.stream, layout, (), job_space=False)
    owned = shards.own_keys(cfg.stream, layout, levels)
    for keys, _ in [kw for shard in layout for kw in cfg.key_sets(shard.index)]:
        for level in levels:
            for stream in (level_stream(cfg.stream, level), level_stream(keys.stream, level)):
                taken = fixed.problem(stream)
                _need(taken is None, "GPUFEED_PRIORITIES", f"level {level!r}: {taken}")
        taken = owned.problem(keys.results_stream)
        _need(taken is None, "GPUFEED_RESULTS_STREAM", f"{taken}: results cannot go there")


def batch_shapes(cfg: WorkerConfig) -> None:
    """The smaller batch shapes fit the batch size (with the size picked by the device,
    the engine checks this at start-up)."""
    sizes = parse_batch_sizes(cfg.batch_sizes)
    if sizes and cfg.batch_size:
        try:
            planned_sizes(sizes, cfg.batch_size)
        except ValueError as exc:
            raise ConfigError(f"{table.BY_NAME['batch_sizes'].label}: {exc}") from None


def degrade(cfg: WorkerConfig) -> None:
    """The degraded step is on with exactly one cheaper step; whether its input is smaller
    than a model's own is known only once the model is loaded (worker/model/degraded.py)."""
    on = cfg.degrade_after_s > 0
    _need(
        not on or bool(cfg.degrade_input_size or cfg.degrade_model.strip()),
        "GPUFEED_DEGRADE_AFTER_S",
        "needs the cheaper step: GPUFEED_DEGRADE_INPUT_SIZE (the same model at a smaller "
        "input size) or GPUFEED_DEGRADE_MODEL (a smaller model directory)",
    )
    for name in ("GPUFEED_DEGRADE_INPUT_SIZE", "GPUFEED_DEGRADE_MODEL"):
        _need(
            on or not getattr(cfg, table.BY_ENV[name].name),
            name,
            "applies only with GPUFEED_DEGRADE_AFTER_S (when to switch to the cheaper step)",
        )
    small, size = cfg.degrade_input_size, cfg.input_size
    _need(
        not (small and size) or small < size,
        "GPUFEED_DEGRADE_INPUT_SIZE",
        f"{small} must be smaller than GPUFEED_INPUT_SIZE ({size}): the degraded step is the "
        "cheaper one",
    )
    _need(
        not (small and cfg.degrade_model),
        "GPUFEED_DEGRADE_INPUT_SIZE",
        "does not apply with GPUFEED_DEGRADE_MODEL: a model directory names its own input size",
    )


def consumer_expiry(cfg: WorkerConfig) -> None:
    """A consumer is not removed while a job it holds may still be its own."""
    _need(
        cfg.consumer_expiry_s >= cfg.visibility_timeout_s,
        table.BY_NAME["consumer_expiry_s"].label,
        "must be at least GPUFEED_VISIBILITY_TIMEOUT_S",
    )


def result_size(cfg: WorkerConfig) -> None:
    """A result must fit one Redis bulk string (512 MB unless proto-max-bulk-len says less)
    with room to spare, and hold its meta beside ids, timings and the answer."""
    least = cfg.max_meta_bytes + RESULT_HEADROOM_BYTES
    _need(
        least <= cfg.max_result_bytes <= table.MAX_RESULT_BYTES,
        "GPUFEED_MAX_RESULT_BYTES",
        f"must be at least GPUFEED_MAX_META_BYTES + {RESULT_HEADROOM_BYTES} ({least}) and at "
        f"most {table.MAX_RESULT_BYTES}",
    )


def metrics_ports(cfg: WorkerConfig) -> None:
    """Each worker process takes the next port."""
    last = cfg.metrics_port + cfg.processes - 1
    _need(
        cfg.metrics_port == 0 or last <= 65535,
        "GPUFEED_METRICS_PORT",
        f"with GPUFEED_PROCESSES={cfg.processes} the processes take ports "
        f"{cfg.metrics_port}..{last}: past 65535",
    )


RULES: tuple[Callable[[WorkerConfig], None], ...] = (
    levels_and_weights,
    shards_and_keys,
    batch_shapes,
    degrade,
    consumer_expiry,
    result_size,
    metrics_ports,
)


# ------------------------------------------------------------------ reading variables


def check_unknown_variables(env: Mapping[str, str]) -> None:
    """Refuse a GPUFEED_* variable that is no setting (a misspelt one would otherwise be
    ignored without a word), naming the closest setting, or, for a former setting, what
    replaced it."""
    known = set(table.BY_ENV) | TOOL_VARIABLES.keys() | {TUNING_VARIABLE}
    for var in sorted(env):
        if not var.upper().startswith("GPUFEED_") or var in known or _service_link(var, env[var]):
            continue
        if var in table.REMOVED_SETTINGS:
            raise ConfigError(f"{var} is no longer a setting: {table.REMOVED_SETTINGS[var]}")
        close = difflib.get_close_matches(var.upper(), sorted(known), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else "see python -m worker --help"
        name = var if re.fullmatch(r"[A-Za-z0-9_]{1,80}", var) else shown(var)
        raise ConfigError(f"{name}: no such setting ({hint}); unset it to start")


def _service_link(var: str, value: str) -> bool:
    if _SERVICE_LINK.fullmatch(var):
        return True
    return bool(_SERVICE_PORT.fullmatch(var) and _SERVICE_URL.fullmatch(value))


def parse_tuning(raw: str) -> dict[str, Any]:
    """GPUFEED_TUNING (`name=value,...`) as field values. A value may hold commas
    (`batch_sizes=1,16`): a part without `=` goes on the value before it."""
    pairs: list[list[str]] = []
    for part in raw.split(","):
        if "=" in part or not pairs:
            name, _, value = part.partition("=")
            pairs.append([name, value])
        else:
            pairs[-1][1] += "," + part
    values: dict[str, Any] = {}
    for name, value in ((n.strip(), v.strip()) for n, v in pairs):
        if not name:
            continue
        entry = table.BY_NAME.get(name)
        if entry is None or entry.env:
            raise ConfigError(_not_tuned(name))
        values[name] = _parse(entry.label, value, entry.type_name)
    return values


def _not_tuned(name: str) -> str:
    entry = table.BY_NAME.get(name)
    if entry is not None:
        return f"{TUNING_VARIABLE}: {name} is a setting: set {entry.env} instead"
    names = [s.name for s in table.TUNED]
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}? " if close else ""
    return (
        f"{TUNING_VARIABLE}: {shown(name)} is no tuning constant ({hint}worker/config/tuning.py "
        "lists them, in upper case)"
    )


def tuning_text(config: WorkerConfig) -> str:
    """The GPUFEED_TUNING that gives `config`'s tuning constants: those off tuning.py's."""
    return ",".join(
        f"{s.name}={_text(getattr(config, s.name))}"
        for s in table.TUNED
        if getattr(config, s.name) != s.default
    )


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


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
        raise ConfigError(f"{var}: expected {kind}, got {shown(raw)}") from None


def gpu_decode_share(cfg: WorkerConfig) -> float | None:
    """The share the tuning constant gpu_decode_share names; None: `auto` (measured at
    start-up)."""
    value = table.share(cfg.gpu_decode_share)
    return value if isinstance(value, float) else None

#!/usr/bin/env python
"""Soak run: many mixed good and bad jobs through real worker processes, with faults.

It starts its own redis-server (append-only file, fsync per write) on a free port and
`--workers` worker processes (`python -m worker`, the tiny random-weights
mobilenet_v3_small at input 64 unless told otherwise), feeds `--jobs` jobs (about 10% bad:
not an image, truncated JPEG, empty image, missing fields, id too long, a header announcing
huge dimensions), with a hostile share (`--hostile-fraction`, about 3%: `reply_to` naming
the job stream, the dead-letter stream, another job's result key, a hash, another group's
queue, or a tenant's own results stream; ids that another job already used; an id naming
another application's key under the result prefix; a 5 KB RLE BMP
of 100000x1000, a 10000x10000 RGBA PNG, and RLE BMPs that take longer to decode than the
soak's 0.5 s decode budget; poison `deadline_ms` values (superscript and circled digits,
other scripts' digits, underscores, 5,000 digits); fields that are not UTF-8; another
tenant's bucket, a 1 MiB URL, private IPv4 addresses in IPv6 forms; a `meta` one byte over
the worker's bound and many at it; answers forged onto a tenant's results stream with
another job's id) and, while they run:

- at 25% answered, SIGKILLs worker 0 and starts it again under the same name;
- at 40%, an XDEL storm: deletes up to 200 entries that workers hold (and some answered);
- at 50%, stops Redis (SIGTERM) and starts it again on the same port and folder;
- at 75%, kills Redis (SIGKILL) and starts it again.

An entry deleted while a worker held it must still get exactly one result: its own, or
`entry_deleted`.

On top of them, `--tenant-fraction` (10%) more come, a few at a time all along the run,
from two tenants of GPUFEED_TENANTS, each with the Redis user docs/security.md documents:
`victim` sends small JPEGs, `mallory` small JPEGs and jobs whose `reply_to` is the victim's
results stream. Mallory, with its own user, attacks (each also tried, the same way, on the
victim's stream and the plain one, where it must be refused NOPERM, as must reading or
deleting the victim's keys and running a script), and the operator's script holds Redis:

- at 10%, `XADD <its stream> MAXLEN 0 *` right after a burst of its own jobs;
- at 20%, `XADD <its stream> MINID <a day ahead> *`;
- at 33%, a Lua script runs for `--script-hold-s` (3 s) past a busy-reply-threshold
  lowered to 200 ms: workers meet `BUSY`, and none may exit for it;
- at 58%, `--same-tail-images` (6) 10000x10000 PNGs of 297 KB (under every limit, seconds
  to decode) with one length and the same last 64 bytes, and right behind them 16 of the
  victim's small JPEGs;
- at 68%, an entry with the last possible ID: its stream takes no entry ever again, and its
  later jobs are refused by Redis (counted, not sent).

Mallory's entries that its own trims removed before any worker read them are counted as
`trimmed_by_tenant`, never as missing; every other entry of each stream, and every one of
the victim's, must get exactly one result. The victim's latency (its entry's time to its
answer's, both Redis stream IDs) is reported for the whole run, for its jobs sent while the
same-tail images decode, and for the 16 sent right behind them.

Then it waits for every job to be answered, stops the workers (SIGTERM) and reports: jobs
in, results out, ok and error counts by code, duplicates (job entries with more than one
result), missing (none), unexpected outcomes (a good job that failed, a bad one with the
wrong code, `meta` not echoed), dead letters, elapsed time and throughput, and each worker
process's RSS at start, after warm-up and at the end (growth after warm-up over
`--rss-flag-pct` is flagged). The report is printed as a table and written as JSON.

    .venv/bin/python scripts/soak.py                       # 20,000 jobs, 2 workers
    .venv/bin/python scripts/soak.py --jobs 600 --rate 60  # a short run

Exit status: 0 when every job has exactly one result, the expected one (a tenant's
trimmed entries none), every cross-tenant attempt was refused and no worker crashed; 1
otherwise; 2 when the run could not be set up.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import shutil
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import click  # noqa: E402
import psutil  # noqa: E402
import redis  # noqa: E402

from producer import tenants  # noqa: E402
from producer.wire import DEFAULT_MAX_META_BYTES, JobResult  # noqa: E402
from tests.support.images import (  # noqa: E402
    blank_png_bytes,
    jpeg_bytes,
    png_bytes,
    png_chunk,
    png_header_only,
    rle_bmp_bytes,
    truncated_jpeg_bytes,
)
from tests.support.process_harness import (  # noqa: E402
    DEAD,
    GROUP,
    JOBS,
    RESULTS,
    ResultTally,
    WorkerProcess,
    pending_of,
    stop_all,
    wait_ready,
    worker_env,
)
from tests.support.redis_server import RedisServer  # noqa: E402
from worker.tools.command_line import CONTEXT_SETTINGS, parse  # noqa: E402

MIB = 1024 * 1024

# Bad job kinds and the error code each must come back with.
BAD_KINDS: dict[str, str] = {
    "not_an_image": "unsupported_format",
    "truncated_jpeg": "decode_error",
    "empty_image": "empty_image",
    "missing_fields": "invalid_job",
    "id_too_long": "id_too_long",
    "huge_dimensions": "image_too_large",
}

# Hostile kinds and the outcome each must come back with. A hostile reply_to is answered on
# the default results stream; the tenant's own stream is a valid one.
TENANT_RESULTS = "soak:tenant-results"
QUEUE = "soak:queue"
NOT_A_STREAM = "soak:not-a-stream"
# Another application's key under the result prefix, and the job id that names it.
FOREIGN_ID = "soak-foreign"
FOREIGN_KEY = f"gpufeed:result:{FOREIGN_ID}"
HOSTILE_KINDS: dict[str, str] = {
    "reply_to_job_stream": "invalid_job",
    "reply_to_dead_stream": "invalid_job",
    "reply_to_result_key": "invalid_job",
    "reply_to_hash": "invalid_job",
    "reply_to_queue": "invalid_job",
    "id_at_foreign_key": "invalid_job",
    "tenant_reply_to": "ok",
    "duplicate_id": "ok",
    "rle_bmp_bomb": "image_too_large",
    "rgba_png_bomb": "image_too_large",
    # About 0.3 s of pure-Python decode against the soak's 0.5 s budget: either answer is
    # right, as long as the jobs behind it are not held.
    "slow_image": "ok|decode_timeout",
    # Fields that a lenient check accepts and a later step chokes on: each must be answered
    # `invalid_job`, never end the reader (nor every worker that reclaims the entry).
    "poison_deadline": "invalid_job",
    "garbage_fields": "invalid_job",
    # Another tenant's bucket (the soak's workers allow none), a URL of 1 MiB, and private
    # or link-local IPv4 addresses inside IPv6 forms (6to4, IPv4-mapped, NAT64): each is
    # refused before any request leaves the worker.
    "object_not_allowed": "object_not_allowed",
    "url_too_long": "invalid_job",
    "url_in_ipv6_form": "forbidden_url",
    # A meta one byte over the worker's bound is refused (and not echoed); one at the bound
    # is echoed, and many of them in one flush are more than one publish call can carry.
    "oversized_meta": "invalid_job",
    "meta_at_limit": "ok",
    # Another tenant's id on the tenant's own results stream, with junk for an image: a
    # forged answer for a job it did not send. It is answered once, on that stream, as
    # itself (or as a duplicate of the job that first had the id, whose result stands).
    "forged_answer": "ok|unsupported_format",
}
# deadline_ms values that str.isdigit() or int() would take: superscript and circled
# digits, other scripts' digits (Arabic-Indic, full-width), underscores, a number too long
# for int().
POISON_DEADLINES = [
    "1800000000000\u00b2",
    "\u2460800000000000",
    "\u0661\u0668" + "\u0660" * 11,
    "\uff11\uff18" + "\uff10" * 11,
    "1_800_000_000_000",
    "9" * 5000,
]
HOSTILE_URLS = {
    "object_not_allowed": [
        "s3://tenant-b-private/passport-scan.jpg",
        "gs://tenant-b-private/salaries.jpg",
    ],
    "url_too_long": ["http://127.0.0.1/" + "a" * (1 << 20)],
    "url_in_ipv6_form": [
        "http://[2002:a9fe:a9fe::1]/latest/meta-data",
        "http://[::ffff:127.0.0.1]/x.jpg",
        "http://[64:ff9b::a00:1]/x.jpg",
    ],
}
# Kinds whose id cannot be used: answered under their entry ID.
BY_ENTRY = ("id_too_long", "id_at_foreign_key")
HOSTILE_REPLY_TO = {
    "reply_to_job_stream": JOBS,
    "reply_to_dead_stream": DEAD,
    "reply_to_hash": NOT_A_STREAM,
    "reply_to_queue": QUEUE,
    "tenant_reply_to": TENANT_RESULTS,
}

# ----------------------------------------------------------------------------- tenants
VICTIM, MALLORY = "victim", "mallory"
TENANT_PASSWORD = "s0ak-tenant-pw"
LAST_ID = "18446744073709551615-18446744073709551615"
# What Redis answers an XADD to a stream that holds the last possible ID.
STREAM_CLOSED = "last possible ID"
# What each tenant kind must be answered with (on the tenant's own results stream). The
# same-tail PNGs take seconds each against the soak's 0.5 s decode budget.
TENANT_KINDS: dict[str, str] = {
    "reply_to_other_tenant": "invalid_job",
    "same_tail_png": "ok|decode_timeout",
    "last_id": "ok",
    "trim_attack": "ok",  # trimmed by its own XADD: never read, so never answered
}
# The victim's small JPEGs sent right behind the same-tail PNGs.
PROBES = 16
# A script that holds Redis for ARGV[1] ms, then ends by itself (it writes nothing).
HOLD_SCRIPT = """
local t0 = redis.call('TIME')
local stop = tonumber(t0[1]) * 1000000 + tonumber(t0[2]) + tonumber(ARGV[1]) * 1000
local spins = 0
while true do
  local t = redis.call('TIME')
  if tonumber(t[1]) * 1000000 + tonumber(t[2]) >= stop then return spins end
  spins = spins + 1
end
"""


def tenant_streams(name: str) -> tuple[str, str, str]:
    """The tenant's job stream, results stream and result prefix (no shards)."""
    return tenants.names(name)


def documented_tenant_acl(name: str, password: str) -> list[str]:
    """Tenant `name`'s ACL rules as docs/security.md documents them (for `acme`): the
    soak's tenants have exactly the rights an operator following the page grants."""
    page = (ROOT / "docs" / "security.md").read_text()
    marker = "ACL SETUSER tenant-acme "
    line = next((ln.strip() for ln in page.splitlines() if marker in ln), None)
    if line is None:
        raise RuntimeError(f"docs/security.md documents no {marker.strip()!r} line")
    rules = line.split(marker, 1)[1].split()
    return [f">{password}" if r.startswith(">") else r.replace("acme", name) for r in rules]


def tenant_url(server_url: str, name: str) -> str:
    return server_url.replace("redis://", f"redis://tenant-{name}:{TENANT_PASSWORD}@", 1)


def same_tail_pngs(count: int, seed: int) -> list[bytes]:
    """`count` different 10000x10000 RGB PNGs (297 KB, under every limit, seconds to
    decode) of one length and the same last 64 bytes: what a decode router keyed on length
    and tail would send to one process. They differ in a text chunk of fixed size after the
    header, so each is new to any cache keyed on the bytes."""
    base = blank_png_bytes(10_000, 10_000, mode="RGB")
    head = 8 + 25  # signature, IHDR chunk
    rng = random.Random(seed)
    out = [
        base[:head]
        + png_chunk(b"tEXt", b"soak\x00" + rng.randbytes(16).hex().encode())
        + base[head:]
        for _ in range(count)
    ]
    assert len({len(p) for p in out}) <= 1 and len({p[-64:] for p in out}) <= 1
    assert len(set(out)) == len(out)
    return out


def make_tenant_jobs(
    n: int, prefix: str, seed: int, sneak_fraction: float = 0.0
) -> list[tuple[str, dict[str, bytes | str]]]:
    """A tenant's planned jobs: small JPEGs (kind "good"), and with `sneak_fraction` jobs
    whose reply_to is the victim's results stream (refused: not one of its own streams)."""
    rng = random.Random(seed)
    good = [jpeg_bytes(64, 48, seed=s) for s in range(3)]
    victim_results = tenant_streams(VICTIM)[1]
    jobs: list[tuple[str, dict[str, bytes | str]]] = []
    for i in range(n):
        fields: dict[str, bytes | str] = {
            "id": f"{prefix}-{i:07d}",
            "image": good[i % len(good)],
            "meta": f"{prefix}{i}".encode(),
        }
        if rng.random() < sneak_fraction:
            fields["reply_to"] = victim_results
            jobs.append(("reply_to_other_tenant", fields))
        else:
            jobs.append(("good", fields))
    return jobs


# ----------------------------------------------------------------------------- jobs
def make_jobs(
    n: int, bad_fraction: float, seed: int, hostile_fraction: float = 0.0
) -> list[tuple[str, dict[str, bytes | str]]]:
    """(kind, fields) for each job; kind is "good", one of BAD_KINDS or HOSTILE_KINDS."""
    rng = random.Random(seed)
    good = [jpeg_bytes(64, 48, seed=s) for s in range(6)]
    good += [jpeg_bytes(320, 240, seed=7), png_bytes(64, 48, seed=8), png_bytes(48, 64, mode="L")]
    truncated = truncated_jpeg_bytes(64, 48)
    huge = png_header_only(100_000, 100_000)
    slow = {
        "rle_bmp_bomb": rle_bmp_bytes(100_000, 1000),
        "rgba_png_bomb": blank_png_bytes(10_000, 10_000),
        "slow_image": rle_bmp_bytes(1000, 1000),
    }
    kinds = list(BAD_KINDS)
    hostile = list(HOSTILE_KINDS)
    jobs: list[tuple[str, dict[str, bytes | str]]] = []
    for i in range(n):
        job_id = f"soak-{i:07d}"
        meta = f"m{i}".encode()
        draw = rng.random()
        if draw < hostile_fraction and i > 0:
            kind = rng.choice(hostile)
        elif draw < hostile_fraction + bad_fraction:
            kind = rng.choice(kinds)
        else:
            kind = "good"
        fields: dict[str, bytes | str]
        if kind in HOSTILE_REPLY_TO:
            fields = {"id": job_id, "image": good[i % len(good)], "meta": meta}
            fields["reply_to"] = HOSTILE_REPLY_TO[kind]
        elif kind == "reply_to_result_key":
            fields = {"id": job_id, "image": good[i % len(good)], "meta": meta}
            fields["reply_to"] = f"gpufeed:result:soak-{rng.randrange(i):07d}"
        elif kind == "id_at_foreign_key":
            fields = {"id": FOREIGN_ID, "image": good[i % len(good)], "meta": meta}
        elif kind in slow:
            fields = {"id": job_id, "image": slow[kind], "meta": meta}
        elif kind == "poison_deadline":
            deadline = POISON_DEADLINES[i % len(POISON_DEADLINES)]
            fields = {"id": job_id, "image": good[0], "meta": meta, "deadline_ms": deadline}
        elif kind == "garbage_fields":
            # Bytes that are no UTF-8 in the number field or in reply_to, next to a valid
            # image (either answers invalid_job on the default results stream).
            junk = b"\xff\xfe" + rng.randbytes(16)
            field_name = "deadline_ms" if i % 2 else "reply_to"
            fields = {"id": job_id, "image": good[0], "meta": meta, field_name: junk}
        elif kind in HOSTILE_URLS:
            urls = HOSTILE_URLS[kind]
            fields = {"id": job_id, "url": urls[i % len(urls)], "meta": meta}
        elif kind in ("oversized_meta", "meta_at_limit"):
            size = DEFAULT_MAX_META_BYTES + (kind == "oversized_meta")
            fields = {"id": job_id, "image": good[i % len(good)], "meta": meta.ljust(size, b".")}
        elif kind == "forged_answer":
            victim = f"soak-{rng.randrange(i):07d}"
            junk = b"forged " + rng.randbytes(32)
            fields = {"id": victim, "image": junk, "meta": meta, "reply_to": TENANT_RESULTS}
        elif kind == "duplicate_id":
            # The id of an earlier job; the same image, as a retrying producer would send.
            j = rng.randrange(i)
            fields = {"id": f"soak-{j:07d}", "image": good[i % len(good)], "meta": meta}
        elif kind == "good":
            fields = {"id": job_id, "image": good[i % len(good)], "meta": meta}
        elif kind == "not_an_image":
            junk = rng.randbytes(64)
            fields = {"id": job_id, "image": b"this is not an image " + junk, "meta": meta}
        elif kind == "truncated_jpeg":
            fields = {"id": job_id, "image": truncated, "meta": meta}
        elif kind == "empty_image":
            fields = {"id": job_id, "image": b"", "meta": meta}
        elif kind == "missing_fields":
            fields = {"id": job_id, "meta": meta}
        elif kind == "id_too_long":
            fields = {"id": job_id + "-" + "x" * 200, "image": good[0], "meta": meta}
        else:  # huge_dimensions
            fields = {"id": job_id, "image": huge, "meta": meta}
        jobs.append((kind, fields))
    return jobs


# ----------------------------------------------------------------------------- feeder
class Feeder(threading.Thread):
    """XADDs the jobs to `stream` in chunks, at `rate` jobs/s (0: as fast as the backlog
    bound allows), keeping at most `backlog` jobs submitted and not yet answered; with
    `pace` (the run's progress, 0 to 1), job i of n waits until it reaches i/n, so that a
    tenant's jobs flow all along the run. Redis is never stopped in the middle of a chunk:
    the fault injector takes `lock` first, so every XADD either happened (and is in the
    AOF) or was never sent."""

    def __init__(
        self,
        url: str,
        jobs: list[tuple[str, dict[str, bytes | str]]],
        *,
        rate: float,
        backlog: int,
        chunk: int = 100,
        stream: str = JOBS,
        name: str = "feeder",
        pace: Callable[[], float] | None = None,
    ) -> None:
        super().__init__(name=name, daemon=True)
        self.client = redis.Redis.from_url(url)
        self.jobs = jobs
        self.rate = rate
        self.backlog = backlog
        self.chunk = chunk
        self.stream = stream
        self.pace = pace
        self.lock = threading.Lock()
        self.entries: list[str] = []  # entry IDs, in the order added
        self.placed: list[tuple[str, dict[str, bytes | str]]] = []  # (kind, fields) of each
        self.sent = 0  # jobs gone through: added, or refused by a closed stream
        self.refused = 0
        # Set by the injector once the stream's own tenant closed it (the last possible ID):
        # from then on Redis refuses every XADD, which is the attack's effect, not an error.
        self.closed = False
        self.answered = 0  # updated by the monitor
        self.started_s = 0.0
        self.finished_s: float | None = None
        self.error: BaseException | None = None
        self.stop = threading.Event()

    def record(self, entry: str, kind: str, fields: dict[str, bytes | str]) -> None:
        self.placed.append((kind, fields))
        self.entries.append(entry)

    def run(self) -> None:
        try:
            self._run()
        except Exception as exc:  # noqa: BLE001 - reported by the monitor
            self.error = exc

    def _run(self) -> None:
        self.started_s = time.monotonic()
        for i in range(0, len(self.jobs), self.chunk):
            chunk = self.jobs[i : i + self.chunk]
            if self.rate > 0:
                due = self.started_s + i / self.rate
                while time.monotonic() < due and not self.stop.is_set():
                    time.sleep(min(0.05, due - time.monotonic()))
            if self.pace is not None:
                while self.pace() < i / len(self.jobs) and not self.stop.is_set():
                    time.sleep(0.02)
            while len(self.entries) - self.answered > self.backlog and not self.stop.is_set():
                time.sleep(0.05)
            if self.stop.is_set():
                return
            with self.lock:
                pipe = self.client.pipeline(transaction=False)
                for _, fields in chunk:
                    pipe.xadd(self.stream, dict(fields))
                replies = pipe.execute(raise_on_error=False)
                for (kind, fields), reply in zip(chunk, replies, strict=True):
                    if not isinstance(reply, Exception):
                        self.record(reply.decode(), kind, fields)
                    elif self.closed and STREAM_CLOSED in str(reply):
                        self.refused += 1
                    else:
                        raise reply
                self.sent = i + len(chunk)
        self.finished_s = time.monotonic()


# ----------------------------------------------------------------------------- workers
@dataclass
class WorkerRun:
    """One worker process, from start to its end (SIGKILL or SIGTERM)."""

    name: str
    pid: int
    ended_by: str = ""
    exit_code: int | None = None
    samples: list[tuple[float, int]] = field(default_factory=list)  # (s since ready, rss)
    ready_at_s: float | None = None  # since the soak started

    def sample(self, proc: WorkerProcess) -> None:
        if proc.ready_s is None or not proc.alive:
            return
        try:
            rss = psutil.Process(proc.pid).memory_info().rss
        except psutil.Error:
            return
        self.samples.append((time.monotonic() - proc.ready_s, rss))

    def memory(self, warmup_s: float, flag_pct: float) -> dict[str, Any]:
        if not self.samples:
            return {"rss_start_mib": None, "rss_warm_mib": None, "rss_end_mib": None}
        start = self.samples[0][1]
        warm_sample = next((s for s in self.samples if s[0] >= warmup_s), None)
        end_t, end = self.samples[-1]
        peak = max(s[1] for s in self.samples)
        out: dict[str, Any] = {
            "rss_start_mib": round(start / MIB, 1),
            "rss_end_mib": round(end / MIB, 1),
            "rss_peak_mib": round(peak / MIB, 1),
            "observed_s": round(end_t, 1),
        }
        if warm_sample is None or warm_sample is self.samples[-1]:
            out.update(rss_warm_mib=None, growth_mib=None, growth_pct=None, rss_flag=False)
            out["note"] = f"ran under the {warmup_s:.0f}s warm-up: growth not judged"
            return out
        warm = warm_sample[1]
        growth = end - warm
        pct = 100 * growth / warm
        out.update(
            rss_warm_mib=round(warm / MIB, 1),
            growth_mib=round(growth / MIB, 1),
            growth_pct=round(pct, 1),
            rss_flag=pct > flag_pct,
        )
        return out


# ----------------------------------------------------------------------------- the run
@dataclass
class Fault:
    kind: str
    at_fraction: float
    done: bool = False
    at_s: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)


def tiny_weights(path: Path) -> Path:
    """Random weights for mobilenet_v3_small with 10 classes, saved once."""
    if path.exists():
        return path
    import torch
    from torchvision.models import get_model

    from worker.model.loader import save_weights_file

    torch.manual_seed(0)
    module = get_model("mobilenet_v3_small", weights=None, num_classes=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_weights_file(module, path, [f"class_{i}" for i in range(10)])
    return path


# ----------------------------------------------------------------------------- tenant attacks
@dataclass
class TenantSide:
    """The two tenants' feeders and results, and mallory's attacks with its own user."""

    client: redis.Redis  # mallory's, with the rights docs/security.md documents
    victim: Feeder
    mallory: Feeder
    tallies: dict[str, ResultTally]
    same_tail: list[bytes]
    # Mallory's entries its own trims removed before any worker read them: no result due.
    trimmed: set[str] = field(default_factory=set)
    # Its entries read and not yet answered when it trimmed: their own result or
    # `entry_deleted`, exactly once.
    removed_while_held: set[str] = field(default_factory=set)
    # "<attack>:<target>" -> "NOPERM", or what happened instead.
    attempts: dict[str, str] = field(default_factory=dict)
    same_tail_entries: list[str] = field(default_factory=list)
    probe_entries: list[str] = field(default_factory=list)  # the victim's, right behind them
    # Per tenant: entry -> the time (ms, Redis's clock) of its first answer.
    answered_ms: dict[str, dict[str, int]] = field(default_factory=dict)

    def poll(self, client: redis.Redis) -> None:
        for tally in self.tallies.values():
            tally.poll(client)

    def answered(self) -> int:
        v = self.tallies[VICTIM].answered(self.victim.entries[:])
        m = self.tallies[MALLORY].answered(self.mallory.entries[:])
        self.victim.answered = v
        self.mallory.answered = m + len(self.trimmed)
        return v + m

    def all_answered(self) -> bool:
        if self.victim.finished_s is None or self.mallory.finished_s is None:
            return False
        mallory = self.tallies[MALLORY]
        return self.tallies[VICTIM].answered(self.victim.entries) == len(
            self.victim.entries
        ) and all(mallory.per_entry[e] or e in self.trimmed for e in self.mallory.entries)

    def progress(self) -> str:
        v = self.tallies[VICTIM].answered(self.victim.entries[:])
        m = self.tallies[MALLORY].answered(self.mallory.entries[:])
        return (
            f"victim {v}/{len(self.victim.entries)}, mallory {m}/{len(self.mallory.entries)} "
            f"({len(self.trimmed)} trimmed by itself)"
        )

    # --------------------------------------------------------------- the attacks
    def attack(self, fault: Fault, client: redis.Redis) -> None:
        # Mallory's feeder is held between chunks, so each attack sees every entry it added.
        with self.mallory.lock:
            self.poll(client)
            if fault.kind == "tenant_trim":
                self._trim(fault, client, {"maxlen": 0, "approximate": False})
                self._reach(fault)
            elif fault.kind == "tenant_minid":
                future = int(time.time() * 1000) + 86_400_000
                self._trim(fault, client, {"minid": f"{future}-0"})
            elif fault.kind == "same_tail_images":
                self._same_tail(fault)
            else:
                self._last_id(fault)
        refused = sum(
            v == "NOPERM" for k, v in self.attempts.items() if k.startswith(fault.kind + ":")
        )
        tried = sum(k.startswith(fault.kind + ":") for k in self.attempts)
        fault.detail.update(others_tried=tried, others_refused=refused)
        shown = {k: v for k, v in fault.detail.items() if k not in ("entries",)}
        print(f"  {fault.at_s:6.1f}s  mallory {fault.kind}: {shown}", flush=True)

    def _job(self, job_id: str) -> dict[str, bytes | str]:
        return {"id": job_id, "image": jpeg_bytes(64, 48, seed=9), "meta": job_id.encode()}

    def _refused(self, name: str, call: Any) -> None:
        try:
            call()
        except redis.exceptions.NoPermissionError:
            self.attempts[name] = "NOPERM"
            return
        except redis.RedisError as exc:
            self.attempts[name] = f"not refused by the ACL: {exc!r}"
            return
        self.attempts[name] = "ALLOWED"

    def _others(self, fault: Fault, fields: dict[str, bytes | str], **xadd: Any) -> None:
        """The same XADD on the victim's stream and the plain one: refused NOPERM."""
        for target in (self.victim.stream, JOBS):
            self._refused(
                f"{fault.kind}:xadd {target}",
                lambda t=target: self.client.xadd(t, dict(fields), **xadd),
            )

    def _trim(self, fault: Fault, client: redis.Redis, trim: dict[str, Any]) -> None:
        own = self.mallory.stream
        # A burst of its own jobs first, so that the trim has queued jobs to take.
        burst = [("good", self._job(f"m-{fault.kind}-{k}")) for k in range(20)]
        attack = self._job(f"m-{fault.kind}")
        pipe = self.client.pipeline(transaction=False)
        for _, fields in burst:
            pipe.xadd(own, dict(fields))
        pipe.xadd(own, dict(attack), **trim)
        replies = pipe.execute()
        for (kind, fields), reply in zip([*burst, ("trim_attack", attack)], replies, strict=True):
            self.mallory.record(reply.decode(), kind, fields)
        # What a worker had read before the trim stays due (its group's last delivered ID
        # moves only by reads, and the feeder is held): the rest went with the trim.
        last = _stream_id(_last_delivered(client, own))
        mallory = self.tallies[MALLORY]
        live = [e for e in self.mallory.entries if e not in self.trimmed]
        gone = [e for e in live if _stream_id(e) > last]
        held = [e for e in live if _stream_id(e) <= last and not mallory.per_entry[e]]
        self.trimmed.update(gone)
        self.removed_while_held.update(held)
        fault.detail.update(
            burst=len(burst),
            trimmed=len(gone),
            read_not_answered=len(held),
            length_after=int(client.xlen(own)),
        )
        self._others(fault, attack, **trim)

    def _reach(self, fault: Fault) -> None:
        """Reads, deletes and a script beyond its keys: each refused NOPERM."""
        v_stream, v_results, v_prefix = tenant_streams(VICTIM)
        c = self.client
        calls: dict[str, Any] = {
            f"del {v_stream}": lambda: c.delete(v_stream),
            f"del {JOBS}": lambda: c.delete(JOBS),
            f"xread {v_stream}": lambda: c.xread({v_stream: "0"}, count=1),
            f"xrange {v_results}": lambda: c.xrange(v_results, count=1),
            f"hgetall {v_prefix}v-0000000": lambda: c.hgetall(f"{v_prefix}v-0000000"),
            f"xadd {v_results} (a forged answer)": lambda: c.xadd(
                v_results, {"id": "v-0000000", "entry": "0-1", "status": "ok"}
            ),
            f"xadd {DEAD}": lambda: c.xadd(DEAD, {"id": "x"}),
            "eval (a script)": lambda: c.eval("return 1", 0),
        }
        for name, call in calls.items():
            self._refused(f"{fault.kind}:{name}", call)

    def _same_tail(self, fault: Fault) -> None:
        pipe = self.client.pipeline(transaction=False)
        placed = []
        for k, png in enumerate(self.same_tail):
            fields: dict[str, bytes | str] = {"id": f"m-tail-{k}", "image": png, "meta": b"t%d" % k}
            placed.append(fields)
            pipe.xadd(self.mallory.stream, dict(fields))
        for fields, reply in zip(placed, pipe.execute(), strict=True):
            self.mallory.record(reply.decode(), "same_tail_png", fields)
            self.same_tail_entries.append(reply.decode())
        # Right behind them, the victim sends a handful of small JPEGs of its own (with its
        # own user, as its feeder does): their latency is the attack's effect.
        with self.victim.lock:
            probes = [self._job(f"v-probe-{k}") for k in range(PROBES)]
            pipe = self.victim.client.pipeline(transaction=False)
            for fields in probes:
                pipe.xadd(self.victim.stream, dict(fields))
            for fields, reply in zip(probes, pipe.execute(), strict=True):
                self.victim.record(reply.decode(), "good", fields)
                self.probe_entries.append(reply.decode())
        size = len(self.same_tail[0]) if self.same_tail else 0
        fault.detail.update(
            images=len(self.same_tail), bytes_each=size, pixels="10000x10000", victim_probes=PROBES
        )

    def _last_id(self, fault: Fault) -> None:
        own = self.mallory.stream
        fields = self._job("m-last")
        self.mallory.record(
            self.client.xadd(own, dict(fields), id=LAST_ID).decode(), "last_id", fields
        )
        self.mallory.closed = True
        try:
            after = self._job("m-after-last")
            entry = self.client.xadd(own, dict(after)).decode()
        except redis.ResponseError as exc:
            fault.detail["closed_for_good"] = STREAM_CLOSED in str(exc)
            self.mallory.refused += 1  # a job of its own that the stream no longer takes
        else:
            self.mallory.record(entry, "good", after)
            fault.detail["closed_for_good"] = False
        self._others(fault, fields, id=LAST_ID)

    # --------------------------------------------------------------- the report
    def read_answer_times(self, client: redis.Redis) -> None:
        for name, tally in self.tallies.items():
            stream = tally.streams[0]
            first: dict[str, int] = {}
            start = "-"
            while True:
                page = client.xrange(stream, start, "+", count=5000)
                for raw_id, fields in page:
                    entry = fields.get(b"entry", b"").decode()
                    first.setdefault(entry, _stream_id(raw_id.decode())[0])
                if len(page) < 5000:
                    break
                start = f"({page[-1][0].decode()}"
            self.answered_ms[name] = first

    def report(self, args: SoakArgs) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, feeder in ((VICTIM, self.victim), (MALLORY, self.mallory)):
            tally = self.tallies[name]
            # Entry IDs are per stream: the victim's may equal mallory's trimmed ones.
            gone = self.trimmed if name == MALLORY else set()
            kept = [(p, e) for p, e in zip(feeder.placed, feeder.entries, strict=True)]
            kept = [(p, e) for p, e in kept if e not in gone]
            jobs = [p for p, _ in kept]
            r = build_report(
                args,
                jobs,
                [e for _, e in kept],
                tally,
                Counter(kind for kind, _ in jobs),
                deleted=self.removed_while_held if name == MALLORY else set(),
            )
            keys = (
                "jobs_in", "results_out", "answered", "ok", "error", "errors_by_code",
                "duplicates", "duplicate_examples", "missing", "missing_examples",
                "results_for_unknown_entries", "unexpected", "unexpected_by_kind",
                "unexpected_examples", "by_kind", "answers_after_delete",
            )  # fmt: skip
            t = {"jobs_planned": len(feeder.jobs), **{k: r[k] for k in keys}}
            if name == MALLORY:
                t.update(
                    trimmed_by_tenant=len(self.trimmed),
                    trimmed_then_answered=sum(bool(tally.per_entry[e]) for e in self.trimmed),
                    refused_stream_closed=feeder.refused,
                    read_when_trimmed=len(self.removed_while_held),
                )
            else:
                t["latency_ms"] = self._victim_latency()
            out[name] = t
        return out

    def _victim_latency(self) -> dict[str, Any]:
        answers = self.answered_ms.get(VICTIM, {})
        sent = {e: _stream_id(e)[0] for e in self.victim.entries}
        latency = {e: answers[e] - sent[e] for e in self.victim.entries if e in answers}
        out: dict[str, Any] = {"all": _quantiles(list(latency.values()))}
        if self.same_tail_entries:
            tail_answers = [
                self.answered_ms.get(MALLORY, {}).get(e) for e in self.same_tail_entries
            ]
            start = min(_stream_id(e)[0] for e in self.same_tail_entries)
            done = [a for a in tail_answers if a is not None]
            end = max(done) if done else start
            during = [v for e, v in latency.items() if start <= sent[e] <= end]
            outside = [v for e, v in latency.items() if not start <= sent[e] <= end]
            out.update(
                during_same_tail={
                    **_quantiles(during),
                    "window_s": round((end - start) / 1000, 2),
                    "images_answered": len(done),
                },
                outside_same_tail=_quantiles(outside),
                probes_behind_same_tail=_quantiles(
                    [latency[e] for e in self.probe_entries if e in latency]
                ),
            )
        return out

    def attacks(self, faults: list[Fault]) -> dict[str, Any]:
        refused = sorted(k for k, v in self.attempts.items() if v == "NOPERM")
        return {
            "done": [
                {"kind": f.kind, "at_s": f.at_s, **f.detail}
                for f in faults
                if f.done
                and (f.kind.startswith("tenant_") or f.kind in ("same_tail_images", "long_script"))
            ],
            "trimmed_by_tenant": len(self.trimmed),
            "refused_stream_closed": self.mallory.refused,
            "attempts_on_others": len(self.attempts),
            "refused_noperm": len(refused),
            "not_refused": {k: v for k, v in self.attempts.items() if v != "NOPERM"},
        }

    def failures(self, report: dict[str, Any]) -> list[str]:
        out: list[str] = []
        for name, t in report["tenants"].items():
            for what in ("missing", "duplicates", "unexpected", "results_for_unknown_entries"):
                if t[what]:
                    out.append(f"{name}: {t[what]} {what}")
            if t["results_out"] != t["jobs_in"]:
                out.append(f"{name}: {t['results_out']} results for {t['jobs_in']} entries")
        if self.victim.sent != len(self.victim.jobs):
            out.append(f"victim: {len(self.victim.jobs) - self.victim.sent} jobs never sent")
        if report["tenants"][MALLORY]["trimmed_then_answered"]:
            out.append("mallory: an entry its trim removed before any read was answered")
        out += [f"not refused: {k} ({v})" for k, v in self.attempts.items() if v != "NOPERM"]
        return out


def _quantiles(values: list[int]) -> dict[str, Any]:
    """n, p50, p99 and max of `values` (ms), nearest rank."""
    if not values:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    ordered = sorted(values)

    def rank(q: float) -> int:
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)]

    return {"n": len(ordered), "p50": rank(0.50), "p99": rank(0.99), "max": ordered[-1]}


@dataclass(frozen=True)
class SoakArgs:
    """The command line (`command`)."""

    jobs: int
    workers: int
    out: Path
    workdir: Path
    bad_fraction: float
    hostile_fraction: float
    tenant_fraction: float
    same_tail_images: int
    script_hold_s: float
    rate: float
    backlog: int
    batch_size: int
    model: str
    input_size: int
    weights: str
    device: str
    decode_processes: str
    result_writer: str
    visibility_timeout: float
    no_faults: bool
    redis_down_s: float
    warmup_s: float
    rss_flag_pct: float
    settle_s: float
    timeout_s: float
    seed: int
    cluster: bool
    shards: int
    wait_replicas: int


_PATH = click.Path(path_type=Path)


@click.command(
    help=__doc__.split("\n\n")[0],
    # click has no option groups: the epilog says which options belong to the variant.
    epilog="The cluster variant: --cluster, --shards and --wait-replicas.",
    context_settings=CONTEXT_SETTINGS,
)
@click.option("--jobs", type=int, default=20_000, help="jobs to submit (default 20000)")
@click.option("--workers", type=int, default=2, help="worker processes (default 2)")
@click.option("--out", type=_PATH, default=Path(".soak/report.json"), help="JSON report")
@click.option("--workdir", type=_PATH, default=Path(".soak"), help="Redis data, logs")
@click.option("--bad-fraction", type=float, default=0.10, help="share of bad jobs")
@click.option("--hostile-fraction", type=float, default=0.03, help="share of hostile jobs")
@click.option(
    "--tenant-fraction",
    type=float,
    default=0.10,
    help="jobs sent by the tenants victim (2/3) and mallory (1/3) on top of --jobs, as a "
    "share of it, with mallory's attacks (default 0.10); 0: no tenants",
)
@click.option(
    "--same-tail-images", type=int, default=6, help="mallory's same-tail 10000x10000 PNGs"
)
@click.option(
    "--script-hold-s", type=float, default=3.0, help="how long the operator's script holds Redis"
)
@click.option("--rate", type=float, default=0.0, help="jobs/s to submit; 0: no limit")
@click.option("--backlog", type=int, default=2000, help="max submitted, not answered")
@click.option("--batch-size", type=int, default=8)
@click.option("--model", default="mobilenet_v3_small")
@click.option("--input-size", type=int, default=64)
@click.option("--weights", default="", help="GPUFEED_WEIGHTS; default: tiny random file")
@click.option("--device", default="cpu", help="GPUFEED_DEVICE (default cpu)")
@click.option(
    "--decode-processes", default="auto", help="GPUFEED_DECODE_PROCESSES (0: decode threads)"
)
@click.option(
    "--result-writer",
    default="process",
    help="the result_writer tuning constant (default process: its guarantees under kills and "
    "restarts)",
)
@click.option("--visibility-timeout", type=float, default=5.0)
@click.option("--no-faults", is_flag=True, help="no kills, no Redis restarts")
@click.option("--redis-down-s", type=float, default=2.0, help="how long Redis stays down")
@click.option("--warmup-s", type=float, default=10.0, help="RSS baseline after this")
@click.option("--rss-flag-pct", type=float, default=20.0, help="flag RSS growth over")
@click.option("--settle-s", type=float, default=3.0, help="wait for late duplicates")
@click.option("--timeout-s", type=float, default=0.0, help="0: 300 s + 20 ms per job")
@click.option("--seed", type=int, default=1)
@click.option(
    "--cluster",
    is_flag=True,
    help="a private Redis Cluster (3 masters, 1 replica each), the null model, good jobs "
    "only, a master SIGKILLed at 50% answered (not with --no-faults); reports "
    "duplicates, lost results and jobs/s",
)
@click.option("--shards", type=int, default=3, help="GPUFEED_SHARDS (default 3)")
@click.option("--wait-replicas", type=int, default=0, help="GPUFEED_WAIT_REPLICAS")
def command(**options: Any) -> SoakArgs:
    args = SoakArgs(**options)
    if args.jobs < 1 or args.workers < 1:
        raise click.UsageError("--jobs and --workers must be at least 1")
    if not 0 <= args.tenant_fraction <= 1 or args.same_tail_images < 0 or args.script_hold_s < 0:
        raise click.UsageError(
            "--tenant-fraction must be in [0, 1], --same-tail-images and --script-hold-s at least 0"
        )
    return args


def parse_args(argv: list[str] | None = None) -> SoakArgs:
    return parse(command, argv, SoakArgs)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cluster:
        return cluster_main(args)
    work = args.workdir.resolve()
    if (work / "redis").exists():
        shutil.rmtree(work / "redis")
    if (work / "logs").exists():
        shutil.rmtree(work / "logs")
    work.mkdir(parents=True, exist_ok=True)
    (work / ".gitignore").write_text("*\n")
    weights = args.weights or str(tiny_weights(work / "tiny-mobilenet_v3_small.pt"))
    n_tenant = round(args.jobs * args.tenant_fraction)
    n_victim = round(n_tenant * 2 / 3)
    with_tenants = n_tenant > 0
    total = args.jobs + n_tenant
    timeout_s = args.timeout_s or 300 + 0.02 * total

    print(f"preparing {args.jobs} jobs and {n_tenant} of tenants ...", flush=True)
    jobs = make_jobs(args.jobs, args.bad_fraction, args.seed, args.hostile_fraction)
    kinds_in = Counter(kind for kind, _ in jobs)
    victim_jobs = make_tenant_jobs(n_victim, "v", args.seed + 1)
    mallory_jobs = make_tenant_jobs(n_tenant - n_victim, "m", args.seed + 2, sneak_fraction=0.1)
    attacks_on = with_tenants and not args.no_faults
    same_tail = same_tail_pngs(args.same_tail_images, args.seed) if attacks_on else []

    # The tenants' users live in an ACL file, so that they outlast the Redis restarts.
    acl = ("--aclfile", str(work / "redis" / "users.acl")) if with_tenants else ()
    server = RedisServer(work / "redis", *acl, persistent=True)
    if with_tenants:
        (work / "redis" / "users.acl").write_text("")
    server.start()
    settings = {"GPUFEED_TENANTS": f"{VICTIM}=1,{MALLORY}=1"} if with_tenants else {}
    env = worker_env(
        server.url,
        weights,
        GPUFEED_MODEL=args.model,
        GPUFEED_INPUT_SIZE=str(args.input_size),
        GPUFEED_BATCH_SIZE=str(args.batch_size),
        GPUFEED_DEVICE=args.device,
        GPUFEED_DECODE_PROCESSES=args.decode_processes,
        GPUFEED_VISIBILITY_TIMEOUT_S=str(args.visibility_timeout),
        GPUFEED_TUNING=(
            f"result_writer={args.result_writer},claim_interval_s=1,"
            f"consumer_expiry_s={max(30.0, args.visibility_timeout)},trim_interval_s=5,"
            "decode_budget_ms=500"
        ),
        **settings,
    )
    names = [f"soak-w{i}" for i in range(args.workers)]
    procs: dict[str, WorkerProcess] = {}
    runs: list[WorkerRun] = []
    current: dict[str, WorkerRun] = {}
    t0 = time.monotonic()

    def launch(name: str) -> None:
        proc = WorkerProcess(name, env, work / "logs" / f"{name}.log").start()
        procs[name] = proc
        run = WorkerRun(name=name, pid=proc.pid)
        runs.append(run)
        current[name] = run

    crashes: list[str] = []
    faults = (
        []
        if args.no_faults
        else [
            Fault("worker_sigkill", 0.25),
            Fault("long_script", 0.33),
            Fault("xdel_storm", 0.40),
            Fault("redis_restart", 0.50, detail={"signal": "SIGTERM"}),
            Fault("redis_restart", 0.75, detail={"signal": "SIGKILL"}),
        ]
    )
    if attacks_on:
        faults += [
            Fault("tenant_trim", 0.10),
            Fault("tenant_minid", 0.20),
            Fault("same_tail_images", 0.58),
            Fault("tenant_last_id", 0.68),
        ]
    faults.sort(key=lambda f: f.at_fraction)
    feeder = Feeder(server.url, jobs, rate=args.rate, backlog=args.backlog)
    feeders = [feeder]
    tally = ResultTally(RESULTS, TENANT_RESULTS)
    client = redis.Redis.from_url(server.url)
    # The keys hostile jobs name: a hash, and another deployment's queue with its group.
    client.hset(NOT_A_STREAM, "x", "y")
    client.set(FOREIGN_KEY, "keep")
    client.xgroup_create(QUEUE, "other", id="0", mkstream=True)
    deleted: set[str] = set()
    side: TenantSide | None = None
    progress = [0.0]  # the run's, for the tenants' feeders
    if with_tenants:
        for name in (VICTIM, MALLORY):
            rules = documented_tenant_acl(name, TENANT_PASSWORD)
            client.execute_command("ACL", "SETUSER", f"tenant-{name}", *rules)
        client.execute_command("ACL", "SAVE")
        # The tenants send a few jobs at a time as the run goes (all of them by 90%
        # answered): the victim's latency is then its service's, not that of a backlog of
        # its own, and mallory still has jobs to send once it has closed its stream.
        victim, mallory = (
            Feeder(
                tenant_url(server.url, name),
                tenant_jobs,
                rate=0,
                backlog=200,
                chunk=4,
                stream=tenant_streams(name)[0],
                name=name,
                pace=lambda: progress[0],
            )
            for name, tenant_jobs in ((VICTIM, victim_jobs), (MALLORY, mallory_jobs))
        )
        feeders += [victim, mallory]
        side = TenantSide(
            client=redis.Redis.from_url(tenant_url(server.url, MALLORY)),
            victim=victim,
            mallory=mallory,
            tallies={
                VICTIM: ResultTally(tenant_streams(VICTIM)[1]),
                MALLORY: ResultTally(tenant_streams(MALLORY)[1]),
            },
            same_tail=same_tail,
        )
    all_answered_s: float | None = None
    try:
        print(f"starting {args.workers} workers ...", flush=True)
        for name in names:
            launch(name)
        wait_ready(procs.values(), timeout_s=180)
        for name in names:
            current[name].ready_at_s = round(time.monotonic() - t0, 1)
        for f in feeders:
            f.start()
        deadline = time.monotonic() + timeout_s
        last_sample = 0.0
        last_print = time.monotonic()
        while True:
            now = time.monotonic()
            for f in feeders:
                if f.error is not None:
                    raise RuntimeError(f"feeder {f.name} failed: {f.error!r}")
            with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
                tally.poll(client)  # fails while Redis restarts; the next poll catches up
                if side is not None:
                    side.poll(client)
            entries = feeder.entries[:]
            answered = tally.answered(entries)
            feeder.answered = answered
            everything = answered
            plain_done = feeder.finished_s is not None and answered >= len(jobs)
            all_in = plain_done
            if side is not None:
                everything += side.answered()
                all_in = all_in and side.all_answered()
            progress[0] = 1.0 if plain_done else everything / (0.9 * total)
            if now - last_sample >= 1.0:
                last_sample = now
                for name, proc in procs.items():
                    if proc.ready_s is None and proc.alive and proc.is_ready():
                        current[name].ready_at_s = round(now - t0, 1)
                    current[name].sample(proc)
            for name, proc in procs.items():
                if not proc.alive and current[name].ended_by == "":
                    current[name].ended_by = "crash"
                    current[name].exit_code = proc.returncode
                    crashes.append(name)
                    print(f"worker {name} exited by itself ({proc.returncode})", flush=True)
            if now - last_print >= 5:
                last_print = now
                line = f"  {now - t0:6.1f}s  submitted {len(entries):>7}  answered {answered:>7}"
                if side is not None:
                    line += f"  tenants {side.progress()}"
                print(line, flush=True)
            for fault in faults:
                if not fault.done and everything >= fault.at_fraction * total:
                    inject(
                        fault,
                        procs=procs,
                        current=current,
                        server=server,
                        feeders=feeders,
                        client=client,
                        launch=launch,
                        t0=t0,
                        args=args,
                        deleted=deleted,
                        side=side,
                    )
            if all_in:
                all_answered_s = now
                break
            if now > deadline:
                print(f"timed out after {timeout_s:.0f}s", flush=True)
                break
            time.sleep(0.2)

        time.sleep(args.settle_s)  # a wrong second result would show up now
        for name, proc in procs.items():
            current[name].sample(proc)
        print("stopping the workers (SIGTERM) ...", flush=True)
        codes = stop_all(procs.values(), timeout_s=90)
        for name, code in codes.items():
            run = current[name]
            if run.ended_by == "":
                run.ended_by = "sigterm"
                run.exit_code = code
        tally.poll(client)
        job_streams = [JOBS]
        if side is not None:
            side.poll(client)
            side.read_answer_times(client)
            job_streams += [tenant_streams(VICTIM)[0], tenant_streams(MALLORY)[0]]
        pending = sum(_pending(client, s) for s in job_streams)
        dead_letters = int(client.xlen(DEAD))
        # Hostile reply_to values wrote nothing into keys that are not results streams.
        untouched = (
            client.xlen(QUEUE) == 0
            and client.type(NOT_A_STREAM) == b"hash"
            and client.get(FOREIGN_KEY) == b"keep"
        )
    except (RuntimeError, TimeoutError, OSError, redis.RedisError) as exc:
        print(f"soak could not run: {exc!r}", file=sys.stderr)
        return 2
    finally:
        for f in feeders:
            f.stop.set()
        for proc in procs.values():
            proc.kill()  # only those still alive
        client.close()
        if side is not None:
            side.client.close()
        server.stop()

    entries = feeder.entries
    started = feeder.started_s
    end = all_answered_s or time.monotonic()
    report = build_report(args, jobs, entries, tally, kinds_in, deleted=deleted)
    elapsed = end - started
    answered_all = report["answered"]
    if side is not None:
        report["tenants"] = side.report(args)
        report["tenant_attacks"] = side.attacks(faults)
        answered_all += sum(t["answered"] for t in report["tenants"].values())
    report.update(
        pending_at_end=pending,
        dead_letters=dead_letters,
        hostile_keys_untouched=untouched,
        elapsed_s=round(elapsed, 2),
        throughput_per_s=round(answered_all / elapsed, 1) if elapsed > 0 else None,
        crashes=crashes,
        faults=[
            {"kind": f.kind, "at_fraction": f.at_fraction, "at_s": f.at_s, **f.detail}
            for f in faults
            if f.done
        ],
        workers=[
            {
                **{k: v for k, v in asdict(r).items() if k != "samples"},
                **r.memory(args.warmup_s, args.rss_flag_pct),
                **log_summary(work / "logs" / f"{r.name}.log", start_index),
            }
            for r, start_index in zip(runs, start_indexes(runs), strict=True)
        ],
        settings={
            "jobs": args.jobs,
            "workers": args.workers,
            "bad_fraction": args.bad_fraction,
            "tenant_fraction": args.tenant_fraction,
            "tenant_jobs": n_tenant,
            "model": args.model,
            "input_size": args.input_size,
            "batch_size": args.batch_size,
            "device": args.device,
            "decode_processes": args.decode_processes,
            "visibility_timeout_s": args.visibility_timeout,
            "rate": args.rate,
            "faults": not args.no_faults,
            "cores": psutil.cpu_count(),
        },
    )
    tenant_failures = side.failures(report) if side is not None else []
    report["tenant_failures"] = tenant_failures
    failed = bool(
        report["missing"]
        or report["duplicates"]
        or report["unexpected"]
        or report["results_out"] != report["jobs_in"]
        or not untouched
        or crashes
        or tenant_failures
    )
    report["passed"] = not failed
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print_report(report)
    print(f"\nreport: {args.out}")
    return 1 if failed else 0


def inject(
    fault: Fault,
    *,
    procs: dict[str, WorkerProcess],
    current: dict[str, WorkerRun],
    server: RedisServer,
    feeders: list[Feeder],
    client: redis.Redis,
    launch: Any,
    t0: float,
    args: SoakArgs,
    deleted: set[str],
    side: TenantSide | None,
) -> None:
    fault.done = True
    fault.at_s = round(time.monotonic() - t0, 1)
    feeder = feeders[0]
    if fault.kind == "worker_sigkill":
        name = next(iter(procs))
        proc, run = procs[name], current[name]
        run.sample(proc)
        # Kill it while it holds jobs it read and has not answered (a moment at most).
        give_up = time.monotonic() + 5
        held = pending_of(client, name)
        while held == 0 and proc.alive and time.monotonic() < give_up:
            time.sleep(0.005)
            held = pending_of(client, name)
        proc.kill()
        run.ended_by, run.exit_code = "sigkill", proc.returncode
        fault.detail.update(worker=name, pid=run.pid, held_pending=held)
        print(f"  {fault.at_s:6.1f}s  SIGKILL {name} (holding {held}), restarting it", flush=True)
        launch(name)
        return
    if fault.kind == "xdel_storm":
        # Entries the workers hold, and a few already answered: every one was delivered, so
        # every one must still end with exactly one result.
        held = client.xpending_range(JOBS, GROUP, min="-", max="+", count=150)
        ids = [p["message_id"].decode() for p in held]
        last = _stream_id(_last_delivered(client))
        chosen = set(ids)
        ids += [e for e in feeder.entries[-2000:] if e not in chosen and _stream_id(e) <= last][:50]
        if ids:
            client.xdel(JOBS, *ids)
        deleted.update(ids)
        fault.detail.update(deleted=len(ids), pending_deleted=len(held))
        print(f"  {fault.at_s:6.1f}s  XDEL storm: {len(ids)} entries", flush=True)
        return
    if fault.kind == "long_script":
        with contextlib.ExitStack() as stack:
            for f in feeders:
                stack.enter_context(f.lock)  # the soak's own clients wait; the workers meet BUSY
            hold_script(fault, server, args.script_hold_s)
        alive = [n for n, p in procs.items() if p.alive]
        fault.detail.update(workers_alive_after=alive)
        print(
            f"  {fault.at_s:6.1f}s  Lua script held Redis {fault.detail['held_s']} s "
            f"(BUSY seen: {fault.detail['busy_seen']})",
            flush=True,
        )
        return
    if fault.kind.startswith(("tenant_", "same_tail")):
        assert side is not None
        side.attack(fault, client)
        return
    # Redis: never while a feeder is between sending a chunk and reading its replies.
    with contextlib.ExitStack() as stack:
        for f in feeders:
            stack.enter_context(f.lock)
        print(f"  {fault.at_s:6.1f}s  Redis down ({fault.detail['signal']})", flush=True)
        server.restart(args.redis_down_s, hard=fault.detail["signal"] == "SIGKILL")
        for f in feeders:
            f.client.connection_pool.disconnect()
        client.connection_pool.disconnect()
        if side is not None:
            side.client.connection_pool.disconnect()
    alive = [n for n, p in procs.items() if p.alive]
    fault.detail.update(down_s=args.redis_down_s, workers_alive_after=alive)


def hold_script(fault: Fault, server: RedisServer, hold_s: float) -> None:
    """The operator's long script: past a busy-reply-threshold lowered to 200 ms, Redis
    answers BUSY to every other client until the script ends by itself (`hold_s`)."""
    admin = redis.Redis.from_url(server.url)
    before = admin.config_get("busy-reply-threshold")["busy-reply-threshold"]
    admin.config_set("busy-reply-threshold", 200)
    outcome: dict[str, Any] = {}

    def run() -> None:
        # Its own connection without a socket timeout: the answer comes when the script ends.
        runner = redis.Redis.from_url(server.url)
        started = time.monotonic()
        try:
            outcome["spins"] = runner.eval(HOLD_SCRIPT, 0, round(hold_s * 1000))
        except redis.RedisError as exc:
            outcome["error"] = repr(exc)
        outcome["held_s"] = round(time.monotonic() - started, 2)
        runner.close()

    thread = threading.Thread(target=run, name="long-script", daemon=True)
    thread.start()
    time.sleep(min(0.6, hold_s / 2))
    busy = False
    try:
        admin.ping()
    except redis.ResponseError as exc:
        busy = str(exc).startswith("BUSY")
    thread.join(hold_s + 30)
    admin.config_set("busy-reply-threshold", before)
    admin.close()
    fault.detail.update(
        threshold_ms=200, hold_s=hold_s, busy_seen=busy, held_s=outcome.get("held_s")
    )
    if "error" in outcome:
        fault.detail["script_error"] = outcome["error"]


def _pending(client: redis.Redis, stream: str) -> int:
    try:
        return int(client.xpending(stream, GROUP)["pending"])
    except redis.ResponseError:
        return 0  # no group: nothing was read from it


def _last_delivered(client: redis.Redis, stream: str = JOBS) -> str:
    """The group's last delivered entry ID on `stream` (0-0 before its first read)."""
    for group in client.xinfo_groups(stream):
        if group["name"].decode() == GROUP:
            return str(group["last-delivered-id"].decode())
    return "0-0"


def _stream_id(entry: str) -> tuple[int, int]:
    ms, _, seq = entry.partition("-")
    return int(ms), int(seq or 0)


def expected_outcome(kind: str) -> str:
    return "ok" if kind == "good" else {**BAD_KINDS, **HOSTILE_KINDS, **TENANT_KINDS}[kind]


def build_report(
    args: SoakArgs,
    jobs: list[tuple[str, dict[str, bytes | str]]],
    entries: list[str],
    tally: ResultTally,
    kinds_in: Counter[str],
    *,
    deleted: set[str],
) -> dict[str, Any]:
    status: Counter[str] = Counter()
    codes: Counter[str] = Counter()
    unexpected: Counter[str] = Counter()
    examples: list[str] = []
    after_delete: Counter[str] = Counter()
    marked_duplicates = 0
    # Per bad or hostile kind: entries answered exactly once, and with the expected outcome
    # (or `entry_deleted`, for one deleted while it was held).
    once: Counter[str] = Counter()
    as_expected: Counter[str] = Counter()
    for (kind, fields), entry in zip(jobs, entries, strict=False):
        results = [JobResult.from_fields(f) for f in tally.fields.get(entry, [])]
        once[kind] += len(results) == 1
        for r in results:
            status[r.status] += 1
            if not r.ok:
                codes[r.error_code or "?"] += 1
        if not results:
            continue
        r = results[0]
        want = expected_outcome(kind)
        got = "ok" if r.ok else (r.error_code or "?")
        marked_duplicates += r.duplicate_of is not None
        problem = ""
        if entry in deleted:
            after_delete[got] += 1
            if got == "entry_deleted":
                # Its worker died before answering, or a reclaimer got there first.
                as_expected[kind] += 1
                continue
        if got not in want.split("|"):
            problem = f"{kind}: expected {want}, got {got} ({r.error})"
        elif kind == "oversized_meta":
            if r.meta is not None or "GPUFEED_MAX_META_BYTES" not in (r.error or ""):
                problem = f"{kind}: meta echoed or the limit not named ({r.error})"
        elif r.meta != fields.get("meta"):
            problem = f"{kind}: meta not echoed ({r.meta!r})"
        elif kind not in BY_ENTRY and r.id != fields.get("id"):
            problem = f"{kind}: id {r.id!r}"
        elif kind in BY_ENTRY and r.id != entry:
            problem = f"{kind}: answered under {r.id!r}, not the entry ID"
        elif (
            kind in HOSTILE_KINDS
            and kind not in ("tenant_reply_to", "forged_answer")
            and r.duplicate_of is None
        ):
            if tally.where[entry] != [RESULTS]:
                problem = f"{kind}: answered on {tally.where[entry]}, not on {RESULTS}"
        elif kind in ("tenant_reply_to", "forged_answer") and tally.where[entry] != [
            TENANT_RESULTS
        ]:
            problem = f"{kind}: answered on {tally.where[entry]}, not on {TENANT_RESULTS}"
        if problem:
            unexpected[kind] += 1
            if len(examples) < 10:
                examples.append(f"{entry} {problem}")
        else:
            as_expected[kind] += 1
    per_entry = tally.per_entry
    known = set(entries)
    duplicates = {e: n for e, n in per_entry.items() if n > 1 and e in known}
    missing = [e for e in entries if per_entry[e] == 0]
    return {
        "jobs_in": len(entries),
        "jobs_planned": len(jobs),
        "kinds_in": dict(sorted(kinds_in.items())),
        "by_kind": {
            kind: {
                "in": n,
                "answered_once": once[kind],
                "as_expected": as_expected[kind],
                "expected": expected_outcome(kind),
            }
            for kind, n in sorted(kinds_in.items())
            if kind != "good"
        },
        "results_out": tally.total,
        "answered": len(entries) - len(missing),
        "ok": status["ok"],
        "error": status["error"],
        "errors_by_code": dict(sorted(codes.items())),
        "duplicates": len(duplicates),
        "duplicate_examples": sorted(duplicates)[:10],
        "missing": len(missing) + (len(jobs) - len(entries)),
        "missing_examples": missing[:10],
        "results_for_unknown_entries": sum(n for e, n in per_entry.items() if e not in known),
        "unexpected": sum(unexpected.values()),
        "unexpected_by_kind": dict(unexpected),
        "unexpected_examples": examples,
        "deleted_while_held": len(deleted),
        "answers_after_delete": dict(sorted(after_delete.items())),
        "marked_duplicate_of": marked_duplicates,
    }


def start_indexes(runs: list[WorkerRun]) -> list[int]:
    """For each run, which start of its worker name it was (0: the first)."""
    seen: Counter[str] = Counter()
    out: list[int] = []
    for r in runs:
        out.append(seen[r.name])
        seen[r.name] += 1
    return out


def log_summary(path: Path, start_index: int) -> dict[str, Any]:
    """What one start of a worker logged (a restarted worker appends to the same file, each
    start begins with a `starting` event): jobs it reclaimed, its error-level events."""
    reclaimed = 0
    errors: Counter[str] = Counter()
    busy: Counter[str] = Counter()  # events that name Redis's BUSY (the long script)
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return {}
    segment = -1
    for line in lines:
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event.get("event") == "starting":
            segment += 1
        if segment != start_index:
            continue
        if event.get("event") == "reclaimed_stale_jobs":
            reclaimed += int(event.get("count", 0))
        if event.get("level") in ("error", "critical"):
            errors[str(event.get("event"))] += 1
        if "BUSY" in line:
            busy[str(event.get("event"))] += 1
    return {"log_reclaimed": reclaimed, "log_errors": dict(errors), "log_busy": dict(busy)}


def print_report(r: dict[str, Any]) -> None:
    rows: list[tuple[str, str]] = [
        ("jobs in", str(r["jobs_in"])),
        ("results out", str(r["results_out"])),
        ("ok", str(r["ok"])),
        ("error", str(r["error"])),
    ]
    rows += [(f"  {code}", str(n)) for code, n in r["errors_by_code"].items()]
    rows += [
        ("duplicates", str(r["duplicates"])),
        ("missing", str(r["missing"])),
        ("unexpected outcomes", str(r["unexpected"])),
        ("dead letters", str(r["dead_letters"])),
        ("XDEL storm", f"{r['deleted_while_held']} deleted: {r['answers_after_delete']}"),
        ("duplicate ids", f"{r['marked_duplicate_of']} answered with duplicate_of"),
        ("hostile keys", "untouched" if r["hostile_keys_untouched"] else "WRITTEN"),
        ("pending at end", str(r["pending_at_end"])),
        ("elapsed", f"{r['elapsed_s']:.1f} s"),
        ("throughput", f"{r['throughput_per_s']} jobs/s"),
        ("faults", ", ".join(f"{f['kind']}@{f['at_s']}s" for f in r["faults"]) or "none"),
        ("crashes", ", ".join(r["crashes"]) or "none"),
    ]
    rows += [("bad and hostile kinds", "in / answered once / as expected (expected)")]
    rows += [
        (f"  {kind}", f"{k['in']} / {k['answered_once']} / {k['as_expected']} ({k['expected']})")
        for kind, k in r["by_kind"].items()
    ]
    if "tenants" in r:
        rows += tenant_rows(r)
    width = max(len(k) for k, _ in rows)
    print("\n" + "soak report".center(width + 20, "-"))
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print()
    header = f"{'worker':<10} {'pid':>8} {'ended by':<9} {'exit':>4} {'RSS start':>10} "
    header += f"{'warm':>8} {'end':>8} {'growth':>15} flag"
    print(header)
    for w in r["workers"]:

        def mib(v: float | None) -> str:
            return "-" if v is None else f"{v:.0f} MiB"

        growth = (
            "-"
            if w.get("growth_mib") is None
            else f"{w['growth_mib']:+.1f} MiB {w['growth_pct']:+.1f}%"
        )
        flag = (
            "GROWING" if w.get("rss_flag") else ("" if w.get("growth_mib") is not None else "n/a")
        )
        exit_code = "-" if w["exit_code"] is None else str(w["exit_code"])
        print(
            f"{w['name']:<10} {w['pid']:>8} {w['ended_by']:<9} {exit_code:>4} "
            f"{mib(w.get('rss_start_mib')):>10} {mib(w.get('rss_warm_mib')):>8} "
            f"{mib(w.get('rss_end_mib')):>8} {growth:>15} {flag}"
        )
    verdict = "PASS" if r["passed"] else "FAIL"
    print(
        f"\n{verdict}: {r['answered']} of {r['jobs_in']} jobs answered, "
        f"{r['duplicates']} duplicated, {r['missing']} missing, {r['unexpected']} unexpected"
    )
    if "tenants" in r:
        v, m = r["tenants"][VICTIM], r["tenants"][MALLORY]
        print(
            f"tenants: victim {v['answered']} of {v['jobs_in']} answered, mallory "
            f"{m['answered']} of {m['jobs_in']} (and {m['trimmed_by_tenant']} trimmed by "
            f"itself), {len(r['tenant_failures'])} failures"
        )


def tenant_rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    """The tenants' lines of the table: each one's accounting, the victim's latency, the
    attacks and what the attempts beyond mallory's keys were answered."""
    victim, mallory = r["tenants"][VICTIM], r["tenants"][MALLORY]
    attacks = r["tenant_attacks"]

    def outcome(t: dict[str, Any]) -> str:
        return (
            f"{t['jobs_in']} entries, {t['answered']} answered, {t['duplicates']} duplicated, "
            f"{t['missing']} missing, {t['unexpected']} unexpected"
        )

    def ms(q: dict[str, Any]) -> str:
        if not q.get("n"):
            return "no jobs"
        return f"{q['p50']} / {q['p99']} ms p50 / p99 (max {q['max']}, {q['n']} jobs)"

    latency = victim["latency_ms"]
    rows = [
        ("tenant victim", outcome(victim)),
        ("  latency, whole run", ms(latency["all"])),
    ]
    if "during_same_tail" in latency:
        during = latency["during_same_tail"]
        rows += [
            (
                "  while same-tail PNGs decode",
                f"{ms(during)}, {during['window_s']} s window",
            ),
            ("  outside that window", ms(latency["outside_same_tail"])),
            ("  sent right behind them", ms(latency["probes_behind_same_tail"])),
        ]
    rows += [
        ("tenant mallory", outcome(mallory)),
        ("  trimmed_by_tenant", f"{mallory['trimmed_by_tenant']} (its own, never read)"),
        ("  refused: stream closed", str(mallory["refused_stream_closed"])),
    ]
    rows += [
        (f"  {kind}", f"{k['in']} / {k['answered_once']} / {k['as_expected']} ({k['expected']})")
        for kind, k in mallory["by_kind"].items()
    ]
    for a in attacks["done"]:
        summary = {
            "tenant_trim": lambda a: f"MAXLEN 0 after {a['burst']}: {a['trimmed']} trimmed",
            "tenant_minid": lambda a: f"MINID a day ahead: {a['trimmed']} trimmed",
            "long_script": lambda a: (
                f"{a['held_s']} s past 200 ms, BUSY seen: {a['busy_seen']}, workers alive "
                f"after: {len(a['workers_alive_after'])}"
            ),
            "same_tail_images": lambda a: f"{a['images']} PNGs of {a['bytes_each']} bytes",
            "tenant_last_id": lambda a: f"closed for good: {a['closed_for_good']}",
        }[a["kind"]](a)
        rows.append((f"attack {a['kind']}@{a['at_s']}s", summary))
    not_refused = attacks["not_refused"]
    rows.append(
        (
            "mallory beyond its keys",
            f"{attacks['refused_noperm']} of {attacks['attempts_on_others']} refused NOPERM"
            + (f"; NOT: {', '.join(not_refused)}" if not_refused else ""),
        )
    )
    rows += [("TENANT FAILURE", f) for f in r["tenant_failures"]]
    return rows


# ----------------------------------------------------------------------------- cluster
def cluster_main(args: SoakArgs) -> int:
    """The cluster variant: sharded job streams on a real cluster, a master killed."""
    from redis.cluster import RedisCluster as ClusterClient

    from producer.client import Job, Producer
    from tests.support.redis_cluster import RedisCluster, ResultWatcher

    work = args.workdir.resolve() / "cluster"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    (work.parent / ".gitignore").write_text("*\n")
    print("starting a Redis Cluster (3 masters, 1 replica each) ...", flush=True)
    cluster = RedisCluster(work / "redis").start()
    procs: list[WorkerProcess] = []
    try:
        env = worker_env(
            cluster.url,
            "none",
            GPUFEED_MODEL="null",
            GPUFEED_WEIGHTS="none",
            GPUFEED_BATCH_SIZE=str(args.batch_size),
            GPUFEED_DEVICE="cpu",
            GPUFEED_SHARDS=str(args.shards),
            GPUFEED_WAIT_REPLICAS=str(args.wait_replicas),
            GPUFEED_VISIBILITY_TIMEOUT_S=str(args.visibility_timeout),
            GPUFEED_TUNING=(
                f"claim_interval_s=1,consumer_expiry_s={max(30.0, args.visibility_timeout)}"
            ),
        )
        if args.shards == 1:
            # One shard on a cluster: the four names in one slot.
            env.update(
                GPUFEED_STREAM="{gpufeed}:jobs",
                GPUFEED_RESULTS_STREAM="{gpufeed}:results",
                GPUFEED_RESULT_PREFIX="{gpufeed}:result:",
                GPUFEED_DEAD_STREAM="{gpufeed}:dead",
            )
        names = {
            "stream": env.get("GPUFEED_STREAM", "gpufeed:jobs"),
            "results_stream": env.get("GPUFEED_RESULTS_STREAM", "gpufeed:results"),
            "result_prefix": env.get("GPUFEED_RESULT_PREFIX", "gpufeed:result:"),
            "dead_stream": env.get("GPUFEED_DEAD_STREAM", "gpufeed:dead"),
        }
        print(f"starting {args.workers} workers ...", flush=True)
        procs = [
            WorkerProcess(f"soak-c{i}", env, work / "logs" / f"soak-c{i}.log").start()
            for i in range(args.workers)
        ]
        wait_ready(procs, timeout_s=180)
        client = ClusterClient.from_url(cluster.url)
        producer = Producer(client, shard_count=args.shards, **names)
        streams = [s.results_stream for s in producer.shards]
        image = jpeg_bytes(64, 48, seed=args.seed)
        ids = [f"c{i}" for i in range(args.jobs)]
        failover: dict[str, Any] = {}
        with ResultWatcher(cluster.url, streams) as watcher:
            t0 = time.monotonic()
            for i in range(0, len(ids), 500):
                producer.submit_many([Job(image=image, id=j) for j in ids[i : i + 500]])
            print(f"submitted {len(ids)} jobs over {args.shards} shard(s)", flush=True)
            if not args.no_faults:
                while len(watcher.seen) < len(ids) // 2:
                    time.sleep(0.01)
                failover["at_s"] = round(time.monotonic() - t0, 2)
                failover["answered_before"] = len(watcher.seen)
                started = time.monotonic()
                victim = cluster.kill_master_of(producer.shards[0].stream)
                failover["killed_port"] = victim.port
                failover["took_s"] = round(time.monotonic() - started, 2)
                print(f"killed the master of {producer.shards[0].stream}", flush=True)
            url = next(n for n in cluster.nodes if n.running).url
            after = Producer(ClusterClient.from_url(url), shard_count=args.shards, **names)
            timeout_s = args.timeout_s or 300 + 0.02 * args.jobs
            results = after.wait(ids, timeout_s=timeout_s, raise_on_timeout=False)
            elapsed = time.monotonic() - t0
            time.sleep(args.settle_s)
            tally = watcher.report()
        exit_codes = stop_all(procs)
    finally:
        for proc in procs:
            if proc.alive:
                proc.kill()
        cluster.stop()
    report = {
        "variant": "cluster",
        "shards": args.shards,
        "workers": args.workers,
        "wait_replicas": args.wait_replicas,
        "jobs_in": len(ids),
        "answered": len(results),
        "ok": sum(1 for r in results.values() if r.ok),
        "missing": len(ids) - len(results),
        **tally,
        "failover": failover or None,
        "elapsed_s": round(elapsed, 2),
        "jobs_per_s": round(len(results) / elapsed, 1),
        "worker_exit_codes": exit_codes,
    }
    report["passed"] = report["missing"] == 0 and report["ok"] == len(ids)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    verdict = "PASS" if report["passed"] else "FAIL"
    print(
        f"\n{verdict}: {report['answered']} of {report['jobs_in']} jobs answered, "
        f"{report['duplicates']} answered twice, {report['lost']} results lost in the "
        f"failover, {report['jobs_per_s']} jobs/s"
    )
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

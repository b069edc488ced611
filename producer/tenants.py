"""Where a tenant's keys live: a job stream, results stream and result hashes of its own.

Redis ACLs cannot restrict what an XADD says (MAXLEN, MINID, an explicit last ID), so a
tenant that may add to a stream may also trim it or close it for good. Isolation is therefore
in the key layout: each tenant submits to a job stream of its own and its Redis user names
only its own keys; what it does to its stream reaches only its own jobs. Tenant `a` has

    job stream      <GPUFEED_STREAM>:t:a           gpufeed:jobs:t:a
    its levels      <GPUFEED_STREAM>:t:a:<level>   gpufeed:jobs:t:a:high
    results stream  <GPUFEED_RESULTS_STREAM>:t:a   gpufeed:results:t:a
    its own streams <GPUFEED_RESULTS_STREAM>:t:a:* gpufeed:results:t:a:batch:...
    result hashes   <GPUFEED_RESULT_PREFIX>t:a:    gpufeed:result:t:a:<id>

A tenant job's `reply_to` must be its results stream or lie under it (`...:t:a:<anything>`),
so it can neither answer into another tenant's stream nor reach a key gpufeed owns. The
dead-letter stream stays the operator's. With shards each name takes the shard's hash tag
as the plain names do (producer/shards.py), so a shard's publish script still touches one
slot.

Workers read every tenant named in GPUFEED_TENANTS and take from them in turn, by weight
(worker/config/lanes.py). This module is torch-free: producers and workers both import it.
"""

from __future__ import annotations

import re
from dataclasses import replace

from producer import wire
from producer.shards import Shard, layout

# What a tenant's name may hold: no ':' (its keys' patterns end in ':*'), no glob or
# hash-tag characters (ACL key patterns, cluster slots), short enough for a key.
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MARK = ":t:"
MAX_TENANTS = 1024
MAX_WEIGHT = 1000


class TenantError(ValueError):
    """A tenant name or GPUFEED_TENANTS cannot be used (one line, for the operator)."""


def check_name(name: str) -> str:
    if not NAME.fullmatch(name):
        raise TenantError(
            f"tenant {name!r}: a name is 1 to 64 letters, digits, '_' or '-' (it becomes "
            "part of key names and of ACL key patterns)"
        )
    return name


def parse(spec: str) -> list[tuple[str, int]]:
    """GPUFEED_TENANTS: `name[=weight],...` in order, e.g. `acme=3,globex`; weight 1 unless
    given. Empty: no tenants."""
    out: list[tuple[str, int]] = []
    seen: set[str] = set()
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        name, _, weight = part.partition("=")
        name = check_name(name.strip())
        if name in seen:
            raise TenantError(f"tenant {name!r} is named twice")
        seen.add(name)
        weight = weight.strip()
        # ASCII digits only (int() also takes other scripts' digits and underscores), and
        # few of them (int() refuses thousands).
        if weight and not re.fullmatch(r"[0-9]{1,4}", weight):
            raise TenantError(f"tenant {name!r}: weight {weight[:20]!r} is not a whole number")
        w = int(weight) if weight else 1
        if not 1 <= w <= MAX_WEIGHT:
            raise TenantError(f"tenant {name!r}: weight must be between 1 and {MAX_WEIGHT}")
        out.append((name, w))
    if len(out) > MAX_TENANTS:
        raise TenantError(f"at most {MAX_TENANTS} tenants (got {len(out)})")
    return out


def names(
    tenant: str,
    *,
    stream: str = wire.DEFAULT_STREAM,
    results_stream: str = wire.DEFAULT_RESULTS_STREAM,
    result_prefix: str = wire.DEFAULT_RESULT_PREFIX,
) -> tuple[str, str, str]:
    """The tenant's job stream, results stream and result prefix, before any shard tag."""
    check_name(tenant)
    return (
        f"{stream}{MARK}{tenant}",
        f"{results_stream}{MARK}{tenant}",
        f"{result_prefix}{MARK.lstrip(':')}{tenant}:",
    )


def tenant_layout(
    tenant: str,
    shards: int,
    *,
    stream: str = wire.DEFAULT_STREAM,
    results_stream: str = wire.DEFAULT_RESULTS_STREAM,
    result_prefix: str = wire.DEFAULT_RESULT_PREFIX,
    dead_stream: str = wire.DEFAULT_DEAD_STREAM,
) -> list[Shard]:
    """The tenant's keys on every shard; "" is the operator's own (the names as set)."""
    if not tenant:
        return layout(
            shards,
            stream=stream,
            results_stream=results_stream,
            result_prefix=result_prefix,
            dead_stream=dead_stream,
        )
    t_stream, t_results, t_prefix = names(
        tenant, stream=stream, results_stream=results_stream, result_prefix=result_prefix
    )
    # The dead letters stay the operator's: the shard's own stream, in the shard's slot.
    dead = [s.dead_stream for s in layout(shards, stream=stream, dead_stream=dead_stream)]
    return [
        replace(shard, dead_stream=d, tenant=tenant)
        for shard, d in zip(
            layout(shards, stream=t_stream, results_stream=t_results, result_prefix=t_prefix),
            dead,
            strict=True,
        )
    ]


def reply_problem(reply_to: str, keys: Shard) -> str | None:
    """Why a job of tenant `keys.tenant` may not be answered on `reply_to`; None when it
    may (its results stream, or a name under it)."""
    own = keys.results_stream
    # A shard's results stream ends in its hash tag; names under the tenant's are told by
    # the name before it (a client's own stream takes the tag at its end: Shard.reply_stream).
    base = own.removesuffix(f":{{{keys.tag}}}") if keys.tag else own
    if not keys.tenant or reply_to == own or reply_to.startswith(base + ":"):
        return None
    return (
        f"reply_to {reply_to!r} is not one of tenant {keys.tenant!r}'s streams: a job read "
        f"from {keys.stream} is answered on {own} or a stream whose name starts with "
        f"'{base}:'"
    )

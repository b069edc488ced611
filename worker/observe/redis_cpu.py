"""What Redis itself spends: redis-server's CPU read from `INFO cpu`, so a tool can say what
each job cost Redis on any server it can reach (local or not), and how many such jobs one
Redis serves with its command thread busy all the time."""

from __future__ import annotations

from typing import Any


async def redis_cpu_s(client: Any) -> tuple[float, bool] | None:
    """redis-server's CPU seconds so far: its main thread's where the server says (Redis 6+;
    the thread that runs every command), else the whole process's; and which. None when
    INFO does not answer (an ACL user without it, a proxy)."""
    try:
        info = await client.info("cpu")
    except Exception:  # noqa: BLE001 - a figure not measured, never a failed tool
        return None
    return cpu_of_info(info)


def cpu_of_info(info: Any) -> tuple[float, bool] | None:
    """redis-server's CPU seconds in an `INFO cpu` reply, and whether they are its main
    thread's (see `redis_cpu_s`); None when the reply lacks them."""
    try:
        if "used_cpu_user_main_thread" in info:
            return info["used_cpu_user_main_thread"] + info["used_cpu_sys_main_thread"], True
        return info["used_cpu_user"] + info["used_cpu_sys"], False
    except (KeyError, TypeError):
        return None


def redis_cost(
    before: tuple[float, bool] | None, after: tuple[float, bool] | None, jobs: int
) -> dict[str, Any]:
    """µs of Redis CPU per job between two readings, whether it is the command thread's,
    and 1e6 / µs: the most such jobs/s one Redis serves. Nones where not measured."""
    if before is None or after is None or jobs <= 0:
        return dict.fromkeys(
            ("redis_cpu_us_per_job", "redis_cpu_main_thread", "redis_jobs_per_s_max")
        )
    us = round(1e6 * max(0.0, after[0] - before[0]) / jobs, 1)
    return {
        "redis_cpu_us_per_job": us,
        "redis_cpu_main_thread": before[1] and after[1],
        "redis_jobs_per_s_max": round(1e6 / us) if us else None,
    }

"""The hot list section: the fleet's hot list in the configured Redis (what a worker with
these settings would warm before it joins the group; worker/lifecycle/warm_start.py)."""

from __future__ import annotations

from typing import Any

from producer.shards import connect_async
from worker.config.settings import WorkerConfig
from worker.delivery.hot_list import HotList, hot_list_key
from worker.delivery.redis_errors import ANY, FAILING_OVER
from worker.lifecycle.wiring import hot_list_off

# The best entries shown.
SHOWN = 5


async def hot_list_section(config: WorkerConfig, redis_answers: bool) -> dict[str, Any]:
    """`redis_answers`: the configured Redis answered (doctor's run used it)."""
    section: dict[str, Any] = {
        "key": hot_list_key(config.stream),
        "size": config.hot_list,
        "warm_start_s": config.warm_start_s,
        "off": hot_list_off(config),
        "images": None,
        "top": [],
        "not_measured": [],
    }
    if section["off"]:
        return section
    if not redis_answers:
        section["not_measured"].append(
            f"the configured Redis ({config.redacted_url()}) did not answer"
        )
        return section
    try:
        client = await connect_async(config.redis_url, socket_connect_timeout=2)
    except (*ANY, *FAILING_OVER) as exc:
        section["not_measured"].append(f"Redis: {exc}")
        return section
    try:
        hot = HotList(client, config.stream, config.hot_list)
        section["images"] = await hot.count()
        section["top"] = [e.as_dict() for e in await hot.top(SHOWN)]
    except (*ANY, *FAILING_OVER) as exc:
        section["not_measured"].append(f"the hot list could not be read: {exc}")
    finally:
        await client.aclose()
    return section

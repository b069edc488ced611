"""The two shapes the end-to-end tests run in (`host_shape`, tests/support/worker_harness.py) are
the ones `auto` picks: a small host's below 4 cores, a GPU host's on 16 cores with CUDA.
The shapes pin their settings so that they run whatever the cores here; should `auto`
change what a GPU host runs, this fails rather than CI testing a shape no host runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.worker_harness import GPU_HOST, HOST_SHAPES, SMALL_HOST
from worker.config.settings import WorkerConfig
from worker.lifecycle.feed_plan import FeedPlan, decode_processes_for, plan_feed
from worker.model.resample import choose_placement

URL = "redis://127.0.0.1:1/0"


def planned(cfg: WorkerConfig, *, cores: int, device: str) -> FeedPlan:
    """The plan start-up makes for `cfg` on a host of `cores` and `device`."""
    processes, _ = decode_processes_for(cfg, cores)
    placement, why = choose_placement(cfg.resize, torch.device(device), cfg.decode, processes)
    return plan_feed(
        cfg,
        placement=placement,
        placement_why=why,
        thread_only_hook=False,
        default_threads=2,
        cores=cores,
    )


def shape_of(plan: FeedPlan) -> dict[str, object]:
    return {
        "decoders": "processes" if plan.decode_processes else "threads",
        "intake": plan.intake,
        "result_writer": plan.result_writer,
        "placement": plan.placement,
        "packed": plan.packed,
    }


@pytest.mark.parametrize(
    ("name", "cores", "device", "asked"),
    [(SMALL_HOST, 2, "cpu", {}), (GPU_HOST, 16, "cuda", {"decode": "gpu"})],
)
def test_each_shape_is_what_auto_picks_on_its_host(
    name: str, cores: int, device: str, asked: dict[str, str], tmp_path: Path
) -> None:
    """`asked`: what an operator sets on that host beyond the defaults (GPU decode)."""
    weights = tmp_path / "w.pt"
    values = {"redis_url": URL, "weights": str(weights), **asked}
    operators = WorkerConfig.load(env={}, overrides=values)
    shape = HOST_SHAPES[name]
    # The shape's settings decide, whatever the cores: here 2, as on the CI box.
    pinned = planned(shape.config(URL, weights), cores=2, device="cpu")
    assert shape_of(pinned) == shape_of(planned(operators, cores=cores, device=device))

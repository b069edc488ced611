"""What the tools (doctor, bench, GPU check, harness) see of a running worker: its report
(worker/lifecycle/report.py), and no property of Worker that merely forwards to a part."""

from __future__ import annotations

import ast
import inspect
import os
from pathlib import Path

import pytest
import torch

from tests.support.worker_harness import running_worker, tiny_config
from worker.delivery.redis_check import RedisUnavailable
from worker.lifecycle import service
from worker.lifecycle.service import Worker


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_a_worker_on_decode_threads_reports_what_it_was_configured_with(
    redis_url: str, tiny_weights: Path
) -> None:
    async with running_worker(
        redis_url,
        tiny_weights,
        batch_size=4,
        device="cpu",
        resize="host",
        decode="cpu",
        decode_threads=3,
        decode_processes="0",
        intake="loop",
        result_writer="loop",
    ) as worker:
        report = worker.report()
    assert (report.model, report.kind, report.input_size) == ("mobilenet_v3_small", "classify", 64)
    assert (report.batch_size, report.device, report.device_name) == (4, torch.device("cpu"), "cpu")
    assert (report.placement, report.row_side) == ("host", 0)
    assert (report.decoders, report.decode_threads, report.decoder_pids) == ("threads", 3, ())
    assert (report.writer_pids, report.intake_pids) == ((), ())
    assert report.plan.line().startswith("3 decode threads")
    assert report.degraded_model is None
    assert report.compile_report.mode == "off"  # compile=auto is off on the CPU


@pytest.mark.slow
async def test_a_worker_on_decode_processes_reports_them_and_its_other_processes(
    redis_url: str, tiny_weights: Path
) -> None:
    async with running_worker(
        redis_url,
        tiny_weights,
        batch_size=2,
        resize="device",
        decode="cpu",
        decode_threads=0,
        decode_processes="2",
        intake="process",
        result_writer="process",
        degrade_after_s=3600.0,
        degrade_input_size=32,
    ) as worker:
        report = worker.report()
        processes = [*report.decoder_pids, *report.writer_pids, *report.intake_pids]
        assert all(map(_alive, processes))
    assert (report.batch_size, report.placement) == (2, "device")
    assert report.row_side > 0 and report.ring_side >= report.row_side
    assert (report.decoders, report.decode_threads, len(report.decoder_pids)) == ("processes", 2, 2)
    # One result writer's process, one intake's per shard (one shard here).
    assert (len(report.writer_pids), len(report.intake_pids)) == (1, 1)
    assert len(set(processes)) == 4 and os.getpid() not in processes
    assert report.degraded_model == "mobilenet_v3_small@32"


async def test_before_redis_answers_the_report_has_the_model_side_alone(
    tiny_weights: Path,
) -> None:
    """The doctor's run without Redis: the model warmed up, no stages to report."""
    worker = Worker(tiny_config("redis://127.0.0.1:1/0", tiny_weights, batch_size=4))
    try:
        with pytest.raises(RedisUnavailable):
            await worker.startup(wait_for_redis=False)
        report = worker.report()
    finally:
        await worker.shutdown()
    assert (report.batch_size, report.device, report.decoders) == (
        4,
        torch.device("cpu"),
        "threads",
    )
    assert (report.writer_pids, report.intake_pids) == ((), ())


def _only_return(fn: ast.FunctionDef) -> ast.expr | None:
    """What `fn` returns where that is all it does (its docstring aside)."""
    body = fn.body[1:] if ast.get_docstring(fn) is not None else fn.body
    match body:
        case [ast.Return(value=ast.expr() as value)]:
            return value
    return None


def _forwards(node: ast.expr | None) -> bool:
    """`self.a.b...` (two attributes or more), an item of one, or a choice between them and
    None: what reads another object's attribute and adds nothing."""
    if isinstance(node, ast.IfExp):
        return all(
            _forwards(branch) or (isinstance(branch, ast.Constant) and branch.value is None)
            for branch in (node.body, node.orelse)
        )
    if isinstance(node, ast.Subscript):
        return _forwards(node.value)
    depth = 0
    while isinstance(node, ast.Attribute):
        node, depth = node.value, depth + 1
    return isinstance(node, ast.Name) and node.id == "self" and depth >= 2


def test_worker_has_no_property_that_merely_forwards_to_a_part() -> None:
    """The tools read the worker's figures from its report and its parts from their owners
    (engine.model, engine.feed, stages): a property of Worker does more than return
    `self._engine.x`."""
    tree = ast.parse(inspect.getsource(service))
    (worker,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Worker"]
    properties = [
        f
        for f in worker.body
        if isinstance(f, ast.FunctionDef)
        and any(isinstance(d, ast.Name) and d.id == "property" for d in f.decorator_list)
    ]
    forwarding = [p.name for p in properties if _forwards(_only_return(p))]
    assert forwarding == []
    # What remains: the parts start-up built, each an AttributeError until it is built.
    assert sorted(p.name for p in properties) == ["engine", "link", "stages"]

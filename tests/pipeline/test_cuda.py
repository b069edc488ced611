"""The CUDA hot path on a real GPU (skipped without one; `make gpu-check` runs them).

- the asynchronous pipeline gives the same results as a fully synchronised run;
- N batches through the compiled, graph-replaying step raise nothing under
  torch.cuda.set_sync_debug_mode("error"), with Tensor.to / copy_ wrapped to reject any
  host-to-device copy from pageable memory (which that mode does not see);
- CUDA-graph replays are counted, and a step inductor will not graph is refused;
- a pinned slot is never handed out again before its copy finished (poison and check),
  also when the launch fails after the copy was queued;
- fp16 / bf16 agree with fp32 eager;
- a real Worker on CUDA answers from Redis like the CPU reference.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import torch

from tests.model.test_step import random_batch, tiny_step
from worker.base.device import make_context
from worker.decode.cpu import DecodeInfo
from worker.decode.executor import DecodeResult
from worker.jobs import Job
from worker.model.compiler import (
    CompileRefused,
    compile_step,
    count_cudagraph_replays,
    still_compiled,
)
from worker.model.precision import precision_check
from worker.model.sizes import BatchSizes
from worker.model.step import InferenceStep
from worker.pipeline.batcher import Batch
from worker.pipeline.launch import Launched, LaunchFailed, ModelRunner
from worker.pipeline.staging import InputRing, OutputRing
from worker.pipeline.transfer import DeviceTransfer

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

B, S, K = 8, 20, 3
OK = DecodeResult(DecodeInfo("JPEG", S, S, 1), None, 0.0)


def cuda_step(dtype: torch.dtype = torch.float32) -> InferenceStep:
    return tiny_step(dtype, top_k=K).to(torch.device("cuda", 0))


class Pipeline:
    """The worker's hot path without Redis: rings, transfer, runner, as service.py wires
    them (dispatcher: launch, then release the slot after its copy)."""

    def __init__(
        self, step: Any, *, slots: int = 3, compile_mode: str = "off", sizes: tuple[int, ...] = ()
    ) -> None:
        self.device = torch.device("cuda", 0)
        self.ctx = make_context(self.device)
        self.ring = InputRing(slots, B, S, pin=True)
        self.out_ring = OutputRing(slots, B, K, pin=True)
        self.transfer = DeviceTransfer(self.ctx, slots, B, S)
        cudagraphs = compile_mode == "reduce-overhead"
        self.runner = ModelRunner(self.ctx, step, self.transfer, cudagraphs=cudagraphs)
        self.report = None
        if compile_mode != "off":
            example = torch.zeros((B, S, S, 3), dtype=torch.uint8, device=self.device)

            def compile_here() -> None:
                fn, report = compile_step(
                    step, example, mode=compile_mode, allow_eager_fallback=False, sizes=sizes
                )
                self.runner.step = fn
                self.report = report

            self.runner.run_sync(compile_here)
        self.runner.sizes = BatchSizes((*sizes, B))
        self._seq = 0

    async def launch(
        self, pixels: np.ndarray, *, before_copy: Any = None, rows: int = B
    ) -> Launched:
        """Launch a batch of `rows` jobs (the first rows of `pixels`; the rest padding)."""
        slot = await self.ring.acquire()
        slot.array[:] = pixels
        loop = asyncio.get_running_loop()
        futures = []
        for _ in range(rows):
            f: asyncio.Future[DecodeResult] = loop.create_future()
            f.set_result(OK)
            futures.append(f)
        self._seq += 1
        jobs = [
            Job.new(
                entry_id=f"0-{i}", job_id=f"j{i}", reply_to="r", meta=None, image=b"", path=None
            )
            for i in range(rows)
        ]
        batch = Batch(seq=self._seq, slot=slot, jobs=jobs, futures=futures, opened_s=0.0)
        await batch.decoded()
        if before_copy is not None:
            before_copy()
        out = await self.out_ring.acquire()
        launched = await self.runner.launch(batch, out)
        batch.slot.copy_done = launched.copied
        self.ring.release_after_copy(batch.slot)
        return launched

    async def collect(self, launched: Launched) -> tuple[np.ndarray, np.ndarray]:
        while not launched.done.query():  # noqa: ASYNC110 - what the completion watcher does
            await asyncio.sleep(0.0005)
        result = launched.out.indices_np.copy(), launched.out.scores_np.copy()
        self.out_ring.release(launched.out)
        return result

    def close(self) -> None:
        self.runner.shutdown()


def reference(step: InferenceStep, pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Fully synchronised, eager: copy, compute, synchronize, read."""
    x = torch.from_numpy(pixels).to("cuda")
    with torch.inference_mode():
        idx, sc = step(x)
    torch.cuda.synchronize()
    return idx.cpu().numpy(), sc.cpu().numpy()


def batches(n: int) -> list[np.ndarray]:
    return [random_batch(B, S, seed=i).numpy() for i in range(n)]


async def run_pipelined(pipe: Pipeline, inputs: list[np.ndarray]) -> list[tuple[Any, Any]]:
    """Launch as far ahead as the output ring allows; collect in launch order."""
    pending: list[Launched] = []
    results = []
    for pixels in inputs:
        if pipe.out_ring.free_count == 0:
            results.append(await pipe.collect(pending.pop(0)))
        pending.append(await pipe.launch(pixels))
    for launched in pending:
        results.append(await pipe.collect(launched))
    return results


@pytest.mark.parametrize("compile_mode", ["off", "reduce-overhead"])
async def test_async_pipeline_equals_synchronised_run(compile_mode: str) -> None:
    step = cuda_step()
    pipe = Pipeline(step, compile_mode=compile_mode)
    try:
        inputs = batches(10)
        got = await run_pipelined(pipe, inputs)
        for pixels, (idx, sc) in zip(inputs, got, strict=True):
            ref_idx, ref_sc = reference(step, pixels)
            np.testing.assert_allclose(sc, ref_sc, atol=1e-4, rtol=1e-4)
            assert (idx[:, 0] == ref_idx[:, 0]).mean() >= 0.99
    finally:
        pipe.close()


@contextlib.contextmanager
def reject_pageable_h2d() -> Iterator[list[str]]:
    """Fail any Tensor.to / copy_ that moves pageable host memory to the GPU."""
    seen: list[str] = []
    original_copy, original_to = torch.Tensor.copy_, torch.Tensor.to

    def check(src: torch.Tensor, dst_device: torch.device | None) -> None:
        if dst_device is not None and dst_device.type == "cuda" and src.device.type == "cpu":
            if not src.is_pinned():
                seen.append("pageable")
                raise AssertionError("host-to-device copy from pageable memory")
            seen.append("pinned")

    def copy_(self: torch.Tensor, src: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        check(src, self.device)
        return original_copy(self, src, *args, **kwargs)

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        parsed = torch._C._nn._parse_to(*args, **kwargs)
        check(self, parsed[0])
        return original_to(self, *args, **kwargs)

    torch.Tensor.copy_ = copy_  # type: ignore[method-assign]
    torch.Tensor.to = to  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        torch.Tensor.copy_ = original_copy  # type: ignore[method-assign]
        torch.Tensor.to = original_to  # type: ignore[method-assign]


async def test_hot_path_has_no_host_sync_and_no_pageable_copy() -> None:
    step = cuda_step()
    pipe = Pipeline(step, compile_mode="reduce-overhead")
    assert pipe.report is not None and pipe.report.compiled, pipe.report
    inputs = batches(12)
    previous = torch.cuda.get_sync_debug_mode()
    try:
        with reject_pageable_h2d() as copies:
            torch.cuda.set_sync_debug_mode("error")
            try:
                launched = [await pipe.launch(p) for p in inputs[:3]]
                results = [await pipe.collect(x) for x in launched]
                for pixels in inputs[3:]:
                    results.append(await pipe.collect(await pipe.launch(pixels)))
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        assert "pinned" in copies and "pageable" not in copies
        assert len(results) == len(inputs)
        assert still_compiled(pipe.report) == [], "the hot path recompiled"
    finally:
        pipe.close()


async def test_wrapper_catches_a_pageable_copy() -> None:
    x = torch.zeros(4)
    with reject_pageable_h2d(), pytest.raises(AssertionError, match="pageable"):
        x.to("cuda", non_blocking=True)


async def test_each_batch_size_replays_one_graph_with_no_host_sync() -> None:
    """Batches of 1 to B jobs run on shapes 1, 4 and B (batch_sizes=1,4), each one
    graph replay, with no host sync and no recompile, and give the synchronised run's
    answers for their rows."""
    step = cuda_step()
    pipe = Pipeline(step, compile_mode="reduce-overhead", sizes=(1, 4))
    assert pipe.report is not None and pipe.report.compiled, pipe.report
    assert sorted(pipe.report.size_costs) == [1, 4, B]
    counts = [1, 3, B, 1, 5, 4, 2, B]
    inputs = batches(len(counts))
    previous = torch.cuda.get_sync_debug_mode()
    try:
        with count_cudagraph_replays() as replays:
            torch.cuda.set_sync_debug_mode("error")
            try:
                results = []
                for pixels, rows in zip(inputs, counts, strict=True):
                    launched = await pipe.launch(pixels, rows=rows)
                    assert launched.size == {1: 1, 2: 4, 3: 4, 4: 4}.get(rows, B)
                    results.append(await pipe.collect(launched))
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        assert replays.count == len(counts)
        assert still_compiled(pipe.report) == [], "a batch size recompiled"
        for pixels, rows, (idx, sc) in zip(inputs, counts, results, strict=True):
            ref_idx, ref_sc = reference(step, pixels)
            np.testing.assert_allclose(sc[:rows], ref_sc[:rows], atol=1e-4, rtol=1e-4)
            assert (idx[:rows, 0] == ref_idx[:rows, 0]).mean() >= 0.99
    finally:
        pipe.close()


def test_compile_counts_replays_and_takes_no_skips() -> None:
    device = torch.device("cuda", 0)
    step = cuda_step()
    example = torch.zeros((B, S, S, 3), dtype=torch.uint8, device=device)
    with count_cudagraph_replays() as replays:
        fn, report = compile_step(
            step, example, mode="reduce-overhead", allow_eager_fallback=False, warmup_iters=3
        )
        with torch.inference_mode():
            for _ in range(3):
                torch.compiler.cudagraph_mark_step_begin()
                fn(example)
    assert report.compiled and report.cudagraph_skips == []
    assert report.cudagraph_replays >= 1
    assert replays.count >= report.cudagraph_replays + 3


class CpuTensorInside(torch.nn.Module):
    """Inductor will not CUDA-graph a graph with a CPU op in it."""

    def __init__(self, step: InferenceStep) -> None:
        super().__init__()
        self.step = step

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        indices, scores = self.step(x)
        return indices.cpu(), scores


def test_a_cudagraph_skip_refuses_to_start() -> None:
    """The step is compiled without graph partitions: a CPU op skips CUDA graphs, which is
    logged and refused."""
    device = torch.device("cuda", 0)
    example = torch.zeros((B, S, S, 3), dtype=torch.uint8, device=device)
    with pytest.raises(CompileRefused, match="skipping cudagraphs"):
        compile_step(
            CpuTensorInside(cuda_step()).eval(),
            example,
            mode="reduce-overhead",
            allow_eager_fallback=False,
        )


def test_a_partitioned_step_refuses_to_start() -> None:
    """With inductor's graph partitioning on (its default since torch 2.9) the CPU op is cut
    out without any skip: the partition counter still refuses the step."""
    device = torch.device("cuda", 0)
    example = torch.zeros((B, S, S, 3), dtype=torch.uint8, device=device)
    with pytest.raises(CompileRefused, match="partitions"):
        compile_step(
            CpuTensorInside(cuda_step()).eval(),
            example,
            mode="reduce-overhead",
            allow_eager_fallback=False,
            inductor_overrides={"graph_partition": True},
        )


async def test_pinned_slot_not_reused_before_its_copy_finished() -> None:
    """Stall the copy stream so each copy is still queued when the next batch wants a slot;
    then poison the slot the moment the ring hands it out. A slot handed out early would
    corrupt the batch still being copied from it."""
    step = cuda_step()
    pipe = Pipeline(step, slots=2)
    assert pipe.ctx.copy_stream is not None
    copy_stream = pipe.ctx.copy_stream

    def stall() -> None:
        with torch.cuda.stream(copy_stream):
            torch.cuda._sleep(20_000_000)  # ~10 ms of GPU spin ahead of the copy

    try:
        inputs = batches(6)
        waited = 0
        for pixels in inputs:
            launched = await pipe.launch(pixels, before_copy=stall)
            # Take every slot the moment the ring gives it, and poison it: the one just
            # launched must only come back once its (stalled) copy has finished.
            taken = []
            for _ in range(len(pipe.ring.slots)):
                t0 = asyncio.get_running_loop().time()
                slot = await pipe.ring.acquire()
                waited += asyncio.get_running_loop().time() - t0 > 0.002
                slot.array[:] = 0xFF
                taken.append(slot)
            for slot in taken:
                pipe.ring.release_now(slot)
            _, sc = await pipe.collect(launched)
            np.testing.assert_allclose(sc, reference(step, pixels)[1], atol=1e-4, rtol=1e-4)
        assert waited >= len(inputs) // 2, "the stall never made the ring wait: test is void"
    finally:
        pipe.close()


async def test_a_failed_launch_keeps_its_slot_until_the_queued_copy_ran() -> None:
    """The step raises after the copy out of the pinned slot was queued (behind ~100 ms of
    GPU spin): the slot must not be free until that copy ran, and the twin's next user
    must wait for the same fence."""
    pipe = Pipeline(cuda_step(), slots=1)
    assert pipe.ctx.copy_stream is not None

    def out_of_memory(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    pipe.runner.step = out_of_memory
    try:
        slot = await pipe.ring.acquire()
        slot.array[:] = batches(1)[0]
        batch = Batch(seq=1, slot=slot, jobs=[], futures=[], opened_s=0.0)
        with torch.cuda.stream(pipe.ctx.copy_stream):
            torch.cuda._sleep(200_000_000)
        with pytest.raises(LaunchFailed, match="out of memory") as info:
            await pipe.runner.launch(batch, await pipe.out_ring.acquire())
        fence = info.value.fence
        assert pipe.transfer.consumed(slot) is fence
        # What the dispatcher does with a failed launch.
        slot.copy_done = fence
        pipe.ring.release_after_copy(slot)
        assert pipe.ring.free_count == 0, "slot freed while its copy was still queued"
        fence.synchronize()  # type: ignore[attr-defined]  # a test may wait
        pipe.ring.poll()
        assert pipe.ring.free_count == 1
    finally:
        pipe.close()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_agrees_with_fp32(dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        pytest.skip("no bf16 on this GPU")
    report = precision_check(cuda_step(dtype), batch=64, batches=2)
    assert report.top1_agreement_confident >= 0.95, report
    assert report.max_abs_top1_prob_diff < 0.05, report


def test_shared_staging_is_registered_pinned_and_copies_asynchronously() -> None:
    """Decode processes' ring: memfd pages registered with CUDA read as pinned, and a
    non-blocking copy from them on a side stream lands whole."""
    from worker.decode.arena import ArenaLayout, SharedArena
    from worker.pipeline.staging import InputRing, register_pinned, unregister_pinned

    arena = SharedArena.create(ArenaLayout(rows=8, side=32, processes=1))
    register_pinned(arena)
    try:
        ring = InputRing(2, 4, 32, pin=True, arena=arena)
        slot = ring.slots[1]
        assert slot.images.is_pinned()
        slot.array[:] = np.arange(slot.array.size, dtype=np.uint64).reshape(slot.array.shape) % 251
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            on_device = slot.images.to("cuda", non_blocking=True)
        side.synchronize()
        assert torch.equal(on_device.cpu(), slot.images)
        del ring, slot, on_device
    finally:
        unregister_pinned(arena)
        arena.close()


@pytest.mark.parametrize("decode_processes", ["0", "2"])
async def test_worker_on_cuda_matches_the_cpu_reference(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path, decode_processes: str
) -> None:
    from producer.wire import JobResult
    from tests.support.images import jpeg_bytes
    from tests.support.worker_harness import running_worker, wait_results
    from tests.system.test_end_to_end import reference_scores

    images = [jpeg_bytes(200 + 10 * i, 150, seed=i) for i in range(6)]
    async with running_worker(
        redis_url,
        tiny_weights,
        device="cuda",
        batch_size=4,
        compile="auto",
        decode_processes=decode_processes,
    ) as worker:
        report = worker.report()
        assert report.compile_report.compiled
        assert report.decoders == ("processes" if decode_processes != "0" else "threads")
        for i, data in enumerate(images):
            redis_client.xadd("gpufeed:jobs", {"id": f"j{i}", "image": data})
        entries = await wait_results(redis_client, "gpufeed:results", len(images))
    results = {r.id: r for r in (JobResult.from_fields(f) for _, f in entries)}
    assert len(results) == len(images) and all(r.ok for r in results.values())
    expected = reference_scores(tiny_weights, images)
    for i in range(len(images)):
        got = np.array(results[f"j{i}"].details["scores"])
        # bf16/fp16 on the GPU against fp32 on the CPU.
        np.testing.assert_allclose(got, expected[i], atol=0.05)

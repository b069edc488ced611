"""The start-up compile guard: graph breaks, recompiles and the eager rollback, on the CPU.

Compiling is slow on a small CPU, so the compiled cases use a tiny module with
mode="default" (inductor, no CUDA graphs) and are marked slow.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from worker.model.compiler import (
    CompileBaseline,
    CompileRefused,
    CompileReport,
    changes_since,
    compile_step,
    count_cudagraph_replays,
    gate_problems,
    snapshot,
    step_inductor_options,
    still_compiled,
)


class Fixed(nn.Module):
    """x: [B, S, S, 3] uint8 -> (indices [B, 2] int32, scores [B, 2] float32)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.proj(x.float().mean(dim=(1, 2)))
        scores, indices = logits.softmax(-1).topk(2, dim=-1)
        return indices.to(torch.int32), scores


class DataDependent(Fixed):
    """The classic hidden graph break: Python control flow on a tensor's value."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.float().sum() > 0:
            x = x // 2
        return super().forward(x)


def example(b: int = 2, s: int = 4) -> torch.Tensor:
    return torch.randint(0, 256, (b, s, s, 3), dtype=torch.uint8)


def test_off_returns_the_eager_step() -> None:
    step = Fixed().eval()
    fn, report = compile_step(step, example(), mode="off", allow_eager_fallback=False)
    assert fn is step
    assert report.mode == "off" and not report.compiled and report.warmup_s >= 0
    assert still_compiled(report) == []


def test_replay_counter_is_a_no_op_without_graphs() -> None:
    with count_cudagraph_replays() as replays:
        Fixed()(example())
    assert replays.count == 0
    assert torch.cuda.CUDAGraph.replay.__name__ == "replay"  # restored


def test_a_partitioned_graph_is_not_one_graph() -> None:
    """What inductor's graph partitioning leaves behind (no skip, replays happen, but the
    partition counter says the graph was cut) is refused like a skip."""
    clean = CompileReport(mode="reduce-overhead", compiled=True, cudagraph_replays=3)
    assert gate_problems(clean) == []
    split = CompileReport(
        mode="reduce-overhead", compiled=True, cudagraph_replays=3, graph_partitions=2
    )
    problems = gate_problems(split)
    assert len(problems) == 1 and "split into 2 partitions" in problems[0]
    skipped = CompileReport(mode="reduce-overhead", compiled=True, cudagraph_skips=["cpu device"])
    assert gate_problems(skipped) == ["skipping cudagraphs: cpu device"]


def test_a_partition_after_start_up_shows_in_the_running_check() -> None:
    from torch._dynamo.utils import counters

    counters.clear()
    baseline = snapshot()
    report = CompileReport(mode="reduce-overhead", compiled=True, baseline=baseline)
    assert still_compiled(report) == []
    counters["inductor"]["cudagraph_partitions"] += 3  # what inductor does when it splits
    try:
        assert changes_since(baseline)["graph_partitions"] == 3
        assert still_compiled(report) == ["3 graph partitions"]
    finally:
        counters.clear()
    assert isinstance(baseline, CompileBaseline)


def test_the_step_is_compiled_without_graph_partitions() -> None:
    import torch._inductor.config as inductor_config

    options = step_inductor_options("reduce-overhead")
    assert options["triton.cudagraphs"] is True  # what mode="reduce-overhead" means
    assert options.get("graph_partition") is False
    assert hasattr(inductor_config, "graph_partition"), "torch without partitions: recheck"
    assert step_inductor_options("default") == {"graph_partition": False}


@pytest.mark.slow
def test_each_batch_size_compiles_to_one_graph_and_another_shape_is_a_recompile() -> None:
    """Batch 4 and the smaller size 1 (the tuning constant batch_sizes) are compiled at start-up; a
    later call on either is no recompile, a batch of 3 is."""
    step = Fixed().eval()
    fn, report = compile_step(
        step, example(b=4), mode="default", allow_eager_fallback=False, warmup_iters=2, sizes=[1]
    )
    assert report.compiled, report.reason
    assert report.graph_breaks == 0 and report.recompiles == 0
    assert report.graph_partitions == 0
    assert report.inductor_options == {"graph_partition": False}
    assert report.compile_s > 0 and report.baseline is not None
    assert sorted(report.size_costs) == [1, 4]
    assert all(first_s > 0 for first_s, _ in report.size_costs.values())
    assert still_compiled(report) == []
    # Made outside inference mode, like the ring's; size 1 as launches give it, a view of
    # the first row of the slot's buffer.
    same, other = example(b=4), example(b=3)
    with torch.inference_mode():
        assert fn(same)[0].shape == (4, 2)
        assert fn(same[:1])[0].shape == (1, 2)
    assert changes_since(report.baseline)["recompiles"] == 0

    with torch.inference_mode():
        fn(other)  # another batch size: dynamic=False means a new graph
    assert changes_since(report.baseline)["recompiles"] >= 1
    assert any("recompiles" in p for p in still_compiled(report))


@pytest.mark.slow
def test_data_dependent_branch_is_refused() -> None:
    with pytest.raises(CompileRefused) as info:
        compile_step(DataDependent().eval(), example(), mode="default", allow_eager_fallback=False)
    message = str(info.value)
    assert "graph break" in message and "GPUFEED_COMPILE=off" in message


@pytest.mark.slow
def test_data_dependent_branch_falls_back_to_eager_when_allowed() -> None:
    step = DataDependent().eval()
    fn, report = compile_step(step, example(), mode="default", allow_eager_fallback=True)
    assert fn is step
    assert report.fell_back_to_eager and not report.compiled
    assert report.graph_breaks >= 1 and report.reason
    with torch.inference_mode():
        indices, scores = fn(example())
    assert indices.shape == (2, 2) and scores.dtype == torch.float32

"""The step's shape contract, dtype choice, the precision check and the measurement helpers
(direct-feed ceiling, GPU sampler) on the CPU."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from worker.model.ceiling import direct_feed_ceiling
from worker.model.loaded import LoadedModel
from worker.model.precision import precision_check
from worker.model.step import (
    InferenceStep,
    build_step,
    contract_problems,
    crop_offset,
    pick_dtype,
    reference_copy,
    resolve_compile_mode,
)
from worker.observe.gpu_sampler import GpuSampler, percentile, summarize


class TinyNet(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.head = nn.Linear(8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x).relu().mean(dim=(2, 3)))


def tiny_step(dtype: torch.dtype = torch.float32, *, top_k: int = 3) -> InferenceStep:
    torch.manual_seed(0)
    model = TinyNet().to(dtype=dtype).to(memory_format=torch.channels_last)
    return InferenceStep(
        model,
        staging_size=20,
        crop_size=16,
        mean=(0.485, 0.456, 0.406),
        std=(0.229, 0.224, 0.225),
        top_k=top_k,
        dtype=dtype,
    ).eval()


def random_batch(b: int = 4, s: int = 20, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, s, s, 3), dtype=torch.uint8, generator=g)


def test_step_shape_contract() -> None:
    step = tiny_step()
    with torch.inference_mode():
        out = step(random_batch(4))
    assert contract_problems(out, 4, 3) == []
    indices, scores = out
    assert indices.dtype == torch.int32 and scores.dtype == torch.float32
    assert bool((scores[:, :-1] >= scores[:, 1:]).all())  # sorted, as top-k promises
    assert bool(((scores >= 0) & (scores <= 1)).all())


class Seen(nn.Module):
    """Keeps the model's input (the normalised batch) and answers like a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.input = torch.empty(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.input = x
        return x.float().mean(dim=(2, 3)).repeat(1, 4)


@pytest.mark.parametrize("input_side", [0, 24])  # crop only; resize then crop
def test_half_precision_normalisation_rounds_once(input_side: int) -> None:
    """The folded /255 and mean/std constants stay fp32 in a bf16 step: its normalised input
    is the fp32 step's, rounded to bf16 once (bf16 constants and arithmetic would carry a
    gain error of up to 0.2% per channel)."""
    inputs = {}
    for dtype in (torch.float32, torch.bfloat16):
        seen = Seen()
        step = InferenceStep(
            seen, staging_size=20, crop_size=16, mean=(0.485, 0.456, 0.406),
            std=(0.229, 0.224, 0.225), top_k=3, dtype=dtype, input_side=input_side,
        ).eval()  # fmt: skip
        assert step.scale.dtype == step.shift.dtype == torch.float32
        side = input_side or 20
        x = torch.randint(0, 256, (2, side, side, 3), generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            step(x.to(torch.uint8))
        inputs[dtype] = seen.input
    assert inputs[torch.bfloat16].dtype == torch.bfloat16
    assert torch.equal(inputs[torch.bfloat16], inputs[torch.float32].to(torch.bfloat16))


def test_contract_problems_names_what_is_wrong() -> None:
    good = (torch.zeros(4, 3, dtype=torch.int32), torch.zeros(4, 3))
    assert contract_problems(good, 4, 3) == []
    wrong = (torch.zeros(4, 3, dtype=torch.int64), torch.zeros(2, 3))
    problems = contract_problems(wrong, 4, 3)
    assert len(problems) == 2 and "int64" in problems[0] and "(2, 3)" in problems[1]


def test_each_row_gets_its_own_answer() -> None:
    # Padding rows must not leak into real ones: the step is row-independent.
    step = tiny_step()
    x = random_batch(4)
    with torch.inference_mode():
        full_idx, full_sc = step(x)
        for row in range(4):
            idx, sc = step(x[row : row + 1])
            assert torch.equal(idx[0], full_idx[row])
            torch.testing.assert_close(sc[0], full_sc[row])


def test_center_crop_reads_only_the_middle() -> None:
    step = tiny_step()
    x = random_batch(2)
    y = x.clone()
    y[:, :2] = 0  # the 2-pixel border lies outside the 16x16 center crop of 20x20
    y[:, -2:] = 255
    with torch.inference_mode():
        torch.testing.assert_close(step(x)[1], step(y)[1])


class Recorder(nn.Module):
    """A 'model' that keeps the tensor it was given and returns zero logits."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.clone())
        return x.new_zeros((x.shape[0], 4))


@pytest.mark.parametrize(("staging", "crop"), [(20, 17), (21, 16), (256, 225), (20, 16)])
def test_center_crop_is_torchvision_center_crop(staging: int, crop: int) -> None:
    from torchvision.transforms.functional import center_crop

    recorder = Recorder()
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    step = InferenceStep(
        recorder,
        staging_size=staging,
        crop_size=crop,
        mean=mean,
        std=std,
        top_k=2,
        dtype=torch.float32,
    )
    x = random_batch(2, staging, seed=staging + crop)
    with torch.inference_mode():
        step(x)
    full = x.permute(0, 3, 1, 2).float() / 255.0
    full = (full - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    want = center_crop(full, [crop, crop])
    torch.testing.assert_close(recorder.seen[0], want, rtol=1e-5, atol=1e-5)


def test_crop_offset_rounds_like_torchvision() -> None:
    # (S - C) / 2 = 15.5 rounds to 16, where floor division would give 15.
    assert crop_offset(256, 225) == 16
    assert crop_offset(21, 16) == 2  # 2.5: Python rounds half to even, as torchvision does
    assert crop_offset(256, 224) == 16


def loaded_tiny(dtype_of_weights: torch.dtype = torch.float32) -> LoadedModel:
    torch.manual_seed(1)
    return LoadedModel(
        name="tiny",
        module=TinyNet().to(dtype_of_weights).eval(),
        weights_label="random",
        categories=None,
        crop_size=16,
        resize_size=20,
        mean=(0.485, 0.456, 0.406),
        std=(0.229, 0.224, 0.225),
        num_classes=10,
    )


def test_the_precision_reference_has_the_weights_as_loaded() -> None:
    loaded = loaded_tiny()
    original = loaded.module.conv.weight.detach().clone()  # type: ignore[union-attr]
    step = build_step(loaded, device=torch.device("cpu"), dtype=torch.bfloat16, top_k=3)
    served = step.model.conv.weight  # type: ignore[union-attr]
    assert served.dtype == torch.bfloat16
    assert not torch.equal(served.float(), original), "bf16 rounding is the point of the test"
    # The loaded module was not cast in place, and the reference computes with it.
    assert torch.equal(loaded.module.conv.weight, original)  # type: ignore[union-attr]
    ref = reference_copy(step)
    assert ref.dtype == torch.float32
    assert torch.equal(ref.model.conv.weight, original)  # type: ignore[union-attr]
    report = precision_check(step, batch=8, batches=1)
    assert report.reference == "float32 eager, weights as loaded"


def test_the_precision_check_takes_a_compiled_step() -> None:
    # What start-up hands it on a GPU host: torch.compile's wrapper, whose truth value
    # raises ("does not support len()") instead of being True like a module's.
    step = tiny_step()
    compiled = torch.compile(step, backend="eager")
    with pytest.raises(TypeError):
        bool(compiled)
    report = precision_check(step, compiled, batch=4, batches=1)
    assert report.top1_agreement == 1.0


def test_an_exported_model_is_copied_without_a_warning() -> None:
    # A bf16 step copies the loaded module; an exported one holds pytree specs whose copy
    # warns on torch 2.11 (not on 2.14), which the suite (and -W error) turns into a failure.
    loaded = loaded_tiny()
    example = torch.randn(1, 3, 16, 16)
    exported = torch.export.export(loaded.module.eval(), (example,)).module()
    loaded = dataclasses.replace(loaded, module=exported)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step = build_step(loaded, device=torch.device("cpu"), dtype=torch.bfloat16, top_k=3)
        reference_copy(step)


def test_a_step_without_loaded_weights_says_its_reference_is_rounded() -> None:
    report = precision_check(tiny_step(torch.bfloat16), batch=4, batches=1)
    assert "already rounded" in report.reference


def test_fp32_step_uses_the_loaded_module_itself() -> None:
    loaded = loaded_tiny()
    step = build_step(loaded, device=torch.device("cpu"), dtype=torch.float32, top_k=3)
    assert step.model is loaded.module and step.fp32_weights == ()
    assert precision_check(step, batch=4, batches=1).reference.endswith("as loaded")


def test_pick_dtype_and_compile_mode_on_cpu() -> None:
    cpu = torch.device("cpu")
    assert pick_dtype("auto", cpu) == torch.float32
    assert pick_dtype("bf16", cpu) == torch.bfloat16
    assert pick_dtype("fp16", cpu) == torch.float16
    assert resolve_compile_mode("auto", cpu) == "off"
    assert resolve_compile_mode("auto", torch.device("cuda", 0)) == "reduce-overhead"
    assert resolve_compile_mode("off", torch.device("cuda", 0)) == "off"


def test_reference_copy_is_fp32_and_leaves_the_original_alone() -> None:
    step = tiny_step(torch.bfloat16)
    ref = reference_copy(step)
    assert ref.dtype == torch.float32 and ref.scale.dtype == torch.float32
    assert next(ref.parameters()).dtype == torch.float32
    assert next(step.parameters()).dtype == torch.bfloat16


def test_precision_check_fp32_against_itself() -> None:
    report = precision_check(tiny_step(), batch=8, batches=2)
    assert report.images == 16
    assert report.top1_agreement == 1.0
    assert report.max_abs_top1_prob_diff < 1e-5


def test_precision_check_bf16_on_cpu() -> None:
    report = precision_check(tiny_step(torch.bfloat16), batch=16, batches=2)
    assert report.dtype == "bfloat16" and report.images == 32
    # bf16 keeps 8 bits of mantissa: close, not equal.
    assert 0 < report.max_abs_top1_prob_diff < 0.05
    assert report.top1_agreement_confident >= 0.9
    assert set(report.as_dict()) >= {"top1_agreement", "max_abs_top1_prob_diff"}


def test_direct_feed_ceiling_on_cpu() -> None:
    step = tiny_step()
    calls = 0

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        nonlocal calls
        calls += 1
        assert torch.is_inference_mode_enabled()
        return step(x)

    result = direct_feed_ceiling(fn, random_batch(4), iters=5, warmup=2)
    assert calls == 7
    assert result["batch"] == 4 and result["iters"] == 5 and result["device"] == "cpu"
    assert result["images_per_s"] > 0 and result["ms_per_batch"] > 0
    with pytest.raises(ValueError):
        direct_feed_ceiling(fn, random_batch(4), iters=0)


def test_percentile_and_summary_math() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([0.0, 10.0], 95) == pytest.approx(9.5)
    assert percentile([7.0], 95) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)
    s = summarize(
        [
            {"t": 1.0, "gpu_util_pct": 10.0, "power_w": 100.0},
            {"t": 2.0, "gpu_util_pct": 30.0},
            {"t": 3.0, "gpu_util_pct": 20.0, "power_w": float("nan")},
        ]
    )
    assert "t" not in s
    assert s["gpu_util_pct"] == {"mean": 20.0, "p50": 20.0, "p95": 29.0, "n": 3}
    assert s["power_w"]["n"] == 1


def test_sampler_without_nvml_still_samples_the_cpu() -> None:
    def no_nvml(index: int) -> Any:
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    sampler = GpuSampler(0, interval_s=0.01, nvml_factory=no_nvml)
    assert not sampler.available and "libnvidia-ml" in sampler.reason
    sampler.start()
    for _ in range(200):
        if len(sampler.samples()) >= 3:
            break
        sampler.sample_once()
    sampler.stop()
    summary = sampler.summary()
    assert summary["available"] is False and summary["samples"] >= 3
    assert "system_cpu_pct" in summary["metrics"]
    assert "gpu_util_pct" not in summary["metrics"]


def test_sampler_with_a_fake_nvml() -> None:
    class FakeNvml:
        name = "Fake GPU"

        def __init__(self, index: int) -> None:
            self.n = 0

        def sample(self) -> dict[str, float]:
            self.n += 1
            return {"gpu_util_pct": 50.0 + self.n, "mem_used_mib": 1000.0}

        def close(self) -> None:
            pass

    sampler = GpuSampler(0, interval_s=0.01, nvml_factory=FakeNvml)
    for _ in range(4):
        sampler.sample_once()
    sampler.close()
    summary = sampler.summary()
    assert summary["available"] and summary["gpu"] == "Fake GPU"
    assert summary["metrics"]["gpu_util_pct"]["mean"] == 52.5

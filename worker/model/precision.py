"""Does the step in its serving dtype (fp16/bf16) pick the same classes as fp32 eager?

Runs the serving step and an fp32 eager copy on the same random uint8 batches and reports
top-1 agreement and the largest difference of the top-1 probability. With random weights
many rows have near-tied logits, where any rounding flips the top-1: agreement is therefore
also reported over the rows whose fp32 top-1 leads the runner-up by a clear margin, which is
the number to hold a half-precision model to.

The reference is built from the weights as loaded (build_step keeps an fp32 copy before it
casts), not from the cast model turned back into fp32: that one would carry the rounding
the check is meant to measure.

It waits for the device (it compares values on the host): start-up and checks only, never
the launch path.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from worker.base.device import mark_cudagraph_step
from worker.model.step import InferenceStep, StepFn, has_exact_reference, reference_copy


@dataclass
class PrecisionReport:
    dtype: str
    reference: str
    images: int
    top1_agreement: float
    confident_rows: int
    top1_agreement_confident: float
    max_abs_top1_prob_diff: float
    margin: float

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for k in ("top1_agreement", "top1_agreement_confident", "max_abs_top1_prob_diff"):
            out[k] = round(out[k], 6)
        return out


def precision_check(
    step: InferenceStep,
    fn: StepFn | None = None,
    *,
    batch: int,
    batches: int = 2,
    seed: int = 0,
    margin: float = 0.02,
    cudagraphs: bool = False,
) -> PrecisionReport:
    """Compare `fn` (default: `step` itself, eager) with an fp32 eager copy of `step`.

    Call it on the thread that launches `fn` when `fn` replays CUDA graphs.
    """
    device = step.scale.device  # a model may have no parameters (only buffers)
    reference = reference_copy(step)
    run = step if fn is None else fn
    gen = torch.Generator(device="cpu").manual_seed(seed)
    s = step.input_side
    agree = total = confident = confident_agree = 0
    max_diff = 0.0
    # x: [B, S, S, 3] uint8, random pixels. Made outside inference mode, like the
    # worker's device buffers: an inference tensor would fail the compiled step's guards
    # (a recompile, and on CUDA a second graph).
    inputs = [
        torch.randint(0, 256, (batch, s, s, 3), dtype=torch.uint8, generator=gen).to(device)
        for _ in range(batches)
    ]
    with torch.inference_mode():
        for x in inputs:
            if cudagraphs:
                mark_cudagraph_step()
            out = run(x)
            # Clone before anything else runs: a graph replay's outputs are overwritten by
            # the next replay. A classifier's first two outputs are its top-k.
            idx, sc = out[0].clone(), out[1].clone()
            ridx, rsc = reference(x)[:2]
            top1 = idx[:, 0].long().cpu()
            rtop1 = ridx[:, 0].long().cpu()
            same = top1 == rtop1
            agree += int(same.sum())
            total += int(same.numel())
            lead = (rsc[:, 0] - rsc[:, 1]).cpu() if rsc.shape[1] > 1 else rsc[:, 0].cpu()
            sure = lead > margin
            confident += int(sure.sum())
            confident_agree += int((same & sure).sum())
            diff = (sc[:, 0].float() - rsc[:, 0].float()).abs().max()
            max_diff = max(max_diff, float(diff))
    dtype = str(step.dtype).removeprefix("torch.")
    return PrecisionReport(
        dtype=dtype,
        reference="float32 eager, weights as loaded"
        if has_exact_reference(step)
        else f"float32 eager from the {dtype} weights (already rounded)",
        images=total,
        top1_agreement=agree / max(total, 1),
        confident_rows=confident,
        top1_agreement_confident=confident_agree / confident if confident else 1.0,
        max_abs_top1_prob_diff=max_diff,
        margin=margin,
    )


@dataclass
class AgreementReport:
    """The serving dtype against fp32 eager for embed and raw outputs."""

    dtype: str
    reference: str
    images: int
    min_cosine: float  # of each image's output, flattened, with the reference's
    max_abs_diff: float

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for k in ("min_cosine", "max_abs_diff"):
            out[k] = round(out[k], 6)
        return out


def output_agreement(
    step: InferenceStep,
    fn: StepFn | None = None,
    *,
    batch: int,
    batches: int = 2,
    seed: int = 0,
    cudagraphs: bool = False,
) -> AgreementReport:
    """Compare `fn` (default: `step`, eager) with an fp32 eager copy of `step` on random
    batches, output by output: the lowest cosine similarity per image and the largest
    absolute difference. For embeddings and raw outputs, where there is no top-1 to agree
    on. Start-up and checks only: it waits for the device."""
    device = step.scale.device  # a model may have no parameters (only buffers)
    reference = reference_copy(step)
    run = step if fn is None else fn
    gen = torch.Generator(device="cpu").manual_seed(seed)
    s = step.input_side
    inputs = [
        torch.randint(0, 256, (batch, s, s, 3), dtype=torch.uint8, generator=gen).to(device)
        for _ in range(batches)
    ]
    min_cos, max_diff, total = 1.0, 0.0, 0
    with torch.inference_mode():
        for x in inputs:
            if cudagraphs:
                mark_cudagraph_step()
            got = run(x)[0].clone().float().flatten(1)
            want = reference(x)[0].float().flatten(1)
            cos = torch.nn.functional.cosine_similarity(got, want, dim=1, eps=1e-12)
            min_cos = min(min_cos, float(cos.min()))
            max_diff = max(max_diff, float((got - want).abs().max()))
            total += int(got.shape[0])
    return AgreementReport(
        dtype=str(step.dtype).removeprefix("torch."),
        reference="float32 eager",
        images=total,
        min_cosine=min_cos,
        max_abs_diff=max_diff,
    )


def merge_reports(
    reports: list[PrecisionReport | AgreementReport],
) -> PrecisionReport | AgreementReport | None:
    """One report over the checks of several batch sizes: images summed, agreement over
    all of them, the worst difference (None for no report)."""
    if not reports:
        return None
    first = reports[0]
    if isinstance(first, AgreementReport):
        agreements = [r for r in reports if isinstance(r, AgreementReport)]
        return AgreementReport(
            dtype=first.dtype,
            reference=first.reference,
            images=sum(r.images for r in agreements),
            min_cosine=min(r.min_cosine for r in agreements),
            max_abs_diff=max(r.max_abs_diff for r in agreements),
        )
    checks = [r for r in reports if isinstance(r, PrecisionReport)]
    images = sum(r.images for r in checks)
    confident = sum(r.confident_rows for r in checks)
    agree = sum(r.top1_agreement * r.images for r in checks)
    confident_agree = sum(r.top1_agreement_confident * r.confident_rows for r in checks)
    return PrecisionReport(
        dtype=first.dtype,
        reference=first.reference,
        images=images,
        top1_agreement=agree / max(images, 1),
        confident_rows=confident,
        top1_agreement_confident=confident_agree / confident if confident else 1.0,
        max_abs_top1_prob_diff=max(r.max_abs_top1_prob_diff for r in checks),
        margin=first.margin,
    )

"""The one fixed-shape step: uint8 staging batch in, top-k indices and scores out.

Preprocessing (crop, uint8 -> float, normalize, channels_last), the model, softmax and top-k
are one module so that torch.compile sees a single graph of fixed shapes: with
mode="reduce-overhead" CUDA graphs then cover the whole step, and hundreds of small kernel
launches become one graph replay.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from worker.model.loader import LoadedModel


def pick_dtype(precision: str, device: torch.device) -> torch.dtype:
    if precision == "fp32" or (precision == "auto" and device.type != "cuda"):
        return torch.float32
    if precision == "bf16":
        return torch.bfloat16
    if precision == "fp16":
        return torch.float16
    # auto on CUDA: bf16 where the hardware has it (same range as fp32, no overflow risk
    # in unnormalised logits), else fp16.
    if torch.cuda.is_bf16_supported(including_emulation=False):
        return torch.bfloat16
    return torch.float16


class InferenceStep(nn.Module):
    """x: [B, S, S, 3] uint8 -> (indices [B, K] int32, scores [B, K] float32)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        staging_size: int,
        crop_size: int,
        mean: tuple[float, float, float],
        std: tuple[float, float, float],
        top_k: int,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        if crop_size > staging_size:
            raise ValueError(f"crop {crop_size} is larger than the staging size {staging_size}")
        self.model = model
        self.staging_size = staging_size
        self.crop_size = crop_size
        # torchvision's CenterCrop offset: round((S - C) / 2), half to even as Python rounds.
        self.crop_offset = crop_offset(staging_size, crop_size)
        self.mean = mean
        self.std = std
        self.top_k = top_k
        self.dtype = dtype
        # The model's weights as loaded, before the cast to `dtype` rounded them: the
        # precision check's fp32 reference (build_step sets it for half-precision steps). In
        # a tuple so that nn.Module does not register it: it stays on the host, out of the
        # compiled graph and out of `.to()`.
        self.fp32_weights: tuple[nn.Module, ...] = ()
        # Folding /255 into the normalisation saves one elementwise pass over the batch.
        scale = torch.tensor([1.0 / (255.0 * s) for s in std]).view(1, 3, 1, 1)
        shift = torch.tensor([-m / s for m, s in zip(mean, std, strict=True)]).view(1, 3, 1, 1)
        self.scale: torch.Tensor
        self.shift: torch.Tensor
        self.register_buffer("scale", scale.to(dtype), persistent=False)
        self.register_buffer("shift", shift.to(dtype), persistent=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        off = self.crop_offset
        x = x[:, off : off + self.crop_size, off : off + self.crop_size, :]
        # NHWC uint8 viewed as NCHW is already channels_last in memory: no transpose copy.
        x = x.permute(0, 3, 1, 2).to(self.dtype)
        x = x * self.scale + self.shift
        x = x.contiguous(memory_format=torch.channels_last)
        logits = self.model(x)
        probs = logits.float().softmax(dim=-1)
        scores, indices = probs.topk(self.top_k, dim=-1)
        return indices.to(torch.int32), scores


def contract_problems(out: tuple[torch.Tensor, torch.Tensor], batch: int, top_k: int) -> list[str]:
    """What is wrong with a step's outputs for a [B, S, S, 3] input (empty: nothing).

    The contract: (indices [B, K] int32, scores [B, K] float32), on the input's device,
    scores in [0, 1] and sorted descending per row (checked on the host by callers that can
    afford it; here only the metadata, so it is free on any device).
    """
    problems = []
    indices, scores = out
    if tuple(indices.shape) != (batch, top_k) or indices.dtype != torch.int32:
        problems.append(
            f"indices are {indices.dtype} {tuple(indices.shape)}, want int32 {(batch, top_k)}"
        )
    if tuple(scores.shape) != (batch, top_k) or scores.dtype != torch.float32:
        problems.append(
            f"scores are {scores.dtype} {tuple(scores.shape)}, want float32 {(batch, top_k)}"
        )
    if indices.device != scores.device:
        problems.append(f"indices on {indices.device} but scores on {scores.device}")
    return problems


def crop_offset(staging_size: int, crop_size: int) -> int:
    """Top (and left) offset of torchvision's CenterCrop(crop_size) on a square of
    staging_size: `int(round((S - C) / 2.0))` in torchvision.transforms.functional."""
    return round((staging_size - crop_size) / 2.0)


def has_exact_reference(step: InferenceStep) -> bool:
    """Whether `reference_copy(step)` computes with the weights as loaded (not rounded)."""
    return bool(step.fp32_weights) or step.dtype == torch.float32


def reference_copy(step: InferenceStep) -> InferenceStep:
    """An fp32 eager copy of `step` on the same device (the precision check's reference).

    Built from the weights as loaded when build_step kept them; otherwise from the step's
    own weights, which for a bf16/fp16 step are already rounded (has_exact_reference says
    which)."""
    device = step.scale.device
    if step.fp32_weights:
        model = copy.deepcopy(step.fp32_weights[0])
        model = model.to(device=device, dtype=torch.float32)
        model = model.to(memory_format=torch.channels_last)
        ref = InferenceStep(
            model,
            staging_size=step.staging_size,
            crop_size=step.crop_size,
            mean=step.mean,
            std=step.std,
            top_k=step.top_k,
            dtype=torch.float32,
        ).to(device)
    else:
        ref = copy.deepcopy(step).float()
        ref.dtype = torch.float32
    return ref.eval()


def build_step(
    loaded: LoadedModel, *, device: torch.device, dtype: torch.dtype, top_k: int
) -> InferenceStep:
    if dtype == torch.float32:
        # Module.to casts in place; in fp32 nothing is rounded, so the loaded module is used.
        model = loaded.module.to(device=device)
        fp32_weights: tuple[nn.Module, ...] = ()
    else:
        # The cast would round the loaded weights in place: cast a copy, and keep the loaded
        # fp32 module on the host as the precision check's reference.
        model = copy.deepcopy(loaded.module).to(device=device, dtype=dtype)
        fp32_weights = (loaded.module,)
    model = model.to(memory_format=torch.channels_last)
    k = min(top_k, loaded.num_classes)
    step = InferenceStep(
        model,
        staging_size=loaded.resize_size,
        crop_size=loaded.crop_size,
        mean=loaded.mean,
        std=loaded.std,
        top_k=k,
        dtype=dtype,
    )
    step.fp32_weights = fp32_weights
    return step.to(device).eval()


def resolve_compile_mode(mode: str, device: torch.device) -> str:
    """GPUFEED_COMPILE=auto: CUDA graphs on CUDA; eager on the CPU, where compiling costs
    tens of seconds at start-up for a small gain."""
    if mode != "auto":
        return mode
    return "reduce-overhead" if device.type == "cuda" else "off"

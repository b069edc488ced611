"""The one fixed-shape step: uint8 staging batch in, the output kind's tensors out.

Preprocessing (crop, uint8 -> float, normalize, channels_last), the model and its head (for
a classifier softmax and top-k; heads.py has every kind) are one module so that
torch.compile sees a single graph of fixed shapes: with mode="reduce-overhead" CUDA graphs
then cover the whole step, and hundreds of small kernel launches become one graph replay.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from worker.base.errors import ConfigError
from worker.model.heads import ClassifyHead, Head, make_head
from worker.model.loaded import LoadedModel
from worker.model.outputs import OutputField

# Modules are copied with copy.deepcopy, which rebuilds every object through its class: in
# an exported or traced model that includes pytree's LeafSpec, whose constructor warns of
# its own deprecation on some torch releases (2.11). The copy is right all the same.
_COPY_WARNING = r".*LeafSpec.*"
_M = TypeVar("_M", bound=nn.Module)

# A step as the launch path, the compiler, the checks and the tools call it: the uint8
# staging batch in, the head's output tensors out (compiled, eager or a stand-in).
StepFn = Callable[[torch.Tensor], tuple[torch.Tensor, ...]]


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
    """x: [B, S, S, 3] uint8 -> the head's outputs; by default the softmax classifier's
    (indices [B, K] int32, scores [B, K] float32).

    `input_side` (default: `staging_size`) is the side of the batches it is given. A step
    given larger batches than its own staging side (the degraded step, fed the main step's
    staging ring) first resizes them to it, antialiased like the decoder's downscale, inside
    the same graph: the staged square is the image already fitted to a square, so resizing
    it is fitting the image to the smaller square, with no second decode."""

    def __init__(
        self,
        model: nn.Module,
        *,
        staging_size: int,
        crop_size: int,
        mean: tuple[float, float, float],
        std: tuple[float, float, float],
        top_k: int = 5,
        dtype: torch.dtype,
        head: Head | None = None,
        input_side: int = 0,
    ) -> None:
        super().__init__()
        if crop_size > staging_size:
            raise ValueError(f"crop {crop_size} is larger than the staging size {staging_size}")
        if input_side and input_side < staging_size:
            raise ValueError(
                f"input side {input_side} is smaller than the staging size {staging_size}"
            )
        self.input_side = input_side or staging_size
        self.resample: torch.Tensor
        self.register_buffer(
            "resample",
            resample_matrix(self.input_side, staging_size, crop_size),
            persistent=False,
        )
        self.model = model
        # Set by worker.model.resample.use_rows for the device placement: the step then
        # reads rows at their own size and resizes them itself.
        self.rows: nn.Module | None = None
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
        self.head = head if head is not None else ClassifyHead(classes=top_k, top_k=top_k)
        # Folding /255 into the normalisation saves one elementwise pass over the batch. The
        # constants stay fp32 and the product is rounded to `dtype` once, after them: bf16
        # constants would carry a gain error of up to 0.2% per channel into every image.
        scale = torch.tensor([1.0 / (255.0 * s) for s in std], dtype=torch.float32)
        shift = torch.tensor([-m / s for m, s in zip(mean, std, strict=True)], dtype=torch.float32)
        self.scale: torch.Tensor
        self.shift: torch.Tensor
        self.register_buffer("scale", scale.view(1, 3, 1, 1), persistent=False)
        self.register_buffer("shift", shift.view(1, 3, 1, 1), persistent=False)

    @property
    def layout(self) -> tuple[OutputField, ...]:
        """The outputs' fields (shape per image, dtype): what the output ring holds."""
        return self.head.layout

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        off = self.crop_offset
        if self.rows is not None:
            # fp32 out of the resampling, rounded to `dtype` once, after the normalisation.
            x = self.rows(x)
        elif self.input_side != self.staging_size:
            # [B, S_in, S_in, 3] uint8 -> [B, 3, C, C] in `dtype`: resized and cropped as two
            # matrix products with the rows of the resampling matrix that survive the crop,
            # in fp32 (weights rounded to bf16 would shift the brightness of whole rows).
            x = x.permute(0, 3, 1, 2).float()
            x = self.resample @ x @ self.resample.transpose(0, 1)
        else:
            x = x[:, off : off + self.crop_size, off : off + self.crop_size, :]
            # NHWC uint8 viewed as NCHW is already channels_last in memory: no transpose copy.
            x = x.permute(0, 3, 1, 2).float()
        # One fused pass: uint8 (or the fp32 resize) -> fp32 normalisation -> `dtype`.
        x = (x * self.scale + self.shift).to(self.dtype)
        x = x.contiguous(memory_format=torch.channels_last)
        out: tuple[torch.Tensor, ...] = self.head(self.model(x))
        return out


def contract_problems(out: tuple[torch.Tensor, ...], batch: int, top_k: int) -> list[str]:
    """What is wrong with a softmax classifier step's outputs for a [B, S, S, 3] input
    (empty: nothing): (indices [B, K] int32, scores [B, K] float32) on the input's device.
    Scores in [0, 1] and sorted per row are checked on the host by callers that can afford
    it; here only the metadata, so it is free on any device."""
    return layout_problems(out, batch, ClassifyHead(classes=top_k, top_k=top_k).layout)


def layout_problems(
    out: tuple[torch.Tensor, ...], batch: int, layout: tuple[OutputField, ...]
) -> list[str]:
    """What is wrong with a step's outputs against its layout (empty: nothing)."""
    if len(out) != len(layout):
        return [f"{len(out)} outputs, want {len(layout)} ({', '.join(f.name for f in layout)})"]
    problems = []
    for tensor, f in zip(out, layout, strict=True):
        want = (batch, *f.shape)
        if tuple(tensor.shape) != want or tensor.dtype != f.dtype:
            problems.append(
                f"{f.name} are {tensor.dtype} {tuple(tensor.shape)}, want "
                f"{str(f.dtype).removeprefix('torch.')} {want}"
            )
    devices = {t.device for t in out}
    if len(devices) > 1:
        problems.append(f"outputs on several devices: {', '.join(map(str, devices))}")
    return problems


def resample_matrix(input_side: int, staging_size: int, crop_size: int) -> torch.Tensor:
    """[C, S_in]: row i holds the weights of the input pixels for output row i of an
    antialiased bilinear resize from S_in to S (the triangle filter widened by the scale,
    as PIL and torchvision resize down), cropped to the C central rows. Resizing is
    separable, so `R @ x @ R.T` resizes and crops a [.., S_in, S_in] square; the weights
    are those of `F.interpolate(antialias=True)`, read off an identity matrix."""
    if input_side == staging_size:
        return torch.empty((0, 0))  # not resized: the step crops the uint8 batch instead
    eye = torch.eye(input_side).view(1, 1, input_side, input_side)
    rows = F.interpolate(
        eye, size=(staging_size, input_side), mode="bilinear", antialias=True
    ).view(staging_size, input_side)
    off = crop_offset(staging_size, crop_size)
    return rows[off : off + crop_size].contiguous()


def crop_offset(staging_size: int, crop_size: int) -> int:
    """Top (and left) offset of torchvision's CenterCrop(crop_size) on a square of
    staging_size: `int(round((S - C) / 2.0))` in torchvision.transforms.functional."""
    return round((staging_size - crop_size) / 2.0)


def has_exact_reference(step: InferenceStep) -> bool:
    """Whether `reference_copy(step)` computes with the weights as loaded (not rounded)."""
    return bool(step.fp32_weights) or step.dtype == torch.float32


def check_step(step: InferenceStep, example: torch.Tensor, *, what: str) -> None:
    """Run `step` once, eager, on `example` (the serving shape, dtype and device) and check
    its outputs against its layout; ConfigError naming `what` if it fails. Start-up only."""

    dtype = str(step.dtype).removeprefix("torch.")
    try:
        with torch.inference_mode():
            out = step(example)
    except Exception as exc:  # noqa: BLE001 - whatever the model raises, it cannot serve
        lines = str(exc).strip().splitlines() or [""]
        hint = "; try GPUFEED_PRECISION=fp32" if step.dtype != torch.float32 else ""
        raise ConfigError(
            f"{what} fails on a {dtype} batch of {example.shape[0]} on {example.device}: "
            f"{type(exc).__name__}: {lines[0]}{hint}"
        ) from None
    problems = layout_problems(tuple(out), int(example.shape[0]), step.layout)
    if problems:
        raise ConfigError(f"{what}: the step's outputs are wrong: {'; '.join(problems)}")


def _copied(module: _M) -> _M:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_COPY_WARNING, category=FutureWarning)
        return copy.deepcopy(module)


def reference_copy(step: InferenceStep) -> InferenceStep:
    """An fp32 eager copy of `step` on the same device (the precision check's reference).

    Built from the weights as loaded when build_step kept them; otherwise from the step's
    own weights, which for a bf16/fp16 step are already rounded (has_exact_reference says
    which)."""
    device = step.scale.device
    if step.fp32_weights:
        model = _copied(step.fp32_weights[0])
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
            head=_copied(step.head).float(),
            input_side=step.input_side,
        ).to(device)
        ref.rows = step.rows
    else:
        ref = _copied(step).float()
        ref.dtype = torch.float32
    return ref.eval()


def build_step(
    loaded: LoadedModel,
    *,
    device: torch.device,
    dtype: torch.dtype,
    top_k: int,
    input_side: int = 0,
) -> InferenceStep:
    """`input_side`: the side of the staged batches when they are larger than the model's
    own staging side (the degraded step; see InferenceStep)."""
    if dtype == torch.float32:
        # Module.to casts in place; in fp32 nothing is rounded, so the loaded module is used.
        model = loaded.module.to(device=device)
        fp32_weights: tuple[nn.Module, ...] = ()
    else:
        # The cast would round the loaded weights in place: cast a copy, and keep the loaded
        # fp32 module on the host as the precision check's reference.
        model = _copied(loaded.module).to(device=device, dtype=dtype)
        fp32_weights = (loaded.module,)
    model = model.to(memory_format=torch.channels_last)
    # `top_k` is GPUFEED_TOP_K: a model directory's own top_k wins, and a classifier never
    # returns more classes than it has.
    # A LoadedModel made by hand may leave output_shape out: a classifier's is its classes.
    output_shape = loaded.output_shape or (loaded.num_classes,)
    head = make_head(loaded.output, output_shape, top_k=top_k)
    step = InferenceStep(
        model,
        staging_size=loaded.resize_size,
        crop_size=loaded.crop_size,
        mean=loaded.mean,
        std=loaded.std,
        top_k=min(top_k, loaded.num_classes) if loaded.num_classes else top_k,
        dtype=dtype,
        head=head,
        input_side=input_side,
    )
    step.fp32_weights = fp32_weights
    return step.to(device).eval()


def resolve_compile_mode(mode: str, device: torch.device) -> str:
    """GPUFEED_COMPILE=auto: CUDA graphs on CUDA; eager on the CPU, where compiling costs
    tens of seconds at start-up for a small gain."""
    if mode != "auto":
        return mode
    return "reduce-overhead" if device.type == "cuda" else "off"

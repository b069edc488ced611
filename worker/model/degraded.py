"""The degraded step: the cheaper second step a worker switches to under backlog.

It is built, checked and compiled at start-up beside the main step, for the same batch
shape: it takes the main step's staged batch ([B, S, S, 3] uint8, S the main model's
staging side) and resizes it to its own staging side inside its compiled graph, so the
decoders, the staging ring and the device copy stay as they are (InferenceStep's
`input_side`). Either:

- GPUFEED_DEGRADE_INPUT_SIZE: the same model, its weights shared, at a smaller input side;
  results name it `<model>@<side>`;
- GPUFEED_DEGRADE_MODEL: a second, smaller model directory, with the main model's output
  kind and resize mode (so the staged square is what its own decode would have made, only
  larger); results name it by its manifest's `name`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from worker.base.errors import ConfigError
from worker.model.directory import load_model_dir
from worker.model.loaded import LoadedModel
from worker.model.step import InferenceStep, build_step

if TYPE_CHECKING:
    # For annotations only: importing it at run time would tie this folder to a layer above it.
    from worker.config.settings import WorkerConfig


@dataclass(frozen=True)
class DegradedModel:
    step: InferenceStep
    loaded: LoadedModel  # what it serves: name, weights label, output kind, class names
    setting: str  # the variable that chose it, for messages


def degraded_staging_side(main: LoadedModel, input_size: int) -> int:
    """The staging side for `input_size` in the main model's proportions (a 224 crop of 256
    at 160 stages 183), as torchvision's presets scale Resize with CenterCrop."""
    return max(input_size, round(input_size * main.resize_size / main.crop_size))


def build_degraded(
    cfg: WorkerConfig,
    main: LoadedModel,
    main_step: InferenceStep,
    *,
    device: torch.device,
    dtype: torch.dtype,
    batch_size: int,
) -> DegradedModel:
    """The degraded step for `cfg` (GPUFEED_DEGRADE_MODEL or GPUFEED_DEGRADE_INPUT_SIZE);
    ConfigError with one line when it cannot be the cheaper step of `main`."""
    side = main.resize_size
    if cfg.degrade_model:
        return _from_model_dir(cfg, main, side, device=device, dtype=dtype, batch_size=batch_size)
    size = cfg.degrade_input_size
    if size >= main.crop_size:
        raise ConfigError(
            f"GPUFEED_DEGRADE_INPUT_SIZE: {size} is not smaller than {main.name}'s input size "
            f"{main.crop_size}: the degraded step must be the cheaper one"
        )
    staging = degraded_staging_side(main, size)
    # The main step's (already cast) model and head: no second copy of the weights.
    step = InferenceStep(
        main_step.model,
        staging_size=staging,
        crop_size=size,
        mean=main.mean,
        std=main.std,
        top_k=main_step.top_k,
        dtype=dtype,
        head=main_step.head,
        input_side=side,
    )
    step.fp32_weights = main_step.fp32_weights
    loaded = replace(main, name=f"{main.name}@{size}", crop_size=size, resize_size=staging)
    return DegradedModel(step.to(device).eval(), loaded, "GPUFEED_DEGRADE_INPUT_SIZE")


def _from_model_dir(
    cfg: WorkerConfig,
    main: LoadedModel,
    side: int,
    *,
    device: torch.device,
    dtype: torch.dtype,
    batch_size: int,
) -> DegradedModel:
    var = "GPUFEED_DEGRADE_MODEL"
    try:
        loaded = load_model_dir(cfg.degrade_model, batch_size=batch_size)
    except ConfigError as exc:
        raise ConfigError(f"{var}: {str(exc).removeprefix('GPUFEED_MODEL: ')}") from None
    if loaded.output.kind != main.output.kind:
        raise ConfigError(
            f"{var}: {loaded.name} has output kind {loaded.output.kind}, {main.name} "
            f"{main.output.kind}: results must keep their fields when the worker degrades"
        )
    if loaded.resize_mode != main.resize_mode:
        raise ConfigError(
            f"{var}: {loaded.name} resizes {loaded.resize_mode}, {main.name} "
            f"{main.resize_mode}: the degraded step resizes the main model's staged images, so "
            f"both must fit images the same way"
        )
    if loaded.resize_size > side:
        raise ConfigError(
            f"{var}: {loaded.name} stages images at {loaded.resize_size} px, larger than "
            f"{main.name}'s {side}: the degraded step only scales the staged batch down"
        )
    step = build_step(loaded, device=device, dtype=dtype, top_k=cfg.top_k, input_side=side)
    return DegradedModel(step, loaded, var)

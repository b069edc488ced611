"""A model directory made from an `nn.Module` (or an exported program) in this process: what
`worker.notebook.batch` hands to the workers it starts, since workers are processes of their
own and take a model only as a name or a directory (see manifest.py).

The module is exported with `torch.export` at a [2, 3, S, S] float32 input with a free batch
dimension, because a worker runs the program at each of its batch sizes. What cannot be
exported that way is a `ModuleNotExportable` with one line that names the module and why,
raised before anything else is started; the directory written is then checked as a worker
checks it at start-up (`load_model_dir`), so a model that does not fit its kind fails here
too, with the worker's one line.
"""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from worker.base.errors import ConfigError, GpufeedError
from worker.model.directory import load_model_dir
from worker.model.manifest import KINDS, MANIFEST, RESIZE_MODES

MODEL_FILE = "model.pt2"
LABELS_FILE = "labels.txt"
# The example's batch: not 1, which torch.export takes for a constant.
EXAMPLE_BATCH = 2
MAX_BATCH = 4096


class ModuleNotExportable(GpufeedError, ValueError):
    """The module cannot become a model directory; the message is one line naming it."""


@dataclass(frozen=True)
class ModuleInput:
    """How the workers make the model's input from an image (the manifest's [preprocess])."""

    input_size: int
    mean: tuple[float, float, float] | None = None  # on 0..1 values; None: 0..1 as they are
    std: tuple[float, float, float] | None = None
    resize: str = "shorter-crop"
    resize_size: int | None = None  # shorter-crop only; None: input_size x 256/224


@dataclass(frozen=True)
class ModuleOutput:
    """What the workers answer with the model's output (the manifest's [output])."""

    kind: str = "embed"
    normalize: bool = False  # embed: the module's vectors as they are
    dtype: str = "float32"  # embed, raw
    activation: str | None = None  # classify: softmax (default), sigmoid, none
    top_k: int | None = None  # classify
    labels: Sequence[str] | None = None  # classify: one name per class, in class order


def describe(model: nn.Module | torch.export.ExportedProgram) -> str:
    """The module as an error names it: its class, or the exported program's."""
    if isinstance(model, torch.export.ExportedProgram):
        return "the exported program"
    return type(model).__name__


def export_module(module: nn.Module, input_size: int) -> torch.export.ExportedProgram:
    """`module` exported for a worker: in eval mode, at an [N, 3, input_size, input_size]
    input of any batch N; ModuleNotExportable with the reason otherwise."""
    name = describe(module)
    if not isinstance(module, nn.Module):
        raise ModuleNotExportable(
            f"{type(module).__name__} is not a torch.nn.Module or torch.export.ExportedProgram"
        )
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    example = torch.zeros((EXAMPLE_BATCH, 3, input_size, input_size), device=device)
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    was_training = module.training
    module.eval()
    try:
        return torch.export.export(module, (example,), dynamic_shapes=({0: batch},))
    except Exception as exc:  # noqa: BLE001 - torch.export raises many kinds, all one refusal
        raise ModuleNotExportable(f"{name} cannot be exported: {_why(exc)}") from None
    finally:
        module.train(was_training)


def _why(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    first = lines[0] if lines else type(exc).__name__
    kind = type(exc).__name__
    if kind == "GuardOnDataDependentSymNode" or "data-dependent" in first:
        hint = (
            "its control flow depends on the input's values (an `if` or a loop on a tensor); "
            "use torch.where or torch.cond"
        )
    elif "Constraints violated (batch)" in first or "specialized it to be a constant" in str(exc):
        hint = (
            "its code fixes the batch dimension (e.g. a view or reshape with the batch as a "
            "number); use x.shape[0] or -1 so that any batch size runs"
        )
    else:
        hint = ""
    said = f"{kind}: {first}"[:300]
    where = _user_line(exc)
    return (f"{hint} ({said})" if hint else said) + (f", at {where}" if where else "")


def _user_line(exc: BaseException) -> str:
    """The last line of the caller's code the export ran before it failed ("file:line"
    and the code), where the traceback holds one: torch's own frames are passed over."""
    torch_dir = str(Path(torch.__file__).parent)
    frames = [
        frame
        for frame in traceback.extract_tb(exc.__traceback__)
        if not frame.filename.startswith((torch_dir, "<"))
        and frame.filename != __file__
        and "/contextlib.py" not in frame.filename
    ]
    if not frames:
        return ""
    frame = frames[-1]
    code = f" ({frame.line.strip()})" if frame.line else ""
    return f"{Path(frame.filename).name}:{frame.lineno}{code}"


def write_model_dir(
    model: nn.Module | torch.export.ExportedProgram,
    folder: str | Path,
    *,
    preprocess: ModuleInput,
    output: ModuleOutput,
    name: str | None = None,
    batch_size: int = EXAMPLE_BATCH,
) -> Path:
    """A model directory in `folder` (gpufeed.toml, model.pt2, labels.txt for classify with
    labels), checked as a worker of `batch_size` checks it; ModuleNotExportable or
    ConfigError (one line each) when it would not serve."""
    _check_choices(preprocess, output)
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    if isinstance(model, torch.export.ExportedProgram):
        program = model
    else:
        program = export_module(model, preprocess.input_size)
    torch.export.save(program, str(root / MODEL_FILE))
    if output.labels is not None:
        bad = [label for label in output.labels if not label or "\n" in label or "\r" in label]
        if bad:
            raise ConfigError(f"labels: {bad[0]!r}: each class name is one non-empty line")
        (root / LABELS_FILE).write_text("".join(f"{label}\n" for label in output.labels))
    (root / MANIFEST).write_text(
        manifest_text(name or describe(model), preprocess, output), encoding="utf-8"
    )
    try:
        load_model_dir(root, batch_size=batch_size)
    except ConfigError as exc:
        # The worker's line names a file in a folder removed after the run: say the module.
        said = str(exc)
        for prefix in {str(root), str(root.resolve())}:
            said = said.replace(prefix + os.sep, "")
        raise ConfigError(f"{describe(model)}: {said}") from None
    return root


def _check_choices(preprocess: ModuleInput, output: ModuleOutput) -> None:
    if preprocess.resize not in RESIZE_MODES:
        raise ConfigError(f"resize: {preprocess.resize!r}, not one of {', '.join(RESIZE_MODES)}")
    if output.kind not in KINDS:
        raise ConfigError(f"kind: {output.kind!r}, not one of {', '.join(KINDS)}")
    if output.labels is not None and output.kind != "classify":
        raise ConfigError(f"labels: apply to kind classify only, not {output.kind!r}")


def manifest_text(name: str, preprocess: ModuleInput, output: ModuleOutput) -> str:
    """gpufeed.toml for the run's directory: only what was given, so that the manifest's
    own defaults and checks apply as to any directory."""
    model: dict[str, Any] = {"file": MODEL_FILE, "input_size": preprocess.input_size}
    model["name"] = name
    pre: dict[str, Any] = {"resize": preprocess.resize}
    if preprocess.resize_size is not None:
        pre["resize_size"] = preprocess.resize_size
    if preprocess.mean is not None:
        pre["mean"] = [float(v) for v in preprocess.mean]
    if preprocess.std is not None:
        pre["std"] = [float(v) for v in preprocess.std]
    out: dict[str, Any] = {"kind": output.kind}
    if output.kind == "embed":
        out["normalize"] = output.normalize
    if output.kind in ("embed", "raw"):
        out["dtype"] = output.dtype
    if output.kind == "classify":
        if output.activation is not None:
            out["activation"] = output.activation
        if output.top_k is not None:
            out["top_k"] = output.top_k
    tables = {"model": model, "preprocess": pre, "output": out}
    lines: list[str] = []
    for table, keys in tables.items():
        lines.append(f"[{table}]")
        # JSON's strings, numbers, booleans and arrays are TOML's too.
        lines += [f"{key} = {json.dumps(value)}" for key, value in keys.items()]
    return "\n".join(lines) + "\n"

"""Load a model directory: its model (exported program, TorchScript, or entry point and
weights), its labels, and a probe that the model takes the input size and gives an output
that fits the kind.

Every way to load ends in an nn.Module that torch.compile takes whole:
- `.pt2`: `torch.export.load`, then the program's module. A program exported with a dynamic
  batch dimension is checked to accept the worker's batch size; the step is compiled for
  that one size (dynamic=False), which specialises it.
- `.ts` / `.pt`: `torch.jit.load`, then converted to an exported program at the worker's
  batch size (torch's TorchScript converter), since torch.compile cannot trace into
  TorchScript. A module the converter cannot take stays TorchScript: it runs eager
  (GPUFEED_COMPILE=off), and a compiled step with it is refused at start-up.
- `entry = "module:callable"`: the callable (imported with the directory first on
  sys.path) returns an nn.Module; `weights` is a state dict loaded with weights_only=True.

A model directory is code: a .pt2 file may hold pickled constants, TorchScript is a program,
an entry point is Python. Serve only directories you trust, as you would a package.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import sys
import warnings
from pathlib import Path
from typing import Any

import structlog
import torch
from torch import nn

from worker.base.errors import ConfigError
from worker.model.loaded import LoadedModel, file_label
from worker.model.manifest import (
    MANIFEST,
    MAX_OUTPUT_BYTES,
    ModelManifest,
    read_labels,
    read_manifest,
)

log = structlog.get_logger("gpufeed.model")

_ITEMSIZE = {"float16": 2, "float32": 4}


class ExportedModule(nn.Module):
    """An exported program's module, as the step holds it.

    The program was captured in inference mode and refuses `train()`; `eval()` on the
    step reaches it through this wrapper, which has no training mode to switch.
    """

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def train(self, mode: bool = True) -> ExportedModule:
        return self

    def forward(self, x: torch.Tensor) -> Any:
        return self.inner(x)


def load_model_dir(directory: str | Path, *, batch_size: int) -> LoadedModel:
    """Load and check the model directory for a worker of `batch_size`; ConfigError with one
    line naming the file and key for anything wrong with it."""
    manifest = read_manifest(directory)
    if manifest.format == "export":
        module, probe_batch = _load_export(manifest, batch_size)
    elif manifest.format == "torchscript":
        module, probe_batch = _load_torchscript(manifest, batch_size)
    else:
        module, probe_batch = _load_entry(manifest), min(batch_size, 2)
    output_shape = _probe(manifest, module, probe_batch)
    spec = manifest.output
    classes = output_shape[0] if spec.kind == "classify" else 0
    categories = None
    if manifest.labels is not None:
        categories = read_labels(manifest.labels)
        if len(categories) != classes:
            raise ConfigError(
                f"{manifest.labels}: {len(categories)} lines but the model has {classes} "
                "classes (one class name per line, in class order)"
            )
    if spec.top_k > classes > 0:
        raise ConfigError(
            f"{manifest.where('output', 'top_k')}: {spec.top_k} but the model has {classes} classes"
        )
    module.requires_grad_(False)
    pre = manifest.preprocess
    return LoadedModel(
        name=manifest.name,
        module=module,
        weights_label=_what_was_loaded(manifest),
        categories=categories,
        crop_size=manifest.input_size,
        resize_size=manifest.staging_size,
        mean=pre.mean,
        std=pre.std,
        num_classes=classes,
        output=spec,
        output_shape=output_shape,
        resize_mode=pre.resize,
        source=manifest.format,
    )


def _what_was_loaded(m: ModelManifest) -> str:
    if m.file is not None:
        return file_label(m.file)
    return f"{m.entry} with {file_label(m.weights)}" if m.weights is not None else f"{m.entry}"


def _example(batch: int, m: ModelManifest) -> torch.Tensor:
    return torch.zeros((batch, 3, m.input_size, m.input_size))


# ----------------------------------------------------------------------------- .pt2
def _load_export(m: ModelManifest, batch_size: int) -> tuple[nn.Module, int]:
    assert m.file is not None
    where = m.where("model", "file")
    try:
        program = torch.export.load(str(m.file))
    except Exception as exc:  # noqa: BLE001 - torch raises many kinds for a file that is not one
        raise ConfigError(
            f"{where}: {m.file.name} is not a torch.export program ({_first_line(exc)})"
        ) from None
    probe_batch = _check_export_input(m, program, batch_size)
    return ExportedModule(program.module()), probe_batch


def _check_export_input(m: ModelManifest, program: Any, batch_size: int) -> int:
    """The program's one input must be [B, 3, S, S] for S = input_size and the worker's B;
    returns the batch size to probe it with."""
    assert m.file is not None
    name = m.file.name
    inputs = [
        node.meta.get("val")
        for node in program.graph.nodes
        if node.op == "placeholder" and node.name in set(program.graph_signature.user_inputs)
    ]
    if len(inputs) != 1 or not isinstance(inputs[0], torch.Tensor):
        raise ConfigError(
            f"{m.where('model', 'file')}: {name} takes {len(inputs)} inputs; gpufeed gives "
            "a model one image batch [B, 3, H, W]"
        )
    # Sizes are ints where the program is static, SymInts where it is dynamic.
    shape: tuple[Any, ...] = tuple(inputs[0].shape)
    if len(shape) != 4 or (isinstance(shape[1], int) and shape[1] != 3):
        raise ConfigError(
            f"{m.where('model', 'file')}: {name} takes inputs of shape {_shape(shape)}; "
            "gpufeed gives [B, 3, H, W] RGB batches"
        )
    for side in shape[2:]:
        if isinstance(side, int) and side != m.input_size:
            raise ConfigError(
                f"{m.where('model', 'input_size')}: {m.input_size}, but {name} was exported "
                f"for {_shape(shape)} inputs"
            )
    batch = shape[0]
    if isinstance(batch, int):
        if batch != batch_size:
            raise ConfigError(
                f"{m.where('model', 'file')}: {name} was exported for batch {batch} only (a "
                f"static batch dimension) and the worker's batch is {batch_size}: export "
                'with dynamic_shapes={"x": {0: torch.export.Dim("batch")}}, or set '
                f"GPUFEED_BATCH_SIZE={batch}"
            )
        return batch
    low, high = _range(program, batch)
    if not low <= batch_size <= high:
        raise ConfigError(
            f"{m.where('model', 'file')}: {name} takes batches of {low} to {high}; the "
            f"worker's batch is {batch_size} (GPUFEED_BATCH_SIZE)"
        )
    # Probed with a small batch the program accepts (the worker's own is in its range).
    return max(low, min(batch_size, 2))


def _range(program: Any, size: Any) -> tuple[int, float]:
    """(lowest, highest) value of a symbolic size of an exported program."""
    ranges = getattr(program, "range_constraints", {}) or {}
    found = ranges.get(getattr(getattr(size, "node", None), "expr", None))
    if found is None:
        return 0, math.inf
    return _bound(found.lower, 0), _bound(found.upper, math.inf)


def _bound(value: Any, unbounded: float) -> Any:
    # sympy bounds: an Integer, or int_oo / -int_oo for no bound.
    if getattr(value, "is_finite", True) is False:
        return unbounded
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError, AttributeError):
        return unbounded


def _shape(shape: tuple[Any, ...]) -> str:
    return "[" + ", ".join(str(d) if isinstance(d, int) else "B" for d in shape) + "]"


# ----------------------------------------------------------------------------- TorchScript
def _load_torchscript(m: ModelManifest, batch_size: int) -> tuple[nn.Module, int]:
    assert m.file is not None
    where = m.where("model", "file")
    try:
        scripted = torch.jit.load(str(m.file), map_location="cpu")  # type: ignore[no-untyped-call]
    except Exception as exc:  # noqa: BLE001 - a state dict, an archive of another kind, junk
        raise ConfigError(
            f"{where}: {m.file.name} is not a TorchScript module saved with torch.jit.save "
            f"({_first_line(exc)}); a state dict needs entry and weights instead of file"
        ) from None
    scripted.eval()
    try:
        # Only a TorchScript model needs torch's converter.
        from torch._export.converter import TS2EPConverter  # noqa: PLC0415

        # Converted at the worker's batch size: the converter specialises a batch of 1.
        # It warns about every parameter the traced graph does not use: noise here.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            program = TS2EPConverter(scripted, (_example(batch_size, m),)).convert()
    except Exception as exc:  # noqa: BLE001 - the converter fails in many ways; eager still works
        log.warning(
            "torchscript_not_converted",
            file=str(m.file),
            reason=_first_line(exc),
            note="the model runs as TorchScript: eager only (GPUFEED_COMPILE=off)",
        )
        return scripted, min(batch_size, 2)
    return ExportedModule(program.module()), batch_size


# ----------------------------------------------------------------------------- entry point
def _load_entry(m: ModelManifest) -> nn.Module:
    assert m.entry is not None
    where = m.where("model", "entry")
    module_name, _, attr = m.entry.partition(":")
    _forget_other_models(module_name.split(".")[0], m.directory)
    # The directory's own modules come first, before anything of the same name elsewhere.
    with contextlib.suppress(ValueError):
        sys.path.remove(str(m.directory))
    sys.path.insert(0, str(m.directory))
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except ImportError as exc:
        raise ConfigError(f"{where}: cannot import {module_name}: {exc}") from None
    except AttributeError:
        raise ConfigError(f"{where}: {module_name} has no {attr}") from None
    if not callable(target):
        raise ConfigError(f"{where}: {m.entry} is not callable")
    try:
        module = target(**m.args)
    except Exception as exc:  # noqa: BLE001 - the entry point is the model's own code
        raise ConfigError(f"{where}: {m.entry} raised {_first_line(exc)}") from None
    if not isinstance(module, nn.Module):
        raise ConfigError(
            f"{where}: {m.entry} returned a {type(module).__name__}, not a torch.nn.Module"
        )
    if m.weights is not None:
        _load_weights(m, module)
    module.eval()
    return module


def _forget_other_models(top: str, directory: Path) -> None:
    """A module of this name imported from another model directory (a tool that loads
    several) must not stand in for this one's."""
    origin = getattr(sys.modules.get(top), "__file__", None)
    if origin is None:
        return
    path = Path(origin).resolve()
    if path.is_relative_to(directory) or not any(
        (parent / MANIFEST).is_file() for parent in path.parents
    ):
        return
    for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
        del sys.modules[name]
    importlib.invalidate_caches()


def _load_weights(m: ModelManifest, module: nn.Module) -> None:
    assert m.weights is not None
    where = m.where("model", "weights")
    try:
        obj = torch.load(m.weights, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises many kinds for a bad file
        raise ConfigError(
            f"{where}: cannot load {m.weights.name} as a state dict ({_first_line(exc)})"
        ) from None
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: {m.weights.name} holds no state dict")
    try:
        module.load_state_dict(obj)
    except RuntimeError as exc:
        raise ConfigError(
            f"{where}: {m.weights.name} does not fit {m.entry}: {_first_line(exc)}"
        ) from None


# ----------------------------------------------------------------------------- probe
def _probe(m: ModelManifest, module: nn.Module, batch: int) -> tuple[int, ...]:
    """Run the model once on the CPU in fp32 and check its output against the kind;
    returns the output's shape per image."""
    x = _example(batch, m)
    name = m.file.name if m.file is not None else str(m.entry)
    try:
        with torch.inference_mode():
            y = module(x)
    except Exception as exc:  # noqa: BLE001 - whatever the model raises, it rejects the input
        raise ConfigError(
            f"{m.where('model', 'input_size')}: {m.input_size}, but {name} rejects a "
            f"{'x'.join(map(str, x.shape))} float32 input: {_first_line(exc)}"
        ) from None
    where = m.where("output", "kind")
    kind = m.output.kind
    if not isinstance(y, torch.Tensor):
        count = f" of {len(y)}" if isinstance(y, tuple | list | dict) else ""
        raise ConfigError(
            f"{where}: {kind}, but {name} returns a {type(y).__name__}{count}; gpufeed "
            "takes a model that returns one tensor"
        )
    if y.ndim == 0 or y.shape[0] != batch:
        raise ConfigError(
            f"{where}: {kind}, but {name} returns {_dims(y)} for a batch of {batch}; the "
            "first dimension must be the batch"
        )
    if not y.is_floating_point():
        raise ConfigError(f"{where}: {kind}, but {name} returns {y.dtype} values, not floats")
    per_image = tuple(int(d) for d in y.shape[1:])
    if kind in ("classify", "embed") and len(per_image) != 1:
        what = "[batch, classes]" if kind == "classify" else "[batch, dim]"
        raise ConfigError(
            f"{where}: {kind}, but {name} returns {_dims(y)}; {kind} needs {what} "
            '(kind = "raw" returns any shape)'
        )
    if kind == "classify" and per_image[0] < 1:
        raise ConfigError(f"{where}: classify, but {name} returns no classes")
    nbytes = math.prod(per_image) * _ITEMSIZE[m.output.dtype]
    if kind != "classify" and nbytes > MAX_OUTPUT_BYTES:
        raise ConfigError(
            f"{where}: {kind}, but {name} returns {_dims(y)}: {nbytes} bytes per image in "
            f"{m.output.dtype}, over the limit of {MAX_OUTPUT_BYTES} bytes per result"
        )
    return per_image


def _dims(y: torch.Tensor) -> str:
    return "[" + ", ".join(str(d) for d in y.shape) + "]"


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0].strip() if lines else ''}"[:300]

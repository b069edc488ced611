"""The model GPUFEED_MODEL names: a torchvision classifier by name (here) or a model
directory (directory.py), as one LoadedModel.

For a torchvision model, GPUFEED_WEIGHTS is one of:
- a torchvision weights name (`DEFAULT`, `IMAGENET1K_V1`, or fully qualified
  `ResNet50_Weights.IMAGENET1K_V2`): downloaded to the torch hub cache on first use;
- a local file: a state dict, or a dict {"state_dict": ..., "categories": [...]} for models
  fine-tuned on other classes; always loaded with `weights_only=True` (no pickle);
- `none`: random initialisation (tests, benchmarks, hosts without network).

GPUFEED_MODEL=null is the null model (null.py): no weights, a step that does next to nothing.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import torch
import torchvision
from torch import nn
from torchvision.models import get_model, get_model_weights, list_models

from worker.base.errors import EXIT_CONFIG, ConfigError, GpufeedError
from worker.model.directory import load_model_dir
from worker.model.loaded import LoadedModel, file_label
from worker.model.manifest import looks_like_model_dir
from worker.model.names import NULL_MODEL, check_name, is_null_model
from worker.model.null import (
    NULL_CLASSES,
    NULL_INPUT_SIZE,
    NullClassifier,
)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


WEIGHTS_FIX = "Set GPUFEED_WEIGHTS=none for random weights or to a local file."


class WeightsUnavailable(GpufeedError, RuntimeError):
    """Pretrained weights could not be fetched (no network, no cache)."""

    exit_code = EXIT_CONFIG

    def operator_line(self) -> str:
        return f"{self}. {WEIGHTS_FIX}"


def load_configured(
    model: str, weights: str, *, input_size: int = 0, batch_size: int = 1
) -> LoadedModel:
    """GPUFEED_MODEL as the worker serves it: a model directory (a path), else a torchvision
    name. A directory names its own weights and input size, so GPUFEED_WEIGHTS and
    GPUFEED_INPUT_SIZE apply to torchvision models only."""
    if looks_like_model_dir(model):
        return load_model_dir(model, batch_size=batch_size)
    if is_null_model(model):
        return load_null(input_size=input_size)
    return load_model(model, weights, input_size=input_size)


def load_null(*, input_size: int = 0) -> LoadedModel:
    """The null model: classify results for null_0.., staged and cropped at one side (no
    resize margin: the point is to cost nothing beyond the pipeline)."""
    side = input_size or NULL_INPUT_SIZE
    module = NullClassifier().eval()
    return LoadedModel(
        name=NULL_MODEL,
        module=module,
        weights_label="none (null model)",
        categories=tuple(f"null_{i}" for i in range(NULL_CLASSES)),
        crop_size=side,
        resize_size=side,
        mean=IMAGENET_MEAN,
        std=IMAGENET_STD,
        num_classes=NULL_CLASSES,
        output_shape=(NULL_CLASSES,),
        source="null",
    )


def classification_models() -> list[str]:
    return sorted(list_models(module=torchvision.models))


def load_model(name: str, weights: str, *, input_size: int = 0) -> LoadedModel:
    # The list torchvision itself gives, now that it is imported: the source scan of
    # names.py decided before torch only where it found the names.
    name = check_name(name, classification_models())
    crop, resize = 224, 256
    mean, std = IMAGENET_MEAN, IMAGENET_STD
    categories: tuple[str, ...] | None = None
    state_dict: dict[str, Any] | None = None
    label = weights

    if weights.lower() == "none":
        tv_weights = None
        label = "none (random init)"
        # The class names of the model's published weights (metadata that ships with
        # torchvision: no download), so a random-weights worker answers with labels, as
        # meaningless as its answers but read the same way.
        categories = _published_categories(name)
    elif _looks_like_path(weights):
        path = Path(weights).expanduser()
        if not path.is_file():
            raise ConfigError(f"GPUFEED_WEIGHTS: {path} is not a file")
        state_dict, categories = _read_weights_file(path)
        tv_weights = None
        label = file_label(path)
    else:
        tv_weights = _resolve_weights_name(name, weights)
        label = f"{type(tv_weights).__name__}.{tv_weights.name}"
        categories = tuple(tv_weights.meta.get("categories") or ()) or None
        preset = tv_weights.transforms()
        crop = int(preset.crop_size[0])
        resize = int(preset.resize_size[0])
        mean = (float(preset.mean[0]), float(preset.mean[1]), float(preset.mean[2]))
        std = (float(preset.std[0]), float(preset.std[1]), float(preset.std[2]))

    num_classes = len(categories) if categories and state_dict is not None else 1000
    try:
        if tv_weights is not None:
            module = get_model(name, weights=tv_weights)
        else:
            module = get_model(name, weights=None, num_classes=num_classes)
    except (OSError, RuntimeError) as exc:  # urllib's URLError is an OSError
        if tv_weights is not None:
            raise WeightsUnavailable(f"cannot fetch {label}: {exc}") from exc
        raise
    if state_dict is not None:
        try:
            module.load_state_dict(state_dict)
        except RuntimeError as exc:
            first = str(exc).strip().splitlines()[0]
            raise ConfigError(f"GPUFEED_WEIGHTS: {label} does not fit {name}: {first}") from None

    if input_size:
        resize = round(input_size * resize / crop)
        crop = input_size
    module.eval()
    module.requires_grad_(False)
    return LoadedModel(
        name=name,
        module=module,
        weights_label=label,
        categories=categories,
        crop_size=crop,
        resize_size=resize,
        mean=mean,
        std=std,
        num_classes=num_classes,
        output_shape=(num_classes,),
    )


def save_weights_file(module: nn.Module, path: Path, categories: list[str] | None = None) -> None:
    """Write weights in the format `load_model` reads (used by tests and the demo)."""
    payload: dict[str, Any] = {"state_dict": module.state_dict()}
    if categories:
        payload["categories"] = list(categories)
    torch.save(payload, path)


def _published_categories(model: str) -> tuple[str, ...] | None:
    """The class names of `model`'s default torchvision weights, when they name the 1000
    classes a model built without weights has; else None."""
    try:
        meta = get_model_weights(model).DEFAULT.meta
    except (ValueError, KeyError, AttributeError):
        return None
    names = tuple(str(c) for c in meta.get("categories") or ())
    return names if len(names) == 1000 else None


def _looks_like_path(weights: str) -> bool:
    return "/" in weights or weights.endswith((".pt", ".pth", ".bin", ".safetensors"))


def _resolve_weights_name(model: str, weights: str) -> Any:
    enum_cls = get_model_weights(model)
    member = weights.split(".", 1)[1] if "." in weights else weights
    try:
        return enum_cls[member]
    except KeyError:
        names = ", ".join(["DEFAULT", *(w.name for w in enum_cls)])
        raise ConfigError(
            f"GPUFEED_WEIGHTS: {weights!r} is not a weights name of {model}; "
            f"use one of {names}, a local file path, or none"
        ) from None


def _read_weights_file(path: Path) -> tuple[dict[str, Any], tuple[str, ...] | None]:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises many kinds for a bad file
        raise ConfigError(f"GPUFEED_WEIGHTS: cannot load {path}: {exc}") from None
    if isinstance(obj, dict) and "state_dict" in obj:
        cats = obj.get("categories")
        categories = tuple(str(c) for c in cats) if isinstance(cats, list | tuple) else None
        return dict(obj["state_dict"]), categories
    if isinstance(obj, dict):
        return dict(obj), None
    raise ConfigError(f"GPUFEED_WEIGHTS: {path} holds no state dict")


def prefetch_weights(model: str, weights: str, *, timeout_s: float = 15.0) -> str | None:
    """Bring a torchvision weights file into the hub cache; returns why not, or None.

    Hosts without network would otherwise hang in the download for minutes; the timeout
    turns that into a prompt, readable answer.
    """
    try:
        tv_weights = _resolve_weights_name(model, weights)
    except ConfigError as exc:
        return str(exc)
    cached = Path(torch.hub.get_dir()) / "checkpoints" / Path(tv_weights.url).name
    if cached.is_file():
        return None
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(timeout_s)
    try:
        torch.hub.load_state_dict_from_url(tv_weights.url, progress=False, check_hash=True)
    except Exception as exc:  # noqa: BLE001 - any failure means "not available here"
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"
    finally:
        socket.setdefaulttimeout(previous)
    return None

"""gpufeed.toml: what a model directory says about its model, read and checked without torch.

    my-model/
      gpufeed.toml     # this manifest
      model.pt2        # torch.export.save() of an ExportedProgram (or .ts / .pt TorchScript)
      labels.txt       # optional: one class name per line (classify)

Every key is checked here, so a wrong one stops the worker at start-up with one line that
names the file, the table and the key. Whether the model itself fits what the manifest says
(its input size, its output for the kind) is checked when it is loaded (directory.py).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker.config import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 hosts install tomli (pyproject.toml)
    import tomli as tomllib

MANIFEST = "gpufeed.toml"
DEFAULT_LABELS = "labels.txt"

KINDS = ("classify", "embed", "raw")
ACTIVATIONS = ("softmax", "sigmoid", "none")
RESIZE_MODES = ("shorter-crop", "squash", "letterbox")
OUTPUT_DTYPES = ("float16", "float32")
# Suffix of [model] file -> how it is loaded.
FILE_FORMATS = {".pt2": "export", ".ts": "torchscript", ".pt": "torchscript"}
# The most one image's output may take in a result (embed and raw): results live in Redis,
# in a stream capped by GPUFEED_RESULTS_MAXLEN entries and in hashes.
MAX_OUTPUT_BYTES = 256 * 1024
MAX_TOP_K = 100

_ENTRY = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")
_KNOWN = {
    "model": ("file", "entry", "weights", "args", "input_size", "name"),
    "preprocess": ("resize", "resize_size", "mean", "std"),
    "output": ("kind", "activation", "top_k", "threshold", "normalize", "dtype", "labels"),
}


@dataclass(frozen=True)
class PreprocessSpec:
    resize: str = "shorter-crop"
    resize_size: int = 0  # shorter-crop: the staging side (shorter side resized to it)
    mean: tuple[float, float, float] = (0.0, 0.0, 0.0)  # on 0..1 values
    std: tuple[float, float, float] = (1.0, 1.0, 1.0)


@dataclass(frozen=True)
class OutputSpec:
    kind: str = "classify"
    activation: str = "softmax"  # classify
    top_k: int = 0  # classify; 0: GPUFEED_TOP_K (at most the number of classes)
    threshold: float = 0.5  # classify with sigmoid
    normalize: bool = True  # embed
    dtype: str = "float32"  # embed, raw


@dataclass(frozen=True)
class ModelManifest:
    directory: Path
    path: Path  # the gpufeed.toml
    name: str
    input_size: int
    file: Path | None = None
    entry: str | None = None
    weights: Path | None = None
    args: dict[str, Any] = field(default_factory=dict)
    preprocess: PreprocessSpec = field(default_factory=PreprocessSpec)
    output: OutputSpec = field(default_factory=OutputSpec)
    labels: Path | None = None

    @property
    def format(self) -> str:
        """export, torchscript or entry."""
        return FILE_FORMATS[self.file.suffix] if self.file is not None else "entry"

    @property
    def staging_size(self) -> int:
        """The side of the decoded rows: the crop is taken from them inside the step."""
        if self.preprocess.resize == "shorter-crop":
            return self.preprocess.resize_size
        return self.input_size

    def where(self, table: str, key: str) -> str:
        return f"{self.path}: [{table}] {key}"


def looks_like_model_dir(value: str) -> bool:
    """GPUFEED_MODEL names a directory when it is a path (`./my-model`, `/models/x`, `~/m`);
    a bare word is a torchvision model name."""
    return "/" in value or value.startswith((".", "~")) or Path(value).suffix == ".toml"


def read_manifest(directory: str | Path) -> ModelManifest:
    """Parse and check `directory`/gpufeed.toml; ConfigError (one line) when anything is wrong."""
    root = Path(directory).expanduser()
    if root.name == MANIFEST and root.is_file():
        root = root.parent
    if not root.is_dir():
        raise ConfigError(f"GPUFEED_MODEL: {root} is not a directory")
    root = root.resolve()
    path = root / MANIFEST
    if not path.is_file():
        raise ConfigError(f"GPUFEED_MODEL: {root} has no {MANIFEST}")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    for table, value in data.items():
        if table not in _KNOWN:
            raise ConfigError(
                f"{path}: unknown table [{table}] (known: {', '.join(f'[{t}]' for t in _KNOWN)})"
            )
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: {table} must be a table ([{table}])")
    model = _Table(path, "model", data.get("model"))
    pre = _Table(path, "preprocess", data.get("preprocess"))
    out = _Table(path, "output", data.get("output"))
    if "model" not in data:
        raise ConfigError(f"{path}: [model] is missing (file or entry, and input_size)")
    if "output" not in data:
        raise ConfigError(f"{path}: [output] is missing (kind = {' | '.join(KINDS)})")

    file = model.text("file")
    entry = model.text("entry")
    if file is not None and entry is not None:
        raise ConfigError(f"{path}: [model] file and entry: give one of them, not both")
    if file is None and entry is None:
        raise ConfigError(
            f"{path}: [model] file is missing (a .pt2 or .ts file; or entry = "
            '"module:callable" with weights)'
        )
    file_path = None
    if file is not None:
        file_path = model.file_in(root, "file", file)
        if file_path.suffix not in FILE_FORMATS:
            raise model.error(
                "file",
                f"{file}: use a .pt2 file (torch.export.save) or .ts / .pt (TorchScript)",
            )
    weights = model.text("weights")
    args = model.table("args")
    if entry is not None and not _ENTRY.match(entry):
        raise model.error("entry", f"{entry!r} is not of the form 'package.module:callable'")
    if entry is None:
        for key in ("weights", "args"):
            if key in model.data:
                raise model.error(key, "applies to entry only ([model] file holds its weights)")
    input_size = model.integer("input_size", low=16, high=2048, required=True)
    assert input_size is not None
    name = model.text("name") or root.name

    resize = pre.choice("resize", RESIZE_MODES) or "shorter-crop"
    resize_size = pre.integer("resize_size", low=input_size, high=4096)
    if resize_size is not None and resize != "shorter-crop":
        raise pre.error("resize_size", f'applies to resize = "shorter-crop" only, not {resize!r}')
    if resize_size is None:
        # torchvision's ImageNet ratio (256 for 224) unless said otherwise.
        resize_size = round(input_size * 256 / 224) if resize == "shorter-crop" else input_size
    mean, std = pre.triple("mean"), pre.triple("std")
    if (mean is None) != (std is None):
        raise pre.error("mean" if mean is None else "std", "give both mean and std, or neither")
    if std is not None and min(std) <= 0:
        raise pre.error("std", "every value must be above 0")
    preprocess = PreprocessSpec(
        resize=resize,
        resize_size=resize_size,
        mean=mean or (0.0, 0.0, 0.0),
        std=std or (1.0, 1.0, 1.0),
    )

    kind = out.choice("kind", KINDS, required=True)
    assert kind is not None
    only = {
        "activation": "classify",
        "top_k": "classify",
        "threshold": "classify",
        "labels": "classify",
        "normalize": "embed",
        "dtype": "embed or raw",
    }
    for key, kinds in only.items():
        if key in out.data and kind not in kinds.split(" or "):
            raise out.error(key, f"applies to kind {kinds} only, not {kind!r}")
    activation = out.choice("activation", ACTIVATIONS) or "softmax"
    if "threshold" in out.data and activation != "sigmoid":
        raise out.error("threshold", f'applies to activation = "sigmoid", not {activation!r}')
    threshold = out.number("threshold", low=0.0, high=1.0)
    spec = OutputSpec(
        kind=kind,
        activation=activation,
        top_k=out.integer("top_k", low=1, high=MAX_TOP_K) or 0,
        threshold=0.5 if threshold is None else threshold,
        normalize=out.boolean("normalize", default=True),
        dtype=out.choice("dtype", OUTPUT_DTYPES) or "float32",
    )
    labels_name = out.text("labels")
    labels = None
    if labels_name is not None:
        labels = out.file_in(root, "labels", labels_name)
    elif kind == "classify" and (root / DEFAULT_LABELS).is_file():
        labels = root / DEFAULT_LABELS

    return ModelManifest(
        directory=root,
        path=path,
        name=name,
        input_size=input_size,
        file=file_path,
        entry=entry,
        weights=model.file_in(root, "weights", weights) if weights is not None else None,
        args=args,
        preprocess=preprocess,
        output=spec,
        labels=labels,
    )


def read_labels(path: Path) -> tuple[str, ...]:
    """One class name per line (UTF-8); a final newline is fine, an empty line is not."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    names = [line.strip() for line in text.splitlines()]
    for number, name in enumerate(names, 1):
        if not name:
            raise ConfigError(f"{path}: line {number} is empty (one class name per line)")
    if not names:
        raise ConfigError(f"{path}: the file is empty (one class name per line)")
    return tuple(names)


class _Table:
    """One table of the manifest: typed getters that fail with the file, table and key."""

    def __init__(self, path: Path, name: str, data: Any) -> None:
        self.path = path
        self.name = name
        self.data: dict[str, Any] = dict(data or {})
        known = _KNOWN[name]
        for key in self.data:
            if key not in known:
                raise self.error(key, f"unknown key (known in [{name}]: {', '.join(known)})")

    def error(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.path}: [{self.name}] {key}: {message}")

    def _get(self, key: str, required: bool) -> Any:
        if key not in self.data:
            if required:
                raise self.error(key, "missing")
            return None
        return self.data[key]

    def text(self, key: str) -> str | None:
        value = self._get(key, False)
        if value is None:
            return None
        if not isinstance(value, str) or not value.strip():
            raise self.error(key, f"must be a non-empty string (got {value!r})")
        return value.strip()

    def choice(self, key: str, options: tuple[str, ...], *, required: bool = False) -> str | None:
        value = self._get(key, required)
        if value is None:
            return None
        if value not in options:
            raise self.error(key, f"must be one of {', '.join(options)} (got {value!r})")
        return str(value)

    def integer(self, key: str, *, low: int, high: int, required: bool = False) -> int | None:
        value = self._get(key, required)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise self.error(key, f"must be an integer from {low} to {high} (got {value!r})")
        return value

    def number(self, key: str, *, low: float, high: float) -> float | None:
        value = self._get(key, False)
        if value is None:
            return None
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not (low <= value <= high)
        ):
            raise self.error(key, f"must be a number from {low} to {high} (got {value!r})")
        return float(value)

    def boolean(self, key: str, *, default: bool) -> bool:
        value = self._get(key, False)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false (got {value!r})")
        return value

    def triple(self, key: str) -> tuple[float, float, float] | None:
        value = self._get(key, False)
        if value is None:
            return None
        if (
            not isinstance(value, list)
            or len(value) != 3
            or any(isinstance(v, bool) or not isinstance(v, int | float) for v in value)
        ):
            raise self.error(key, f"must be a list of 3 numbers, one per channel (got {value!r})")
        return (float(value[0]), float(value[1]), float(value[2]))

    def table(self, key: str) -> dict[str, Any]:
        value = self._get(key, False)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.error(key, f"must be a table of keyword arguments (got {value!r})")
        return dict(value)

    def file_in(self, root: Path, key: str, name: str) -> Path:
        path = (root / name).resolve()
        if not path.is_file():
            raise self.error(key, f"{name} is not a file in {root}")
        return path

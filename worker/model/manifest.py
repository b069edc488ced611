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

import math
import os
import re
import reprlib
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker.base.errors import ConfigError

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
# What a model directory's text files may weigh: a manifest is a few hundred bytes, and a
# million class names fit in the labels' limit. Anything larger is a mistake (or /dev/zero).
MAX_MANIFEST_BYTES = 1024 * 1024
MAX_LABELS_BYTES = 64 * 1024 * 1024
# mean and std apply to 0..1 pixel values: within these bounds every normalised value stays
# inside float16's range (|(1 - -10) / 0.001| = 11000 < 65504).
MEAN_RANGE = (-10.0, 10.0)
STD_RANGE = (0.001, 100.0)

# Values as an error line shows them: a 4,000-digit integer or arrays nested 900 deep
# (both valid TOML) are cut short.
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxstring, _REPR.maxlong, _REPR.maxother = 2, 4, 60, 40, 60

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
    try:
        root = Path(directory).expanduser()
        if root.name == MANIFEST and root.is_file():
            root = root.parent
        if not root.is_dir():
            raise ConfigError(f"GPUFEED_MODEL: {_name(str(root), 300)} is not a directory")
        root = root.resolve()
    except (OSError, RuntimeError, ValueError) as exc:
        # ~user of no such user, a symlink loop, a NUL in the name.
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"GPUFEED_MODEL: {_name(str(directory), 300)}: {_reason(exc)}") from None
    path = root / MANIFEST
    if not os.path.lexists(path):
        raise ConfigError(f"GPUFEED_MODEL: {root} has no {MANIFEST}")
    text = read_small_text(path, MAX_MANIFEST_BYTES)
    try:
        data = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, ValueError) as exc:
        # ValueError: an integer too long for int() (over 4,300 digits).
        raise ConfigError(f"{path}: not valid TOML: {_reason(exc)}") from None
    except RecursionError:
        raise ConfigError(f"{path}: not valid TOML: arrays or tables nested too deep") from None
    for table, value in data.items():
        if table not in _KNOWN:
            raise ConfigError(
                f"{path}: unknown table [{_name(table)}] "
                f"(known: {', '.join(f'[{t}]' for t in _KNOWN)})"
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
                f"{_name(file)}: use a .pt2 file (torch.export.save) or .ts / .pt (TorchScript)",
            )
    weights = model.text("weights")
    args = model.table("args")
    if entry is not None and not _ENTRY.match(entry):
        raise model.error("entry", f"{_shown(entry)} is not of the form 'package.module:callable'")
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
    mean, std = pre.triple("mean", *MEAN_RANGE), pre.triple("std", *STD_RANGE)
    if (mean is None) != (std is None):
        raise pre.error("mean" if mean is None else "std", "give both mean and std, or neither")
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
    elif kind == "classify" and os.path.lexists(root / DEFAULT_LABELS):
        # There, it is meant to be read: one that is no regular file (a FIFO, a link to a
        # device or to nothing) is refused, not passed over.
        labels = root / DEFAULT_LABELS
    if labels is not None:
        check_small_file(labels, MAX_LABELS_BYTES)

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
    """One class name per line (UTF-8); a final newline is fine, an empty line is not.

    Lines end at "\n" (or "\r\n") only: str.splitlines() would also split at form feeds,
    U+2028 and others, and shift every class name after one by a line."""
    lines = read_small_text(path, MAX_LABELS_BYTES).split("\n")
    if lines[-1] == "":
        lines.pop()
    names = [line.removesuffix("\r").strip() for line in lines]
    for number, name in enumerate(names, 1):
        if not name:
            raise ConfigError(f"{path}: line {number} is empty (one class name per line)")
    if not names:
        raise ConfigError(f"{path}: the file is empty (one class name per line)")
    return tuple(names)


def check_small_file(path: Path, limit: int) -> None:
    """What read_small_text would refuse, known from a stat: a manifest refuses a bad
    labels file at start-up, before the model is loaded (read_small_text checks again)."""
    try:
        st = os.stat(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read it: {_reason(exc)}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{path}: not a regular file")
    if st.st_size > limit:
        raise ConfigError(f"{path}: larger than {limit} bytes; is it the right file?")


def read_small_text(path: Path, limit: int) -> str:
    """The UTF-8 text of the regular file `path` (links followed), at most `limit` bytes;
    ConfigError for anything else, without waiting on a FIFO or reading a device."""
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read it: {_reason(exc)}") from None
    try:
        with os.fdopen(fd, "rb") as file:
            fd = -1
            st = os.fstat(file.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"{path}: not a regular file")
            data = file.read(limit + 1)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it: {_reason(exc)}") from None
    finally:
        if fd >= 0:
            os.close(fd)
    if len(data) > limit:
        raise ConfigError(f"{path}: larger than {limit} bytes; is it the right file?")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None


def _reason(exc: BaseException) -> str:
    """One line of `exc`, for an error message."""
    text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return str(text).splitlines()[0][:200]


def _shown(value: Any) -> str:
    return _REPR.repr(value)


def _name(text: str, longest: int = 100) -> str:
    """A key or file name from the manifest, as typed where it is plain, else quoted and
    escaped (a TOML key may hold a newline) and cut short: the error stays one line."""
    return text if text.isprintable() and len(text) <= longest else _shown(text)


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
        return ConfigError(f"{self.path}: [{self.name}] {_name(key)}: {message}")

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
            raise self.error(key, f"must be a non-empty string (got {_shown(value)})")
        return value.strip()

    def choice(self, key: str, options: tuple[str, ...], *, required: bool = False) -> str | None:
        value = self._get(key, required)
        if value is None:
            return None
        if value not in options:
            raise self.error(key, f"must be one of {', '.join(options)} (got {_shown(value)})")
        return str(value)

    def integer(self, key: str, *, low: int, high: int, required: bool = False) -> int | None:
        value = self._get(key, required)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise self.error(key, f"must be an integer from {low} to {high} (got {_shown(value)})")
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
            raise self.error(key, f"must be a number from {low} to {high} (got {_shown(value)})")
        return float(value)

    def boolean(self, key: str, *, default: bool) -> bool:
        value = self._get(key, False)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false (got {_shown(value)})")
        return value

    def triple(self, key: str, low: float, high: float) -> tuple[float, float, float] | None:
        value = self._get(key, False)
        if value is None:
            return None
        if (
            not isinstance(value, list)
            or len(value) != 3
            or any(isinstance(v, bool) or not isinstance(v, int | float) for v in value)
        ):
            raise self.error(
                key, f"must be a list of 3 numbers, one per channel (got {_shown(value)})"
            )
        # nan and inf are TOML floats: every score would be NaN. Integers are checked as
        # integers first, as float() of a long one overflows.
        if not all(low <= v <= high and math.isfinite(v) for v in value):
            above = ", above 0" if low > 0 else ""
            raise self.error(
                key,
                f"every value must be a number from {low:g} to {high:g}{above} "
                f"(got {_shown(value)})",
            )
        return (float(value[0]), float(value[1]), float(value[2]))

    def table(self, key: str) -> dict[str, Any]:
        value = self._get(key, False)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.error(key, f"must be a table of keyword arguments (got {_shown(value)})")
        return dict(value)

    def file_in(self, root: Path, key: str, name: str) -> Path:
        try:
            path = (root / name).resolve()
        except (OSError, RuntimeError, ValueError) as exc:  # a loop, a NUL in the name
            raise self.error(key, f"{_shown(name)}: {_reason(exc)}") from None
        try:
            regular = path.is_file()
        except (OSError, ValueError):  # a name too long for the file system
            regular = False
        if not regular:
            raise self.error(key, f"{_name(name)} is not a file in {root}")
        return path

"""GPUFEED_MODEL as a name: which torchvision classifiers exist, and the hint for one that
does not, without importing torch or torchvision (seconds), so a wrong name is refused
before anything is loaded or any Redis is asked.

The names are those torchvision's classification modules register (`@register_model()` in
torchvision/models/*.py, the files `torchvision.models.list_models(module=torchvision.models)`
reads), found by reading the installed package's source: a few milliseconds, always the
installed version. Should a future torchvision register them otherwise, the scan finds none
and the name is checked after torch is imported instead (`check_name` with the imported
list), with the same hints. tests/model/test_model_names.py holds the scan to torchvision's list.
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import re
import stat
from collections.abc import Collection
from pathlib import Path

from worker.base.errors import ConfigError
from worker.base.paths import lookup
from worker.model.manifest import MANIFEST, looks_like_model_dir

# The null model (null.py), named here so that naming it needs no torch.
NULL_MODEL = "null"

# `@register_model()` or `@register_model(name="...")`, other decorators, then the `def`.
_REGISTERED = re.compile(
    r"^@register_model\((?:name=[\"'](\w+)[\"'])?\)\n.*?^def (\w+)\(", re.M | re.S
)


@functools.cache
def registered_models() -> frozenset[str]:
    """torchvision's classification model names, read from its source; empty when the
    package or its registrations cannot be found that way."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return frozenset()
    models = Path(next(iter(spec.submodule_search_locations))) / "models"
    names: set[str] = set()
    for source in sorted(models.glob("*.py")):
        try:
            text = source.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return frozenset()
        names.update(given or defined for given, defined in _REGISTERED.findall(text))
    return frozenset(names)


def is_null_model(name: str) -> bool:
    return name.strip().lower() == NULL_MODEL


def check_name(value: str, known: Collection[str] | None = None) -> str:
    """The model GPUFEED_MODEL names, as the loader takes it: a path or `null` unchanged, a
    torchvision name in its registered spelling (`Resnet18` -> resnet18 where one name
    matches regardless of case). ConfigError with a hint for an unknown name; unchanged
    when the names are not known without torch (checked at load)."""
    if looks_like_model_dir(value) or is_null_model(value):
        return value
    names = registered_models() if known is None else frozenset(known)
    if not names or value in names:
        return value
    same = [n for n in names if n.lower() == value.lower()]
    if len(same) == 1:
        return same[0]
    shown = repr(value) if len(value) <= 100 else repr(value[:97]) + "..."
    raise ConfigError(f"GPUFEED_MODEL: unknown model {shown}; {_hint(value, names)}")


def _hint(value: str, names: Collection[str]) -> str:
    # `lookup`, not Path.is_dir(): a name no file system takes (300 digits) is still just an
    # unknown model, not a traceback.
    folder = lookup(value)
    if folder is not None and stat.S_ISDIR(folder.st_mode):
        manifest = lookup(Path(value) / MANIFEST)
        has = "holds" if manifest is not None and stat.S_ISREG(manifest.st_mode) else "has no"
        return (
            f"did you mean `./{value}`? (the folder here, which {has} {MANIFEST}: a model "
            "directory is written as a path)"
        )
    candidates = sorted({*names, NULL_MODEL})
    close = difflib.get_close_matches(value.lower(), candidates, n=3, cutoff=0.6)
    also = (
        ""
        if NULL_MODEL in close
        else f"; or {NULL_MODEL} (a step that does next to nothing, for measuring gpufeed itself)"
    )
    listed = "`python -m worker model list` shows every torchvision model"
    if close:
        return f"did you mean {' or '.join(close)}? ({listed}){also}"
    return f"{listed}, or name a model directory by its path (./my-model){also}"

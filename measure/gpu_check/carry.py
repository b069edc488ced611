"""python -m measure.gpu_check.carry: is the carried site really what the check runs on?

scripts/gpu-check.sh installs the carried wheels (`.gpu-check/wheels/`, gathered by
`make gpu-check-prepare`) into a private folder (`.gpu-check/site/`) first on PYTHONPATH.
A stamp file saying "installed" proved nothing: a carry that keeps file times but not the
folder's contents, an interrupted install, or a host package shadowing a carried one all
left a check that failed later, far from the cause. This module is the proof instead: for
each wheel it finds the installed distribution of that name and version in the site and
imports each top-level module the wheel ships, from there. A wheel with no module of its
own (nvJPEG's shared library) counts as verified by its installed metadata.

Exit status 0 when every wheel is there and imports; 1 otherwise, each problem on a line
that names the wheel and the module. Imports only the standard library before it imports
the carried modules themselves: it runs before anything else of the check is importable.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import importlib
import io
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path


def normalize(name: str) -> str:
    """A distribution's name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Wheel:
    name: str
    version: str
    file: str

    @classmethod
    def from_file(cls, path: Path) -> Wheel:
        name, version = path.name.removesuffix(".whl").split("-")[:2]
        return cls(normalize(name), version, path.name)


@dataclass
class Installed:
    name: str
    version: str
    modules: list[str] = field(default_factory=list)


def _top_level_modules(record: list[str]) -> list[str]:
    """The importable top-level names of an installed distribution, from its RECORD: a
    package (a folder with `__init__.py`), a module file, or the first package inside a
    namespace folder (`nvidia/nvimgcodec/`)."""
    paths = [p for p in record if p and not p.startswith("..")]
    inits = {p.rsplit("/", 1)[0] for p in paths if p.endswith("/__init__.py")}
    found: list[str] = []
    for p in paths:
        parts = p.split("/")
        top = parts[0]
        if top.endswith((".dist-info", ".data", ".libs")) or top == "__pycache__":
            continue
        if len(parts) == 1:
            if top.endswith(".py") and top != "__init__.py":
                found.append(top.removesuffix(".py"))
            elif top.endswith(".so"):
                found.append(top.split(".", 1)[0])
        elif top in inits:
            found.extend(_package_names(top, paths, inits))
        elif len(parts) > 2 and f"{top}/{parts[1]}" in inits:
            found.append(f"{top}.{parts[1]}")
    # A distribution's private helpers (`_pytest`, `_hypothesis_pytestplugin`) are imported
    # by its public package; importing the public ones is the check.
    public = [m for m in dict.fromkeys(found) if not m.startswith("_")]
    return public or list(dict.fromkeys(found))


def _package_names(top: str, paths: list[str], inits: set[str]) -> list[str]:
    """`top`, or its subpackages where `top` holds nothing but them: an `nvidia/` whose
    `__init__.py` is empty says nothing about the library inside it."""
    own = [
        p
        for p in paths
        if p.count("/") == 1 and p.startswith(f"{top}/") and p.endswith((".py", ".so"))
    ]
    if own != [f"{top}/__init__.py"]:
        return [top]
    subs = sorted(
        {i.replace("/", ".") for i in inits if i.count("/") == 1 and i.startswith(f"{top}/")}
    )
    return subs or [top]


def installed_in(site: Path) -> dict[str, Installed]:
    """Every distribution installed in `site`, by normalized name."""
    out: dict[str, Installed] = {}
    for info in sorted(site.glob("*.dist-info")):
        meta = (info / "METADATA").read_text(encoding="utf-8", errors="replace")
        name = re.search(r"^Name: *(.+)$", meta, re.MULTILINE)
        version = re.search(r"^Version: *(.+)$", meta, re.MULTILINE)
        if name is None or version is None:
            continue
        record_file = info / "RECORD"
        rows = (
            list(csv.reader(io.StringIO(record_file.read_text(encoding="utf-8"))))
            if record_file.exists()
            else []
        )
        dist = Installed(normalize(name.group(1).strip()), version.group(1).strip())
        dist.modules = _top_level_modules([row[0] for row in rows if row])
        out[dist.name] = dist
    return out


def _is_under(module: str, site: Path) -> str | None:
    """Where `module` was imported from, when that is not inside `site` (else None)."""
    loaded = sys.modules[module]
    where = getattr(loaded, "__file__", None)
    paths = [where] if where else list(getattr(loaded, "__path__", []))
    for p in paths:
        with contextlib.suppress(ValueError):
            Path(p).resolve().relative_to(site.resolve())
            return None
    return str(paths[0]) if paths else "nowhere"


def verify(site: Path, wheels: list[Path]) -> tuple[list[str], list[str]]:
    """(what was verified, the problems): each wheel installed in `site` at its version,
    and each of its modules imported from there."""
    ok: list[str] = []
    problems: list[str] = []
    if not site.is_dir():
        return ok, [f"{site} does not exist: the carried wheels are not installed"]
    found = installed_in(site)
    for path in wheels:
        wheel = Wheel.from_file(path)
        dist = found.get(wheel.name)
        if dist is None:
            problems.append(
                f"{wheel.name} {wheel.version} ({wheel.file}) is not installed in {site}"
            )
            continue
        if dist.version != wheel.version:
            problems.append(
                f"{wheel.name}: {dist.version} is installed in {site}, the carry has "
                f"{wheel.version} ({wheel.file})"
            )
            continue
        bad = False
        for module in dist.modules:
            try:
                importlib.import_module(module)
            except Exception as exc:  # noqa: BLE001 - any failure to import is the finding
                problems.append(
                    f"{wheel.name} {wheel.version}: module {module!r} does not import: "
                    f"{type(exc).__name__}: {exc}"
                )
                bad = True
                continue
            elsewhere = _is_under(module, site)
            if elsewhere is not None:
                problems.append(
                    f"{wheel.name} {wheel.version}: module {module!r} is imported from "
                    f"{elsewhere}, not from the carry in {site}"
                )
                bad = True
        if not bad:
            ok.append(f"{wheel.name} {wheel.version} ({', '.join(dist.modules) or 'no module'})")
    return ok, problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m measure.gpu_check.carry",
        description="Verify that every carried wheel is installed in the site and imports "
        "from there (run with the site first on PYTHONPATH).",
    )
    parser.add_argument("--site", type=Path, required=True, help="the folder installed into")
    parser.add_argument("--wheels", type=Path, required=True, help="the carried wheels' folder")
    parser.add_argument("--quiet", action="store_true", help="print only the problems")
    args = parser.parse_args(argv)
    wheels = sorted(args.wheels.glob("*.whl"))
    if not wheels:
        print(f"carry: FAILED: no wheel in {args.wheels}", file=sys.stderr)
        return 1
    ok, problems = verify(args.site, wheels)
    for line in problems:
        print(f"carry: FAILED: {line}", file=sys.stderr)
    if not args.quiet and not problems:
        print(f"carry: {len(ok)} wheels installed in {args.site}, each importing from there")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())

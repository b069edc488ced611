"""make gpu-check-rehearse: the GPU check's own steps, here, in a GPU host's environment.

A GPU host is lent rarely and for minutes; a check that fails there on its own set-up (a
package the carry misses, a carried one shadowing the host's, a test module importing what
the host lacks) spends the run for nothing. This rehearses those steps on every `make
test`, in an environment that has exactly what a GPU host has:

- the host's own packages, as ../shared/gpu-host/README.md lists them (torch, torchvision,
  numpy, pillow, msgpack, uvloop, nvidia-ml-py, prometheus-client, psutil, rich, typer),
  with what they require, and pip: a fresh virtual environment of this machine's Python
  whose site-packages links only those distributions of the development environment
  (nothing else of it is importable there);
- what `make gpu-check-prepare` carries (scripts/prepare-gpu-host.sh), prepared for this
  machine's Python: the same packages at the same versions as the GPU host's carry.

In it, `scripts/gpu-check.sh --rehearse` runs with that environment's interpreter as the
host's: the carry installed and verified, the carried redis-server started, the CUDA tests
collected with the check's own pytest command line, its entry points started. The GPU
host's own carry (for its Python 3.12) is prepared too and its size held to the limit.

    python scripts/gpu_host_rehearsal.py [--work DIR] [--drop NAME ...] [--prepared DIR]

--drop NAME removes a carried wheel before the rehearsal (shows what its absence breaks);
--prepared DIR takes the carries and the host environment an earlier run prepared.
Exit status: the rehearsal's (0 when every step passed), 2 when it could not be set up.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import venv
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]

# The GPU host's own distributions (../shared/gpu-host/README.md), besides its Python's
# standard library. pip: the check installs the carry with the host's pip.
HOST_PACKAGES = (
    "torch",
    "torchvision",
    "numpy",
    "pillow",
    "msgpack",
    "uvloop",
    "nvidia-ml-py",
    "prometheus-client",
    "psutil",
    "rich",
    "typer",
    "pip",
)
# The GPU host's Python, for which the real carry is prepared.
HOST_PYTHON = "3.12"
CARRY_LIMIT_MIB = 64


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _installed() -> dict[str, metadata.Distribution]:
    out: dict[str, metadata.Distribution] = {}
    for dist in metadata.distributions():
        out.setdefault(normalize(dist.metadata["Name"]), dist)
    return out


def host_closure(
    names: Iterable[str], installed: dict[str, metadata.Distribution]
) -> tuple[list[str], list[str]]:
    """(the host's distributions present here with everything they require on this
    Python, the host's packages this environment does not have)."""
    env = default_environment()
    chosen: set[str] = set()
    absent: list[str] = []
    todo: list[tuple[str, frozenset[str]]] = [(normalize(n), frozenset()) for n in names]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        dist = installed.get(name)
        if dist is None:
            absent.append(name)
            continue
        chosen.add(name)
        for text in dist.requires or []:
            req = Requirement(text)
            wanted = req.marker is None or any(
                req.marker.evaluate({**env, "extra": extra}) for extra in ("", *extras)
            )
            if wanted:
                todo.append((normalize(req.name), frozenset(req.extras)))
    return sorted(chosen), sorted(set(absent))


def _files(dist: metadata.Distribution) -> list[str]:
    return [
        str(f)
        for f in dist.files or []
        if not str(f).startswith("..") and "__pycache__" not in f.parts
    ]


def link_site(
    site: Path, source: Path, chosen: list[str], installed: dict[str, metadata.Distribution]
) -> int:
    """Links into `site` every file and folder of the chosen distributions found in
    `source` (the development site-packages), each at the shallowest level that holds
    nothing of any other distribution: `torch/` whole, but `nvidia/` file by file where
    other distributions share it. Returns how many links were made."""
    owners: dict[str, set[str]] = {}
    for name, dist in installed.items():
        if Path(str(dist.locate_file(""))).resolve() != source.resolve():
            continue
        for f in _files(dist):
            parts = f.split("/")
            for depth in range(1, len(parts) + 1):
                owners.setdefault("/".join(parts[:depth]), set()).add(name)
    wanted = set(chosen)
    linked: set[str] = set()
    for name in chosen:
        for f in _files(installed[name]):
            parts = f.split("/")
            for depth in range(1, len(parts) + 1):
                prefix = "/".join(parts[:depth])
                if prefix in linked:
                    break
                if owners.get(prefix, {name}) <= wanted or depth == len(parts):
                    target = site / prefix
                    if not target.exists() and (source / prefix).exists():
                        target.parent.mkdir(parents=True, exist_ok=True)
                        target.symlink_to(source / prefix)
                    linked.add(prefix)
                    break
    return len(linked)


def build_host_env(where: Path) -> tuple[Path, list[str], list[str]]:
    """A virtual environment with only the GPU host's packages: (its python, the
    distributions it has, the host's packages that were not here to link)."""
    shutil.rmtree(where, ignore_errors=True)
    venv.EnvBuilder(symlinks=True, with_pip=False, clear=True).create(where)
    python = where / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    installed = _installed()
    chosen, absent = host_closure(HOST_PACKAGES, installed)
    source = Path(str(installed["torch"].locate_file("")))
    link_site(site, source, chosen, installed)
    return python, chosen, absent


def _clean_env() -> dict[str, str]:
    """This process's environment less what points into the development environment."""
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "VIRTUAL_ENV"}}
    dev_bin = str(Path(sys.prefix) / "bin")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != dev_bin)
    return env


def prepare(dest: Path, python_version: str) -> tuple[int, str]:
    """scripts/prepare-gpu-host.sh into `dest` for `python_version`: (exit status, output)."""
    env = {
        **_clean_env(),
        "GPU_CHECK_DIR": str(dest),
        "GPU_CHECK_PYTHON_VERSION": python_version,
        "PIP": f"{sys.executable} -m pip",
    }
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "prepare-gpu-host.sh")],
        env=env,
        check=False,
        capture_output=True,
        text=True,
    )
    lines = [
        line
        for line in (done.stdout + done.stderr).splitlines()
        if not line.startswith("WARNING: Location")
    ]
    return done.returncode, "\n".join(lines)


def size_kib(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) // 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=ROOT / ".gpu-check-rehearsal")
    parser.add_argument("--drop", action="append", default=[], metavar="NAME")
    parser.add_argument(
        "--prepared",
        type=Path,
        default=None,
        metavar="DIR",
        help="an earlier rehearsal's --work folder: its prepared carries and host "
        "environment are used as they are",
    )
    args = parser.parse_args(argv)
    work: Path = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    prepared: Path = (args.prepared or work).resolve()
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    summary: dict[str, object] = {"python": here, "host_python": HOST_PYTHON}

    # The GPU host's own carry, for its Python: its size against the limit. Then the same
    # carry for this Python, which the rehearsal installs.
    for folder, version in (("host-carry", HOST_PYTHON), ("carry-prepared", here)):
        if args.prepared is not None:
            continue
        rc, text = prepare(prepared / folder, version)
        if rc != 0:
            print(text, file=sys.stderr)
            print(
                f"rehearsal: FAILED: preparing the carry for Python {version} exited {rc}",
                file=sys.stderr,
            )
            return 2
    host_kib = size_kib(prepared / "host-carry")
    summary["carry_kib"] = host_kib
    summary["carry_spare_kib"] = CARRY_LIMIT_MIB * 1024 - host_kib
    print(
        f"rehearsal: the GPU host's carry is {host_kib / 1024:.1f} MiB, "
        f"{CARRY_LIMIT_MIB - host_kib / 1024:.1f} MiB under the {CARRY_LIMIT_MIB} MiB limit"
    )

    # The carry this run installs: the prepared one (linked, not copied) less --drop.
    carry = work / "carry"
    shutil.rmtree(carry, ignore_errors=True)
    shutil.copytree(prepared / "carry-prepared", carry, copy_function=os.link)
    for name in args.drop:
        dropped = [
            w
            for w in (carry / "wheels").glob("*.whl")
            if normalize(w.name.split("-")[0]) == normalize(name)
        ]
        if not dropped:
            print(f"rehearsal: --drop {name}: no such wheel in the carry", file=sys.stderr)
            return 2
        for w in dropped:
            w.unlink()
        print(f"rehearsal: dropped {', '.join(w.name for w in dropped)} from the carry")

    if args.prepared is None:
        python, chosen, absent = build_host_env(prepared / "host-env")
    else:
        python = prepared / "host-env" / "bin" / "python"
        chosen, absent = host_closure(HOST_PACKAGES, _installed())
    summary["host_distributions"] = len(chosen)
    summary["host_packages_absent_here"] = absent
    print(
        f"rehearsal: host environment {python.parent.parent}: {len(chosen)} distributions"
        + (f" (not installed here, so not in it: {', '.join(absent)})" if absent else "")
    )

    out = work / "out"
    shutil.rmtree(out, ignore_errors=True)
    env = {
        **_clean_env(),
        "PYTHON": str(python),
        "GPU_CHECK_DIR": str(carry),
        "GPU_CHECK_OUT": str(out),
    }
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--rehearse"],
        env=env,
        cwd=ROOT,
        check=False,
    )
    summary["rc"] = done.returncode
    (work / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return done.returncode


if __name__ == "__main__":
    raise SystemExit(main())

"""python -m measure.gpu_check.preflight: can this host run the GPU check at all? Fails fast.

Run by scripts/gpu-check.sh before anything else, so that a host that cannot really run on
its GPU says so in seconds instead of passing with every CUDA test skipped:

- CUDA: torch must see the device asked for (`--device`, default cuda:0). A driver too old
  for the wheel, no GPU, or a CUDA_VISIBLE_DEVICES that hides it all end here, with what
  torch said about it.
- triton's toolchain: on first use triton compiles small C helpers (its CUDA driver
  bindings) with the host's C compiler against the Python headers, so a host without
  either fails deep inside the first torch.compile. The same build is tried here on a
  one-line extension: the compiler triton would pick (CC, else gcc, else clang) and the
  include folder it would pass (sysconfig's, with Debian's posix_local read as
  posix_prefix).

Imports only the standard library (and torch, for the CUDA check), so it runs before the
carried wheels are installed. Writes `report.json` into --out when it fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

_PROBE_SOURCE = """#include <Python.h>
static PyModuleDef probe = {PyModuleDef_HEAD_INIT, "probe", NULL, -1, NULL};
PyMODINIT_FUNC PyInit_probe(void) { return PyModule_Create(&probe); }
"""


def find_c_compiler(env: Mapping[str, str]) -> str | None:
    """The C compiler triton (3.6 to 3.8) builds with: $CC as given, else gcc, else clang."""
    if env.get("CC"):
        return env["CC"]
    path = env.get("PATH")
    return shutil.which("gcc", path=path) or shutil.which("clang", path=path)


def python_include_dir() -> str:
    """The folder triton passes as -I for Python.h."""
    scheme = sysconfig.get_default_scheme()
    if scheme == "posix_local":  # Debian's scheme; triton reads posix_prefix instead
        scheme = "posix_prefix"
    return sysconfig.get_paths(scheme=scheme)["include"]


def check_toolchain(env: Mapping[str, str], include_dir: str | None = None) -> list[str]:
    """Problems that would stop triton from building its helpers (empty: none)."""
    include = include_dir if include_dir is not None else python_include_dir()
    cc = find_c_compiler(env)
    problems = []
    if cc is None:
        problems.append(
            "no C compiler: triton builds its CUDA helpers with one at the first compile "
            "(install gcc, or set CC)"
        )
    elif shutil.which(cc, path=env.get("PATH")) is None:
        problems.append(f"CC={cc} is not an executable C compiler")
    if not Path(include, "Python.h").is_file():
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        problems.append(
            f"no Python headers ({include}/Python.h is missing): triton compiles against "
            f"them (install python{version}-dev or the distribution's equivalent)"
        )
    if problems:
        return problems
    assert cc is not None
    with tempfile.TemporaryDirectory(prefix="gpu-preflight-") as tmp:
        src = Path(tmp, "probe.c")
        src.write_text(_PROBE_SOURCE)
        suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
        cmd = [
            cc,
            str(src),
            "-O0",
            "-shared",
            "-fPIC",
            f"-I{include}",
            "-o",
            f"{tmp}/probe{suffix}",
        ]
        try:
            done = subprocess.run(
                cmd, capture_output=True, text=True, timeout=60, check=False, env=dict(env)
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return [f"the C compiler {cc} could not be run: {exc}"]
        if done.returncode != 0:
            tail = " ".join((done.stderr or done.stdout).split())[-400:]
            return [f"the C compiler {cc} cannot build a Python extension: {tail}"]
    return []


def check_cuda(device: str) -> tuple[list[str], dict[str, Any]]:
    """Problems with running on `device` (empty: none), and what torch reports."""
    if not device.startswith("cuda"):
        return [f"the GPU check needs a CUDA device, not {device!r}"], {}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        import torch

        available = torch.cuda.is_available()
        count = torch.cuda.device_count() if available else 0
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": available,
        "device_count": count,
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    said = [" ".join(str(w.message).split())[:300] for w in seen]
    if said:
        info["torch_warnings"] = said
    if not available:
        why = f" torch says: {said[0]}" if said else ""
        return [
            f"CUDA is not available to torch {torch.__version__} (built for CUDA "
            f"{torch.version.cuda}): no GPU, a driver too old for this wheel, or "
            f"CUDA_VISIBLE_DEVICES hides it.{why}"
        ], info
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    if index >= count:
        return [f"{device} asked for, but torch sees {count} CUDA device(s)"], info
    info["device_name"] = torch.cuda.get_device_name(index)
    return [], info


def main(argv: list[str] | None = None) -> int:
    # argparse, not click like the other tools: this runs before the carried wheels (click
    # among them) are installed, on a host whose Python may have nothing but the standard
    # library and torch.
    p = argparse.ArgumentParser(prog="python -m measure.gpu_check.preflight", description=__doc__)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--out", default=None, help="folder for report.json when it fails")
    args = p.parse_args(argv)
    problems, info = check_cuda(args.device)
    # Checked even without CUDA: the operator gets every missing piece in one go.
    problems += check_toolchain(os.environ)
    if not problems:
        print(f"gpu-preflight: ok ({info.get('device_name')}, torch {info.get('torch')})")
        return 0
    for problem in problems:
        print(f"gpu-check: FAILED before running anything: {problem}", file=sys.stderr)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        report = {
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "error": "preflight: " + "; ".join(problems),
            "preflight": {"device": args.device, "problems": problems, **info},
            "verdict": {"passed": False, "problems": problems},
        }
        (out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 2


if __name__ == "__main__":
    sys.exit(main())

"""Where a measurement's figures come from: the CPU model and the source tree measured.

The bench's `host` block and the GPU check's `environment` block carry these
(report_head.FIELDS), so that a figure quoted in the docs can say which machine and which
code it measured (measure/bench/figures_page.py heads every figure section with them).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

# The tree the running code was imported from (worker/tools/harness/ -> the repository root).
SOURCE_ROOT = Path(__file__).resolve().parents[3]


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The first `model name` of /proc/cpuinfo (Linux on x86 and most arm64 kernels);
    None where there is none."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("model name", "Model", "cpu model") and value.strip():
            return " ".join(value.split())
    return None


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(SOURCE_ROOT), *args],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def source_commit() -> dict[str, Any]:
    """`commit`: the commit the measured code was checked out at (None outside a git
    checkout); `commit_dirty`: whether tracked files differed from it."""
    commit = _git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "commit_dirty": None}
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "commit_dirty": bool(status) if status is not None else None}


def host_extras() -> dict[str, Any]:
    """The head block's fields this module measures, keyed as report_head.FIELDS."""
    return {"cpu_model": cpu_model(), **source_commit()}

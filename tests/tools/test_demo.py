"""`make demo` as a newcomer sees it: progress while the sample images are made, and one
line, not a download log, when the pretrained weights cannot be fetched."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.cli_runner import ROOT, clean_env
from tests.support.redis_server import free_port
from worker.tools.demo import sample_images

OFFLINE_CHECK = """
from worker.tools.demo import make_samples, weights_for_demo
print("weights:", weights_for_demo("resnet18", "DEFAULT"))
make_samples(2)
"""


def test_sample_images_report_progress() -> None:
    ticks: list[int] = []
    images = sample_images(3, on_image=lambda: ticks.append(1))
    assert len(ticks) == 3  # one per JPEG, as it is made
    names = [name for name, _ in images]
    assert names[:3] == ["sample-000.jpg", "sample-001.jpg", "sample-002.jpg"]
    assert {"logo.png", "truncated.jpg", "notes.txt"} <= set(names)


def test_offline_weights_are_one_line(tmp_path: Path) -> None:
    # No network: every HTTPS request goes to a proxy port where nothing listens.
    proxy = f"http://127.0.0.1:{free_port()}"
    proc = subprocess.run(
        [sys.executable, "-c", OFFLINE_CHECK],
        cwd=ROOT,
        env=clean_env(TORCH_HOME=str(tmp_path / "torch"), HTTPS_PROXY=proxy, https_proxy=proxy),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert lines[0].startswith("no pretrained weights for resnet18 (")
    assert "random weights" in lines[0]
    assert "Downloading" not in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert lines[1] == "weights: none"
    assert lines[2].startswith("made 5 sample images: 2 JPEGs")
    assert len(lines) == 3

"""The GPU check's DataLoader peer on the CPU: its model compiled as the worker's step is
(once, no recompile while it is timed), or eager with the compiler's refusal in the report.
A tiny model and 96x64 JPEGs keep it cheap; the compile is inductor's `default` mode, as
in test_compiler."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from measure.gpu_check.peer import dataloader_rate
from worker.decode.samples import synthetic_jpeg


def tiny() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, stride=4), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)
    ).eval()


def peer(tmp_path: Path, compile_mode: str) -> dict[str, Any]:
    files = []
    for i in range(3):
        path = tmp_path / f"{i}.jpg"
        path.write_bytes(synthetic_jpeg(96, 64, seed=i, quality=85))
        files.append(path)
    return dataloader_rate(
        tiny(),
        files,
        batch=4,
        resize=40,
        crop=32,
        mean=[0.5] * 3,
        std=[0.25] * 3,
        dtype=torch.float32,
        device=torch.device("cpu"),
        seconds=0.3,
        workers=1,
        compile_mode=compile_mode,
    )


@pytest.mark.slow
def test_the_peer_runs_the_model_compiled_with_the_workers_mode(tmp_path: Path) -> None:
    found = peer(tmp_path, "default")
    assert found["compiled"] is True and found["compile_mode"] == "default"
    assert found["compile_s"] > 0 and found["recompiles_in_window"] == 0
    assert "compile_refused" not in found
    assert found["images_per_s"] > 0 and found["model_alone_images_per_s"] > 0
    assert "model compiled (default)" in found["how"]


def test_a_mode_the_compiler_refuses_leaves_the_peer_eager_and_says_why(tmp_path: Path) -> None:
    found = peer(tmp_path, "no-such-mode")
    assert found["compiled"] is False and found["compile_mode"] == "no-such-mode"
    assert "no-such-mode" in found["compile_refused"]
    assert found["images_per_s"] > 0 and "model eager" in found["how"]

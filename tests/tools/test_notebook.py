"""`worker.notebook.batch`: a folder, an nn.Module and an output from Python, run through the
`--local` service; docs/own-model.md's "From a notebook" example is the run, and a module
that cannot serve is refused with its reason before any service starts."""

from __future__ import annotations

import io
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from tests.support.images import jpeg_bytes
from worker.base.errors import ConfigError
from worker.model.from_module import ModuleNotExportable

ROOT = Path(__file__).resolve().parents[2]
IMAGES = 3


def notebook_example() -> str:
    text = (ROOT / "docs" / "own-model.md").read_text()
    section = text.split("## From a notebook", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "docs/own-model.md: From a notebook has no ```python example"
    return match.group(1)


@pytest.fixture
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This process's temporary folders go here, so that what a call leaves is seen."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def model_folders(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("gpufeed-model-*"))


@pytest.mark.slow
def test_the_documented_example_returns_one_ok_row_per_image_with_the_modules_outputs(
    tmp_path: Path,
    private_tmp: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    photos = tmp_path / "photos"
    photos.mkdir()
    for i in range(IMAGES):
        # The example's input size, so that "squash" leaves the decoded pixels as they are.
        (photos / f"img-{i}.jpg").write_bytes(jpeg_bytes(32, 32, seed=i))
    monkeypatch.chdir(tmp_path)
    for name, value in {
        "GPUFEED_DEVICE": "cpu",
        "GPUFEED_BATCH_SIZE": "4",
        "GPUFEED_COMPILE": "off",
    }.items():
        monkeypatch.setenv(name, value)
    namespace: dict[str, Any] = {"__name__": "notebook"}

    exec(compile(notebook_example(), "own-model.md", "exec"), namespace)

    table = namespace["table"]
    rows = sorted(table.to_pylist(), key=lambda r: r["id"])
    assert [r["id"] for r in rows] == [f"img-{i}.jpg" for i in range(IMAGES)]
    assert [r["status"] for r in rows] == ["ok"] * IMAGES
    assert {r["model"] for r in rows} == {"TinyNet"}
    mean = torch.tensor((0.485, 0.456, 0.406)).view(3, 1, 1)
    std = torch.tensor((0.229, 0.224, 0.225)).view(3, 1, 1)
    net = namespace["net"]
    for row in rows:
        pixels = np.asarray(Image.open(io.BytesIO((photos / row["id"]).read_bytes())))
        x = (torch.from_numpy(pixels.copy()).permute(2, 0, 1).float() / 255.0 - mean) / std
        with torch.inference_mode():
            want = net(x[None])[0].numpy()
        # Decoders may round a JPEG's pixels differently by one level.
        np.testing.assert_allclose(np.asarray(row["embedding"]), want, atol=2e-2, rtol=0)
    assert (tmp_path / "vectors.parquet").is_file()
    assert model_folders(private_tmp) == []
    # The progress bar, drawn once at the end where stderr is no terminal.
    bar = capsys.readouterr().err
    assert re.search(rf"batch\b.*\b{IMAGES}/{IMAGES}\b.*ok {IMAGES}  errors 0", bar), bar


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x).mean(dim=(2, 3))
        if y.sum() > 0:
            return y
        return -y


BRANCH_LINE = Branchy.forward.__code__.co_firstlineno + 2


class FixedBatch(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(2, -1)


class Maps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class Pool(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(2, 3))


def program_of_batch_two() -> torch.export.ExportedProgram:
    return torch.export.export(Pool(), (torch.zeros(2, 3, 32, 32),))


@pytest.mark.parametrize(
    ("make", "error", "said"),
    [
        (Branchy, ModuleNotExportable, "Branchy cannot be exported: its control flow depends"),
        (FixedBatch, ModuleNotExportable, "FixedBatch cannot be exported: its code fixes the"),
        (Maps, ConfigError, "Maps: gpufeed.toml: [output] kind: embed, but model.pt2 returns"),
        (program_of_batch_two, ConfigError, "the exported program: gpufeed.toml: [model] file:"),
    ],
    ids=["data-dependent", "fixed-batch", "wrong-kind", "program-of-one-batch-size"],
)
def test_a_module_that_cannot_serve_fails_with_its_reason_before_any_service_starts(
    tmp_path: Path,
    private_tmp: Path,
    monkeypatch: pytest.MonkeyPatch,
    make: Callable[[], nn.Module | torch.export.ExportedProgram],
    error: type[Exception],
    said: str,
) -> None:
    from worker import notebook

    photos = tmp_path / "photos"
    photos.mkdir()
    (photos / "a.jpg").write_bytes(jpeg_bytes(32, 32))

    def no_service(**_: Any) -> None:
        raise AssertionError("a local service was started")

    monkeypatch.setattr(notebook, "local_service", no_service)
    monkeypatch.setenv("GPUFEED_BATCH_SIZE", "4")
    with pytest.raises(error) as caught:
        notebook.batch(photos, make(), tmp_path / "out.parquet", input_size=32)
    message = str(caught.value)
    assert message.startswith(said), message
    assert "\n" not in message
    if make is Branchy:
        # Where in the module: the line torch.export stopped at.
        assert message.endswith(f"at {Path(__file__).name}:{BRANCH_LINE} (if y.sum() > 0:)")
    if make is Maps:
        assert "returns [2, 16, 32, 32]; embed needs [batch, dim]" in message
    if make is program_of_batch_two:
        assert "exported for batch 2 only" in message and "GPUFEED_BATCH_SIZE=2" in message
    assert not (tmp_path / "out.parquet").exists()
    assert model_folders(private_tmp) == []

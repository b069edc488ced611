"""Model directories for tests: a tiny CNN packaged the three ways users package theirs
(torch.export, TorchScript, an entry point with weights), and an eager reference that
computes what gpufeed should answer from the same decoded pixels."""

from __future__ import annotations

import math
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

# The model's source, written into entry-point directories as tinynet.py and executed here
# for the exported and scripted ones, so all three are the same code.
TINYNET_SOURCE = '''
import torch
from torch import nn


class TinyNet(nn.Module):
    """A small CNN: [B, 3, S, S] -> [B, out] (classify, embed) or [B, out, 4, 4] (raw)."""

    def __init__(self, out: int = 5, raw: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, out)
        self.mix = nn.Conv2d(8, out, 1)
        self.raw = raw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn(self.conv(x)))
        if self.raw:
            return nn.functional.adaptive_avg_pool2d(self.mix(y), 4)
        return self.fc(y.mean(dim=(2, 3)))


def build(out: int = 5, raw: bool = False) -> TinyNet:
    return TinyNet(out, raw).eval()


# Models that do not fit, for the start-up errors.
def flat(out: int = 5, size: int = 32) -> nn.Module:
    """Takes size x size inputs only."""
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * size * size, out)).eval()


class Pair(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x.mean(dim=(2, 3))
        return y, y


def pair() -> nn.Module:
    return Pair()


class Wide(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros((x.shape[0], 300, 300))


def wide() -> nn.Module:
    return Wide()


def broken() -> nn.Module:
    raise ValueError("the checkpoint server is down")


def not_a_module() -> dict[str, int]:
    return {"weights": 1}
'''

_source = ModuleType("tinynet_source")
exec(compile(TINYNET_SOURCE, "tinynet.py", "exec"), _source.__dict__)
TinyNet: type[nn.Module] = _source.TinyNet

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def tiny_net(out: int = 5, *, raw: bool = False, seed: int = 0) -> nn.Module:
    """The same weights for the same seed; BatchNorm statistics made non-trivial."""
    torch.manual_seed(seed)
    model = TinyNet(out, raw)
    with torch.no_grad():
        model.bn.running_mean.uniform_(-0.2, 0.2)
        model.bn.running_var.uniform_(0.5, 2.0)
    return model.eval()


def toml_text(tables: dict[str, dict[str, Any]]) -> str:
    """A gpufeed.toml from nested dicts (strings, numbers, booleans, lists, one level of
    sub-tables)."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return repr(v)

    lines: list[str] = []
    for table, keys in tables.items():
        lines.append(f"[{table}]")
        subtables = {k: v for k, v in keys.items() if isinstance(v, dict)}
        lines += [f"{k} = {value(v)}" for k, v in keys.items() if not isinstance(v, dict)]
        for name, sub in subtables.items():
            lines.append(f"[{table}.{name}]")
            lines += [f"{k} = {value(v)}" for k, v in sub.items()]
    return "\n".join(lines) + "\n"


def write_tinynet(root: Path) -> None:
    """tinynet.py in `root`, for `entry = "tinynet:..."`."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "tinynet.py").write_text(TINYNET_SOURCE)


def make_model_dir(
    root: Path,
    *,
    fmt: str = "export",
    kind: str = "classify",
    out: int = 5,
    input_size: int = 32,
    output: dict[str, Any] | None = None,
    preprocess: dict[str, Any] | None = None,
    labels: list[str] | None = None,
    dynamic_batch: bool = True,
    seed: int = 0,
) -> Path:
    """A model directory under `root` holding the tiny CNN as `fmt` (export, torchscript or
    entry); returns its path."""
    root.mkdir(parents=True, exist_ok=True)
    raw = kind == "raw"
    model = tiny_net(out, raw=raw, seed=seed)
    example = torch.zeros(4, 3, input_size, input_size)
    section: dict[str, Any] = {"input_size": input_size}
    if fmt == "export":
        dims = ({0: torch.export.Dim("batch")},) if dynamic_batch else None
        program = torch.export.export(model, (example,), dynamic_shapes=dims)
        torch.export.save(program, root / "model.pt2")
        section["file"] = "model.pt2"
    elif fmt == "torchscript":
        traced = torch.jit.trace(model, example)  # type: ignore[no-untyped-call]
        traced.save(str(root / "model.ts"))
        section["file"] = "model.ts"
    elif fmt == "entry":
        write_tinynet(root)
        torch.save(model.state_dict(), root / "weights.pt")
        section.update(entry="tinynet:build", weights="weights.pt")
        section["args"] = {"out": out, "raw": raw}
    else:
        raise ValueError(fmt)
    tables: dict[str, dict[str, Any]] = {
        "model": section,
        "preprocess": {"resize_size": input_size + 4, "mean": list(MEAN), "std": list(STD)}
        if preprocess is None
        else preprocess,
        "output": {"kind": kind, **(output or {})},
    }
    (root / "gpufeed.toml").write_text(toml_text(tables))
    if labels is not None:
        (root / "labels.txt").write_text("".join(f"{name}\n" for name in labels))
    return root


def reference_outputs(
    model: nn.Module,
    rows: np.ndarray,
    *,
    input_size: int,
    mean: tuple[float, float, float] = MEAN,
    std: tuple[float, float, float] = STD,
) -> torch.Tensor:
    """The model's output computed the slow, obvious way on decoded staging rows
    [N, S, S, 3] uint8: centre crop, to float, normalise, forward, in fp32, one at a time."""
    s = rows.shape[1]
    off = round((s - input_size) / 2)
    outs = []
    with torch.inference_mode():
        for row in rows:
            x = torch.from_numpy(row[off : off + input_size, off : off + input_size].copy())
            x = x.permute(2, 0, 1).float() / 255.0
            x = (x - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1)
            outs.append(model(x[None])[0])
    return torch.stack(outs)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (math.sqrt(float(a @ a)) * math.sqrt(float(b @ b))))


def softmax_topk(logits: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
    scores, indices = F.softmax(logits.float(), dim=-1).topk(k)
    return [int(i) for i in indices], [float(s) for s in scores]

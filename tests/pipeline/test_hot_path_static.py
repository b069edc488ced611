"""No host sync on the hot path, checked on the source: no .item(), .cpu(), .tolist(),
.numpy() or synchronize() in the modules between "batch decoded" and "results in pinned
memory", except the few allow-listed below, each with its reason.

The check is syntactic (any call of those names, whatever the receiver), so it is strict on
purpose: a host-side numpy call that happens to be named `.numpy()` must be allow-listed
with a reason too.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = frozenset({"item", "cpu", "tolist", "numpy", "synchronize"})

HOT_PATH = (
    "worker/pipeline/transfer.py",
    "worker/pipeline/launch.py",
    "worker/pipeline/gpu_decode.py",
    "worker/model/step.py",
    "worker/pipeline/staging.py",
    "worker/pipeline/batcher.py",
    "worker/decode/pool.py",
    "worker/decode/gpu.py",
    "worker/decode/gpu_packed.py",
    "worker/decode/nvimgcodec.py",
    "worker/decode/torchvision_jpeg.py",
    "worker/pipeline/completion.py",
    "worker/model/compiler.py",
    "worker/model/ceiling.py",
    "worker/model/heads.py",
    "worker/model/readers.py",
)

# (module, enclosing function, call name) -> why it is not a hot-path sync.
ALLOWED: dict[tuple[str, str, str], str] = {
    (
        "worker/pipeline/staging.py",
        "InputRing.__init__",
        "numpy",
    ): "numpy view of a host (pinned) tensor, made once at allocation for the decode threads",
    (
        "worker/pipeline/staging.py",
        "OutputSlot.__post_init__",
        "numpy",
    ): "numpy views of the pinned output slot, made once at allocation; the completion "
    "watcher reads them only after the batch's done-event fired",
    (
        "worker/model/compiler.py",
        "_sync",
        "synchronize",
    ): "start-up only: the warm-up must have run before its time is reported",
    (
        "worker/model/ceiling.py",
        "direct_feed_ceiling",
        "synchronize",
    ): "measurement harness: one wait at the end of the timed run",
    (
        "worker/decode/gpu.py",
        "_wait",
        "synchronize",
    ): "start-up calibration of GPU against CPU decode, before the worker takes jobs",
    (
        "worker/decode/gpu_packed.py",
        "_wait",
        "synchronize",
    ): "start-up measurement of the GPU decoder's rate, before the worker takes jobs",
    (
        "worker/decode/nvimgcodec.py",
        "NvImgCodec.decode_into",
        "numpy",
    ): "the CPU-only backend's buffers: numpy views of host memory, never on CUDA",
    (
        "worker/model/readers.py",
        "ClassifyReader.read",
        "tolist",
    ): "numpy's tolist on the pinned output slot (host memory), called by the completion "
    "watcher only after the batch's done-event fired: no device is involved",
}


@dataclass(frozen=True)
class Finding:
    module: str
    function: str
    name: str
    line: int

    def __str__(self) -> str:
        return f"{self.module}:{self.line}: {self.name}() in {self.function or '<module>'}"


class _Visitor(ast.NodeVisitor):
    def __init__(self, module: str) -> None:
        self.module = module
        self.stack: list[str] = []
        self.findings: list[Finding] = []

    def _scoped(self, node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()

    visit_ClassDef = _scoped
    visit_FunctionDef = _scoped
    visit_AsyncFunctionDef = _scoped

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = None
        if isinstance(func, ast.Attribute):
            name = func.attr
        elif isinstance(func, ast.Name) and func.id == "synchronize":
            name = func.id
        if name in FORBIDDEN:
            self.findings.append(Finding(self.module, ".".join(self.stack), name, node.lineno))
        self.generic_visit(node)


def find_host_syncs(source: str, module: str = "<string>") -> list[Finding]:
    visitor = _Visitor(module)
    visitor.visit(ast.parse(source))
    return visitor.findings


def unexplained(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if (f.module, f.function, f.name) not in ALLOWED]


@pytest.mark.parametrize("module", HOT_PATH)
def test_hot_path_module_has_no_host_sync(module: str) -> None:
    source = (ROOT / module).read_text()
    bad = unexplained(find_host_syncs(source, module))
    assert not bad, "host syncs on the hot path:\n" + "\n".join(map(str, bad))


def test_every_allow_list_entry_is_still_used() -> None:
    # A stale entry would silently allow a future sync in that function.
    found = set()
    for module in HOT_PATH:
        for f in find_host_syncs((ROOT / module).read_text(), module):
            found.add((f.module, f.function, f.name))
    assert set(ALLOWED) <= found, set(ALLOWED) - found


@pytest.mark.parametrize(
    "snippet",
    [
        "def launch(x):\n    return x.sum().item()\n",
        "def launch(x):\n    return x.cpu()\n",
        "def launch(x):\n    return x.tolist()\n",
        "def launch(x):\n    return x.numpy()\n",
        "import torch\ndef launch():\n    torch.cuda.synchronize()\n",
        "from torch.cuda import synchronize\ndef launch():\n    synchronize()\n",
        "class R:\n    def go(self, ev):\n        ev.synchronize()\n",
        "def launch(x):\n    y = [v.item() for v in x]\n    return y\n",
    ],
)
def test_the_checker_catches_each_forbidden_call(snippet: str) -> None:
    findings = find_host_syncs(snippet, "worker/pipeline/launch.py")
    assert findings and unexplained(findings) == findings


def test_the_checker_passes_clean_code_and_respects_the_allow_list() -> None:
    clean = "def launch(x, out):\n    out.copy_(x, non_blocking=True)\n    return x.shape\n"
    assert find_host_syncs(clean) == []
    allowed = "class InputRing:\n    def __init__(self, t):\n        self.a = t.numpy()\n"
    findings = find_host_syncs(allowed, "worker/pipeline/staging.py")
    assert len(findings) == 1 and unexplained(findings) == []
    # The same call anywhere else in the module is not allowed.
    moved = "class InputRing:\n    def acquire(self, t):\n        return t.numpy()\n"
    assert unexplained(find_host_syncs(moved, "worker/pipeline/staging.py"))

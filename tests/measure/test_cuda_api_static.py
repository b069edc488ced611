"""The torch, torchvision and nvImageCodec names the CUDA path uses exist in the installed
versions, checked without a GPU (attributes and signatures only; nothing is called).

- Every `torch.*`, `F.*` and `torchvision.*` name written in the CUDA-path modules (found
  by walking their syntax tree, so a new use is checked without editing this file), plus
  the members reached through instances or getattr, which the walk cannot see.
- nvImageCodec is an optional dependency (the `gpu` extra; the dev extra installs it for
  the CPU-only backend's tests): the names the GPU decoders use from it must be among
  those vendored below, as read from the nvidia-nvimgcodec-cu13 0.9.0.20 wheel's module
  (ColorSpec has SRGB and no RGB since 0.7); where nvImageCodec is installed they are
  checked against it too.

docs/cuda-api-check.md says which of these were also checked against torch 2.11.0 and
torchvision 0.26.0, the versions of the GPU host.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path
from typing import Any

import pytest
import torch
import torchvision

ROOT = Path(__file__).resolve().parents[2]

CUDA_PATH = (
    "worker/base/device.py",
    "worker/pipeline/transfer.py",
    "worker/pipeline/launch.py",
    "worker/pipeline/gpu_decode.py",
    "worker/pipeline/staging.py",
    "worker/pipeline/completion.py",
    "worker/model/step.py",
    "worker/model/compiler.py",
    "worker/model/precision.py",
    "worker/model/ceiling.py",
    "worker/decode/gpu.py",
    "worker/decode/gpu_packed.py",
    "worker/decode/nvimgcodec.py",
    "worker/decode/torchvision_jpeg.py",
    "worker/observe/gpu_sampler.py",
    "worker/observe/health.py",
    "measure/gpu_check/check.py",
    "measure/gpu_check/phases/decode.py",
    "measure/gpu_check/phases/extras.py",
    "measure/gpu_check/copy_rate.py",
    "measure/gpu_check/preflight.py",
    "worker/tools/harness/environment.py",  # the GPU check's environment section
)

# Reached through an instance, getattr or hasattr: invisible to the walk.
THROUGH_INSTANCES = (
    "torch.cuda.Stream.wait_event",
    "torch.cuda.Stream.wait_stream",
    "torch.cuda.Stream.cuda_stream",
    "torch.cuda.Event.record",
    "torch.cuda.Event.query",
    "torch.cuda.Event.elapsed_time",
    "torch.cuda.Event.synchronize",
    "torch.cuda.CUDAGraph.replay",
    "torch.Tensor.record_stream",
    "torch.Tensor.is_pinned",
    "torch._dynamo.explain",
    "torch._inductor.config.graph_partition",
    "torch._inductor.config.triton.cudagraphs",
    "torch._C._CudaDeviceProperties.uuid",
    "torch._C._CudaDeviceProperties.pci_bus_id",
    "torch._C._CudaDeviceProperties.pci_device_id",
    "torch._C._CudaDeviceProperties.pci_domain_id",
    "torch.cuda._sleep",  # the CUDA tests stall streams with it
    "torch.OutOfMemoryError",
    "torch.profiler.profile.start",
    "torch.profiler.profile.stop",
    "torch.profiler.profile.events",
    "torch.cuda.set_sync_debug_mode",
    "torch.cuda.get_sync_debug_mode",
)

# (callable, keyword parameters the CUDA path passes to it)
SIGNATURES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("torch.compile", ("options", "fullgraph", "dynamic")),
    ("torch.profiler.profile", ("activities",)),
    ("torch._inductor.list_mode_options", ("mode", "dynamic")),
    ("torch.cuda.is_bf16_supported", ("including_emulation",)),
    ("torch.cuda.Event", ("enable_timing",)),
    ("torchvision.io.decode_jpeg", ("mode", "device")),
    ("torchvision.transforms.functional.center_crop", ("output_size",)),
)

# nvImageCodec names used, as the 0.9.0.20 wheel has them (module imported on a CPU host:
# ColorSpec members UNKNOWN, UNCHANGED, SYCC, SRGB, GRAY, CMYK, YCCK, PALETTE, ICC_PROFILE,
# UNSUPPORTED; Decoder(device_id, ...), Decoder.decode(srcs, *, params, cuda_stream), bytes
# accepted for CodeStream; DecodeParams(apply_exif_orientation, color_spec, ...)).
NVIMGCODEC_API = frozenset(
    {
        "__version__",
        "Decoder",
        "Decoder.decode",
        "DecodeParams",
        "ColorSpec",
        "ColorSpec.SRGB",
        "Image.__cuda_array_interface__",
        "as_images",
        "Backend",
        "CPU_ONLY",
        "NVIMGCODEC_DEVICE_CPU_ONLY",
        "BackendKind",
        "BackendKind.CPU_ONLY",
        # worker/decode/nvimgcodec.py GPU_BACKENDS, taken by name with getattr.
        "BackendKind.HW_GPU_ONLY",
        "BackendKind.GPU_ONLY",
        "BackendKind.HYBRID_CPU_GPU",
    }
)
NVIMGCODEC_KEYWORDS = {
    "Decoder": ("device_id", "backends", "max_num_cpu_threads"),
    "Decoder.decode": ("images", "params", "cuda_stream"),
    "as_images": ("cuda_stream",),
    "DecodeParams": ("apply_exif_orientation", "color_spec"),
}
ROOTS = {"torch": "torch", "F": "torch.nn.functional", "torchvision": "torchvision"}


def dotted_names(source: str, roots: dict[str, str]) -> set[str]:
    """Every attribute chain on one of `roots` (name -> module), and every name imported
    from them, as fully qualified dotted names (longest chains only)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            parts: list[str] = []
            inner: ast.expr = node
            while isinstance(inner, ast.Attribute):
                parts.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id in roots:
                found.add(".".join([roots[inner.id], *reversed(parts)]))
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.split(".")[0] in {m.split(".")[0] for m in roots.values()}
        ):
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {n for n in found if not any(o.startswith(n + ".") for o in found)}


def resolve(name: str) -> Any:
    """getattr along `name`, importing submodules on the way (torch._inductor.config...)."""
    parts = name.split(".")
    obj: Any = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(".".join(parts[: i + 1]))
    return obj


def used_names() -> list[str]:
    names: set[str] = set()
    for module in CUDA_PATH:
        names |= dotted_names((ROOT / module).read_text(), ROOTS)
    return sorted(names)


def test_the_walk_sees_the_cuda_path() -> None:
    names = used_names()
    # A few that must be there: if these vanish, the walk (not the code) broke.
    for name in ("torch.cuda.Stream", "torch.compiler.cudagraph_mark_step_begin"):
        assert name in names
    assert "torchvision.io.decode_jpeg" in names


@pytest.mark.parametrize("name", used_names())
def test_names_written_in_the_cuda_path_exist(name: str) -> None:
    try:
        resolve(name)
    except (AttributeError, ImportError) as exc:
        pytest.fail(
            f"{name} is missing in torch {torch.__version__} / torchvision "
            f"{torchvision.__version__}: {exc}"
        )


@pytest.mark.parametrize("name", THROUGH_INSTANCES)
def test_members_reached_through_instances_exist(name: str) -> None:
    owner, _, member = name.rpartition(".")
    assert hasattr(resolve(owner), member), f"{name} is missing in torch {torch.__version__}"


@pytest.mark.parametrize(("name", "keywords"), SIGNATURES)
def test_keyword_parameters_exist(name: str, keywords: tuple[str, ...]) -> None:
    params = inspect.signature(resolve(name)).parameters
    missing = [k for k in keywords if k not in params]
    assert not missing, f"{name} lacks {missing}"


NVIMGCODEC_USERS = ("worker/decode/nvimgcodec.py",)


def nvimgcodec_names_in_code() -> set[str]:
    chains: set[str] = set()
    for path in NVIMGCODEC_USERS:
        chains |= dotted_names((ROOT / path).read_text(), {"nvimgcodec": "nvimgcodec"})
    return {c.removeprefix("nvimgcodec.") for c in chains}


def test_gpu_decode_uses_only_vendored_nvimgcodec_names() -> None:
    used = nvimgcodec_names_in_code()
    assert used, "the walk found no nvImageCodec use in the GPU decoders"
    assert {"as_images", "Decoder", "NVIMGCODEC_DEVICE_CPU_ONLY"} <= used
    assert used <= NVIMGCODEC_API, f"not in nvImageCodec 0.9: {sorted(used - NVIMGCODEC_API)}"
    from worker.decode.nvimgcodec import GPU_BACKENDS

    taken_by_name = {f"BackendKind.{kind}" for kind in GPU_BACKENDS}
    assert taken_by_name <= NVIMGCODEC_API, sorted(taken_by_name - NVIMGCODEC_API)
    assert "ColorSpec.RGB" not in used


def test_nvimgcodec_names_exist_where_installed() -> None:
    try:
        nvimgcodec = importlib.import_module("nvidia.nvimgcodec")
    except ImportError:
        pytest.skip("nvImageCodec is not installed (the vendored names are checked above)")
    for name in sorted(NVIMGCODEC_API):
        obj: Any = nvimgcodec
        for part in name.split("."):
            assert hasattr(obj, part), f"nvImageCodec {nvimgcodec.__version__} lacks {name}"
            obj = getattr(obj, part)
    for name, keywords in NVIMGCODEC_KEYWORDS.items():
        owner: Any = nvimgcodec
        for part in name.split("."):
            owner = getattr(owner, part)
        doc = (getattr(owner, "__init__", owner).__doc__ or "") + (owner.__doc__ or "")
        missing = [k for k in keywords if f"{k}:" not in doc]
        assert not missing, f"nvImageCodec {name} lacks {missing}"


# ------------------------------------------------------- which compile modes replay graphs


@pytest.mark.parametrize(
    ("mode", "graphs"),
    [
        ("off", False),
        ("default", False),
        ("reduce-overhead", True),
        ("max-autotune", True),  # its option list turns triton.cudagraphs on as well
        ("max-autotune-no-cudagraphs", False),
    ],
)
def test_every_compile_mode_knows_whether_it_replays_graphs(mode: str, graphs: bool) -> None:
    from worker.config.settings import COMPILE_MODES
    from worker.model.compiler import mode_uses_cudagraphs, step_inductor_options

    assert mode in COMPILE_MODES
    assert mode_uses_cudagraphs(mode) is graphs
    if mode != "off":
        # What torch.compile(mode=...) itself would turn on, read from this torch.
        from torch._inductor import list_mode_options

        own = dict(list_mode_options(mode, False)) if mode != "default" else {}
        assert bool(own.get("triton.cudagraphs")) is graphs
        assert step_inductor_options(mode).get("triton.cudagraphs", False) is graphs


def test_no_module_decides_cuda_graphs_by_the_mode_name() -> None:
    """Graphs are on wherever inductor's options say so (max-autotune too): a test of the
    mode's name would leave a max-autotune step without cudagraph_mark_step_begin and
    without the start-up replay gate."""
    offenders = []
    for path in sorted((ROOT / "worker").rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if '== "reduce-overhead"' in line or "== 'reduce-overhead'" in line:
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert offenders == []


# ------------------------------------------------ /live queries events under the device


def test_every_event_query_in_health_is_under_the_device_guard() -> None:
    """/live runs on the HTTP thread: a CUDA call there without the worker's device would
    create a context on GPU 0 for a worker on cuda:N."""
    tree = ast.parse((ROOT / "worker/observe/health.py").read_text())
    guarded: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.With) and any(
            isinstance(item.context_expr, ast.Call)
            and isinstance(item.context_expr.func, ast.Attribute)
            and item.context_expr.func.attr == "_device_guard"
            for item in node.items
        ):
            guarded |= {id(n) for n in ast.walk(node)}
    queries = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "query"
    ]
    assert queries, "the walk found no query() in health.py"
    assert all(id(q) in guarded for q in queries)


def test_live_queries_each_stale_batch_on_the_workers_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from types import SimpleNamespace

    from worker.observe.health import Health

    entered: list[Any] = []
    current: list[Any] = [None]

    class Guard:
        def __init__(self, device: Any) -> None:
            self.device = device

        def __enter__(self) -> None:
            entered.append(self.device)
            current[0] = self.device

        def __exit__(self, *exc: object) -> None:
            current[0] = None

    seen: list[Any] = []

    class Done:
        def query(self) -> bool:
            seen.append(current[0])
            return False

    monkeypatch.setattr(torch.cuda, "device", Guard)
    health = Health(loop_stall_s=0, launch_stall_s=1.0)
    device = torch.device("cuda", 1)
    health.watch_launches(lambda: None, 2, device=device)
    health.launched(SimpleNamespace(batch=SimpleNamespace(seq=7), done=Done(), launched_s=0.0))
    ok, why = health.live()
    assert not ok and "batch 7 unfinished" in why
    assert seen == [device] and entered == [device]

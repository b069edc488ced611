"""Failure paths of the CUDA path that can be checked without a GPU.

- a GPU decoder that cannot be built (nvImageCodec missing its RGB colour spec, a decoder
  constructor that raises, no device) leaves the worker on CPU decode, logged;
- a GPU decoder that raises on a batch sends those rows to the CPU decoder, and the batch
  is answered normally;
- a launch that raises hands back a fence, and the worker answers the batch's jobs with
  `inference_error` and goes on serving with the same slots;
- the GPU sampler finds the worker's CUDA device in NVML by UUID, PCI bus id or
  CUDA_VISIBLE_DEVICES, not by assuming the CUDA index is NVML's (fake device lists).

The decoder classes are device-agnostic, so these run the real code on the CPU (where the
"device twin" is the pinned slot itself and events are born completed).
"""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import torch
from structlog.testing import capture_logs

from producer.wire import JobResult
from tests.model.test_step import tiny_step
from tests.support.images import jpeg_bytes, png_bytes
from tests.support.worker_harness import running_worker, wait_results
from worker.base.device import make_context, prepare_graph_thread
from worker.decode import nvimgcodec as nvimgcodec_module
from worker.decode.codecs import GpuDecodeUnavailable
from worker.decode.cpu import DecodeSpec, decode_to_array
from worker.decode.gpu import (
    GpuDecodeFailed,
    GpuDecoder,
    GpuDecodeRouter,
    make_backend,
    setup_gpu_decode,
)
from worker.decode.nvimgcodec import NvImgCodec
from worker.decode.pool import DecodePool
from worker.decode.torchvision_jpeg import TorchvisionJpeg
from worker.jobs import Job
from worker.observe.gpu_sampler import (
    CudaIdentity,
    DeviceNotFound,
    GpuSampler,
    NvmlDevice,
    _Nvml,
    nvml_index_for,
)
from worker.pipeline.batcher import Batch
from worker.pipeline.gpu_decode import GpuDecodeStage
from worker.pipeline.launch import LaunchFailed, ModelRunner
from worker.pipeline.staging import InputRing, OutputRing
from worker.pipeline.transfer import DeviceTransfer

ALL_GPU = GpuDecodeRouter({"small": True, "medium": True, "large": True})
SPEC = DecodeSpec(size=20, dct_scaling=False)
CPU = torch.device("cpu")


# ------------------------------------------------------------------ building a decoder
def fake_nvimgcodec(*, colour_specs: Sequence[str], decoder_error: str | None = None) -> Any:
    """A stand-in for `nvidia.nvimgcodec` with the given ColorSpec members."""
    module = types.ModuleType("nvidia.nvimgcodec")
    module.__version__ = "0.9.0"  # type: ignore[attr-defined]
    module.ColorSpec = types.SimpleNamespace(**{name: name for name in colour_specs})  # type: ignore[attr-defined]
    made: dict[str, Any] = {}

    def decoder(**kwargs: Any) -> Any:
        if decoder_error is not None:
            raise RuntimeError(decoder_error)
        made["decoder"] = kwargs
        # The start-up probe decodes one JPEG per backend: an image of the probe's size.
        width, height = nvimgcodec_module._PROBE_SIZE
        probed = types.SimpleNamespace(shape=(height, width, 3))
        return types.SimpleNamespace(
            decode=lambda data, *a, **k: probed if isinstance(data, bytes) else []
        )

    def decode_params(**kwargs: Any) -> Any:
        made["params"] = kwargs
        return kwargs

    module.BackendKind = types.SimpleNamespace(  # type: ignore[attr-defined]
        **{kind: kind for kind in ("CPU_ONLY", *nvimgcodec_module.GPU_BACKENDS)}
    )
    module.Backend = lambda kind: kind  # type: ignore[attr-defined]
    module.Decoder = decoder  # type: ignore[attr-defined]
    module.DecodeParams = decode_params  # type: ignore[attr-defined]
    module.made = made  # type: ignore[attr-defined]
    return module


@pytest.fixture
def fresh_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a fresh process asks: no backend probed yet."""
    monkeypatch.setattr(nvimgcodec_module, "_engines", {})
    monkeypatch.setattr(nvimgcodec_module, "_why_not", {})


@pytest.mark.usefixtures("fresh_probe")
def test_nvimgcodec_is_asked_for_srgb(monkeypatch: pytest.MonkeyPatch) -> None:
    # nvImageCodec 0.7 onwards: ColorSpec has SRGB and no RGB (checked on the 0.9.0.20 wheel).
    fake = fake_nvimgcodec(colour_specs=["UNCHANGED", "SRGB", "GRAY", "SYCC"])
    monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", fake)
    backend = make_backend(CPU, "auto")
    assert isinstance(backend, NvImgCodec)
    assert fake.made["params"] == {"apply_exif_orientation": True, "color_spec": "SRGB"}
    # The GPU backends that answered the probe, one CPU thread, never the CPU backend.
    assert fake.made["decoder"]["backends"] == list(nvimgcodec_module.GPU_BACKENDS)
    assert fake.made["decoder"]["max_num_cpu_threads"] == 1


@pytest.mark.parametrize(
    ("colour_specs", "decoder_error"),
    [
        (["RGB"], None),  # a colour spec the code does not know: AttributeError
        (["SRGB"], "Internal error - Could not create decoder. Code: 8"),  # no device
    ],
)
@pytest.mark.usefixtures("fresh_probe")
def test_a_broken_nvimgcodec_falls_back_to_torchvision_with_a_log_line(
    monkeypatch: pytest.MonkeyPatch, colour_specs: list[str], decoder_error: str | None
) -> None:
    """No GPU backend decodes the probe's JPEG: the error says so and what the library
    raised, and `auto` goes on with torchvision."""
    fake = fake_nvimgcodec(colour_specs=colour_specs, decoder_error=decoder_error)
    monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", fake)
    with capture_logs() as logs:
        backend = make_backend(CPU, "auto")
    assert isinstance(backend, TorchvisionJpeg)
    [line] = [e for e in logs if e["event"] == "gpu_decoder_unavailable"]
    assert line["log_level"] == "warning" and line["using"] == "torchvision"
    assert "none of its GPU backends" in line["reason"]
    assert (decoder_error or "SRGB") in line["reason"]
    with pytest.raises(GpuDecodeUnavailable, match="none of its GPU backends"):
        make_backend(CPU, "nvimgcodec")


def test_a_missing_nvimgcodec_is_not_worth_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", None)  # import raises ImportError
    with capture_logs() as logs:
        backend = make_backend(CPU, "auto")
    assert isinstance(backend, TorchvisionJpeg)
    assert logs == []


@pytest.mark.parametrize(("mode", "level"), [("auto", "error"), ("gpu", "error")])
def test_setup_falls_back_to_cpu_decode_on_any_failure(mode: str, level: str) -> None:
    def broken(device: torch.device) -> GpuDecoder:
        raise AttributeError("type object 'ColorSpec' has no attribute 'RGB'")

    with capture_logs() as logs:
        got = setup_gpu_decode(mode, torch.device("cuda", 0), SPEC, 2, make_decoder=broken)
    assert got is None
    [line] = [e for e in logs if e["event"] == "gpu_decode_unavailable"]
    assert line["log_level"] == level and line["using"] == "cpu decode"
    assert "ColorSpec" in line["reason"]


def test_setup_without_any_gpu_decoder_warns_in_auto_mode() -> None:
    def unavailable(device: torch.device) -> GpuDecoder:
        raise GpuDecodeUnavailable("torchvision's JPEG decode is unusable: no nvJPEG")

    with capture_logs() as logs:
        assert (
            setup_gpu_decode("auto", torch.device("cuda", 0), SPEC, 2, make_decoder=unavailable)
            is None
        )
    assert [e["log_level"] for e in logs if e["event"] == "gpu_decode_unavailable"] == ["warning"]


# ------------------------------------------------------------------ a decoder that raises
class RaisingBackend:
    name = "raising"
    applies_exif = True

    def decode(self, datas: Sequence[bytes], stream: Any) -> list[torch.Tensor | None]:
        raise RuntimeError("nvjpeg: CUDA_ERROR_ILLEGAL_ADDRESS")


class HalfwayBackend:
    """Decodes every image, but hands back all after the first as tensors of their right
    shape with no data behind them (the meta device), which the resize cannot read: the
    decoder fails after it has written a row."""

    name = "halfway"
    applies_exif = True

    def __init__(self) -> None:
        self.real = TorchvisionJpeg(CPU)

    def decode(self, datas: Sequence[bytes], stream: Any) -> list[torch.Tensor | None]:
        decoded = self.real.decode(datas, stream)
        return decoded[:1] + [
            None if img is None else torch.empty_like(img, device="meta") for img in decoded[1:]
        ]


def make_job(i: int, data: bytes) -> Job:
    return Job.new(
        entry_id=f"0-{i}", job_id=f"j{i}", reply_to="r", meta=None, image=data, path=None
    )


def test_decoder_failure_names_the_event_after_its_work() -> None:
    decoder = GpuDecoder(CPU, RaisingBackend())
    try:
        row = ALL_GPU.route(jpeg_bytes(60, 40), SPEC)
        assert row is not None
        dest = torch.zeros((2, 20, 20, 3), dtype=torch.uint8)
        with pytest.raises(GpuDecodeFailed, match="ILLEGAL_ADDRESS") as info:
            decoder.decode_rows_sync([(0, row)], dest)
        assert info.value.ready is not None and info.value.ready.query()
    finally:
        decoder.shutdown()


@pytest.mark.parametrize("backend", [RaisingBackend, HalfwayBackend])
async def test_a_raising_gpu_decoder_sends_its_rows_to_the_cpu(backend: type) -> None:
    step = tiny_step()
    pool = DecodePool(SPEC, 2, None, gpu_router=ALL_GPU)
    ctx = make_context(CPU)
    ring = InputRing(1, 4, 20, pin=False)
    out_ring = OutputRing(1, 4, 3, pin=False)
    transfer = DeviceTransfer(ctx, 1, 4, 20)
    runner = ModelRunner(ctx, step, transfer, cudagraphs=False)
    stage = GpuDecodeStage(transfer)
    stage.use_rows(GpuDecoder(CPU, backend()), pool.decode_on_cpu)
    try:
        images = [jpeg_bytes(60, 50, seed=1), png_bytes(40, 40, seed=2), jpeg_bytes(50, 70, seed=3)]
        slot = await ring.acquire()
        jobs = [make_job(i, d) for i, d in enumerate(images)]
        futures = [pool.submit(j, slot.array[i]) for i, j in enumerate(jobs)]
        batch = Batch(seq=1, slot=slot, jobs=jobs, futures=futures, opened_s=0.0)
        results = await batch.decoded()
        assert [r.gpu is not None for r in results] == [True, False, True]
        with capture_logs() as logs:
            launched = await runner.launch(
                batch, await out_ring.acquire(), rows=await stage.rows(batch)
            )
        assert [e["job_ids"] for e in logs if e["event"] == "gpu_decode_failed"] == [["j0", "j2"]]
        assert all(r.gpu is None and r.error is None for r in batch.results)
        for i, data in enumerate(images):
            want, _ = decode_to_array(data, SPEC)
            assert np.array_equal(slot.array[i], want), i
        with torch.inference_mode():
            ref_idx, _ = step(torch.from_numpy(np.stack([slot.array[i] for i in range(4)])))
        assert np.array_equal(launched.out.indices_np, ref_idx.numpy())
    finally:
        runner.shutdown()
        stage.shutdown()
        pool.shutdown()


# ------------------------------------------------------------------ a launch that raises
async def test_a_failed_launch_hands_back_a_fence() -> None:
    def broken(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    ctx = make_context(CPU)
    ring = InputRing(1, 4, 20, pin=False)
    out_ring = OutputRing(1, 4, 3, pin=False)
    runner = ModelRunner(ctx, broken, DeviceTransfer(ctx, 1, 4, 20), cudagraphs=False)
    try:
        slot = await ring.acquire()
        batch = Batch(seq=1, slot=slot, jobs=[], futures=[], opened_s=0.0)
        with pytest.raises(LaunchFailed, match="out of memory") as info:
            await runner.launch(batch, await out_ring.acquire())
        assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
        assert info.value.fence.query()  # CPU: nothing was queued
    finally:
        runner.shutdown()


async def test_worker_answers_a_failed_batch_and_keeps_serving(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    async with running_worker(redis_url, tiny_weights, ring_slots=2, max_wait_ms=5.0) as worker:
        serving = worker.engine.model.runner.step

        def out_of_memory(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

        worker.engine.model.runner.step = out_of_memory
        for i in range(6):
            redis_client.xadd(
                "gpufeed:jobs", {"id": f"bad{i}", "image": jpeg_bytes(80, 60, seed=i)}
            )
        failed = await wait_results(redis_client, "gpufeed:results", 6)
        worker.engine.model.runner.step = serving
        for i in range(6):
            redis_client.xadd("gpufeed:jobs", {"id": f"ok{i}", "image": jpeg_bytes(80, 60, seed=i)})
        entries = await wait_results(redis_client, "gpufeed:results", 12)
    assert len(failed) == 6
    results = {r.id: r for r in (JobResult.from_fields(f) for _, f in entries)}
    assert len(results) == 12
    for i in range(6):
        bad = results[f"bad{i}"]
        assert bad.error_code == "inference_error" and "out of memory" in (bad.error or "")
        assert results[f"ok{i}"].ok


# ------------------------------------------------------------------ NVML device mapping
GPUS = [
    # NVML index, UUID, PCI bus id: NVML lists them in PCI order.
    NvmlDevice(0, "GPU-aaaaaaaa-0000-0000-0000-000000000000", "00000000:1A:00.0"),
    NvmlDevice(1, "GPU-bbbbbbbb-0000-0000-0000-000000000000", "00000000:3B:00.0"),
    NvmlDevice(2, "GPU-cccccccc-0000-0000-0000-000000000000", "00000000:88:00.0"),
]


@pytest.mark.parametrize(
    ("cuda_index", "identity", "visible", "order", "want"),
    [
        # What CUDA says about the device wins over everything else.
        (0, CudaIdentity(uuid="cccccccc-0000-0000-0000-000000000000"), "0", None, (2, "uuid")),
        (0, CudaIdentity(pci_bus_id="00000000:3b:00.0"), None, None, (1, "pci bus id")),
        # run-workers.sh: CUDA_VISIBLE_DEVICES=2, the worker uses cuda:0.
        (0, None, "2", "PCI_BUS_ID", (2, "CUDA_VISIBLE_DEVICES ordinal")),
        (1, None, "2,0", "PCI_BUS_ID", (0, "CUDA_VISIBLE_DEVICES ordinal")),
        (0, None, "GPU-bbbb", None, (1, "CUDA_VISIBLE_DEVICES uuid")),
        (1, None, None, None, (1, "ordinal")),
    ],
)
def test_the_cuda_device_is_found_in_nvml(
    cuda_index: int,
    identity: CudaIdentity | None,
    visible: str | None,
    order: str | None,
    want: tuple[int, str],
) -> None:
    assert nvml_index_for(cuda_index, GPUS, identity=identity, visible=visible, order=order) == want


def test_nvml_order_is_not_assumed_to_be_the_listing_order() -> None:
    shuffled = [
        NvmlDevice(0, "GPU-x", "00000000:88:00.0"),
        NvmlDevice(1, "GPU-y", "00000000:1A:00.0"),
    ]
    index, how = nvml_index_for(0, shuffled, visible="0")
    assert index == 1 and "PCI order assumed" in how


@pytest.mark.parametrize(
    ("cuda_index", "visible", "message"),
    [
        (0, "", "empty"),
        (1, "2", "not visible"),
        (0, "7", "NVML lists 3"),
        (0, "MIG-0b7b7f2e-aaaa", "MIG"),
        (0, "GPU-dead", "matches 0"),
    ],
)
def test_an_unmappable_device_is_said_so(cuda_index: int, visible: str, message: str) -> None:
    with pytest.raises(DeviceNotFound, match=message):
        nvml_index_for(cuda_index, GPUS, visible=visible)


class FakePynvml:
    """pynvml's calls over GPUS; each GPU reports its own utilisation (10, 20, 30 %)."""

    class NVMLError(Exception):
        pass

    NVML_CLOCK_SM = 1
    NVML_PCIE_UTIL_TX_BYTES = 0
    NVML_PCIE_UTIL_RX_BYTES = 1

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(GPUS)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUUID(self, h: int) -> bytes:
        return GPUS[h].uuid.encode()

    def nvmlDeviceGetPciInfo(self, h: int) -> Any:
        return types.SimpleNamespace(busId=GPUS[h].pci_bus_id.encode())

    def nvmlDeviceGetName(self, h: int) -> str:
        return f"Fake H200 #{h}"

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        return types.SimpleNamespace(gpu=10 * (h + 1), memory=5)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        return types.SimpleNamespace(used=2**30)

    def nvmlDeviceGetPowerUsage(self, h: int, *args: Any) -> int:
        raise self.NVMLError("not supported")

    nvmlDeviceGetClockInfo = nvmlDeviceGetPowerUsage
    nvmlDeviceGetPcieThroughput = nvmlDeviceGetPowerUsage

    def nvmlDeviceGetJpgUtilization(self, h: int) -> list[int]:
        # Only the third GPU has JPEG engines (NVML answers "not supported" elsewhere).
        if h != 2:
            raise self.NVMLError("not supported")
        return [37, 166_667]


def test_a_worker_started_by_run_workers_samples_its_own_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    fake = FakePynvml()
    sampler = GpuSampler(0, nvml_factory=lambda i: _Nvml(i, nv=fake, identity=CudaIdentity()))
    for _ in range(3):
        sampler.sample_once()
    sampler.close()
    summary = sampler.summary()
    assert summary["available"], summary["reason"]
    assert summary["gpu"] == "Fake H200 #2"
    assert summary["nvml_device"]["nvml_index"] == 2
    assert summary["nvml_device"]["uuid"] == GPUS[2].uuid
    assert summary["metrics"]["gpu_util_pct"]["mean"] == 30.0
    # The JPEG engines' utilisation where the GPU has them (the GPU decode's share of work).
    assert summary["metrics"]["jpg_util_pct"]["mean"] == 37.0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    other = GpuSampler(0, nvml_factory=lambda i: _Nvml(i, nv=fake, identity=CudaIdentity()))
    other.sample_once()
    other.close()
    assert "jpg_util_pct" not in other.summary()["metrics"]


# ------------------------------------------------------- CUDA-graph trees on the launch thread
def test_a_thread_that_did_not_import_graph_trees_gets_its_own_managers() -> None:
    # torch 2.11 looks the tree managers up in a threading.local filled on the importing
    # thread only (its fallback, torch's TLS stash, is empty on a thread torch did not
    # start), so the launch thread's first replay failed an assertion on the first GPU
    # host. 2.14 fills the local on first use; 2.11 needs it filled beforehand.
    from torch._inductor import cudagraph_trees

    seen: dict[str, bool] = {}

    def launch_thread() -> None:
        seen["before"] = hasattr(cudagraph_trees.local, "tree_manager_containers")
        prepare_graph_thread()
        seen["after"] = hasattr(cudagraph_trees.local, "tree_manager_containers")
        seen["container"] = isinstance(
            cudagraph_trees.get_container(0), cudagraph_trees.TreeManagerContainer
        )

    thread = threading.Thread(target=launch_thread)
    thread.start()
    thread.join()
    assert seen == {"before": False, "after": True, "container": True}

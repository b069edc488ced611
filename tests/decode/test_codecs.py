"""The GPU JPEG codecs stand side by side behind one contract, chosen by name from one table
(worker/decode/codecs.py): every codec the table names has the contract's members, `auto`
tries them in the table's order, and a codec added to the table is one the decoders use."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from tests.support.images import jpeg_bytes
from worker.decode.codecs import CODECS, GpuDecodeUnavailable, IntoCodec, JpegCodec, codec_class
from worker.decode.cpu import DecodeSpec
from worker.decode.gpu import GpuDecoder, make_backend

CPU = torch.device("cpu")


def members(protocol: type) -> set[str]:
    return {
        name
        for name in [*vars(protocol), *getattr(protocol, "__annotations__", {})]
        if not name.startswith("_")
    }


@pytest.mark.parametrize("name", list(CODECS))
def test_every_codec_of_the_table_has_the_contract_s_members(name: str) -> None:
    cls = codec_class(name)
    missing = [m for m in members(JpegCodec) if not hasattr(cls, m) and m not in _set_in_init(cls)]
    assert not missing, f"{name}: {cls.__name__} lacks {missing}"


def _set_in_init(cls: type) -> set[str]:
    source = inspect.getsource(cls.__init__)
    return {m for m in ("name", "applies_exif") if f"self.{m} =" in source}


def test_the_codec_that_writes_into_caller_buffers_is_nvimgcodec() -> None:
    # The decode processes' packed rows need decode_into; torchvision has none.
    into = [n for n in CODECS if callable(getattr(codec_class(n), "decode_into", None))]
    assert into == ["nvimgcodec"]
    assert members(IntoCodec) <= {*dir(codec_class("nvimgcodec")), "name"}


def test_a_name_the_table_lacks_is_refused_with_the_names_it_has() -> None:
    with pytest.raises(GpuDecodeUnavailable, match="no GPU JPEG codec is named 'nvjpeg2'"):
        make_backend(CPU, "nvjpeg2")


class PlainCodec:
    """A codec of this test: decodes on the CPU with Pillow, as the contract says."""

    applies_exif = False

    def __init__(self, device: torch.device) -> None:
        self.name = "plain"
        self.device = device

    def decode(self, datas: Sequence[bytes], stream: Any) -> list[torch.Tensor | None]:
        import io

        import numpy as np
        from PIL import Image

        out: list[torch.Tensor | None] = []
        for data in datas:
            try:
                rgb = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
            except OSError:
                out.append(None)
                continue
            out.append(torch.from_numpy(rgb.copy()).permute(2, 0, 1))
        return out


async def test_a_codec_added_to_the_table_is_one_the_decoders_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(CODECS, "plain", f"{__name__}:PlainCodec")
    codec = make_backend(CPU, "plain")
    assert isinstance(codec, PlainCodec)
    decoder = GpuDecoder(CPU, codec)
    try:
        from worker.decode.gpu import GpuDecodeRouter

        spec = DecodeSpec(size=20, dct_scaling=False)
        router = GpuDecodeRouter({"small": True, "medium": True, "large": True})
        rows = [router.route(jpeg_bytes(60, 40, seed=s), spec) for s in range(2)]
        assert all(r is not None for r in rows)
        dest = torch.zeros((2, 20, 20, 3), dtype=torch.uint8)
        result = await decoder.decode_rows([(i, r) for i, r in enumerate(rows) if r], dest)
        assert result.failed == []
        assert int(dest.sum()) > 0  # both rows written
    finally:
        decoder.shutdown()


def test_auto_tries_the_table_in_its_order_and_says_why_it_passed_one_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Broken:
        def __init__(self, device: torch.device) -> None:
            raise RuntimeError("no engine here")

    table = {"broken": f"{__name__}:BROKEN", "plain": f"{__name__}:PlainCodec"}
    monkeypatch.setitem(globals(), "BROKEN", Broken)
    monkeypatch.setattr("worker.decode.gpu.CODECS", table)
    monkeypatch.setattr("worker.decode.codecs.CODECS", table)
    with capture_logs() as logs:
        codec = make_backend(CPU, "auto")
    assert isinstance(codec, PlainCodec)
    [line] = [e for e in logs if e["event"] == "gpu_decoder_unavailable"]
    assert line["decoder"] == "broken" and line["using"] == "plain"
    assert "no engine here" in line["reason"]

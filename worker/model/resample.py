"""Rows at their own size -> the model's input, inside the compiled step (device placement).

Each row (worker/decode/rows.py) holds decoded pixels as stored and, in its first line, the
geometry: stored size, EXIF orientation and the upright resize target and crop. From those
words every row gets, on the device, the taps and weights of an antialiased bilinear resize
per axis, PIL's and torchvision's `Resize(antialias=True)` filter: a triangle widened by the
scale factor when scaling down, over pixel centres, renormalised over the taps inside the
image. The orientation picks which stored axis feeds which output axis and folds the flips
into the tap positions. Two gather-and-sum passes (one per stored axis, a fixed number of
taps each) and a transpose where the orientation swaps axes give [B, 3, C, C]: fixed
shapes, no data-dependent control flow, so the whole of it is captured in the CUDA graph
with the model; in eager it runs on the CPU too (tests).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from worker.base.errors import ConfigError
from worker.decode.packed import HEADER_BYTES, HEADER_WORDS, OFFSET_WORD, packed_side
from worker.decode.rows import GEOMETRY_WORDS

if TYPE_CHECKING:
    from worker.model.step import InferenceStep


class RowResampler(nn.Module):
    """x: [B, R, R, 3] uint8 rows -> [B, 3, C, C] float32, resized, cropped and upright.

    `geometry_size` is the staging size S the rows' geometry was computed for; `staging_size`
    is this step's own (smaller for the degraded step: its targets scale by the ratio), and
    `crop_size` C is cut from the centre of it, as the step's CenterCrop."""

    def __init__(self, side: int, geometry_size: int, staging_size: int, crop_size: int) -> None:
        super().__init__()
        self.side = side
        self.ratio = staging_size / geometry_size
        self.crop_size = crop_size
        self.offset = round((staging_size - crop_size) / 2.0)
        # Enough taps for the widest filter a row can need: its support is the scale, at
        # most R / S' (R pixels to S'), and fewer than 2 * support + 1 pixels lie under it.
        self.taps = math.ceil(2 * side / (geometry_size * self.ratio)) + 1
        self.steps: torch.Tensor
        self.register_buffer(
            "steps", torch.arange(self.taps, dtype=torch.float32), persistent=False
        )
        self.outputs: torch.Tensor
        self.register_buffer(
            "outputs", torch.arange(crop_size, dtype=torch.float32), persistent=False
        )
        self.byte_weights: torch.Tensor
        self.register_buffer(
            "byte_weights", torch.tensor([1, 1 << 8, 1 << 16, 1 << 24]), persistent=False
        )
        self.output_index: torch.Tensor
        self.register_buffer(
            "output_index", torch.arange(crop_size).view(1, -1, 1, 1), persistent=False
        )

    def _words(self, head: torch.Tensor) -> torch.Tensor:
        """[B, N, 4] bytes -> [B, N] little-endian int32 values (as int64): by arithmetic
        (no dtype view: any strides, any alignment)."""
        word = (head.to(torch.int64) * self.byte_weights).sum(dim=2)
        return torch.where(word >= 2**31, word - 2**32, word)

    def _header(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's words: line 0's first GEOMETRY_WORDS int32."""
        b, r = x.shape[0], self.side
        return self._words(
            x[:, 0].reshape(b, r * 3)[:, : 4 * GEOMETRY_WORDS].view(b, GEOMETRY_WORDS, 4)
        )

    def _lines(self, x: torch.Tensor, index: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
        """Stored lines `index` ([B, C]) of each row, whole: [B, C, R, 3] uint8."""
        b = x.shape[0]
        batch = torch.arange(b, device=x.device).view(b, 1)
        return x[:, 1:][batch, index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, r = x.shape[0], self.side
        words = self._header(x)
        g = words[:, :GEOMETRY_WORDS].to(torch.float32)
        h = g[:, 0].clamp(1, r - 1)
        w = g[:, 1].clamp(1, r)
        o = g[:, 2]
        # Upright targets, in this step's staging pixels.
        nh = (g[:, 3] * self.ratio).clamp_min(1.0)
        nw = (g[:, 4] * self.ratio).clamp_min(1.0)
        top = g[:, 5] * self.ratio + self.offset
        left = g[:, 6] * self.ratio + self.offset
        swap = o >= 5
        # Which upright axis each stored axis carries, and whether it runs backwards
        # (the transposes of PIL's EXIF table, see worker/decode/cpu.py).
        flip_y = torch.where(swap, (o == 6) | (o == 7), (o == 3) | (o == 4))
        flip_x = torch.where(swap, (o == 7) | (o == 8), (o == 2) | (o == 3))
        out_y = torch.where(swap, nw, nh)
        start_y = torch.where(swap, left, top)
        out_x = torch.where(swap, nh, nw)
        start_x = torch.where(swap, top, left)
        idx_y, wt_y = self._taps(h, out_y, start_y, flip_y)  # [B, C, T]
        idx_x, wt_x = self._taps(w, out_x, start_x, flip_x)
        batch = torch.arange(b, device=x.device).view(b, 1)
        # Pass 1, along stored lines, one tap at a time (a fixed, unrolled count: the
        # compiled graph fuses them; eager holds one [B, C, R, 3] term at a time).
        y = self._lines(x, idx_y[:, :, 0], words).to(torch.float32) * wt_y[:, :, 0, None, None]
        for t in range(1, self.taps):
            line = self._lines(x, idx_y[:, :, t], words)
            y = y + line.to(torch.float32) * wt_y[:, :, t, None, None]
        # Pass 2, along stored columns: [B, C, C, 3].
        rows = self.output_index.view(1, -1, 1)
        batch3 = batch.view(b, 1, 1)
        z = y[batch3, rows, idx_x[:, None, :, 0]] * wt_x[:, None, :, 0, None]
        for t in range(1, self.taps):
            z = z + y[batch3, rows, idx_x[:, None, :, t]] * wt_x[:, None, :, t, None]
        z = torch.where(swap.view(b, 1, 1, 1), z.transpose(1, 2), z)
        # NHWC viewed as NCHW: channels_last in memory, as the model wants it.
        return z.permute(0, 3, 1, 2)

    def _taps(
        self, size: torch.Tensor, out: torch.Tensor, start: torch.Tensor, flip: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored tap positions [B, C, T] (long) and their normalised weights (float32) for
        one axis: `size` stored pixels resized to `out` and read from `start` on."""
        scale = (size / out)[:, None]
        support = scale.clamp_min(1.0)
        u = self.outputs[None, :] + start[:, None]  # [B, C]: resized coordinates
        inside = ((u >= 0) & (u < out[:, None])).to(torch.float32)
        center = (u + 0.5) * scale
        first = torch.floor(center - support + 0.5)
        q = first[:, :, None] + self.steps  # [B, C, T]: upright source pixels
        weight = (1.0 - ((q + 0.5 - center[:, :, None]) / support[:, :, None]).abs()).clamp_min(0.0)
        n = size[:, None, None]
        weight = weight * ((q >= 0) & (q < n)).to(torch.float32)
        weight = weight / weight.sum(dim=2, keepdim=True).clamp_min(1e-12)
        weight = weight * inside[:, :, None]
        stored = torch.where(flip[:, None, None], n - 1.0 - q, q)
        index = stored.clamp_min(0.0).minimum(n - 1.0).long()
        return index, weight


class PackedResampler(RowResampler):
    """x: a slot of packed rows (worker/decode/packed.py), the memory of [B, R + 1, R + 1, 3]
    uint8 -> [B, 3, C, C] float32, as RowResampler gives for the same images in rows.

    Only where the pixels are read from differs: each row's record in the slot's header
    holds its geometry and where its pixels start; stored line y of a row of width w starts
    w * 3 * y bytes after that. A line is gathered as R * 3 bytes from its start, out of a
    sliding-window view of the slot (`unfold`: no copy, one start per line gathered), so a
    pass reads what RowResampler's does: the bytes past the row's width belong to other
    lines, and no tap reads them (taps stop at the stored width)."""

    def __init__(self, side: int, geometry_size: int, staging_size: int, crop_size: int) -> None:
        super().__init__(side, geometry_size, staging_size, crop_size)

    def _header(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        head = x.reshape(-1)[: b * HEADER_BYTES].view(b, HEADER_WORDS, 4)
        return self._words(head)

    def _lines(self, x: torch.Tensor, index: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
        b, c = index.shape
        r = self.side
        windows = x.reshape(-1).unfold(0, r * 3, 1)  # [N - 3R + 1, 3R], a view
        width = words[:, 1].clamp(1, r)
        start = words[:, OFFSET_WORD, None] + index * (width[:, None] * 3)
        # A row never written reads zeros from the header's start; the clamp only keeps a
        # damaged record inside the slot.
        start = start.clamp(0, windows.shape[0] - 1)
        return windows[start].view(b, c, r, 3)


def use_packed(step: InferenceStep, side: int, geometry_size: int) -> None:
    """Make `step` read slots of packed rows of row side `side` (the memory of rows of side
    packed_side(side)) whose geometry was computed for staging size `geometry_size`."""
    step.rows = PackedResampler(side, geometry_size, step.staging_size, step.crop_size).to(
        step.scale.device
    )
    step.input_side = packed_side(side)


def use_rows(step: InferenceStep, side: int, geometry_size: int) -> None:
    """Make `step` read rows of side `side` whose geometry was computed for staging size
    `geometry_size` (the main step's; a degraded step scales it to its own)."""
    step.rows = RowResampler(side, geometry_size, step.staging_size, step.crop_size).to(
        step.scale.device
    )
    step.input_side = side


def choose_placement(
    setting: str, device: torch.device, decode: str, processes: int = 0
) -> tuple[str, str]:
    """(`device` or `host`, why) for the tuning constant RESIZE (`setting`) on `device` with
    GPUFEED_DECODE=`decode` and `processes` decode processes (0: threads). Raises
    ConfigError for a combination that cannot be honoured."""

    if decode != "cpu" and not processes:
        # GPU decode from the worker's threads: its decoder writes resized rows.
        if setting == "device" and decode == "auto":
            return "device", (
                "GPUFEED_TUNING resize=device; GPUFEED_DECODE=auto decodes on the CPU here: "
                "the decode threads' GPU decoder writes resized rows"
            )
        if setting == "device":
            raise ConfigError(
                f"GPUFEED_TUNING resize=device: with decode threads, rows at their own size need "
                f"GPUFEED_DECODE=cpu (got {decode}): the threads' GPU decoder writes resized "
                "rows; decode processes take both"
            )
        if setting == "auto":
            return (
                "host",
                f"GPUFEED_DECODE={decode} on decode threads: its decoder writes resized rows",
            )
    if decode == "gpu" and processes and setting == "host":
        raise ConfigError(
            "GPUFEED_TUNING resize=host: with decode processes the GPU decoder writes each "
            "image at its own size into packed rows, resized in the step; take resize out of "
            "GPUFEED_TUNING, or set GPUFEED_DECODE_PROCESSES=0"
        )
    if setting != "auto":
        return setting, f"GPUFEED_TUNING resize={setting}"
    if device.type == "cuda":
        return "device", (
            "auto on CUDA: the decode threads only decode, the resize is a few gathers in "
            "the compiled step"
        )
    return "host", (
        "auto on the CPU: the step would share the decode threads' cores, and Pillow's "
        "resize on them measured faster than the step's gathers (bench: resize_placement)"
    )


def ring_budget(batch: int, side: int, slots: int) -> dict[str, int]:
    """What the input ring costs: pinned bytes (all slots) and bytes copied per batch."""
    per_batch = batch * side * side * 3
    return {
        "row_side": side,
        "ring_pinned_bytes": per_batch * slots,
        "h2d_bytes_per_batch": per_batch,
    }

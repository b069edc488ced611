"""The split of each batch between the GPU's JPEG decoder and the decode processes, kept
right while the worker runs.

The start-up measurement (worker/decode/gpu_packed.py, `measure_rates`) gives the GPU the
share of the two decoders' summed rate on sample JPEGs. Real traffic differs (other sizes,
other encoders, a model that competes with the decode for the GPU), so with the share on
`auto` (the tuning constant GPU_DECODE_SHARE) the dispatcher reports, for each batch, how
long it waited for the batch's CPU rows (decoded after the batch was taken) and how long
for its GPU rows (decoded when the launch needed them). Over a window of batches, the
decoder it waited for more gets less: the share moves by a step toward the side that kept
the dispatcher waiting less. While neither keeps it waiting (the model binds, or jobs are
few) the share stays where it is. A share set through GPUFEED_TUNING is never moved.
"""

from __future__ import annotations

from collections.abc import Callable

# Batches per adjustment, and the step: 0.02 a window moves the share by 0.1 in a few
# hundred batches at most (seconds on a GPU host).
WINDOW = 8
STEP = 0.02
# Waits below this (a window's total) are noise, not a side that binds.
NOISE_S = 0.002


class DecodeSplit:
    """The GPU's share of each batch's rows; `observe` tunes it when `tune`."""

    def __init__(
        self,
        share: float,
        *,
        tune: bool,
        on_change: Callable[[float], None],
        window: int = WINDOW,
        step: float = STEP,
    ) -> None:
        self.share = share
        self.tune = tune
        self._on_change = on_change
        self._window = window
        self._step = step
        self._batches = 0
        self._cpu_s = 0.0
        self._gpu_s = 0.0
        self.adjustments = 0
        on_change(share)

    def observe(self, cpu_wait_s: float, gpu_wait_s: float) -> None:
        """One batch: the dispatcher's wait for its CPU rows and for its GPU rows."""
        if not self.tune:
            return
        self._batches += 1
        self._cpu_s += max(0.0, cpu_wait_s)
        self._gpu_s += max(0.0, gpu_wait_s)
        if self._batches < self._window:
            return
        cpu, gpu = self._cpu_s, self._gpu_s
        self._batches, self._cpu_s, self._gpu_s = 0, 0.0, 0.0
        if max(cpu, gpu) < NOISE_S:
            return
        if gpu > cpu:
            share = max(0.0, self.share - self._step)
        else:
            share = min(1.0, self.share + self._step)
        if share != self.share:
            self.share = share
            self.adjustments += 1
            self._on_change(share)

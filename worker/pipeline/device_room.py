"""Whether the device can take another batch: how many sealed batches are ahead of the open one.

A batch whose max wait has passed is sealed only when the device has room for it: fewer
than `depth` batches sealed and not yet finished (waiting for their decodes, launched, or
running). Until then it keeps filling. Sealed at its max wait whatever the device did, a
nearly empty batch took a ring slot and a full batch's step, and a job arriving behind a few
of them waited for all their steps; kept open, the jobs that arrive while the device is busy
run together in the next step. A full batch is sealed at once, as before: it gains nothing by
waiting, and at saturation every batch is full.

`depth` is 1 on the CPU (the step runs on the launch thread: a second sealed batch would
only wait behind it) and 2 on CUDA (one batch queued on the device behind the one running,
so the GPU never waits for the host between steps, while the next batch's decodes overlap
both).
"""

from __future__ import annotations

from collections.abc import Callable


class DeviceRoom:
    def __init__(self, depth: int, on_room: Callable[[], None] | None = None) -> None:
        if depth < 1:
            raise ValueError(f"depth must be at least 1 (got {depth})")
        self.depth = depth
        self.ahead = 0
        # Called when a finished batch leaves room (the batcher's queue wake-up).
        self.on_room = on_room

    def has_room(self) -> bool:
        return self.ahead < self.depth

    def sealed(self) -> None:
        self.ahead += 1

    def finished(self) -> None:
        """A sealed batch is done with the device: run, failed, or dropped before it."""
        self.ahead = max(0, self.ahead - 1)
        if self.ahead < self.depth and self.on_room is not None:
            self.on_room()

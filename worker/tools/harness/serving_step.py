"""The worker's serving step as the doctor's (a) and (b) and the GPU check measure it: its eager
module, a random batch."""

from __future__ import annotations

from typing import Any

import torch


def random_batch(batch: int, size: int, device: torch.device) -> torch.Tensor:
    """x: [B, S, S, 3] uint8 on the device, made outside inference mode (compiled steps
    guard on that, as on the production buffers)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randint(0, 256, (batch, size, size, 3), dtype=torch.uint8, generator=gen)
    return x.to(device)


def eager_of(step_fn: Any) -> Any:
    # torch.compile(module) returns an OptimizedModule that keeps the module it wraps.
    return getattr(step_fn, "_orig_mod", step_fn)

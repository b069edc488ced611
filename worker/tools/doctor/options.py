"""What `doctor` is asked to measure (DoctorOptions)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DoctorOptions:
    jobs: int = 0  # synthetic JPEGs in the end-to-end run; 0: 200 on CPU, 3000 on CUDA
    image_size: tuple[int, int] = (640, 480)  # their width, height
    compile_ceiling: bool = False  # compile on the CPU too, to measure the compiled ceiling
    ceiling_seconds: float = 3.0  # timed run per ceiling variant (after warm-up)
    sync_launches: int = 20  # launches of the hot path under sync-debug mode (CUDA)
    timeout_s: float = 300.0  # the end-to-end run gives up after this
    decode_delay_s: float = 0.0  # test hook: sleep in every decode (to test the verdict)
    urls: bool = False  # the jobs name URLs on a loopback HTTP server (measures fetching)
    paths: bool = False  # the jobs name files in a folder of the run's (GPUFEED_PATH_ROOT)

"""What each phase of the GPU check costs besides its own window, in seconds, on a 16-core GPU
host: what the budget plan adds up (the table, table.py, says which phase each is for).
Each phase still checks the time left when its turn comes."""

from __future__ import annotations

STARTUP_S = 100.0  # resnet50 compiled cold at its four batch shapes, its checks
STARTUP_EAGER_S = 20.0  # no compile: the model built and warmed up
LIGHT_START_S = 75.0  # the light model's worker, compiled for the full batch alone
LIGHT_START_EAGER_S = 20.0
ONE_COMPILE_S = 40.0  # the model compiled cold at one shape (the peer's, the cudnn extra's)
CEILING_S = 5.0
WINDOW_S = 5.0  # a window's ramp (four batches answered), warm-up and read-out
SYNCS_S = 5.0  # the profiler's start, stop and read-out of every thread's events
DRAIN_S = 5.0  # the pipeline's worker answering its backlog and stopping
DECODE_S = 10.0
PEER_S = 20.0  # the DataLoader's processes spawned, the model alone timed
LIGHT_CEILING_S = 5.0
LIGHT_S = 15.0  # the light worker's loop started, its ramp and drain
SHUTDOWN_S = 10.0  # the workers shut down and the report written
GPU_DECODE_RATE_S = 35.0
H2D_S = 15.0
CUDNN_S = 10.0  # and a compile where the step is compiled
# A before_processes run besides its window: the workers' start (torch's import, a compile
# mostly served by the cache the check's own worker filled), a warm-up and the drain.
PROCESSES_RUN_S = 45.0


def before_process_counts(value: str) -> list[int]:
    """--before-processes: GPUFEED_PROCESSES values, each 1 to 16 (ValueError otherwise)."""
    counts = [int(v) for v in value.replace(" ", "").split(",") if v]
    if any(not 1 <= n <= 16 for n in counts):
        raise ValueError("each value must be 1 to 16")
    return counts

"""`python -m worker doctor`: why is the device not busier? Measured, with evidence.

On the configured model, device and batch:

(a) the direct-feed ceiling: images/s with a random batch already on the device, eager and
    compiled (on the CPU compiled only when asked: compiling costs tens of seconds there);
(b) one forward under torch.profiler: kernels (CPU: operators) launched, their busy time
    against the forward's wall time, the idle gaps between them, the share under 10 µs;
(c) host syncs on the launch path: N launches of the real hot path under CUDA sync-debug
    mode, each sync counted with where it happened (CUDA only);
(d) a short end-to-end run: synthetic JPEGs through Redis and a real in-process Worker,
    with the NVML/CPU sampler on;
(e) the verdict (worker/tools/doctor/verdict.py) with its evidence and the knob to turn.

One real Worker is started with the configured settings (its own start-up: model, compile,
warm-up and checks), on a private stream so production streams are untouched; (a)-(c) run
on its launch thread before it takes any job, (d) is its main loop. Whatever could not be
measured is said, with the reason, in its section and in `not_measured`.

`--json` prints one object whose schema is SCHEMA (schema.py), documented in
docs/doctor-schema.md (the table there is `schema_markdown()`).
"""

from __future__ import annotations

from worker.model.step import StepFn
from worker.tools.doctor.ceiling_section import timed_ceiling
from worker.tools.doctor.checkup import run_doctor
from worker.tools.doctor.evidence import evidence_from
from worker.tools.doctor.options import DoctorOptions
from worker.tools.doctor.output import print_json, report_console
from worker.tools.doctor.profile_section import profile_forward
from worker.tools.doctor.render import render
from worker.tools.doctor.schema import SCHEMA, SCHEMA_VERSION
from worker.tools.doctor.schema_table import schema_markdown
from worker.tools.doctor.validate import validate
from worker.tools.harness.environment import environment

__all__ = [
    "SCHEMA",
    "SCHEMA_VERSION",
    "DoctorOptions",
    "StepFn",
    "environment",
    "evidence_from",
    "print_json",
    "profile_forward",
    "render",
    "report_console",
    "run_doctor",
    "schema_markdown",
    "timed_ceiling",
    "validate",
]

"""The report's JSON Schema (SCHEMA), documented in docs/doctor-schema.md.

A JSON Schema in the subset worker/tools/harness/report_head.py writes and checks (type,
properties, required, additionalProperties, items, enum), with a `unit` next to
`description` where one applies. Its `environment` is the block the bench and the GPU check
share (report_head.json_schema), defined there once.
"""

from __future__ import annotations

from typing import Any

from worker.tools.doctor.verdict import VERDICTS
from worker.tools.harness import report_head
from worker.tools.harness.report_head import node as _t
from worker.tools.harness.report_head import object_node as _obj

SCHEMA_VERSION = 1


def _map(description: str, values: dict[str, Any], key: str, *, nullable: bool = False) -> Any:
    return {
        "type": ["object", "null"] if nullable else "object",
        "description": description,
        "additionalProperties": values,
        "x-key": key,
    }


def _list(description: str, items: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "description": description, "items": items}


_NOT_MEASURED = _list(
    "what this section could not measure, and why (empty when everything was measured)",
    _t("string", "one reason"),
)

_KINDS_US = {
    "event_loop": "the event loop's thread (reader, batcher, completion, writer, Redis client)",
    "decode": "the decode threads",
    "launch": "the launch thread",
    "other": "every other thread Python started (metrics server, samplers, executors)",
}

_GIL = _obj(
    "what holds the GIL per job, and the most one process could serve "
    "(worker/decode/gil_account.py)",
    {
        "jobs": _t("integer", "results the figures are per", "jobs"),
        "threads": _map(
            "threads of each kind (`native`: started by no Python code, e.g. torch's "
            "intra-op pool)",
            _t("integer", "threads", "threads"),
            "kind",
        ),
        "gil_us_per_job": _obj(
            "GIL-holding time per job: CPU time; for decode threads, less the time inside "
            "calls that release the GIL",
            {k: _t("number", v, "µs") for k, v in _KINDS_US.items()},
        ),
        "cpu_us_per_job": _obj(
            "CPU time per job by thread kind",
            {
                **{k: _t("number", v, "µs") for k, v in _KINDS_US.items()},
                "native": _t("number", "threads no Python code started (no GIL)", "µs"),
            },
        ),
        "system_us_per_job": _obj(
            "of cpu_us_per_job, the part in the kernel (system calls, which release the "
            "GIL: how loose the CPU-time bound is), to the kernel's tick",
            {
                **{k: _t("number", v, "µs") for k, v in _KINDS_US.items()},
                "native": _t("number", "threads no Python code started", "µs"),
            },
        ),
        "process_cpu_us_per_job": _t(
            "number",
            "the worker's CPU per job (its decode, writer and intake processes' included)",
            "µs",
        ),
        "decode_processes_cpu_us_per_job": _t(
            "number", "the decode processes' CPU per job (0 with decode threads)", "µs"
        ),
        "writer_process_cpu_us_per_job": _t(
            "number",
            "the result writer's process's CPU per job (0 with the writer on the event loop)",
            "µs",
        ),
        "intake_process_cpu_us_per_job": _t(
            "number",
            "the intake's processes' CPU per job (0 with jobs read on the event loop)",
            "µs",
        ),
        "decode_released_us_per_job": _t(
            "number",
            "decode threads' time inside libjpeg-turbo, Pillow's decode and resize and the "
            "row copy, and the time sending rows to decode processes: calls that release the "
            "GIL",
            "µs",
        ),
        "timed_calls_per_job": _t("number", "timed GIL-releasing calls per job", "calls"),
        "launch_computes_model": _t(
            "boolean",
            "the launch thread computed a real model on the CPU (torch ops release the GIL): "
            "its figure, and so the projection, is a loose bound, not a GPU host's launch cost",
        ),
        "timed_call_us": _t("number", "what timing one call costs on this host", "µs"),
        "projections": _list(
            "for 16 cores and this host's",
            _obj(
                "one projection: the lower of the GIL bound and the core bound",
                {
                    "cores": _t("integer", "cores of the projected host", "cores"),
                    "gil_us_per_job": _t("number", "GIL µs per job, all threads", "µs"),
                    "cpu_us_per_job": _t("number", "process CPU µs per job", "µs"),
                    "gil_bound_jobs_per_s": _t(
                        ["number", "null"], "1e6 / gil_us_per_job", "jobs/s"
                    ),
                    "cores_bound_jobs_per_s": _t(
                        ["number", "null"], "cores x 1e6 / cpu_us_per_job", "jobs/s"
                    ),
                    "jobs_per_s": _t(["number", "null"], "the lower of the two", "jobs/s"),
                    "binds": _t(
                        ["string", "null"], "which bound is lower", enum=["GIL", "cores", None]
                    ),
                },
            ),
        ),
    },
    nullable=True,
)

_CEILING_RUN = _obj(
    "one direct-feed run (worker/model/ceiling.py)",
    {
        "device": _t("string", "the device the batch was on, e.g. `cpu`, `cuda:0`"),
        "batch": _t("integer", "batch size", "images"),
        "iters": _t("integer", "timed batches, after warm-up", "batches"),
        "images_per_s": _t("number", "throughput", "images/s"),
        "ms_per_batch": _t("number", "time per batch (CUDA events on CUDA, wall on CPU)", "ms"),
        "wall_s": _t("number", "wall time of the timed batches", "s"),
        "mode": _t("string", "`off` (eager) or the torch.compile mode"),
        "compile_s": _t(["number", "null"], "compile time when compiled for this measurement", "s"),
    },
    nullable=True,
)

_FINDING = _obj(
    "a finding",
    {
        "name": _t("string", "the finding's name (one of the verdict names)", enum=list(VERDICTS)),
        "headline": _t("string", "what it means, in plain words"),
        "evidence": _list("the figures behind it", _t("string", "one line")),
        "knob": _t("string", "the setting to change"),
        "hint": _t("boolean", "true: not strong enough to be the verdict (e.g. on CPU)"),
    },
)

SCHEMA: dict[str, Any] = _obj(
    "the report of `python -m worker doctor --json`",
    {
        "schema_version": _t("integer", f"the schema's version ({SCHEMA_VERSION})"),
        "started_at": _t("string", "when the doctor started, ISO 8601 UTC"),
        "elapsed_s": _t("number", "how long the doctor ran", "s"),
        "environment": report_head.json_schema(report_head.DOCTOR),
        "config": _obj(
            "the settings measured (environment and flags, as the worker resolved them)",
            {
                "model": _t("string", "GPUFEED_MODEL"),
                "weights": _t("string", "the weights loaded"),
                "device": _t("string", "the device used, e.g. `cpu`, `cuda:0 (NVIDIA H200)`"),
                "batch_size": _t("integer", "the largest batch shape", "images"),
                "batch_sizes": _list(
                    "each batch shape compiled at start-up (tuning constant BATCH_SIZES); a batch "
                    "runs on the smallest kept one that holds it",
                    _obj(
                        "one batch shape",
                        {
                            "size": _t("integer", "the batch shape", "images"),
                            "compile_s": _t("number", "its compile (0 in eager)", "s"),
                            "step_ms": _t("number", "one step, timed at start-up", "ms"),
                            "graph_mib": _t(
                                "number", "device memory its compile and warm-up took", "MiB"
                            ),
                            "kept": _t(
                                "boolean",
                                "run for batches (false: no faster than the next larger)",
                            ),
                        },
                    ),
                ),
                "compile": _t("string", "GPUFEED_COMPILE as configured"),
                "compile_mode": _t(
                    "string", "the resolved mode of the serving step (`off`: eager)"
                ),
                "compiled": _t("boolean", "the serving step is compiled (no eager fallback)"),
                "cudagraphs": _t("boolean", "the serving step replays CUDA graphs"),
                "dtype": _t("string", "the serving precision, e.g. `float32`, `bfloat16`"),
                "input_size": _t("integer", "model input side", "px"),
                "staging_size": _t("integer", "staging (resize) side", "px"),
                "decode": _t("string", "GPUFEED_DECODE"),
                "decode_threads": _t(
                    "integer", "decoders: processes, or threads when there are none", "decoders"
                ),
                "decode_processes": _t(
                    "integer", "decode processes (0: threads in the worker)", "processes"
                ),
                "feed_plan": _t(
                    "string",
                    "the feed plan's line: decoders, ring, resize, intake and result writer, each "
                    "with why",
                ),
                "result_writer": _t(
                    "string",
                    "where results are built and published: `process` or `loop` "
                    "(the tuning constant RESULT_WRITER as resolved)",
                ),
                "intake": _t(
                    "string",
                    "where jobs are read from Redis: `process` (image bytes straight into "
                    "memory the decode processes read) or `loop` (the tuning constant INTAKE as "
                    "resolved)",
                ),
                "staged_bytes_per_image": _t(
                    "integer",
                    "host bytes staged and copied to the device per image (packed rows: "
                    "measured over the run, the decoded pixels and a 64-byte record)",
                    "bytes",
                ),
                "dct_scaling": _t(
                    "boolean", "large JPEGs decoded at 1/2-1/8 scale (tuning constant DCT_SCALING)"
                ),
                "resize": _t("string", "where images are resized (`host` or `device`)"),
                "resize_why": _t(
                    "string", "why that placement (the tuning constant RESIZE and the device)"
                ),
                "row_side": _t("integer", "side of the input ring's rows (S; R for device)", "px"),
                "ring_pinned_bytes": _t(
                    "integer", "the input ring's host memory, all slots (pinned on CUDA)", "bytes"
                ),
                "h2d_bytes_per_batch": _t(
                    "integer",
                    "bytes copied host-to-device per batch (packed rows: at most)",
                    "bytes",
                ),
                "max_wait_ms": _t("number", "GPUFEED_MAX_WAIT_MS", "ms"),
                "fetch_concurrency": _t(
                    "integer", "GPUFEED_FETCH_CONCURRENCY (`url` jobs)", "fetches"
                ),
                "notes": _list(
                    "changes the doctor made, e.g. random weights", _t("string", "one note")
                ),
            },
        ),
        "ceiling": _obj(
            "(a) the direct-feed ceiling: a random batch already on the device, fed to the step",
            {
                "measured": _t("boolean", "at least one variant was measured"),
                "serving": _t(
                    "string", "which variant the worker serves with", enum=["eager", "compiled"]
                ),
                "eager": _CEILING_RUN,
                "compiled": _CEILING_RUN,
                "not_measured": _NOT_MEASURED,
            },
        ),
        "profile": _obj(
            "(b) one forward of the step under torch.profiler",
            {
                "measured": _t("boolean", "the profile was taken"),
                "device": _t("string", "`cuda` or `cpu`"),
                "unit": _t(
                    "string",
                    "what was counted: CUDA kernels, or on the CPU the outermost aten operators",
                    enum=["kernels", "ops"],
                ),
                "step": _t(
                    "string",
                    "the step profiled: the serving one, or one passed in by a caller",
                    enum=["eager", "compiled", "injected"],
                ),
                "stats": _obj(
                    "figures of the trace (worker/tools/doctor/profile_stats.py)",
                    {
                        "count": _t("integer", "kernels (or ops) in one forward"),
                        "busy_us": _t("number", "time any of them ran (union)", "µs"),
                        "wall_us": _t("number", "wall time of the forward", "µs"),
                        "span_us": _t("number", "first start to last end", "µs"),
                        "busy_ratio": _t(["number", "null"], "busy_us / wall_us", "0..1"),
                        "gaps": _obj(
                            "idle gaps between one ending and the next starting",
                            {
                                "count": _t("integer", "gaps"),
                                "mean_us": _t(["number", "null"], "mean gap", "µs"),
                                "p50_us": _t(["number", "null"], "median gap", "µs"),
                                "max_us": _t(["number", "null"], "longest gap", "µs"),
                                "total_us": _t("number", "sum of the gaps", "µs"),
                            },
                        ),
                        "tiny_share": _t(
                            ["number", "null"], "share shorter than tiny_threshold_us", "0..1"
                        ),
                        "tiny_threshold_us": _t("number", "the 'tiny' threshold (10)", "µs"),
                        "median_us": _t(["number", "null"], "median duration", "µs"),
                    },
                    nullable=True,
                ),
                "top": _list(
                    "the names with the most time",
                    _obj(
                        "one name",
                        {
                            "name": _t("string", "kernel or operator name"),
                            "count": _t("integer", "occurrences in the forward"),
                            "total_us": _t("number", "their summed duration", "µs"),
                        },
                    ),
                ),
                "not_measured": _NOT_MEASURED,
            },
        ),
        "host_syncs": _obj(
            "(c) host syncs on the launch path, under CUDA sync-debug mode",
            {
                "measured": _t("boolean", "the check ran"),
                "applicable": _t("boolean", "false on the CPU, where there are no device syncs"),
                "launches": _t("integer", "launches of the real hot path checked", "batches"),
                "count": _t(["integer", "null"], "syncs counted in those launches (0 expected)"),
                "where": _list(
                    "where they happened: `file:line: message`, or `thread:call xN` for "
                    "explicit synchronize calls",
                    _t("string", "one location"),
                ),
                "pipeline_count": _t(
                    ["integer", "null"], "syncs counted during the end-to-end run"
                ),
                "not_measured": _NOT_MEASURED,
            },
        ),
        "end_to_end": _obj(
            "(d) synthetic JPEGs through Redis and a real in-process worker",
            {
                "measured": _t("boolean", "the run took place and produced results"),
                "redis": _t(
                    ["string", "null"],
                    "`existing` (REDIS_URL answered) or `private` (a redis-server started here)",
                ),
                "stream": _t(["string", "null"], "the private job stream used (deleted after)"),
                "jobs": _t(
                    "integer", "jobs submitted (--jobs; default 200 on CPU, 3000 on CUDA)", "jobs"
                ),
                "backlog": _t(
                    "boolean",
                    "jobs were waiting in Redis beyond what the worker held, in at least 90% "
                    "of the checks while jobs were fed (false: the feed, not the worker, ran dry)",
                ),
                "image_size": _t("string", "WIDTHxHEIGHT of the synthetic JPEGs", "px"),
                "source": _t(
                    "string",
                    "how the jobs carry their images: inline, by URL from a loopback HTTP "
                    "server (--urls), or by path to files in a folder of the run's (--paths)",
                    enum=["image", "url", "path"],
                ),
                "mean_jpeg_bytes": _t(["integer", "null"], "mean encoded size", "bytes"),
                "decode_delay_ms": _t("number", "test hook: added to every decode", "ms"),
                "images_per_s": _t(
                    ["number", "null"], "results per second after the first batch", "images/s"
                ),
                "elapsed_s": _t(["number", "null"], "main loop start to the last result", "s"),
                "first_result_s": _t(["number", "null"], "main loop start to the first", "s"),
                "latency_p50_ms": _t(
                    ["number", "null"],
                    "median time from XADD to the published result (all jobs pushed at once: "
                    "the wait behind the backlog included; the bench measures paced loads)",
                    "ms",
                ),
                "latency_p99_ms": _t(["number", "null"], "99th percentile of the same", "ms"),
                "timed_out": _t("boolean", "the run hit --timeout before all results"),
                "results_ok": _t(["integer", "null"], "ok results", "jobs"),
                "results_error": _t(["integer", "null"], "error results", "jobs"),
                "stage_ms": _map(
                    "mean time per job in each stage (the worker's observer)",
                    _t(["number", "null"], "mean", "ms"),
                    "stage",
                    nullable=True,
                ),
                "gpu_ms_per_batch": _t(
                    ["number", "null"],
                    "model time per batch (CUDA events; wall time on CPU)",
                    "ms",
                ),
                "batch_fill": _t(["number", "null"], "mean real rows / batch size", "0..1"),
                "decode_threads": _t(["integer", "null"], "decode threads", "threads"),
                "decode_capacity_images_per_s": _t(
                    ["number", "null"], "decode threads / mean decode time", "images/s"
                ),
                "fetch_capacity_images_per_s": _t(
                    ["number", "null"],
                    "GPUFEED_FETCH_CONCURRENCY / mean fetch time (--urls runs)",
                    "images/s",
                ),
                "model_capacity_images_per_s": _t(
                    ["number", "null"], "the serving step's ceiling, from (a)", "images/s"
                ),
                "model_in_pipeline_images_per_s": _t(
                    ["number", "null"], "batch size / gpu_ms_per_batch", "images/s"
                ),
                "queue_capacity_jobs_per_s": _t(
                    ["number", "null"],
                    "the queue ceiling: gpufeed's Redis work alone for the same jobs and batch "
                    "(XREADGROUP, one publish script per job), measured before the run",
                    "jobs/s",
                ),
                "queue_client_cpu_us_per_job": _t(
                    ["number", "null"], "client CPU of the queue ceiling per job", "µs"
                ),
                "loop_cpu_us_per_job": _t(
                    ["number", "null"],
                    "the event loop thread's CPU per result during the run (the worker's "
                    "reader, batcher, writer and Redis client; the doctor's jobs come from a "
                    "process of their own)",
                    "µs",
                ),
                "redis_cpu_us_per_job": _t(
                    ["number", "null"],
                    "redis-server's CPU per job over the run (INFO cpu): each job's XADD and "
                    "the worker's reads, results and acks; its main thread's where Redis "
                    "reports it (null on a cluster, or where INFO is refused)",
                    "µs",
                ),
                "redis_cpu_main_thread": _t(
                    ["boolean", "null"],
                    "redis_cpu_us_per_job is the main thread's (the one that runs every "
                    "command), not the whole process's",
                ),
                "redis_jobs_per_s_max": _t(
                    ["number", "null"],
                    "1e6 / redis_cpu_us_per_job: the most such jobs one Redis serves, its "
                    "command thread busy all the time",
                    "jobs/s",
                ),
                "gil": _GIL,
                "gpu_util_pct": _t(["number", "null"], "NVML GPU utilisation, mean", "%"),
                "mem_bw_util_pct": _t(["number", "null"], "NVML memory utilisation, mean", "%"),
                "process_cpu_pct": _t(
                    ["number", "null"], "this process's CPU, mean (100 = one core)", "%"
                ),
                "system_cpu_pct": _t(["number", "null"], "whole host CPU, mean", "%"),
                "not_measured": _NOT_MEASURED,
            },
        ),
        "hot_list": _obj(
            "the fleet's hot list in the configured Redis: what a worker with these settings "
            "decodes into its cache before it joins the group (docs/operations.md, Warm start)",
            {
                "key": _t("string", "its key, `<GPUFEED_STREAM>:hot`"),
                "size": _t(
                    "integer", "the most images it keeps (tuning constant HOT_LIST)", "images"
                ),
                "warm_start_s": _t(
                    "number",
                    "a starting worker's warming budget (tuning constant WARM_START_S)",
                    "s",
                ),
                "off": _t("string", "why a worker with these settings keeps none, or empty"),
                "images": _t(["integer", "null"], "images on it now", "images"),
                "top": _list(
                    "its best entries, best first (at most 5)",
                    _obj(
                        "one image",
                        {
                            "kind": _t("string", "how jobs name it", enum=["path", "url"]),
                            "reply_to": _t("string", "the reply stream of the jobs it serves"),
                            "ref": _t("string", "the path or URL"),
                            "score": _t("number", "its cache hits, each halved every 10 minutes"),
                        },
                    ),
                ),
                "not_measured": _NOT_MEASURED,
            },
        ),
        "verdict": _obj(
            "(e) the verdict (rules and thresholds: worker/tools/doctor/verdict.py)",
            {
                "name": _t("string", "the verdict", enum=list(VERDICTS)),
                "headline": _t("string", "what it means, in plain words"),
                "evidence": _list("the figures behind it", _t("string", "one line")),
                "knob": _t("string", "the setting to change"),
                "also": _list("other findings that hold, and hints", _FINDING),
                "thresholds": _map(
                    "the thresholds the rules used", _t("number", "threshold"), "name"
                ),
            },
        ),
        "not_measured": _list(
            "every section's not_measured lines, prefixed with the section",
            _t("string", "one line"),
        ),
    },
)

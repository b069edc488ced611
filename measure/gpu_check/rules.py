"""The rules `make gpu-check` is judged by: one place, applied to the report when the run
ends and again by `python -m measure gpu-check --judge REPORT.json` to any saved report.

Each rule names a documented claim (docs/gpu-hosts.md), the figure the report measured for
it, the target and pass / fail. A rule whose figure is missing (its phase was skipped, cut
by the deadline or failed), or a GPU's claim measured on another device, fails as "not
measured": a check never passes on what it did not see. The targets are those the
documentation states for a GPU host (docs/gpu-hosts.md): half the ceiling and 55%
utilisation for 640x480 JPEGs, the doctor's "healthy" ratio (worker/tools/doctor/verdict.py)
for 64x64 ones, 12,000 images/s for a light model on 640x480 ones, 1.5x a torch DataLoader
on the same model.

Pure functions of the report's dict, importing no torch, so they judge reports from any
host and are tested on crafted reports.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from worker.tools.doctor.verdict import HEALTHY_RATIO

# The photo window's images/s (640x480 JPEGs, every one decoded) against the model's
# direct-feed ceiling, and the GPU's NVML utilisation over it: half the ceiling and 55%.
# A GPU host's cores alone decode 640x480 JPEGs at about half resnet50's ceiling on an
# H200 (docs/gpu-hosts.md#make-gpu-check gives the figures): the rest is the GPU's JPEG
# engines' to decode, and half the ceiling is what the two together are held to.
RATIO_TARGET = 0.5
GPU_UTIL_TARGET = 55.0
# The thumbnail window (64x64 JPEGs): decode is cheap, the feed itself is judged at the
# doctor's "healthy" level.
THUMBNAIL_RATIO_TARGET = HEALTHY_RATIO
# gpufeed's images/s against the same model fed by a torch DataLoader over the same JPEGs.
PEER_TARGET = 1.5
# The light model's window (mobilenet_v3_large by default) on the photo JPEGs, images/s.
LIGHT_TARGET = 12_000.0
# Mean absolute difference per pixel value of GPU decode against the CPU path (the CUDA
# tests' bound: nvJPEG upsamples chroma differently from libjpeg).
DECODE_DIFF_TARGET = 4.0

NOT_MEASURED = "not measured"

# Phases the rules need: their figures, or those the figures are measured against (the
# ceiling, the light model's start-up and ceiling). The run's budget plan keeps time for
# each of them first (measure/gpu_check/check.py, budget_plan).
JUDGED_PHASES = (
    "startup",
    "light_startup",
    "ceiling",
    "pipeline",
    "syncs",
    "thumbnails",
    "decode",
    "peer",
    "light_ceiling",
    "light",
)
# Phases between judged ones that no rule reads: run only where the judged phases after
# them keep their time.
UNJUDGED_PHASES = ("wait_for_tests", "latency", "before")
# Phases run after every judged claim was measured, when time is left; none is a rule.
EXTRA_PHASES = ("gpu_decode_rate", "decode_processes", "h2d", "before_processes", "cudnn")
# The rules that judge something besides a GPU's claims: the tests, the feed's answers.
NOT_GPU_RULES = ("cuda_tests", "pipeline_decodes", "run")


@dataclass(frozen=True)
class Rule:
    name: str
    claim: str
    measured: str
    target: str
    passed: bool

    def as_dict(self) -> dict[str, Any]:
        return {
            "rule": self.name,
            "claim": self.claim,
            "measured": self.measured,
            "target": self.target,
            "passed": self.passed,
        }


def _phase(report: Mapping[str, Any], name: str) -> str:
    entry = report.get("phases", {}).get(name) or {}
    status = str(entry.get("status", "absent"))
    why = entry.get("why") or entry.get("error")
    return f"{status} ({why})" if why else status


def _phase_done(report: Mapping[str, Any], name: str) -> bool:
    return bool((report.get("phases", {}).get(name) or {}).get("status") == "done")


def _not_measured(report: Mapping[str, Any], phase: str) -> str:
    return f"{NOT_MEASURED}: phase {phase} {_phase(report, phase)}"


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def rule_cuda_tests(report: Mapping[str, Any]) -> Rule:
    claim = "every cuda-marked test in tests/ was collected, ran and passed"
    tests = report.get("tests") or {}
    expected = tests.get("expected")
    target = f"{expected} of {expected} passed" if expected else "all passed"
    if not tests.get("available") or not isinstance(expected, int) or expected <= 0:
        reason = tests.get("reason") or "no test results or no expected count"
        return Rule("cuda_tests", claim, f"{NOT_MEASURED}: {reason}", target, False)
    passed = int(tests.get("passed_expected", tests.get("passed", 0)))
    missing = list(tests.get("missing", []))
    bad = int(tests.get("failures", 0)) + int(tests.get("errors", 0))
    skipped = int(tests.get("skipped", 0))
    parts = [f"{passed} of {expected} passed"]
    if bad:
        parts.append(f"{bad} failed: " + ", ".join(tests.get("failed", [])[:5]))
    if skipped:
        parts.append(f"{skipped} skipped: " + ", ".join(tests.get("skipped_tests", [])[:5]))
    if missing:
        parts.append(f"{len(missing)} not run: " + ", ".join(missing[:5]))
    if tests.get("rc") not in (None, 0):
        parts.append(f"pytest exited {tests['rc']}")
    ok = passed == expected and not bad and not skipped and not missing
    ok = ok and tests.get("rc") in (None, 0)
    return Rule("cuda_tests", claim, "; ".join(parts), target, ok)


def rule_pipeline_decodes(report: Mapping[str, Any]) -> Rule:
    claim = "the pipeline phase ran from Redis, every job decoded, every job answered ok"
    target = "window done, 0 decode-cache hits, 0 failed jobs"
    pipe = report.get("pipeline")
    if not _phase_done(report, "pipeline") or not isinstance(pipe, Mapping):
        return Rule("pipeline_decodes", claim, _not_measured(report, "pipeline"), target, False)
    hits = pipe.get("decode_cache_hits")
    errors = pipe.get("results_error")
    window = pipe.get("results_in_window")
    if not isinstance(hits, int) or not isinstance(errors, int) or not isinstance(window, int):
        return Rule("pipeline_decodes", claim, f"{NOT_MEASURED}: counts missing", target, False)
    measured = f"{window} results in the window, {hits} decode-cache hits, {errors} failed jobs"
    ok = hits == 0 and errors == 0 and window > 0
    return Rule("pipeline_decodes", claim, measured, target, ok)


def rule_gpu_decoded_rows(report: Mapping[str, Any]) -> Rule:
    claim = "where the check's --decode resolved to a GPU decoder, it decoded rows in the window"
    target = "> 0 rows decoded on the GPU in the pipeline window, where a GPU decoder runs"
    pipe = report.get("pipeline")
    if not _phase_done(report, "pipeline") or not isinstance(pipe, Mapping):
        return Rule("gpu_decoded_rows", claim, _not_measured(report, "pipeline"), target, False)
    if "gpu_decoder" not in pipe:
        measured = f"{NOT_MEASURED}: the report does not say which decoder ran"
        return Rule("gpu_decoded_rows", claim, measured, target, False)
    setting = pipe.get("decode_setting", "?")
    decoder = pipe.get("gpu_decoder")
    if decoder is None:
        # `auto` decodes on the CPU where no GPU decoder can be built, and says why; `gpu`
        # never starts without one.
        why = pipe.get("gpu_decode_why") or "no reason given"
        measured = f"--decode {setting}: no GPU decoder in this run ({why})"
        return Rule("gpu_decoded_rows", claim, measured, target, setting != "gpu")
    decoded = pipe.get("gpu_decoded_in_window")
    if not isinstance(decoded, int):
        measured = f"{NOT_MEASURED}: no count of the rows {decoder} decoded"
        return Rule("gpu_decoded_rows", claim, measured, target, False)
    measured = (
        f"--decode {setting}: {decoded} rows decoded by {decoder} in the window of "
        f"{pipe.get('results_in_window')} results, "
        f"{pipe.get('gpu_decode_failed_in_window', '?')} handed back to the CPU "
        f"({pipe.get('gpu_decode_wrong_shape_in_window', '?')} of them at another shape "
        f"than their place; GPU share {pipe.get('gpu_decode_share')}: "
        f"{pipe.get('gpu_decode_why') or '?'})"
    )
    engines = pipe.get("gpu_engines")
    if isinstance(engines, Mapping):
        answered = [kind for kind, ok in engines.items() if ok]
        measured += f"; backends that answered at start-up: {', '.join(answered) or 'none'}"
    return Rule("gpu_decoded_rows", claim, measured, target, decoded > 0)


def rule_host_syncs(report: Mapping[str, Any]) -> Rule:
    claim = (
        "no host sync while serving (any synchronize, blocking or pageable copy, any caller "
        "but a GPU decode lane waiting for its own previous batch)"
    )
    target = "0 per batch"
    syncs = report.get("host_syncs")
    if not _phase_done(report, "syncs") or not isinstance(syncs, Mapping):
        return Rule("host_syncs", claim, _not_measured(report, "syncs"), target, False)
    if not isinstance(syncs.get("batches"), int):
        why = str(syncs.get("status") or f"{NOT_MEASURED}: no batch count")
        return Rule("host_syncs", claim, why, target, False)
    total = int(syncs.get("total", -1))
    batches = int(syncs["batches"])
    if batches <= 0 or total < 0:
        measured = f"{NOT_MEASURED}: {batches} batches in the sync window"
        return Rule("host_syncs", claim, measured, target, False)
    per = total / batches
    measured = f"{per:.3f} per batch ({total} in {batches} batches)"
    sites = syncs.get("sites") or []
    if sites:
        measured += "; at " + " | ".join(str(s) for s in sites[:3])
    lanes = syncs.get("decode_lane_waits")
    if isinstance(lanes, Mapping) and int(lanes.get("total", 0)) > 0:
        # Reported, not counted: the GPU JPEG decoder's lane thread waiting for its own
        # previous batch stalls neither the launch thread nor the event loop.
        measured += (
            f"; apart from these, the GPU decode lanes waited {lanes['total']} times for "
            "their own previous batch"
        )
    return Rule("host_syncs", claim, measured, target, total == 0)


def rule_cudagraph_replays(report: Mapping[str, Any]) -> Rule:
    claim = "each batch in the window is one CUDA-graph replay"
    target = "replays == batches launched in the window"
    pipe = report.get("pipeline")
    if not _phase_done(report, "pipeline") or not isinstance(pipe, Mapping):
        return Rule("cudagraph_replays", claim, _not_measured(report, "pipeline"), target, False)
    replays = pipe.get("cudagraph_replays_in_window")
    launched = pipe.get("batches_in_window")
    if not isinstance(replays, int) or not isinstance(launched, int):
        return Rule("cudagraph_replays", claim, f"{NOT_MEASURED}: no counts", target, False)
    measured = f"{replays} replays, {launched} batches"
    return Rule("cudagraph_replays", claim, measured, target, launched > 0 and replays == launched)


def rule_one_graph(report: Mapping[str, Any]) -> Rule:
    claim = "the step is one compiled graph at start-up and still after the window"
    target = "compiled, no fallback, no recompile / break / skip / partition"
    compile_report = report.get("compile")
    still = report.get("compile_still_one_graph")
    if not isinstance(compile_report, Mapping) or still is None:
        phase = "startup" if not isinstance(compile_report, Mapping) else "pipeline"
        return Rule("one_graph", claim, _not_measured(report, phase), target, False)
    compiled = bool(compile_report.get("compiled")) and not compile_report.get("fell_back_to_eager")
    measured = (
        f"mode {compile_report.get('mode')}, compiled {compiled}, after the window: "
        f"{still if isinstance(still, str) else '; '.join(map(str, still))}"
    )
    return Rule("one_graph", claim, measured, target, compiled and still == "yes")


def rule_gpu_util(report: Mapping[str, Any]) -> Rule:
    claim = "the GPU is kept busy (NVML utilisation over the pipeline window)"
    target = f">= {GPU_UTIL_TARGET:.0f}%"
    util = _num(report.get("gpu_util_mean"))
    if util is None:
        if _phase_done(report, "pipeline"):
            sampler = report.get("gpu_sampler")
            why = sampler.get("reason") if isinstance(sampler, Mapping) else None
            measured = f"{NOT_MEASURED}: no NVML sample ({why or 'no reason given'})"
            return Rule("gpu_util", claim, measured, target, False)
        return Rule("gpu_util", claim, _not_measured(report, "pipeline"), target, False)
    return Rule("gpu_util", claim, f"{util:.1f}%", target, util >= GPU_UTIL_TARGET)


def rule_ratio(report: Mapping[str, Any]) -> Rule:
    claim = "640x480 JPEGs from Redis, every one decoded, at half the direct-feed ceiling"
    target = f">= {RATIO_TARGET:.2f} of the ceiling"
    ratio = _num(report.get("ratio"))
    if ratio is None:
        return Rule("ratio", claim, _not_measured(report, "pipeline"), target, False)
    rate = report.get("pipeline_images_per_s")
    ceiling = report.get("ceiling_best_images_per_s")
    measured = f"{ratio:.3f} ({rate} of {ceiling} images/s)"
    return Rule("ratio", claim, measured, target, ratio >= RATIO_TARGET)


def _window_rule(
    report: Mapping[str, Any],
    *,
    name: str,
    claim: str,
    phase: str,
    figure: str,
    minimum: float,
    target: str,
    describe: Callable[[Mapping[str, Any], float], str],
) -> Rule:
    """A rule on a window of its own (report[phase]): its `figure` at least `minimum`, and
    each batch in it one CUDA-graph replay."""
    found = report.get(phase)
    if not _phase_done(report, phase) or not isinstance(found, Mapping):
        return Rule(name, claim, _not_measured(report, phase), target, False)
    value = _num(found.get(figure))
    replays = found.get("cudagraph_replays_in_window")
    launched = found.get("batches_in_window")
    if value is None or not isinstance(replays, int) or not isinstance(launched, int):
        return Rule(name, claim, f"{NOT_MEASURED}: figures missing", target, False)
    measured = f"{describe(found, value)}; {replays} replays, {launched} batches"
    ok = value >= minimum and launched > 0 and replays == launched
    return Rule(name, claim, measured, target, ok)


def rule_thumbnail_ratio(report: Mapping[str, Any]) -> Rule:
    return _window_rule(
        report,
        name="thumbnail_ratio",
        claim="64x64 JPEGs from Redis near the ceiling, each batch one CUDA-graph replay",
        phase="thumbnails",
        figure="ratio",
        minimum=THUMBNAIL_RATIO_TARGET,
        target=f">= {THUMBNAIL_RATIO_TARGET:.2f} of the ceiling, replays == batches",
        describe=lambda found, ratio: (
            f"{ratio:.3f} ({found.get('images_per_s')} of "
            f"{report.get('ceiling_best_images_per_s')} images/s)"
        ),
    )


def rule_peer(report: Mapping[str, Any]) -> Rule:
    claim = "gpufeed feeds the model faster than a torch DataLoader does, on the same JPEGs"
    target = f">= {PEER_TARGET:.1f}x the DataLoader's images/s"
    peer = report.get("peer")
    if not _phase_done(report, "peer") or not isinstance(peer, Mapping):
        return Rule("peer", claim, _not_measured(report, "peer"), target, False)
    theirs = _num(peer.get("images_per_s"))
    ours = _num(report.get("pipeline_images_per_s"))
    if theirs is None or ours is None or theirs <= 0:
        why = "no pipeline rate" if ours is None else "no DataLoader rate"
        return Rule("peer", claim, f"{NOT_MEASURED}: {why}", target, False)
    times = ours / theirs
    measured = (
        f"{times:.2f}x ({ours} against {theirs} images/s; the DataLoader was "
        f"{peer.get('bound', '?')}-bound)"
    )
    if peer.get("compiled") is False and peer.get("compile_mode", "off") != "off":
        # Not like with like: the worker's step compiled, the peer's model eager.
        measured += f"; the peer's model ran eager: {peer.get('compile_refused', '?')}"
    return Rule("peer", claim, measured, target, times >= PEER_TARGET)


def rule_light_model(report: Mapping[str, Any]) -> Rule:
    return _window_rule(
        report,
        name="light_model",
        claim="640x480 JPEGs from Redis feed a light model at its pace, one replay per batch",
        phase="light",
        figure="images_per_s",
        minimum=LIGHT_TARGET,
        target=f">= {LIGHT_TARGET:,.0f} images/s, replays == batches",
        describe=lambda found, rate: (
            f"{found.get('model')}: {rate:,.0f} images/s ({found.get('ratio')} of its "
            f"ceiling {found.get('ceiling_images_per_s')})"
        ),
    )


def rule_gpu_decode(report: Mapping[str, Any]) -> Rule:
    claim = "GPU JPEG decode (RGB and grey) matches the CPU path"
    target = f"mean |diff| < {DECODE_DIFF_TARGET} per pixel value, each available decoder"
    found = report.get("gpu_decode_vs_cpu")
    if not _phase_done(report, "decode") or not isinstance(found, Mapping):
        return Rule("gpu_decode", claim, _not_measured(report, "decode"), target, False)
    parts: list[str] = []
    ok = True
    available = 0
    for name, entry in found.items():
        if not isinstance(entry, Mapping) or not entry.get("available"):
            continue
        available += 1
        for mode in ("RGB", "L"):
            m = (entry.get("modes") or {}).get(mode) or {}
            diff = _num(m.get("mean_abs_diff"))
            if not m.get("decoded") or diff is None:
                ok = False
                parts.append(f"{name} {mode}: not decoded ({m.get('error', '?')})")
            else:
                ok = ok and diff < DECODE_DIFF_TARGET
                parts.append(f"{name} {mode}: {diff:.2f}")
    if not available:
        return Rule("gpu_decode", claim, f"{NOT_MEASURED}: no GPU decoder", target, False)
    return Rule("gpu_decode", claim, "; ".join(parts), target, ok)


RULES = (
    rule_cuda_tests,
    rule_pipeline_decodes,
    rule_gpu_decoded_rows,
    rule_host_syncs,
    rule_cudagraph_replays,
    rule_one_graph,
    rule_gpu_util,
    rule_ratio,
    rule_thumbnail_ratio,
    rule_light_model,
    rule_peer,
    rule_gpu_decode,
)


def judge(report: Mapping[str, Any]) -> list[Rule]:
    """Every rule applied to `report`, in the order of what matters most. On a device
    other than CUDA (the check's rehearsal on the CPU) the GPU's claims are not measured,
    whatever the figures say."""
    rules = [rule(report) for rule in RULES]
    kind = report.get("device_type", "cuda")
    if kind != "cuda":
        off = f"{NOT_MEASURED}: not a CUDA device ({kind})"
        rules = [
            r
            if r.name in NOT_GPU_RULES
            else replace(r, measured=f"{off}; there: {r.measured}", passed=False)
            for r in rules
        ]
    # A run cut in an extra phase (measured after every claim) keeps its verdict; cut or
    # broken anywhere else, it fails, whatever the rules above found.
    if report.get("error") and report.get("stopped_in") not in EXTRA_PHASES:
        rules.append(Rule("run", "the run ended normally", str(report["error"]), "no error", False))
    return rules


def passed(rules: list[Rule]) -> bool:
    return bool(rules) and all(r.passed for r in rules)


def render(rules: list[Rule]) -> str:
    width = max(len(r.name) for r in rules) if rules else 0
    lines = []
    for r in rules:
        mark = "pass" if r.passed else "FAIL"
        lines.append(f"{mark}  {r.name:<{width}}  {r.measured}  (target {r.target})")
    verdict = "passed" if passed(rules) else "FAILED"
    failing = [r.name for r in rules if not r.passed]
    lines.append(f"gpu-check: {verdict}" + (f" ({', '.join(failing)})" if failing else ""))
    return "\n".join(lines)

"""docs/reference/metrics.md: every Prometheus metric a worker exports, with the help text
/metrics gives it (worker/observe/metrics.py), and the stages of `gpufeed_stage_seconds`."""

from __future__ import annotations

from typing import Any

from worker.docs_gen.markdown import notice
from worker.observe.metrics import DELIVERY_EVENTS, STAGE_INFO, WorkerMetrics
from worker.tools.markdown import table

# The series a metric of each type writes, as Prometheus's text format names them.
_SERIES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "info": ("_info",),
}


def _labels(collector: Any) -> list[str]:
    # prometheus_client's metrics keep their label names in `_labelnames`; the batch
    # histograms of worker/observe/metrics.py have one `label`.
    names = getattr(collector, "_labelnames", None)
    if names is not None:
        return list(names)
    label = getattr(collector, "label", None)
    return [label] if label else []


def render() -> str:
    metrics = WorkerMetrics()
    rows = []
    for attr, collector in vars(metrics).items():
        if attr == "registry":
            continue
        for family in collector.describe():
            series = ", ".join(f"`{family.name}{s}`" for s in _SERIES[family.type])
            labels = ", ".join(f"`{label}`" for label in _labels(collector)) or "none"
            rows.append([series, family.type, labels, family.documentation])
    stages = table(
        ["stage", "`worker top` column", "its time measures", "what moves it"],
        [[f"`{s.name}`", f"`{s.shown}`", s.measures, s.moved_by] for s in STAGE_INFO],
    )
    return (
        notice("worker/observe/metrics.py")
        + "# Metrics\n\n"
        + "A worker serves these on `GPUFEED_METRICS_PORT` (`/metrics`, with `/ready` and "
        + "`/live` beside them), each with the help text below. Every series exists from "
        + "start-up. Times are seconds.\n\n"
        + table(["series", "type", "labels", "help"], rows)
        + "\n\n## Stages\n\n"
        + "The values of `gpufeed_stage_seconds`'s `stage` label, in the order a job goes "
        + "through them (the keys of a result's `timings_ms` too):\n\n"
        + stages
        + "\n\n## Delivery events\n\n"
        + "The values of `gpufeed_delivery_events`'s `event` label: "
        + ", ".join(f"`{e}`" for e in DELIVERY_EVENTS)
        + ".\n"
    )

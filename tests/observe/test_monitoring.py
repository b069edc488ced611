"""deploy/prometheus (alert rules) and deploy/grafana (dashboard) work on the metrics that
exist: promtool checks the rules' syntax, runs their unit tests and parses every query of
the dashboard; a structural check stands in for Grafana's own; and every metric, label and
label value they name is one worker/observe/metrics.py exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.metrics import MetricWrapperBase

from worker.observe.metrics import DELIVERY_EVENTS, STAGES, BatchHistogram, WorkerMetrics

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "gpufeed-alerts.yaml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "gpufeed-alerts.test.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "gpufeed-dashboard.json"

# Labels Prometheus adds when it scrapes (job, instance) or Kubernetes discovery may add.
TARGET_LABELS = {"job", "instance", "namespace"}
ALERTS = {
    "GpufeedBacklogGrowing",
    "GpufeedNoProgress",
    "GpufeedDeadLetters",
    "GpufeedGpuIdleWithBacklog",
    "GpufeedReadinessLost",
}


def promtool() -> str | None:
    venv = ROOT / ".venv" / "bin" / "promtool"
    return shutil.which("promtool") or (str(venv) if venv.is_file() else None)


needs_promtool = pytest.mark.skipif(
    promtool() is None, reason="promtool is not installed (make promtool)"
)


def run_promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    tool = promtool()
    assert tool is not None
    return subprocess.run(
        [tool, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def dashboard_queries() -> list[str]:
    queries = [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]
    for var in dashboard()["templating"]["list"]:
        if var["type"] == "query":
            queries.append(var["query"]["query"])
    return queries


def as_promql(query: str) -> str:
    """A dashboard query as Prometheus would receive it from Grafana."""
    m = re.fullmatch(r"label_values\((.+), (\w+)\)", query)
    if m:  # a variable's query: Grafana asks for the series of its selector
        query = m.group(1)
    query = query.replace("$__rate_interval", "5m")
    return re.sub(r"\$(\w+)", ".*", query)


# ------------------------------------------------------------------ what metrics.py exports
def exported() -> dict[str, set[str]]:
    """Sample names the worker exports, with the label names each may carry."""
    metrics = WorkerMetrics()
    out: dict[str, set[str]] = {}
    for metric in vars(metrics).values():
        if isinstance(metric, BatchHistogram):
            name, kind = metric.name, "histogram"
            labels = {metric.label} if metric.label else set()
        elif isinstance(metric, MetricWrapperBase):
            name, kind = metric._name, metric._type
            labels = set(metric._labelnames)
        else:
            continue
        if kind == "counter":
            out[f"{name}_total"] = labels
        elif kind == "histogram":
            out[f"{name}_bucket"] = labels | {"le"}
            out[f"{name}_count"] = out[f"{name}_sum"] = labels
        elif kind == "info":
            out[f"{name}_info"] = labels | {
                "worker", "model", "weights", "device", "dtype", "batch_size", "compile",
                "compiled", "stream", "group",
            }  # fmt: skip
        else:
            out[name] = labels
    return out


_SELECTOR = re.compile(r"\b(gpufeed_[a-z_]+)\b(?:\{([^}]*)\})?")
_MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"')


def check_names(text: str, where: str) -> list[str]:
    known = exported()
    problems = []
    for m in _SELECTOR.finditer(text):
        name, matchers = m.group(1), m.group(2) or ""
        if name not in known:
            problems.append(f"{where}: {name} is not exported by worker/observe/metrics.py")
            continue
        for label, op, value in _MATCHER.findall(matchers):
            if label not in known[name] | TARGET_LABELS:
                problems.append(f"{where}: {name} has no label {label}")
            if op == "=" and label == "event" and value not in DELIVERY_EVENTS:
                problems.append(f"{where}: no delivery event {value!r}")
            if op == "=" and label == "stage" and value not in STAGES:
                problems.append(f"{where}: no stage {value!r}")
    # Labels used to group or join must exist on some gpufeed metric or target.
    every_label = set().union(*known.values()) | TARGET_LABELS
    for group in re.findall(r"\b(?:by|on|without|ignoring)\s*\(([^)]*)\)", text):
        for label in filter(None, (x.strip() for x in group.split(","))):
            if label not in every_label:
                problems.append(f"{where}: no metric has the label {label}")
    return problems


# ------------------------------------------------------------------ the alert rules
@needs_promtool
def test_alert_rules_are_valid() -> None:
    proc = run_promtool("check", "rules", str(RULES), cwd=RULES.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in proc.stdout


@needs_promtool
def test_alert_rules_fire_when_they_should_and_only_then() -> None:
    proc = run_promtool("test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tested = set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text()))
    assert tested == ALERTS  # every alert has a unit test


def test_alert_rules_name_only_exported_metrics() -> None:
    text = RULES.read_text()
    assert set(re.findall(r"- alert: (\w+)", text)) == ALERTS
    assert check_names(text, RULES.name) == []


# ------------------------------------------------------------------ the dashboard
def test_dashboard_structure() -> None:
    d = dashboard()
    assert d["uid"] and d["title"] and isinstance(d["schemaVersion"], int)
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = d["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: set[tuple[int, int]] = set()
    for p in panels:
        pos = p["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, p["title"]
        mine = {
            (x, y)
            for x in range(pos["x"], pos["x"] + pos["w"])
            for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["type"] in {"timeseries", "stat", "table"}, p["type"]
        assert p["title"] and p["description"], p
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            # Every variable a query uses is defined; every panel follows the filters.
            used = set(re.findall(r"\$(\w+)", t["expr"])) - {"__rate_interval"}
            assert used <= set(variables), (p["title"], used)
            assert 'job=~"$job"' in t["expr"] and 'instance=~"$instance"' in t["expr"]


def test_dashboard_shows_what_operators_look_for() -> None:
    text = DASHBOARD.read_text()
    for needed in (
        "gpufeed_results_total",  # jobs/s by status
        "gpufeed_stage_seconds_bucket",  # stage latency percentiles
        "gpufeed_batch_fill_ratio",
        'metric=\\"gpu_util_pct\\"',
        'metric=\\"mem_used_mib\\"',
        "gpufeed_stream_lag",
        "gpufeed_stream_pending",
        "gpufeed_delivery_events_total",
        "gpufeed_worker_info",  # which model each worker serves
    ):
        assert needed in text, needed


def test_dashboard_names_only_exported_metrics() -> None:
    problems = []
    for query in dashboard_queries():
        problems += check_names(query, DASHBOARD.name)
    assert problems == []


@needs_promtool
def test_dashboard_queries_parse(tmp_path: Path) -> None:
    # promtool has no query linter of its own: each query becomes a recording rule, which
    # `check rules` parses as PromQL.
    rules = [
        f"      - record: gpufeed:dashboard_query_{i}\n        expr: {json.dumps(as_promql(q))}"
        for i, q in enumerate(dashboard_queries())
    ]
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text("groups:\n  - name: dashboard\n    rules:\n" + "\n".join(rules) + "\n")
    proc = run_promtool("check", "rules", str(path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(rules)} rules found" in proc.stdout


def test_the_name_check_catches_what_does_not_exist() -> None:
    assert check_names('rate(gpufeed_results_total{status="ok"}[5m])', "x") == []
    assert check_names("gpufeed_jobs_total", "x") == [
        "x: gpufeed_jobs_total is not exported by worker/observe/metrics.py"
    ]
    assert check_names('gpufeed_results_total{colour="red"}', "x") == [
        "x: gpufeed_results_total has no label colour"
    ]
    assert check_names('gpufeed_delivery_events_total{event="lost"}', "x") == [
        "x: no delivery event 'lost'"
    ]
    assert check_names("sum by (tenant) (gpufeed_ready)", "x") == [
        "x: no metric has the label tenant"
    ]


def test_the_stage_panel_says_what_metrics_and_top_say() -> None:
    from worker.observe.metrics import STAGE_INFO

    panels = json.loads(DASHBOARD.read_text())["panels"]
    (panel,) = [p for p in panels if p.get("title") == "Stage latency p50"]
    for stage in STAGE_INFO:
        assert f"{stage.name}: {stage.measures} ({stage.moved_by})" in panel["description"]

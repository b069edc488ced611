"""The block the doctor's, the GPU check's and the bench's reports open with: one definition
(worker/tools/harness/report_head.py), which each builds its block through and each checks
its block by; reports saved before still validate, and docs/report-common.md is its table."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from measure.bench.report import validate_report
from measure.gpu_check.report import environment_lines, judge_file
from worker.tools.doctor import SCHEMA, schema_markdown, validate
from worker.tools.harness import report_head
from worker.tools.harness.environment import bench_host, environment
from worker.tools.harness.report_head import BENCH, DOCTOR, GPU_CHECK, problems

ROOT = Path(__file__).resolve().parents[2]
SAVED_BENCH = ROOT / "docs" / "figures" / "report.json"
SAVED_GPU_CHECKS = sorted((ROOT / "docs" / "gpu-check").glob("*.json"))


def built(report: str) -> dict[str, Any]:
    if report == DOCTOR:
        return environment()
    if report == GPU_CHECK:
        return environment(build=True)
    # The bench adds its load at the end of its run.
    return {**bench_host(torch.device("cpu"), 2), "load_avg_1m_at_end": 0.5}


@pytest.mark.parametrize("report", report_head.REPORTS)
def test_each_report_builds_a_block_its_validator_accepts(report: str) -> None:
    head = built(report)
    assert problems(head, report) == []
    always = {
        f.name_in(report) for f in report_head.fields_of(report) if f.carried[report].when == "yes"
    }
    assert always <= set(head)


def test_the_doctor_keeps_exactly_its_keys_every_one_required() -> None:
    head = environment()
    assert list(head) == ["host", "python", "torch", "cpu_count", "cuda_available", "device_name"]
    schema = SCHEMA["properties"]["environment"]
    assert schema == report_head.json_schema(DOCTOR)
    assert sorted(schema["required"]) == sorted(head)
    assert validate({**head_of_doctor(), "cpu_model": "x"}, schema, "$.environment") == [
        "$.environment: undocumented key 'cpu_model'"
    ]


def head_of_doctor() -> dict[str, Any]:
    return {
        "host": "h",
        "python": "3.12.3",
        "torch": "2.11.0",
        "cpu_count": 16,
        "cuda_available": True,
        "device_name": "NVIDIA H200",
    }


def test_the_gpu_check_records_the_cpu_model_and_the_commit() -> None:
    head = environment(build=True)
    assert {"torch_cuda", "cpu_model", "commit", "commit_dirty"} <= set(head)
    assert head["cpu_count"] >= 1


def test_reports_saved_before_still_validate() -> None:
    saved = json.loads(SAVED_BENCH.read_text())
    assert problems(saved["host"], BENCH) == []
    assert validate_report(saved) == []
    assert SAVED_GPU_CHECKS
    for path in SAVED_GPU_CHECKS:
        # Saved before the GPU check counted cores or recorded its CPU and commit.
        assert problems(json.loads(path.read_text())["environment"], GPU_CHECK) == [], path
    old_bench = {k: v for k, v in saved["host"].items() if k not in ("cpu_model", "commit")}
    assert problems(old_bench, BENCH) == []


@pytest.mark.parametrize(
    ("report", "change", "problem"),
    [
        (DOCTOR, {"cpu_count": None}, "environment.cpu_count: expected integer, got NoneType"),
        (DOCTOR, {"torch_cuda": "13.0"}, "environment: undocumented key 'torch_cuda'"),
        (GPU_CHECK, {"cuda_available": "yes"}, "environment.cuda_available: expected boolean"),
        (GPU_CHECK, {"capability": 9.0}, "environment.capability: expected string, got float"),
        (BENCH, {"device_name": "NVIDIA H200"}, "host: undocumented key 'device_name'"),
        (BENCH, {"gpu": 0}, "host.gpu: expected string or null, got int"),
        (BENCH, {"load_avg_1m_at_start": "0.2"}, "host.load_avg_1m_at_start: expected number"),
    ],
)
def test_a_broken_block_is_named_by_its_report_s_own_key(
    report: str, change: dict[str, Any], problem: str
) -> None:
    head = {**built(report), **change}
    found = problems(head, report)
    assert len(found) == 1 and found[0].startswith(problem), found


@pytest.mark.parametrize("report", report_head.REPORTS)
def test_a_key_every_report_of_its_kind_carries_is_required(report: str) -> None:
    head = built(report)
    del head["python"]
    assert problems(head, report) == [f"{report_head.BLOCK_NAMES[report]}: missing key 'python'"]
    assert problems([head], report) == [
        f"{report_head.BLOCK_NAMES[report]}: expected object, got list"
    ]


def test_the_gpu_check_says_where_a_report_was_measured_and_what_is_wrong(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = json.loads(SAVED_GPU_CHECKS[0].read_text())
    code = judge_file(SAVED_GPU_CHECKS[0])
    out, err = capsys.readouterr()
    assert err.splitlines()[0] == (
        "gpu-check: measured on vm: NVIDIA H200 (compute capability 9.0); CPU cores not "
        "recorded (CPU model not recorded); Python 3.12.3, torch 2.11.0+cu130 built for CUDA "
        "13.0, torchvision 0.26.0+cu130; commit not recorded"
    )
    broken = {**saved, "environment": {**saved["environment"], "device_name": 3, "gpu": "x"}}
    path = tmp_path / "report.json"
    path.write_text(json.dumps(broken))
    # The block's problems are said and change no rule.
    assert judge_file(path) == code
    again, err = capsys.readouterr()
    assert again == out
    assert err.splitlines()[1:] == [
        "gpu-check: environment.device_name: expected string or null, got int",
        "gpu-check: environment: undocumented key 'gpu'",
    ]
    assert environment_lines({"phases": {}}) == [
        "gpu-check: no environment recorded (the check stopped before it started)"
    ]


def test_the_page_is_the_table_and_the_schema_pages_point_to_it() -> None:
    page = (ROOT / "docs" / "report-common.md").read_text()
    assert report_head.head_markdown() in page, "regenerate the table in docs/report-common.md"
    assert re.search(
        r"^      - [^:\n]+: report-common\.md$", (ROOT / "mkdocs.yml").read_text(), re.M
    )
    doctor = schema_markdown()
    assert "(report-common.md#the-fields)" in doctor
    assert "`environment.host`" not in doctor  # one row, not the fields again
    for name in ("bench-schema.md", "gpu-hosts.md", "doctor-schema.md"):
        assert "(report-common.md#the-fields)" in (ROOT / "docs" / name).read_text(), name

"""The GPU check's report, torch-free: the CUDA tests' results read from pytest's JUnit file
against the list of every cuda-marked test, and the verdict by the rules
(measure/gpu_check/rules.py).

`python -m measure.gpu_check.report --out DIR --junit FILE --tests-rc N` is the last
step of scripts/gpu-check.sh: it adds the test results to the benchmark's report (in
whatever state the benchmark left it), judges it and prints each rule; exit 0 only when
every rule passes. `python -m measure gpu-check --judge REPORT.json` re-judges a saved
report without changing it. Both first say where the report was measured, from its
`environment` block, and what is wrong with that block by the definition the doctor and the
bench share (worker/tools/harness/report_head.py); that changes no verdict.
"""

from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from measure.gpu_check.rules import judge, passed, render
from worker.tools.command_line import CONTEXT_SETTINGS, parse
from worker.tools.harness import report_head

EXPECTED_TESTS = Path(__file__).resolve().parents[2] / "tests" / "cuda_tests.txt"


def expected_cuda_tests(path: Path) -> list[str]:
    """The pytest node ids of every cuda-marked test (tests/cuda_tests.txt)."""
    lines = path.read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def junit_key(nodeid: str) -> str:
    """A pytest node id as JUnit names it: classname (dotted module, then classes) and name."""
    file_part, *rest = nodeid.split("::")
    classname = ".".join([file_part.removesuffix(".py").replace("/", "."), *rest[:-1]])
    return f"{classname}::{rest[-1] if rest else ''}"


def junit_summary(path: Path, expected: list[str] | None = None) -> dict[str, Any]:
    """The test results in pytest's JUnit file; with `expected` (node ids), which of those
    passed and which never ran (not collected, or cut by the time limit)."""
    if not path.is_file():
        return {"available": False, "reason": f"{path} not found"}
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as exc:
        return {"available": False, "reason": f"unreadable: {exc}"}
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    seconds = 0.0
    failed: list[str] = []
    skipped: list[str] = []
    passed_keys: set[str] = set()
    for suite in suites:
        for key in totals:
            totals[key] += int(suite.get(key, 0) or 0)
        seconds += float(suite.get("time", 0) or 0)
        for case in suite.iter("testcase"):
            name = f"{case.get('classname')}::{case.get('name')}"
            if case.find("failure") is not None or case.find("error") is not None:
                failed.append(name)
            elif case.find("skipped") is not None:
                reason = case.find("skipped")
                message = reason.get("message", "") if reason is not None else ""
                skipped.append(f"{name}: {message}" if message else name)
            else:
                passed_keys.add(name)
    passed = totals["tests"] - totals["failures"] - totals["errors"] - totals["skipped"]
    summary: dict[str, Any] = {
        "available": True,
        **totals,
        "passed": passed,
        "failed": failed,
        "skipped_tests": skipped,
        "time_s": round(seconds, 1),
    }
    if expected is not None:
        summary["expected"] = len(expected)
        summary["passed_expected"] = sum(junit_key(n) in passed_keys for n in expected)
        ran = passed_keys | {f.split(": ")[0] for f in skipped} | set(failed)
        summary["missing"] = [n for n in expected if junit_key(n) not in ran]
    return summary


def cuda_tests_verdict(summary: dict[str, Any]) -> list[str]:
    """Why the CUDA tests do not count as passed on this GPU (empty: they do). A skipped
    CUDA test is a failure here: on a GPU host every one of them must run."""
    if not summary.get("available"):
        return [f"no CUDA test results ({summary.get('reason', 'not given')})"]
    problems = []
    if summary["tests"] == 0:
        problems.append("no CUDA test ran")
    bad = summary["failures"] + summary["errors"]
    if bad:
        problems.append(f"{bad} CUDA test(s) failed: " + ", ".join(summary["failed"][:10]))
    if summary["skipped"]:
        problems.append(
            f"{summary['skipped']} CUDA test(s) skipped, which counts as failed on a GPU "
            "host: " + ", ".join(summary["skipped_tests"][:10])
        )
    if summary.get("missing"):
        missing = summary["missing"]
        problems.append(
            f"{len(missing)} of {summary['expected']} CUDA test(s) never ran (not collected "
            "or cut at the time limit): " + ", ".join(missing[:10])
        )
    return problems


def tests_summary(junit: Path, rc: int | None, expected: Path = EXPECTED_TESTS) -> dict[str, Any]:
    """The CUDA tests' results against every cuda-marked test, and pytest's exit status."""
    summary = junit_summary(junit, expected_cuda_tests(expected))
    summary["rc"] = rc
    return summary


def _measured_on(env: Mapping[str, Any]) -> str:
    # str(): a broken block is still said as it is, beside its problems.
    device = str(env.get("device_name") or "no CUDA device")
    if env.get("capability"):
        device += f" (compute capability {env['capability']})"
    cuda = f" built for CUDA {env['torch_cuda']}" if env.get("torch_cuda") else ""
    vision = f", torchvision {env['torchvision']}" if env.get("torchvision") else ""
    cores = f"{env['cpu_count']} CPU cores" if "cpu_count" in env else "CPU cores not recorded"
    cpu = env.get("cpu_model") or "CPU model not recorded"
    commit = f"commit {str(env['commit'])[:10]}" if env.get("commit") else "commit not recorded"
    if env.get("commit_dirty"):
        commit += " + uncommitted changes"
    return (
        f"{env.get('host')}: {device}; {cores} ({cpu}); Python {env.get('python')}, "
        f"torch {env.get('torch')}{cuda}{vision}; {commit}"
    )


def environment_lines(report: Mapping[str, Any]) -> list[str]:
    """Where `report` was measured, and what is wrong with its `environment` block."""
    env = report.get("environment")
    if env is None:
        return ["gpu-check: no environment recorded (the check stopped before it started)"]
    lines = [f"gpu-check: measured on {_measured_on(env)}"] if isinstance(env, Mapping) else []
    return lines + [f"gpu-check: {p}" for p in report_head.problems(env, report_head.GPU_CHECK)]


def add_verdict(report: dict[str, Any]) -> bool:
    """Judges `report` by the rules, stores the verdict in it and prints each rule."""
    rules = judge(report)
    ok = passed(rules)
    report["verdict"] = {
        "passed": ok,
        "problems": [f"{r.name}: {r.measured}" for r in rules if not r.passed],
        "rules": [r.as_dict() for r in rules],
    }
    print(render(rules), file=sys.stderr)
    return ok


def judge_file(path: Path) -> int:
    """Re-judges a saved report by the current rules: prints each, exit 0 only if all pass."""
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        print(f"gpu-check: cannot read {path}: {exc}", file=sys.stderr)
        return 2
    if not isinstance(report, dict):
        print(f"gpu-check: {path} is not a gpu-check report", file=sys.stderr)
        return 2
    print("\n".join(environment_lines(report)), file=sys.stderr)
    rules = judge(report)
    print(render(rules))
    return 0 if passed(rules) else 1


def conclude(
    out: Path, junit: Path | None, rc: int | None, expected: Path, bench_rc: int | None = None
) -> int:
    path = out / "report.json"
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        report = {"phases": {}, "error": f"no benchmark report: {exc}"}
    if not isinstance(report, dict):
        report = {"phases": {}, "error": "the benchmark report is not an object"}
    if bench_rc not in (None, 0, 1) and not report.get("error"):
        # Killed or crashed without a word (a signal, a segfault): where it was.
        running = [n for n, e in report.get("phases", {}).items() if e.get("status") == "running"]
        where = running[-1] if running else None
        report["error"] = f"the benchmark exited {bench_rc} during phase {where!r}"
        report["stopped_in"] = where
    report["tests"] = (
        tests_summary(junit, rc, expected) if junit is not None else {"available": False}
    )
    print("\n".join(environment_lines(report)), file=sys.stderr)
    ok = add_verdict(report)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
    os.replace(tmp, path)
    return 0 if ok else 1


@dataclass(frozen=True)
class ConcludeArgs:
    """The last step's command line (`command`)."""

    out: Path
    junit: Path | None
    tests_rc: int | None
    expected_tests: Path
    bench_rc: int | None


_PATH = click.Path(path_type=Path)


@click.command(context_settings=CONTEXT_SETTINGS)
@click.option("--out", type=_PATH, required=True, help="the folder with report.json")
@click.option("--junit", type=_PATH, default=None)
@click.option("--tests-rc", type=int, default=None)
@click.option("--expected-tests", type=_PATH, default=EXPECTED_TESTS)
@click.option("--bench-rc", type=int, default=None, help="the benchmark's exit status")
def command(**options: Any) -> ConcludeArgs:
    return ConcludeArgs(**options)


def main(argv: list[str] | None = None) -> int:
    args = parse(command, argv, ConcludeArgs, prog_name="python -m measure.gpu_check.report")
    return conclude(args.out, args.junit, args.tests_rc, args.expected_tests, args.bench_rc)


if __name__ == "__main__":
    sys.exit(main())

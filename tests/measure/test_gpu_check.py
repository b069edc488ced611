"""`make gpu-check` fails loudly whenever it did not really run on a GPU, and a run cut by
its time budget still leaves a report of what it measured.

Checked here, on a host without CUDA: the script stops at once with the reason; the
preflight names a missing C compiler or missing Python headers (what triton needs); a
skipped CUDA test counts as a failure; the benchmark's phases, run on the CPU through the
test-only entry point, write report.json as each ends, and its deadline ends the process
with the report written even in the middle of a phase.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import redis
import torch
from click.testing import CliRunner

from measure.cli import cli
from measure.gpu_check.check import main
from measure.gpu_check.decode_scaling import process_counts
from measure.gpu_check.preflight import check_cuda, check_toolchain
from measure.gpu_check.report import (
    EXPECTED_TESTS,
    cuda_tests_verdict,
    expected_cuda_tests,
    junit_key,
    junit_summary,
)
from measure.gpu_check.rules import (
    EXTRA_PHASES,
    GPU_UTIL_TARGET,
    JUDGED_PHASES,
    RATIO_TARGET,
    RULES,
    UNJUDGED_PHASES,
)

ROOT = Path(__file__).resolve().parents[2]

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a host without CUDA")


@needs_no_cuda
def test_gpu_check_on_a_host_without_cuda_fails_at_once(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_OUT": str(tmp_path)}
    done = subprocess.run(
        ["bash", "scripts/gpu-check.sh"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "FAILED" in done.stderr and "CUDA is not available" in done.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["verdict"]["passed"] is False
    assert report["preflight"]["cuda_available"] is False
    assert not (tmp_path / "pytest.xml").exists()  # nothing ran


def test_the_benchmark_refuses_a_cpu_device(tmp_path: Path) -> None:
    assert main(["--device", "cpu", "--out", str(tmp_path)]) == 1
    report = json.loads((tmp_path / "report.json").read_text())
    assert "needs a CUDA device" in report["error"]
    assert report["verdict"]["passed"] is False
    assert "startup" not in report["phases"]  # refused before anything ran


def test_preflight_names_what_triton_would_miss(tmp_path: Path) -> None:
    assert check_toolchain(os.environ) == [], "this host builds Python extensions"
    no_compiler = check_toolchain({"PATH": str(tmp_path)})
    assert len(no_compiler) == 1 and "no C compiler" in no_compiler[0]
    wrong_cc = check_toolchain({**os.environ, "CC": str(tmp_path / "cc")})
    assert wrong_cc == [f"CC={tmp_path / 'cc'} is not an executable C compiler"]
    no_headers = check_toolchain(os.environ, include_dir=str(tmp_path))
    assert len(no_headers) == 1 and "Python headers" in no_headers[0]
    # A compiler that runs but cannot build the extension.
    broken = tmp_path / "broken-cc"
    broken.write_text("#!/bin/sh\necho 'fatal error: Python.h: No such file' >&2\nexit 1\n")
    broken.chmod(0o755)
    failing = check_toolchain({**os.environ, "CC": str(broken)})
    assert len(failing) == 1 and "cannot build a Python extension" in failing[0]


def test_preflight_refuses_a_device_that_is_not_cuda() -> None:
    problems, _ = check_cuda("cpu")
    assert problems == ["the GPU check needs a CUDA device, not 'cpu'"]


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="0" failures="{failures}" skipped="{skipped}"
 tests="{tests}">
<testcase classname="tests.pipeline.test_cuda" name="test_a"/>
{extra}
</testsuite></testsuites>
"""


def write_junit(path: Path, *, skipped: int = 0, failures: int = 0) -> Path:
    extra = "".join(
        f'<testcase classname="tests.pipeline.test_cuda" name="test_s{i}">'
        f'<skipped type="pytest.skip" message="needs CUDA"/></testcase>'
        for i in range(skipped)
    ) + "".join(
        f'<testcase classname="tests.pipeline.test_cuda" name="test_f{i}">'
        f'<failure message="x"/></testcase>'
        for i in range(failures)
    )
    path.write_text(
        JUNIT.format(tests=1 + skipped + failures, skipped=skipped, failures=failures, extra=extra)
    )
    return path


def test_skipped_cuda_tests_fail_the_check(tmp_path: Path) -> None:
    assert cuda_tests_verdict(junit_summary(write_junit(tmp_path / "ok.xml"))) == []
    skipped = cuda_tests_verdict(junit_summary(write_junit(tmp_path / "s.xml", skipped=2)))
    assert len(skipped) == 1 and "2 CUDA test(s) skipped" in skipped[0]
    assert "test_s0: needs CUDA" in skipped[0]
    failed = cuda_tests_verdict(junit_summary(write_junit(tmp_path / "f.xml", failures=1)))
    assert failed == ["1 CUDA test(s) failed: tests.pipeline.test_cuda::test_f0"]
    assert cuda_tests_verdict(junit_summary(tmp_path / "missing.xml"))[0].startswith("no CUDA test")


def phases_on_cpu(
    redis_url: str,
    out: Path,
    junit: Path,
    *,
    deadline_s: float,
    seconds: float = 1.0,
    extra: tuple[str, ...] = (),
    every_phase: bool = False,
) -> list[str]:
    """A child process running the benchmark's phases on the CPU (its deadline and SIGTERM
    end the process, so it cannot run inside the test's). `every_phase`: the thumbnail,
    peer and light-model phases too (0.5 s windows); otherwise they are turned off, so that
    the tests about something else do not pay for them."""
    seconds_of = "0.5" if every_phase else "0"
    phases = [
        "--thumbnail-seconds", seconds_of, "--peer-seconds", seconds_of, "--peer-workers", "1",
        "--light-model", "mobilenet_v3_small", "--light-seconds", seconds_of,
        "--before-processes", "", "--before-processes-seconds", "1",
    ]  # fmt: skip
    argv = [
        "--device", "cpu", "--model", "mobilenet_v3_small", "--batch", "4",
        "--precision", "fp32", "--seconds", str(seconds), "--warmup-seconds", "0.2",
        "--sync-seconds", "1", "--ceiling-iters", "2", "--width", "96", "--height", "64",
        "--latency-seconds", "1", "--backlog", "64", "--decode-rate-seconds", "0.05",
        # The placement `auto` picks on a GPU host: the ceiling feeds the ring's rows.
        "--resize", "device",
        "--redis-url", redis_url, "--out", str(out), "--junit", str(junit),
        "--deadline-s", str(deadline_s), *phases, *extra,
    ]  # fmt: skip
    return [
        sys.executable,
        "-c",
        "import sys; from measure.gpu_check.check import main; "
        f"sys.exit(main({argv!r}, require_cuda=False))",
    ]


def run_child(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env={**os.environ, "GPU_CHECK_LOG_FORMAT": "json"},
    )


@pytest.mark.slow
def test_each_phase_is_reported_and_a_skipped_test_fails_the_run(
    redis_url: str, tmp_path: Path
) -> None:
    junit = write_junit(tmp_path / "pytest.xml", skipped=1)
    done = run_child(phases_on_cpu(redis_url, tmp_path, junit, deadline_s=200, every_phase=True))
    report = json.loads((tmp_path / "report.json").read_text())
    assert "error" not in report, report.get("traceback")
    phases = report["phases"]
    done_phases = (
        "startup",
        "ceiling",
        "pipeline",
        "latency",
        "thumbnails",
        "decode",
        "peer",
        "light_startup",
        "light_ceiling",
        "light",
        "decode_processes",
    )
    assert [phases[p]["status"] for p in done_phases] == ["done"] * len(done_phases)
    for extra in ("h2d", "cudnn"):
        assert phases[extra] == {"status": "skipped", "why": "not a CUDA device"}
    # Without GPU decode there is no "before" to compare with.
    assert phases["before"] == {"status": "skipped", "why": "no GPU decode in this run"}
    assert report["resize"]["placement"] == "device"
    # By default the photo windows' jobs name files, as an operator's would at GPU rates.
    assert report["pipeline_input"]["jobs_by"] == "path"
    assert (
        report["pipeline_input"]["images"]
        == "96x64 JPEG q85, 256 distinct files named by path jobs"
    )
    assert report["ceiling_images_per_s"]["eager"] > 0
    assert report["pipeline_images_per_s"] > 0
    # What the window's jobs cost Redis's command thread, and the rate one Redis carries.
    pipeline = report["pipeline"]
    assert pipeline["redis_cpu_main_thread"] is True and pipeline["redis_cpu_us_per_job"] > 0
    assert pipeline["redis_jobs_per_s_max"] == round(1e6 / pipeline["redis_cpu_us_per_job"])
    # Jobs offered at 80% of that rate after the window: each answered, p50 <= p99, and the
    # bound they are held to (two batches at that rate plus the max wait).
    latency = report["latency_at_80"]
    assert latency["offered_per_s"] == pytest.approx(0.8 * report["pipeline_images_per_s"], 0.01)
    assert latency["results"] >= 16 and 0 <= latency["p50_ms"] <= latency["p99_ms"]
    assert latency["bound_ms"] == pytest.approx(
        2 * 4 / report["pipeline_images_per_s"] * 1000 + latency["max_wait_ms"], abs=0.2
    )
    assert latency["within_bound"] == (latency["p99_ms"] <= latency["bound_ms"])
    # Each batch shape the worker compiled, with its step time, in the compile report.
    assert [s["size"] for s in report["compile"]["batch_sizes"]] == [1, 2, 4]
    # The decode processes' own rates, for 1, 8 and every core, on three image sizes.
    rates = report["decode_process_rates"]
    assert rates["processes"] == process_counts(os.cpu_count() or 1)
    assert [s["image"] for s in rates["sizes"]] == ["64x64", "640x480", "4000x3000"]
    for size in rates["sizes"]:
        assert list(size["images_per_s"]) == [str(k) for k in rates["processes"]]
        assert all(v > 0 for v in size["images_per_s"].values())
        assert size["scaling"]["1"] == 1.0
    # The second window, on 64x64 JPEGs, from the same worker against the same ceiling.
    thumbnails = report["thumbnails"]
    assert thumbnails["results_in_window"] > 0 and thumbnails["errors_in_window"] == 0
    assert thumbnails["decode_cache_hits"] == 0
    assert thumbnails["ratio"] == pytest.approx(
        thumbnails["images_per_s"] / report["ceiling_best_images_per_s"], rel=0.01
    )
    # The peer: the worker's model fed by a torch DataLoader over the same JPEGs.
    peer = report["peer"]
    assert peer["images_per_s"] > 0 and peer["model_alone_images_per_s"] > 0
    assert peer["loader_workers"] == 1 and peer["bound"] in ("model", "loader")
    # Compiled as the worker's step is: not at all on this CPU (the compile is off here).
    assert peer["compile_mode"] == report["compile"]["mode"] == "off"
    assert peer["compiled"] is False and "compile_refused" not in peer
    # The light model on a worker of its own: its ceiling, and a window of the photo JPEGs.
    light = report["light"]
    assert light["model"] == "mobilenet_v3_small" and light["ceiling_images_per_s"] > 0
    assert light["results_in_window"] > 0 and light["errors_in_window"] == 0
    assert light["images"] == report["pipeline_input"]["images"]
    grey = report["gpu_decode_vs_cpu"]["torchvision"]["modes"]["L"]
    assert grey["decoded"] and grey["mean_abs_diff"] < 4
    # Everything measured, but a CUDA test was skipped: the check fails.
    assert done.returncode == 1
    assert report["verdict"]["passed"] is False
    assert "skipped" in report["verdict"]["problems"][0]
    # The rehearsal on the CPU: each rule fails for the skipped test or the missing GPU
    # alone, the GPU's claims as not measured; the plan held every phase.
    assert report["device_type"] == "cpu" and report["budget_plan"]["fits"] is True
    assert set(phases) <= {*JUDGED_PHASES, *UNJUDGED_PHASES, *EXTRA_PHASES}
    rules = {r["rule"]: r for r in report["verdict"]["rules"]}
    assert "1 skipped: tests.pipeline.test_cuda::test_s0" in rules["cuda_tests"]["measured"]
    gpu_only = ("not measured: not a CUDA device (cpu)", "not measured: no CUDA device")
    others = [
        f"{name}: {r['measured']}"
        for name, r in rules.items()
        if not r["passed"] and name != "cuda_tests" and not r["measured"].startswith(gpu_only)
    ]
    assert others == []
    assert rules["pipeline_decodes"]["passed"], rules["pipeline_decodes"]


@pytest.mark.slow
def test_the_pipeline_and_latency_phases_run_on_image_jobs(redis_url: str, tmp_path: Path) -> None:
    """--jobs-by image: the photo windows' jobs carry their images (unique bytes per job),
    in the timed window and in the latency phase alike; every job answered ok. The light
    model's worker, started first, fails (its model file is not a model): its phases say
    why, and the rest of the check runs."""
    junit = write_junit(tmp_path / "pytest.xml")
    broken = tmp_path / "broken-model"
    broken.mkdir()
    manifest = '[model]\ninput_size = 32\nfile = "model.ts"\n\n[output]\nkind = "raw"\n'
    (broken / "gpufeed.toml").write_text(manifest)
    (broken / "model.ts").write_bytes(b"not a TorchScript archive")
    extra = ("--jobs-by", "image", "--decode-rate-seconds", "0")
    extra += ("--light-model", str(broken), "--light-seconds", "0.5")
    # gpufeed before its JPEG engines, as `python -m worker` with two worker processes.
    extra += ("--before-processes", "2")
    argv = phases_on_cpu(redis_url, tmp_path, junit, deadline_s=200, extra=extra)
    run_child(argv)
    report = json.loads((tmp_path / "report.json").read_text())
    assert "error" not in report, report.get("traceback")
    assert report["pipeline_input"]["jobs_by"] == "image"
    assert report["pipeline_input"]["images"] == "96x64 JPEG q85, unique bytes per job"
    pipeline = report["pipeline"]
    assert pipeline["results_ok"] > 0 and pipeline["errors_by_code"] == {}
    assert pipeline["decode_cache_hits"] == 0 and pipeline["redis_cpu_us_per_job"] > 0
    latency = report["latency_at_80"]
    assert latency["results"] >= 16 and 0 <= latency["p50_ms"] <= latency["p99_ms"]
    before = report["before_processes"]
    assert report["phases"]["before_processes"]["status"] == "done", before
    (run,) = before["runs"]
    assert run["processes"] == 2 and run["images_per_s"] > 0 and run["window_s"] >= 1
    assert before["best_images_per_s"] == run["images_per_s"]
    assert before["pipeline_over_best"] == round(
        report["pipeline_images_per_s"] / run["images_per_s"], 2
    )
    started = report["phases"]["light_startup"]
    assert started["status"] == "failed" and "model.ts" in started["error"]
    for phase in ("light_ceiling", "light"):
        assert report["phases"][phase]["status"] == "skipped"
        assert report["phases"][phase]["why"].startswith("its start-up failed: ")


@pytest.mark.slow
def test_a_start_up_longer_than_the_budget_still_reports(redis_url: str, tmp_path: Path) -> None:
    """A compile that outlasts the deadline (here: a start-up made to hang) cannot hold the
    run: the report is written and the process ends at the deadline."""
    junit = write_junit(tmp_path / "pytest.xml")
    argv = phases_on_cpu(redis_url, tmp_path, junit, deadline_s=3)
    argv[2] = (
        "import asyncio, worker.lifecycle.service as service\n"
        "async def hang(self, **kwargs): await asyncio.sleep(600)\n"
        "service.Worker.startup = hang\n" + argv[2]
    )
    done = run_child(argv)
    assert done.returncode == 124, done.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["error"] == "time budget of 3 s spent during phase 'startup'"
    assert report["phases"]["startup"]["status"] == "running"
    assert report["verdict"]["passed"] is False
    assert report["environment"]["torch"] == torch.__version__
    # The plan, written before anything ran, said so: what it skipped and why, and the
    # judged phases past the deadline.
    plan = report["budget_plan"]
    assert plan["deadline_s"] == 3 and plan["fits"] is False
    assert plan["past_deadline"]["startup"] == "ends about 20 s in, past the deadline of 3 s"
    assert "pipeline" in plan["past_deadline"] and "decode" in plan["past_deadline"]
    assert plan["skipped"]["decode_processes"].startswith("about 16 s needed, the judged phases")
    assert plan["skipped"]["cudnn"] == "not a CUDA device"
    assert plan["skipped"]["peer"] == "--peer-seconds 0"


@pytest.mark.slow
def test_a_run_terminated_mid_phase_keeps_what_it_measured(redis_url: str, tmp_path: Path) -> None:
    junit = write_junit(tmp_path / "pytest.xml")
    argv = phases_on_cpu(redis_url, tmp_path, junit, deadline_s=200, seconds=120)
    child = subprocess.Popen(
        argv,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "GPU_CHECK_LOG_FORMAT": "json"},
    )
    path = tmp_path / "report.json"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if path.exists():
                phase = json.loads(path.read_text())["phases"].get("pipeline", {})
                if phase.get("status") == "running":
                    break
            time.sleep(0.1)
        else:
            pytest.fail("the pipeline phase never started")
        child.send_signal(signal.SIGTERM)  # what `timeout` sends at its limit
        assert child.wait(timeout=60) == 124
    finally:
        if child.poll() is None:
            child.kill()
    report = json.loads(path.read_text())
    assert report["error"] == "signal 15 during phase 'pipeline'"
    assert report["phases"]["ceiling"]["status"] == "done"
    assert report["ceiling_images_per_s"]["eager"] > 0  # measured before the cut
    # The check's job feeder (its own process) ends with it.
    deadline = time.monotonic() + 10
    while (left := processes_of(os.environ["PYTEST_CURRENT_TEST"])) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == []


def processes_of(test: str) -> list[int]:
    """Live processes started under `test` (their environment names it), this one aside."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        if int(proc.name) == os.getpid():
            continue
        try:
            environ = (proc / "environ").read_bytes()
            state = (proc / "stat").read_text().split(") ", 1)[1][0]
        except OSError:
            continue
        if f"PYTEST_CURRENT_TEST={test}".encode() in environ and state != "Z":
            found.append(int(proc.name))
    return found


# ------------------------------------------------------------------- the budget plan


def script_default(name: str) -> int:
    """A default of scripts/gpu-check.sh (`NAME=${GPU_CHECK_..._S:-N}`)."""
    script = (ROOT / "scripts" / "gpu-check.sh").read_text()
    match = re.search(rf"^{name}=\$\{{GPU_CHECK_{name}_S:-(\d+)\}}$", script, re.MULTILINE)
    assert match, name
    return int(match.group(1))


# What a GPU host spends around the benchmark by scripts/gpu-check.sh's clock: the set-up
# before it starts (preflight, the carry verified, Redis), and the CUDA tests (100-160 s
# on a 16-core host, docs/gpu-hosts.md).
SET_UP_S = 30
CUDA_TESTS_S = 160


def test_the_default_plan_covers_every_judged_phase_within_one_command() -> None:
    """The check's defaults plan every phase the rules need within its default deadline;
    the script's defaults give the CUDA tests their time, the benchmark its judged phases
    after them, and all of it fits one 10-minute command."""
    from measure.gpu_check.check import budget_plan, parse_args
    from measure.gpu_check.rules import JUDGED_PHASES

    plan = budget_plan(parse_args([])).as_dict()
    assert plan["fits"] is True and plan["past_deadline"] == {}
    assert all(plan[phase] > 0 for phase in JUDGED_PHASES)
    assert plan["total"] <= plan["deadline_s"]
    assert set(plan["skipped"]) <= set(EXTRA_PHASES), plan["skipped"]
    budget, reserve = script_default("BUDGET"), script_default("RESERVE")
    # The benchmark as the script starts it: its deadline ends 10 s before the budget.
    deadline = budget - SET_UP_S - 10
    assert parse_args([]).deadline_s == deadline
    plan = budget_plan(parse_args(["--seconds", "15", "--deadline-s", str(deadline)])).as_dict()
    assert plan["fits"] is True
    # After the tests, the judged phases and the two windows between them that no rule reads.
    assert plan["judged_after_tests"] + plan["latency"] + plan["before"] <= reserve - 10
    assert budget - SET_UP_S - reserve >= CUDA_TESTS_S  # the tests' limit
    assert budget + 25 <= 600  # the last step, the benchmark's kill grace


def test_a_deadline_too_short_says_what_the_plan_left_out() -> None:
    """The judged phases are planned first; what no rule reads is left out, with why, where
    it does not fit; judged phases that cannot fit are named up front."""
    from measure.gpu_check.check import budget_plan, parse_args

    plan = budget_plan(parse_args(["--deadline-s", "360"])).as_dict()
    assert plan["fits"] is True and plan["total"] == 356  # the latency window, then judged
    assert plan["latency"] == 9 and "before" not in plan
    assert plan["skipped"]["before"] == "about 10 s needed, 4 s left in the plan"
    assert plan["skipped"]["before_processes"] == (
        "3 of 3 runs: about 50 s a run, 4 s left in the plan"
    )
    plan = budget_plan(parse_args(["--deadline-s", "300"])).as_dict()
    assert plan["fits"] is False
    assert list(plan["past_deadline"]) == ["peer", "light_ceiling", "light", "shutdown"]
    assert plan["past_deadline"]["peer"] == "ends about 309 s in, past the deadline of 300 s"
    assert set(plan["skipped"]) == {"latency", "before", *EXTRA_PHASES}
    assert plan["skipped"]["latency"] == (
        "about 9 s needed, the judged phases alone need 347 s of 300"
    )


# ------------------------------------------------------------------ the table of phases


def test_the_table_holds_every_phase_the_rules_name_and_every_budget() -> None:
    """Each phase the rules judge, each one between them and each extra is a row of the
    table, in the rules' order; every budget the plan gives comes from a row, and every
    budget constant is one a row reads."""
    from measure.gpu_check.check import budget_plan, parse_args
    from measure.gpu_check.phases import budgets, table

    run = [phase.name for phase in table.PHASES if phase.runs is not None]
    assert len(run) == len(set(run))
    assert set(run) == {*JUDGED_PHASES, *UNJUDGED_PHASES, *EXTRA_PHASES}
    for named in (JUDGED_PHASES, UNJUDGED_PHASES, EXTRA_PHASES):
        assert [name for name in run if name in named] == list(named)
    budgeted = [phase.name for phase in table.PHASES if phase.budget is not None]
    assert set(run) - set(budgeted) == {"wait_for_tests"}  # a wait, no work to plan
    everything_off = [
        "--device", "cpu", "--latency-seconds", "0", "--thumbnail-seconds", "0",
        "--before-seconds", "0", "--peer-seconds", "0", "--light-seconds", "0",
        "--decode-rate-seconds", "0", "--before-processes", "",
    ]  # fmt: skip
    for argv in ([], ["--deadline-s", "300"], everything_off):
        plan = budget_plan(parse_args(argv))
        planned = [name for name, _, _ in plan.order]
        assert planned == [name for name in budgeted if name in planned]
        assert sorted([*planned, *plan.skipped]) == sorted(budgeted), argv
    source = Path(table.__file__).read_text()
    constants = [name for name in vars(budgets) if name.endswith("_S") and name.isupper()]
    assert "STARTUP_S" in constants and "WINDOW_S" in constants
    assert [name for name in constants if not re.search(rf"\b{name}\b", source)] == []


async def test_a_phase_whose_need_is_missing_is_reported_skipped_with_why(tmp_path: Path) -> None:
    """The loop checks a phase's needs before anything of it runs: the first one missing is
    the report's reason. A phase the run never reached (no --wait-for, no pipeline
    window) is left out; a light model whose start failed takes its phases with it."""
    from types import SimpleNamespace

    from measure.gpu_check.check import _run_phases, budget_plan, parse_args
    from measure.gpu_check.phases.state import Deadline, Report, Run
    from measure.gpu_check.phases.table import PHASES

    bodies: list[str] = []

    async def body(run: Run, entry: dict[str, object]) -> None:
        bodies.append(run.report.phase_now)

    async def no_model(run: Run, entry: dict[str, object]) -> None:
        raise RuntimeError("no such model")

    names = ("light_startup", "wait_for_tests", "thumbnails", "before", "peer", "light_ceiling")
    names += ("light", "gpu_decode_rate", "h2d", "before_processes", "cudnn")
    rows = [
        replace(phase, runs=no_model if phase.name == "light_startup" else body)
        for phase in PHASES
        if phase.name in names
    ]
    args = parse_args(["--device", "cpu", "--peer-seconds", "0", "--before-processes", ""])
    report = Report(tmp_path / "report.json")
    worker = SimpleNamespace()
    run = Run(args, report, Deadline(600), budget_plan(args), worker, worker)  # type: ignore[arg-type]
    await _run_phases(run, rows)
    written = json.loads(report.path.read_text())["phases"]
    assert bodies == [] and written == report["phases"]
    started = "its start-up failed: RuntimeError: no such model"
    assert {name: entry.get("why") for name, entry in written.items()} == {
        "light_startup": None,
        "peer": "--peer-seconds 0",
        "light_ceiling": started,
        "light": started,
        "gpu_decode_rate": "not a CUDA device",
        "h2d": "not a CUDA device",
        "before_processes": "--before-processes empty",
        "cudnn": "not a CUDA device",
    }
    assert written["light_startup"]["status"] == "failed"
    assert all(e["status"] == "skipped" for n, e in written.items() if n != "light_startup")


# ------------------------------------------------------------------ the rules and the judge


def good_report() -> dict[str, object]:
    """A report as a passing run on a GPU host writes it: every phase done, every claim
    measured and met."""
    expected = expected_cuda_tests(EXPECTED_TESTS)
    done = {"status": "done", "s": 1.0}
    return {
        "phases": {
            p: dict(done)
            for p in (
                "startup",
                "ceiling",
                "pipeline",
                "syncs",
                "thumbnails",
                "decode",
                "peer",
                "light",
            )
        },
        "tests": {
            "available": True,
            "tests": len(expected),
            "failures": 0,
            "errors": 0,
            "skipped": 0,
            "passed": len(expected),
            "failed": [],
            "skipped_tests": [],
            "expected": len(expected),
            "passed_expected": len(expected),
            "missing": [],
            "rc": 0,
        },
        "compile": {"mode": "reduce-overhead", "compiled": True, "fell_back_to_eager": False},
        "compile_still_one_graph": "yes",
        "pipeline": {
            "results_in_window": 60_000,
            "batches_in_window": 940,
            "cudagraph_replays_in_window": 940,
            "decode_cache_hits": 0,
            "results_error": 0,
            "decode_setting": "auto",
            "gpu_decoder": "nvimgcodec (packed rows)",
            "gpu_decode_share": 0.45,
            "gpu_decode_why": "auto: measured on 640x480 JPEGs",
            "gpu_decoded_in_window": 27_000,
            "gpu_decode_failed_in_window": 0,
        },
        "host_syncs": {"total": 0, "batches": 250, "per_batch": 0.0, "sites": []},
        "pipeline_images_per_s": 4000.0,
        "ceiling_best_images_per_s": 4200.0,
        "ratio": 0.952,
        "gpu_util_mean": 93.0,
        "thumbnails": {
            "images_per_s": 4100.0,
            "ratio": 0.976,
            "batches_in_window": 320,
            "cudagraph_replays_in_window": 320,
        },
        "peer": {"images_per_s": 1900.0, "bound": "loader"},
        "light": {
            "model": "mobilenet_v3_large",
            "images_per_s": 12_500.0,
            "ratio": 0.61,
            "ceiling_images_per_s": 20_400.0,
            "batches_in_window": 1560,
            "cudagraph_replays_in_window": 1560,
        },
        "gpu_decode_vs_cpu": {
            "nvimgcodec": {"available": False, "reason": "not installed"},
            "torchvision": {
                "available": True,
                "modes": {
                    "RGB": {"decoded": True, "mean_abs_diff": 1.2},
                    "L": {"decoded": True, "mean_abs_diff": 0.4},
                },
            },
        },
    }


def judged(report: dict[str, object], tmp_path: Path) -> tuple[int, dict[str, str]]:
    """`python -m measure gpu-check --judge`: its exit status and each rule's line."""
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    done = CliRunner().invoke(cli, ["gpu-check", "--judge", str(path)])
    lines = {}
    for line in done.output.splitlines():
        parts = line.split()
        if len(parts) > 2 and parts[0] in ("pass", "FAIL"):
            lines[parts[1]] = line
    return done.exit_code, lines


def test_the_judge_passes_a_complete_good_report(tmp_path: Path) -> None:
    code, lines = judged(good_report(), tmp_path)
    assert code == 0, lines
    assert set(lines) == {r.__name__.removeprefix("rule_") for r in RULES}
    assert all(line.startswith("pass") for line in lines.values())
    # Each line shows the measured figure beside its target.
    assert "93.0%" in lines["gpu_util"] and f">= {GPU_UTIL_TARGET:.0f}%" in lines["gpu_util"]
    assert "0.952" in lines["ratio"] and f">= {RATIO_TARGET:.2f}" in lines["ratio"]


def test_one_host_sync_fails_and_names_where(tmp_path: Path) -> None:
    report = good_report()
    report["host_syncs"] = {
        "total": 1,
        "batches": 250,
        "sites": ["cudaStreamSynchronize in aten::item < aten::_local_scalar_dense, thread 7"],
    }
    code, lines = judged(report, tmp_path)
    assert code == 1
    assert lines["host_syncs"].startswith("FAIL")
    assert "0.004 per batch (1 in 250 batches)" in lines["host_syncs"]
    assert "aten::item" in lines["host_syncs"]
    assert [n for n, line in lines.items() if line.startswith("FAIL")] == ["host_syncs"]


def test_zero_replays_fail(tmp_path: Path) -> None:
    report = good_report()
    report["pipeline"]["cudagraph_replays_in_window"] = 0  # type: ignore[index]
    code, lines = judged(report, tmp_path)
    assert code == 1 and lines["cudagraph_replays"].startswith("FAIL")
    assert "0 replays, 940 batches" in lines["cudagraph_replays"]


def test_a_gpu_decoder_that_decoded_nothing_in_the_window_fails(tmp_path: Path) -> None:
    """--decode resolved to a GPU decoder: the window must show rows it decoded."""
    report = good_report()
    pipeline = report["pipeline"]
    assert isinstance(pipeline, dict)
    code, lines = judged(report, tmp_path)
    assert (
        code == 0 and "27000 rows decoded by nvimgcodec (packed rows)" in lines["gpu_decoded_rows"]
    )
    pipeline.update(gpu_decoded_in_window=0, gpu_decode_failed_in_window=64, gpu_decode_share=0.0)
    code, lines = judged(report, tmp_path)
    assert code == 1
    assert [n for n, line in lines.items() if line.startswith("FAIL")] == ["gpu_decoded_rows"]
    assert (
        "--decode auto: 0 rows decoded by nvimgcodec (packed rows) in the window of 60000 "
        in (lines["gpu_decoded_rows"])
    )
    assert "64 handed back to the CPU" in lines["gpu_decoded_rows"]
    # Rows written at another shape than their place, and what answered at start-up.
    pipeline.update(
        gpu_decode_wrong_shape_in_window=3,
        gpu_engines={"HW_GPU_ONLY": False, "GPU_ONLY": True, "HYBRID_CPU_GPU": True},
    )
    line = judged(report, tmp_path)[1]["gpu_decoded_rows"]
    assert "(3 of them at another shape than their place" in line
    assert "backends that answered at start-up: GPU_ONLY, HYBRID_CPU_GPU  (target" in line
    # `auto` where no GPU decoder could be built decodes on the CPU, and says why.
    why = "GPUFEED_DECODE=auto: nvidia.nvimgcodec not installed"
    pipeline.update(gpu_decoder=None, gpu_decode_why=why)
    code, lines = judged(report, tmp_path)
    assert code == 0 and f"no GPU decoder in this run ({why})" in lines["gpu_decoded_rows"]
    pipeline["decode_setting"] = "gpu"
    assert judged(report, tmp_path)[1]["gpu_decoded_rows"].startswith("FAIL")


def test_the_rows_of_either_gpu_decoder_are_counted() -> None:
    """The window's GPU rows: the packed rows' decoder's own counts, or the decode threads'
    decoder counted call by call (its method put back after)."""
    import asyncio
    from types import SimpleNamespace

    from worker.tools.harness.instruments import count_gpu_rows, gpu_decoder_of

    packed = SimpleNamespace(decoded=10, failed=1, backend_name="nvimgcodec")
    runner = SimpleNamespace(packed_decoder=packed, gpu_decoder=None)
    with count_gpu_rows(runner) as rows:
        packed.decoded, packed.failed = 74, 3
    assert (rows.decoded, rows.failed) == (64, 2)
    assert gpu_decoder_of(runner) == "nvimgcodec (packed rows)"

    class Threads:
        backend = SimpleNamespace(name="torchvision")

        async def decode_rows(
            self, rows: list[int], dest: object, *, after: object = None
        ) -> object:
            return SimpleNamespace(failed=rows[:1])

    threads = Threads()
    runner = SimpleNamespace(packed_decoder=None, gpu_decoder=threads)
    with count_gpu_rows(runner) as rows:
        for _ in range(2):
            asyncio.run(threads.decode_rows([0, 1, 2, 3], None))
    assert (rows.decoded, rows.failed) == (6, 2)
    assert "decode_rows" not in vars(threads)
    assert gpu_decoder_of(runner) == "torchvision (decode threads)"
    assert gpu_decoder_of(SimpleNamespace(packed_decoder=None, gpu_decoder=None)) is None


def test_a_skipped_phase_fails_as_not_measured(tmp_path: Path) -> None:
    report = good_report()
    for phase in ("pipeline", "syncs"):
        report["phases"][phase] = {  # type: ignore[index]
            "status": "skipped",
            "why": "not measured: 12 s left, no room for a window",
        }
    for key in ("pipeline", "host_syncs", "ratio", "gpu_util_mean", "compile_still_one_graph"):
        del report[key]
    code, lines = judged(report, tmp_path)
    assert code == 1
    for rule in ("pipeline_decodes", "host_syncs", "cudagraph_replays", "one_graph", "ratio"):
        assert lines[rule].startswith("FAIL") and "not measured" in lines[rule], lines[rule]


def test_decode_cache_hits_and_missing_tests_fail(tmp_path: Path) -> None:
    report = good_report()
    report["pipeline"]["decode_cache_hits"] = 3  # type: ignore[index]
    tests = report["tests"]
    assert isinstance(tests, dict)
    tests.update(passed_expected=tests["expected"] - 1, missing=["tests/test_x.py::test_y"])
    code, lines = judged(report, tmp_path)
    assert code == 1
    assert "3 decode-cache hits" in lines["pipeline_decodes"]
    assert lines["cuda_tests"].startswith("FAIL") and "1 not run" in lines["cuda_tests"]


def test_a_run_cut_outside_the_extras_fails(tmp_path: Path) -> None:
    report = good_report()
    report.update(error="time budget of 200 s spent during phase 'cudnn'", stopped_in="cudnn")
    assert judged(report, tmp_path)[0] == 0  # the extras are measured after every claim
    report.update(error="signal 15 during phase 'before_processes'", stopped_in="before_processes")
    assert judged(report, tmp_path)[0] == 0
    report.update(error="signal 15 during phase 'decode'", stopped_in="decode")
    code, lines = judged(report, tmp_path)
    assert code == 1 and lines["run"].startswith("FAIL")


def test_a_gpus_claims_measured_on_another_device_are_not_measured(tmp_path: Path) -> None:
    """The check rehearsed on the CPU: whatever its figures, no GPU claim passes there."""
    report = good_report()
    report["device_type"] = "cpu"
    code, lines = judged(report, tmp_path)
    assert code == 1
    passing = sorted(n for n, line in lines.items() if line.startswith("pass"))
    assert passing == ["cuda_tests", "pipeline_decodes"]
    assert (
        "not measured: not a CUDA device (cpu); there: 0.952 (4000.0 of 4200.0" in (lines["ratio"])
    )
    report["device_type"] = "cuda"
    assert judged(report, tmp_path)[0] == 0


def test_the_photo_window_is_held_to_half_the_ceiling_and_55_percent(tmp_path: Path) -> None:
    """640x480 JPEGs: 0.5 of the ceiling and 55% utilisation pass, just below fails."""
    report = good_report()
    report.update(ratio=0.5, gpu_util_mean=55.0, pipeline_images_per_s=2100.0)
    report["peer"] = {"images_per_s": 1400.0, "bound": "loader"}
    code, lines = judged(report, tmp_path)
    assert code == 0, lines
    report.update(ratio=0.499, gpu_util_mean=54.9)
    code, lines = judged(report, tmp_path)
    failed = sorted(n for n, line in lines.items() if line.startswith("FAIL"))
    assert code == 1 and failed == ["gpu_util", "ratio"]
    assert "0.499" in lines["ratio"] and "54.9%" in lines["gpu_util"]


def test_thumbnails_below_the_ceiling_or_off_the_graph_fail(tmp_path: Path) -> None:
    report = good_report()
    thumbnails = report["thumbnails"]
    assert isinstance(thumbnails, dict)
    thumbnails["ratio"] = 0.85
    code, lines = judged(report, tmp_path)
    assert code == 1 and lines["thumbnail_ratio"].startswith("FAIL")
    assert "0.850" in lines["thumbnail_ratio"]
    thumbnails.update(ratio=0.95, cudagraph_replays_in_window=319)
    code, lines = judged(report, tmp_path)
    assert code == 1 and "319 replays, 320 batches" in lines["thumbnail_ratio"]
    report["phases"]["thumbnails"] = {"status": "skipped", "why": "--thumbnail-seconds 0"}  # type: ignore[index]
    code, lines = judged(report, tmp_path)
    assert (
        "not measured: phase thumbnails skipped (--thumbnail-seconds 0)" in lines["thumbnail_ratio"]
    )


def test_a_light_model_under_12000_images_per_s_fails(tmp_path: Path) -> None:
    report = good_report()
    light = report["light"]
    assert isinstance(light, dict)
    light["images_per_s"] = 11_900.0
    code, lines = judged(report, tmp_path)
    assert code == 1
    assert [n for n, line in lines.items() if line.startswith("FAIL")] == ["light_model"]
    assert "mobilenet_v3_large: 11,900 images/s" in lines["light_model"]


def test_a_dataloader_within_1_5x_fails_the_peer_rule(tmp_path: Path) -> None:
    report = good_report()
    report["peer"] = {"images_per_s": 2700.0, "bound": "model"}
    code, lines = judged(report, tmp_path)
    assert code == 1
    assert [n for n, line in lines.items() if line.startswith("FAIL")] == ["peer"]
    assert "1.48x (4000.0 against 2700.0 images/s; the DataLoader was model-bound)" in lines["peer"]
    # A peer whose model the compiler refused ran eager: the line says so, with why.
    report["peer"] = {
        "images_per_s": 2000.0,
        "bound": "model",
        "compile_mode": "reduce-overhead",
        "compiled": False,
        "compile_refused": "CompileRefused: 1 graph break(s)",
    }
    code, lines = judged(report, tmp_path)
    assert lines["peer"].startswith("pass")
    assert "the peer's model ran eager: CompileRefused: 1 graph break(s)" in lines["peer"]
    del report["peer"]
    report["phases"]["peer"] = {"status": "skipped", "why": "40 s left, about 28 needed"}  # type: ignore[index]
    code, lines = judged(report, tmp_path)
    assert "not measured: phase peer skipped" in lines["peer"]


def test_the_judge_refuses_a_file_that_is_not_a_report(tmp_path: Path) -> None:
    path = tmp_path / "report.json"
    path.write_text("[1, 2]")
    assert CliRunner().invoke(cli, ["gpu-check", "--judge", str(path)]).exit_code == 2


# ------------------------------------------------------------ every cuda test, no fewer


def collect_cuda_tests() -> list[str]:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda", "tests/",
         "-p", "no:cacheprovider", "-o", "addopts="],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return [line for line in done.stdout.splitlines() if "::" in line]


def test_the_expected_list_is_every_cuda_marked_test() -> None:
    """tests/cuda_tests.txt (what the check requires to have run and passed) equals what
    pytest collects under -m cuda in tests/. The script's own pytest command line, in a GPU
    host's environment, is rehearsed by tests/measure/test_gpu_host_rehearsal.py."""
    expected = expected_cuda_tests(EXPECTED_TESTS)
    assert len(expected) >= 20
    assert collect_cuda_tests() == expected


def test_tests_that_never_ran_are_named(tmp_path: Path) -> None:
    expected = ["tests/pipeline/test_cuda.py::test_a", "tests/test_more.py::TestK::test_b[x y]"]
    summary = junit_summary(write_junit(tmp_path / "j.xml"), expected)
    assert summary["passed_expected"] == 1
    assert summary["missing"] == ["tests/test_more.py::TestK::test_b[x y]"]
    assert junit_key(expected[1]) == "tests.test_more.TestK::test_b[x y]"
    problems = cuda_tests_verdict(summary)
    assert problems and "1 of 2 CUDA test(s) never ran" in problems[0]


# --------------------------------------------------- host syncs seen by the profiler


def test_blocking_calls_and_pageable_copies_are_counted_with_their_call_site() -> None:
    """What the profiler records between the window's markers: every blocking CUDA runtime
    or driver call (whoever made it) and every copy from pageable memory counts, named by
    the torch ops around it; asynchronous work does not count, nor the profiler's own
    synchronise after the window."""
    from worker.tools.harness.instruments import _WINDOW_END, _WINDOW_START, RawEvent, SyncCounter

    def ev(name: str, start: int, end: int, thread: int = 1, on_cpu: bool = True) -> RawEvent:
        return RawEvent(name, start, end, thread, on_cpu)

    events = [
        ev("cudaDeviceSynchronize", 0, 1),  # the profiler's start: before the window
        ev(_WINDOW_START, 10, 11),
        ev("aten::item", 100, 200),
        ev("aten::_local_scalar_dense", 110, 190),
        ev("cudaMemcpyAsync", 120, 130),
        ev("cudaStreamSynchronize", 131, 180),
        ev("cudaEventSynchronize", 300, 310, thread=9),  # a library, outside any op
        ev("cuCtxSynchronize", 320, 330, thread=9),
        ev("Memcpy HtoD (Pageable -> Device)", 400, 450, thread=0, on_cpu=False),
        ev("Memcpy DtoH (Device -> Pinned)", 460, 470, thread=0, on_cpu=False),
        ev("cudaGraphLaunch", 500, 510),
        ev("cudaEventQuery", 520, 521),
        ev("cudaMemcpy", 530, 540, thread=3),  # blocking copy
        ev("cuStreamSynchronize_v2", 550, 560, thread=3),  # as CUPTI may name it
        ev("cudaMemcpyAsync_v3020", 570, 580, thread=3),
        ev(_WINDOW_END, 1000, 1001),
        ev("cudaDeviceSynchronize", 1002, 1003),  # the profiler's stop
    ]
    counter = SyncCounter()
    counter.add_profiled(events)
    assert counter.profiled == {
        "cudaStreamSynchronize": 1,
        "cudaEventSynchronize": 1,
        "cuCtxSynchronize": 1,
        "Memcpy HtoD (Pageable -> Device)": 1,
        "cudaMemcpy": 1,
        "cuStreamSynchronize_v2": 1,
    }
    assert counter.total == 6
    assert counter.sites[0] == (
        "cudaStreamSynchronize in aten::_local_scalar_dense < aten::item (thread 1)"
    )
    assert counter.sites[1] == "cudaEventSynchronize in no torch op around it (thread 9)"
    assert counter.as_dict()["decode_lane_waits"]["total"] == 0


def test_a_gpu_decode_lanes_wait_for_its_own_batch_is_reported_apart() -> None:
    """nvImageCodec's hardware decoder waits, on the lane's thread inside the lane's call,
    for its previous batch: reported as the lane's, not the serving path's. The same call
    on another thread, or on the lane's thread outside its call, still counts."""
    from worker.decode.gpu_packed import LANE_SCOPE
    from worker.tools.harness.instruments import _WINDOW_END, _WINDOW_START, RawEvent, SyncCounter

    events = [
        RawEvent(_WINDOW_START, 10, 11, 1, True),
        RawEvent(LANE_SCOPE, 100, 400, 5, True),
        RawEvent("cudaEventSynchronize", 150, 160, 5, True),  # the lane's own wait
        RawEvent("cudaEventSynchronize", 170, 180, 6, True),  # another thread, meanwhile
        RawEvent("cudaStreamSynchronize", 450, 460, 5, True),  # the lane's thread, after
        RawEvent(_WINDOW_END, 1000, 1001, 1, True),
    ]
    counter = SyncCounter()
    counter.add_profiled(events)
    assert counter.profiled == {"cudaEventSynchronize": 1, "cudaStreamSynchronize": 1}
    assert counter.total == 2
    lanes = counter.as_dict()["decode_lane_waits"]
    assert lanes["total"] == 1 and lanes["profiled"] == {"cudaEventSynchronize": 1}
    assert lanes["sites"] == [f"cudaEventSynchronize in {LANE_SCOPE} (thread 5)"]


def test_the_sync_rule_names_the_lanes_waits_and_judges_the_rest(tmp_path: Path) -> None:
    report = good_report()
    syncs = report["host_syncs"]
    assert isinstance(syncs, dict)
    syncs["decode_lane_waits"] = {"total": 24, "profiled": {"cudaEventSynchronize": 24}}
    code, lines = judged(report, tmp_path)
    assert code == 0 and lines["host_syncs"].startswith("pass")
    assert (
        "the GPU decode lanes waited 24 times for their own previous batch" in (lines["host_syncs"])
    )
    syncs.update(total=2, sites=["cudaStreamSynchronize in aten::item (thread 1)"])
    code, lines = judged(report, tmp_path)
    assert code == 1 and lines["host_syncs"].startswith("FAIL")


def test_the_conclusion_adds_the_tests_and_names_a_crashed_benchmark(tmp_path: Path) -> None:
    """The script's last step: the test results join the benchmark's report, and a
    benchmark that died without writing its error (a segfault: exit 139) fails the run."""
    from measure.gpu_check.report import main as conclude_main

    report = good_report()
    del report["tests"]
    report["phases"]["syncs"] = {"status": "running"}  # type: ignore[index]
    (tmp_path / "report.json").write_text(json.dumps(report))
    junit = write_junit(tmp_path / "pytest.xml")
    argv = ["--out", str(tmp_path), "--junit", str(junit), "--tests-rc", "0"]
    assert conclude_main([*argv, "--bench-rc", "139"]) == 1
    written = json.loads((tmp_path / "report.json").read_text())
    assert written["error"] == "the benchmark exited 139 during phase 'syncs'"
    assert written["tests"]["missing"]  # the crafted JUnit file holds one test only
    rules = {r["rule"]: r for r in written["verdict"]["rules"]}
    assert not rules["run"]["passed"] and not rules["host_syncs"]["passed"]


# ------------------------------------------------- replays counted inside each launch


def test_replays_are_counted_inside_each_launch_of_the_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The window counts the step's launches and the CUDA-graph replays inside each: a
    replay outside a launch (a capture's, a warm-up's, another thread's) is not one of
    them, and a launch with no replay, or two, is named."""
    from types import SimpleNamespace

    from worker.tools.harness.instruments import count_step_replays

    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda self: None, raising=False)
    replays_per_call = iter([1, 1, 0, 2, 1])

    def step(x: int) -> int:
        for _ in range(next(replays_per_call)):
            torch.cuda.CUDAGraph.replay(object())  # type: ignore[arg-type]
        return x

    runner = SimpleNamespace(step=step)
    with count_step_replays(runner) as counts:
        torch.cuda.CUDAGraph.replay(object())  # type: ignore[arg-type]  # not in a launch
        for i in range(5):
            assert runner.step(i) == i  # type: ignore[arg-type]
    assert runner.step is step  # put back
    assert (counts.launches, counts.replays, counts.not_one, counts.outside) == (5, 5, 2, 1)


def test_decode_rates_put_both_decoders_side_by_side() -> None:
    """The extra phase's figures (on the CPU here, torchvision's decoder standing in)."""
    from measure.gpu_check.phases.decode import decode_rates

    rates = decode_rates(torch.device("cpu"), 32, 4, 2, width=160, height=120, seconds=0.2)
    assert rates["cpu_images_per_s"] > 0 and rates["gpu_images_per_s"] > 0
    assert rates["cpu_threads"] == 2 and rates["gpu_failed_rows"] == 0
    assert rates["gpu_syncs_per_batch"] == "no CUDA device"  # not counted without CUDA


def test_the_sync_debug_mode_notice_is_not_a_host_sync() -> None:
    from worker.tools.harness.instruments import is_sync_warning

    # The first GPU host counted torch's own notice as "1 host sync in 40 batches".
    notice = (
        "Synchronization debug mode is a prototype feature and does not yet detect all "
        "synchronizing operations (Triggered internally at /pytorch/torch/csrc/cuda/Module.cpp)"
    )
    assert not is_sync_warning(notice)
    assert is_sync_warning("called a synchronizing CUDA operation")


@pytest.mark.parametrize("rate", [0.0, 100.0])
def test_a_feeder_whose_check_is_gone_pushes_nothing(redis_url: str, rate: float) -> None:
    """The feeder is told its check's pid by the check: started after the check was cut
    (its parent is another process by then), it ends at once, backlog or paced."""
    import multiprocessing

    from worker.tools.harness.feed import FeedOrder, feed

    ctx = multiprocessing.get_context("spawn")
    pushed, done = ctx.Value("q", 0), ctx.Value("q", 0)
    gone = FeedOrder(redis_url, "gpu-check:orphan", [b"\xff\xd8"], 64, rate, 50, 0, parent=-1)
    feed(gone, ctx.Event(), pushed, done)
    client = redis.Redis.from_url(redis_url)
    try:
        assert pushed.value == 0 and client.xlen("gpu-check:orphan") == 0
    finally:
        client.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_link_s_rate_is_measured_for_a_batch_of_packed_rows() -> None:
    from measure.gpu_check.copy_rate import h2d_rate, packed_image_bytes

    each = packed_image_bytes(640, 480)
    assert each == 640 * 480 * 3 + 64
    found = h2d_rate(torch.device("cuda"), image_bytes=each, batch=8, seconds=0.3)
    assert found["bytes_per_batch"] == 8 * each and found["copies"] >= 4
    assert found["gb_per_s"] > 0
    assert found["images_per_s"] == round(found["gb_per_s"] * 1e9 / each)


# ------------------------------------------- a second worker's compile in the check


class _TinyStep(torch.nn.Module):
    """x: [B, S, S, 3] uint8 -> ([B, classes] float32,): a step inductor compiles in seconds."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(3, classes)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.proj(x.float().mean(dim=(1, 2))),)


@pytest.mark.slow
async def test_the_light_models_start_keeps_the_main_steps_graphs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The light model's worker starts (compiles, asking for a reset as every worker's
    start-up does) in the check's process after the main step compiled: dynamo is not
    reset under the main step, which serves on from its own graphs, and its one-graph
    figure does not count the light model's graph as a recompile."""
    from types import SimpleNamespace

    from measure.gpu_check.phases.light import start_light
    from measure.gpu_check.phases.state import Report
    from worker.model.compiler import compile_step, still_compiled

    x = torch.randint(0, 256, (2, 4, 4, 3), dtype=torch.uint8)
    main_fn, main = compile_step(_TinyStep(4).eval(), x, mode="default", allow_eager_fallback=False)
    assert main.compiled and still_compiled(main) == []
    resets: list[str] = []
    reset = torch._dynamo.reset

    def spy() -> None:
        resets.append("reset")
        reset()

    monkeypatch.setattr(torch._dynamo, "reset", spy)

    async def startup(*, wait_for_redis: bool) -> None:
        # What a Worker's start-up does with its model: compile_step as the engine calls it.
        compile_step(_TinyStep(2).eval(), x, mode="default", allow_eager_fallback=False)

    light = SimpleNamespace(config=SimpleNamespace(model="tiny"), startup=startup)
    report = Report(tmp_path / "report.json")
    with report.phase("light_startup"):
        await start_light(light, report, main)  # type: ignore[arg-type]
    assert report["phases"]["light_startup"]["status"] == "done"
    assert resets == []
    with torch.inference_mode():
        (out,) = main_fn(x)
    assert out.shape == (2, 4)
    assert still_compiled(main) == []  # no recompile of the main step, none counted

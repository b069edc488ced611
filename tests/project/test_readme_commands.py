"""README.md's commands, and those of the site's getting-started page, work as written:
every fenced `sh` and `python` block runs, in the order the page shows it, in an empty
folder, with the virtualenv's bin/ first on PATH (as after `source .venv/bin/activate`),
REDIS_URL naming a private redis-server, and no network.

A block preceded by `<!-- readme-test: skip (why) -->` is not run, and must say why; one
preceded by `<!-- readme-test: background -->` is a long-running command (a worker): it
starts in the background, and is stopped with SIGINT (a Ctrl+C) when the next background
block starts or the last block has run. It must then exit 0, as a worker does after a
clean stop."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from tests.support.cli_runner import ROOT, clean_env
from tests.support.redis_server import free_port

README = ROOT / "README.md"
GETTING_STARTED = ROOT / "docs" / "getting-started.md"

_BLOCK = re.compile(
    r"(?:^<!-- readme-test: (?P<marker>[^\n]*?) -->\n)?^```(?P<lang>[a-z]*)\n(?P<body>.*?)^```$",
    re.M | re.S,
)


@dataclass(frozen=True)
class Block:
    lang: str
    body: str
    marker: str  # "", "background" or "skip (why)"
    line: int


def readme_blocks(page: Path = README) -> list[Block]:
    text = page.read_text()
    return [
        Block(m["lang"], m["body"], m["marker"] or "", text.count("\n", 0, m.start()) + 1)
        for m in _BLOCK.finditer(text)
    ]


@pytest.mark.parametrize("page", [README, GETTING_STARTED], ids=lambda p: p.name)
def test_every_block_is_run_or_says_why_not(page: Path) -> None:
    blocks = readme_blocks(page)
    assert blocks, f"{page.name} has no fenced blocks"
    for block in blocks:
        assert block.lang in ("sh", "python"), f"{page.name}:{block.line}: ```{block.lang}"
        assert (
            block.marker == "background"
            or block.marker == ""
            or (re.fullmatch(r"skip \(.{10,}\)", block.marker))
        ), f"{page.name}:{block.line}: a skipped block says why: {block.marker!r}"
    run = [b for b in blocks if not b.marker.startswith("skip")]
    assert any(b.marker == "background" for b in run)
    assert "make test     #" in README.read_text()


def _stop(proc: subprocess.Popen[bytes], log: Path) -> None:
    # Ctrl+C in the worker's terminal: SIGINT to its process group.
    os.killpg(proc.pid, signal.SIGINT)
    try:
        rc = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError(
            f"a worker did not stop on SIGINT:\n{log.read_text()[-3000:]}"
        ) from None
    assert rc == 0, f"a worker exited {rc} after SIGINT:\n{log.read_text()[-3000:]}"


def run_blocks(page: Path, tmp_path: Path, redis_url: str) -> tuple[list[str], Path]:
    """Run `page`'s blocks as the module docstring says; their outputs and the folder."""
    venv_bin = Path(sys.executable).parent
    dead_proxy = f"http://127.0.0.1:{free_port()}"  # no network: any download fails at once
    env = clean_env(
        REDIS_URL=redis_url,
        PATH=f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}",
        VIRTUAL_ENV=str(venv_bin.parent),
        # This checkout's packages, wherever the virtualenv's editable install points.
        PYTHONPATH=str(ROOT),
        TORCH_HOME=str(tmp_path / "torch-home"),
        HTTPS_PROXY=dead_proxy,
        https_proxy=dead_proxy,
        HTTP_PROXY=dead_proxy,
        http_proxy=dead_proxy,
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
    )
    work = tmp_path / "work"
    work.mkdir()
    outputs: list[str] = []
    background: tuple[subprocess.Popen[bytes], Path] | None = None
    try:
        for n, block in enumerate(readme_blocks(page)):
            if block.marker.startswith("skip"):
                continue
            if block.marker == "background":
                if background is not None:
                    _stop(*background)
                log = tmp_path / f"background-{n}.log"
                with log.open("wb") as sink:
                    proc = subprocess.Popen(
                        ["bash", "-c", block.body],
                        cwd=work,
                        env=env,
                        stdout=sink,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                background = (proc, log)
                continue
            argv = (
                ["bash", "-euo", "pipefail", "-c", block.body]
                if block.lang == "sh"
                else [sys.executable, "-c", block.body]
            )
            done = subprocess.run(
                argv, cwd=work, env=env, capture_output=True, timeout=180, check=False
            )
            # redis-cli prints binary fields (msgpack, vectors) as they are.
            stdout = done.stdout.decode(errors="replace")
            stderr = done.stderr.decode(errors="replace")
            where = f"{page.name}:{block.line}"
            if background is not None and background[0].poll() is not None:
                raise AssertionError(
                    f"the worker stopped early:\n{background[1].read_text()[-3000:]}"
                )
            assert done.returncode == 0, f"{where} exited {done.returncode}:\n{stderr}"
            outputs.append(stdout)
        if background is not None:
            _stop(*background)
            background = None
    finally:
        if background is not None and background[0].poll() is None:
            os.killpg(background[0].pid, signal.SIGKILL)
            background[0].wait()
    return outputs, work


@pytest.mark.slow
def test_readme_commands_work_as_written(tmp_path: Path, redis_url: str) -> None:
    outputs, work = run_blocks(README, tmp_path, redis_url)
    shown = "\n".join(outputs)
    # What README's comments promise: the redis-cli job's status, the embedding's size...
    assert re.search(r"^ok$", shown, re.M), shown
    assert re.search(r"^512$", shown, re.M), shown
    # ...the vector read with redis-cli is the exact bytes, L2-normalised (float16)...
    client = redis.Redis.from_url(redis_url)
    try:
        stored = client.hget("gpufeed:result:emb-photo.jpg", "embedding")
        assert client.hget("gpufeed:result:cat-1", "status") == b"ok"
    finally:
        client.close()
    assert stored is not None and len(stored) == 512 * 2
    assert (work / "emb.f16").read_bytes() == stored
    norm = re.search(r"^512 (\S+)$", shown, re.M)
    assert norm is not None and abs(float(norm.group(1)) - 1.0) < 0.01, shown
    # ...and the producer decodes the same vector.
    assert re.search(r"^512 float16 \[", shown, re.M), shown


def test_readme_keeps_the_batch_figures_block_in_the_batch_part() -> None:
    # The figures generator fills the block between these two lines; it must stay in the
    # batch part, in this order.
    text = README.read_text()
    start, end = "<!-- figures:batch -->\n", "<!-- /figures:batch -->\n"
    assert text.count(start) == 1 and text.count(end) == 1
    batch_part = text.index("## Batch jobs over a bucket")
    assert batch_part < text.index(start) < text.index(end) < text.index("## The documentation")


def test_the_default_model_offline_exits_2_as_readme_says(tmp_path: Path, redis_url: str) -> None:
    dead_proxy = f"http://127.0.0.1:{free_port()}"
    env = clean_env(
        REDIS_URL=redis_url,
        GPUFEED_DEVICE="cpu",
        PYTHONPATH=str(ROOT),
        TORCH_HOME=str(tmp_path / "torch-home"),
        HTTPS_PROXY=dead_proxy,
        https_proxy=dead_proxy,
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
    )
    done = subprocess.run(
        [sys.executable, "-m", "worker"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    said = done.stderr.strip().splitlines()[-1]
    assert said.startswith("gpufeed: cannot fetch ResNet50_Weights.IMAGENET1K_V2: "), said
    assert said.endswith("Set GPUFEED_WEIGHTS=none for random weights or to a local file."), said
    shown = " ".join(README.read_text().split())
    assert "`gpufeed: cannot fetch ResNet50_Weights.IMAGENET1K_V2: ..." in shown
    assert "Set GPUFEED_WEIGHTS=none for random weights or to a local file.`" in shown


@pytest.mark.slow
def test_getting_started_commands_work_as_written(tmp_path: Path, redis_url: str) -> None:
    """The page's folder becomes a Parquet file three ways (--local from the shell and from
    Python, then through the worker the page starts), each image answered ok and labelled."""
    import pyarrow.parquet as pq

    outputs, work = run_blocks(GETTING_STARTED, tmp_path, redis_url)
    for name in ("photos.parquet", "again.parquet", "served.parquet"):
        rows = pq.read_table(work / name).to_pylist()
        assert sorted(r["id"] for r in rows) == ["navy.jpg", "orange.jpg", "teal.jpg"], name
        assert all(r["status"] == "ok" and r["label"] for r in rows), rows
    shown = "\n".join(outputs)
    assert "3 ok, 0 errors" in shown, shown
    assert "teal.jpg" in shown and "ok" in shown

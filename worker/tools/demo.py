"""`make demo`: a private Redis if none answers, a worker, sample jobs, results, throughput.

Everything it starts it stops again, also on Ctrl+C.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import redis
from PIL import Image
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table

from producer.client import Job, Producer
from producer.wire import JobResult

console = Console(stderr=False, width=max(110, shutil.get_terminal_size((110, 24)).columns))
# Side notes go to stderr, so tools that reuse redis_for_demo keep stdout for their output.
notes = Console(stderr=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def redis_for_demo(url: str, workdir: Path) -> Iterator[str]:
    """Use the Redis at `url` if it answers, else a private one on a free port."""
    try:
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()
        notes.print(f"[dim]using the Redis already running at {url}[/]")
        yield url
        return
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        pass
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed: run `make setup`")
    port = _free_port()
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    private = f"redis://127.0.0.1:{port}/0"
    try:
        client = redis.Redis.from_url(private)
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.025)
        notes.print(f"[dim]started a private redis-server on 127.0.0.1:{port}[/]")
        yield private
    finally:
        proc.terminate()
        proc.wait(10)


def sample_images(
    count: int, seed: int = 7, *, on_image: Callable[[], None] | None = None
) -> list[tuple[str, bytes]]:
    """Photo-like JPEGs of mixed sizes, a PNG with alpha, and two bad files; `on_image` is
    called after each JPEG (they take a few seconds in all)."""
    rng = np.random.default_rng(seed)
    sizes = [(640, 480), (1024, 768), (1920, 1080), (480, 640)]
    out: list[tuple[str, bytes]] = []
    for i in range(count):
        w, h = sizes[i % len(sizes)]
        y, x = np.mgrid[0:h, 0:w]
        phase = rng.uniform(0, 6.28, 3)
        freq = rng.uniform(0.002, 0.02, 3)
        rgb = np.stack(
            [127 + 120 * np.sin(freq[c] * (x + 0.6 * y) + phase[c]) for c in range(3)], axis=-1
        )
        rgb += rng.normal(0, 10, rgb.shape)
        img = Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8), "RGB")
        buf = io.BytesIO()
        img.save(buf, "JPEG", quality=88)
        out.append((f"sample-{i:03d}.jpg", buf.getvalue()))
        if on_image is not None:
            on_image()
    buf = io.BytesIO()
    Image.new("RGBA", (300, 200), (30, 120, 200, 128)).save(buf, "PNG")
    out.append(("logo.png", buf.getvalue()))
    good = out[0][1]
    out.append(("truncated.jpg", good[: len(good) // 3]))
    out.append(("notes.txt", b"this is not an image"))
    return out


def weights_for_demo(model: str, requested: str) -> str:
    """The requested weights if they can be had within a few seconds, else `none`."""
    if requested.lower() == "none" or "/" in requested:
        return requested
    from worker.model.loader import prefetch_weights

    # torch's own "Downloading: ..." line goes: the spinner (drawn on the terminal as it
    # was before stdout is silenced) says it, and a failure is one line.
    terminal = Console(file=sys.stdout)
    with (
        terminal.status(f"fetching the pretrained weights of {model}"),
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(io.StringIO()),
    ):
        problem = prefetch_weights(model, requested, timeout_s=15)
    if problem is None:
        return requested
    console.print(
        f"[yellow]no pretrained weights for {model} ({_first_words(problem)}): random weights, "
        "so labels mean nothing but the pipeline is real[/]",
        soft_wrap=True,
    )
    return "none"


def _first_words(problem: str, limit: int = 60) -> str:
    # "URLError: <urlopen error [Errno -2] Name or service not known>" -> the reason only.
    reason = problem.rsplit("]", 1)[-1].strip(" >") if "]" in problem else problem
    return reason if len(reason) <= limit else reason[: limit - 3] + "..."


def make_samples(count: int) -> list[tuple[str, bytes]]:
    """sample_images with a progress bar: a few seconds of work, never a silent pause."""
    with Progress(
        TextColumn("making sample images"),
        BarColumn(),
        MofNCompleteColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task("images", total=count)
        images = sample_images(count, on_image=lambda: progress.advance(task))
    console.print(
        f"made {len(images)} sample images: {count} JPEGs of 0.3 to 2 megapixels, "
        "a PNG with alpha, a truncated JPEG and a text file"
    )
    return images


def run_demo(count: int = 48) -> int:
    import torch

    cuda = torch.cuda.is_available()
    model = os.environ.get("GPUFEED_MODEL") or ("resnet50" if cuda else "resnet18")
    weights = weights_for_demo(model, os.environ.get("GPUFEED_WEIGHTS", "DEFAULT"))
    workdir = Path(".demo")
    workdir.mkdir(exist_ok=True)
    url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    stream = f"gpufeed:demo:{os.getpid()}"
    results_stream = f"{stream}:results"
    with redis_for_demo(url, workdir) as redis_url:
        env = {
            **os.environ,
            "REDIS_URL": redis_url,
            "GPUFEED_MODEL": model,
            "GPUFEED_WEIGHTS": weights,
            "GPUFEED_STREAM": stream,
            # The demo feeds one stream: no priority levels, whatever the environment says.
            "GPUFEED_PRIORITIES": "",
            "GPUFEED_PRIORITY_WEIGHTS": "",
            "GPUFEED_RESULTS_STREAM": results_stream,
            "GPUFEED_WORKER_NAME": f"demo-{os.getpid()}",
            "GPUFEED_LOG_FORMAT": "console",
        }
        log_path = workdir / "worker.log"
        console.print(f"starting a worker ({model}, weights {weights}); log: {log_path}")
        with log_path.open("wb") as log_file:
            worker = subprocess.Popen(
                [sys.executable, "-m", "worker"], env=env, stdout=log_file, stderr=subprocess.STDOUT
            )
            try:
                return _drive(
                    worker,
                    redis_url,
                    stream=stream,
                    results_stream=results_stream,
                    count=count,
                    log_path=log_path,
                )
            finally:
                if worker.poll() is None:
                    worker.send_signal(signal.SIGTERM)
                    try:
                        worker.wait(60)
                    except subprocess.TimeoutExpired:
                        worker.kill()
                client = redis.Redis.from_url(redis_url)
                client.delete(stream, results_stream)
                client.close()


def _drive(
    worker: subprocess.Popen[bytes],
    redis_url: str,
    *,
    stream: str,
    results_stream: str,
    count: int,
    log_path: Path,
) -> int:
    client = redis.Redis.from_url(redis_url)
    # Made while the worker loads its model.
    images = make_samples(count)
    with console.status("waiting for the worker to load and warm up the model"):
        while True:
            if worker.poll() is not None:
                console.print(f"[red]the worker exited ({worker.returncode}); see {log_path}[/]")
                console.print(log_path.read_text(errors="replace")[-2000:])
                return 1
            with contextlib.suppress(redis.ResponseError):
                groups = client.xinfo_groups(stream)
                if groups:
                    break
            time.sleep(0.2)
    producer = Producer(redis_url, stream=stream, results_stream=results_stream)
    t0 = time.perf_counter()
    ids = producer.submit_many([Job(image=data, id=name) for i, (name, data) in enumerate(images)])
    results = producer.wait(ids, timeout_s=600)
    elapsed = time.perf_counter() - t0
    producer.close()

    table = Table(title="gpufeed demo results")
    for col in ("id", "status", "top1", "label", "score", "error", "total ms"):
        table.add_column(col)
    ordered: list[JobResult] = [results[i] for i in ids if i in results]
    for r in ordered:
        total = r.details.get("timings_ms", {}).get("total")
        table.add_row(
            r.id,
            r.status,
            "" if r.top1 is None else str(r.top1),
            r.label or "",
            "" if r.score is None else f"{r.score:.4f}",
            r.error or "",
            "" if total is None else f"{total:.1f}",
        )
    console.print(table)
    ok = sum(1 for r in ordered if r.ok)
    err = len(ordered) - ok
    missing = len(ids) - len(ordered)
    device = next((str(r.details.get("device")) for r in ordered if r.details), "?")
    console.print(
        f"[bold]throughput: {len(ordered)} images in {elapsed:.2f} s = "
        f"{len(ordered) / elapsed:.1f} images/s[/] (ok {ok}, error {err}, missing {missing}; "
        f"device {device}; the time includes the pipeline filling up from empty)"
    )
    return 0 if missing == 0 else 1

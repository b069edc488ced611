"""Model directories: gpufeed.toml, the three ways to package a model, every output kind, the
start-up errors for a broken directory, and results that equal an eager reference computed
on the same decoded pixels (in process, and through a real worker and redis-server)."""

from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import redis
import torch
from click.testing import CliRunner
from PIL import Image

from producer.replies import parse_result
from producer.wire import JobResult
from tests.support.images import jpeg_bytes, png_bytes
from tests.support.model_dirs import (
    MEAN,
    STD,
    cosine,
    make_model_dir,
    reference_outputs,
    softmax_topk,
    tiny_net,
    toml_text,
    write_tinynet,
)
from tests.support.worker_harness import running_worker, tiny_config, wait_results
from worker.base.errors import ConfigError
from worker.cli import cli
from worker.config.settings import WorkerConfig
from worker.decode.cpu import DecodeSpec, decode_to_array
from worker.delivery.writer import WriterSettings, result_fields
from worker.jobs import Job, Outcome
from worker.model.answers import Embedding
from worker.model.directory import load_model_dir
from worker.model.loaded import LoadedModel
from worker.model.manifest import read_manifest
from worker.model.readers import make_reader
from worker.model.step import build_step

IMAGES = [jpeg_bytes(120 + 8 * i, 90 + 5 * i, seed=i) for i in range(5)] + [png_bytes(64, 80)]


def decoded(loaded: LoadedModel, images: list[bytes] = IMAGES) -> np.ndarray:
    """The images as the worker decodes them for this model: [N, S, S, 3] uint8."""
    spec = DecodeSpec(size=loaded.resize_size, geometry=loaded.resize_mode)
    return np.stack([decode_to_array(data, spec)[0] for data in images])


def step_answers(loaded: LoadedModel, rows: np.ndarray, batch: int = 4) -> list[Any]:
    """gpufeed's answers for `rows`, computed by the serving step (eager, fp32) in batches of
    `batch` (the last one padded), read back the way the completion watcher reads them."""
    step = build_step(loaded, device=torch.device("cpu"), dtype=torch.float32, top_k=3)
    reader = make_reader(loaded.output, loaded.categories)
    answers: list[Any] = []
    for start in range(0, len(rows), batch):
        chunk = rows[start : start + batch]
        x = np.zeros((batch, *rows.shape[1:]), dtype=np.uint8)
        x[: len(chunk)] = chunk
        with torch.inference_mode():
            outputs = [t.numpy() for t in step(torch.from_numpy(x))]
        answers += reader.read(outputs, list(range(len(chunk))))
    return answers


# --------------------------------------------------------------------------- the manifest
def write(root: Path, tables: dict[str, dict[str, Any]]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "model.pt2").write_bytes(b"not read by the manifest")
    (root / "gpufeed.toml").write_text(toml_text(tables))
    return root


GOOD = {"model": {"file": "model.pt2", "input_size": 32}, "output": {"kind": "classify"}}


def test_a_minimal_manifest_and_its_defaults(tmp_path: Path) -> None:
    m = read_manifest(write(tmp_path / "m", GOOD))
    assert m.name == "m" and m.format == "export" and m.input_size == 32
    assert m.preprocess.resize == "shorter-crop"
    assert m.staging_size == round(32 * 256 / 224)  # torchvision's ratio
    assert m.preprocess.mean == (0.0, 0.0, 0.0) and m.preprocess.std == (1.0, 1.0, 1.0)
    assert m.output.activation == "softmax" and m.labels is None


@pytest.mark.parametrize(
    ("change", "table_key", "words"),
    [
        ({"model": {"input_size": 32}}, "[model] file", "missing"),
        (
            {"model": {"file": "model.pt2", "entry": "a:b", "input_size": 32}},
            "[model] file and entry",
            "not both",
        ),
        ({"model": {"file": "model.pt2"}}, "[model] input_size", "missing"),
        ({"model": {"file": "model.pt2", "input_size": "224"}}, "[model] input_size", "integer"),
        ({"model": {"file": "model.onnx", "input_size": 32}}, "[model] file", "not a file"),
        (
            {"model": {"file": "model.pt2", "input_size": 32, "batch": 8}},
            "[model] batch",
            "unknown key",
        ),
        (
            {"model": {"file": "model.pt2", "input_size": 32, "weights": "w.pt"}},
            "[model] weights",
            "entry only",
        ),
        (
            {"model": {"entry": "not a callable", "input_size": 32}},
            "[model] entry",
            "package.module:callable",
        ),
        (
            {"preprocess": {"resize": "crop"}},
            "[preprocess] resize",
            "shorter-crop, squash, letterbox",
        ),
        (
            {"preprocess": {"resize": "squash", "resize_size": 40}},
            "[preprocess] resize_size",
            "shorter-crop",
        ),
        ({"preprocess": {"resize_size": 16}}, "[preprocess] resize_size", "from 32"),
        ({"preprocess": {"mean": [0.5, 0.5, 0.5]}}, "[preprocess] std", "both"),
        ({"preprocess": {"mean": [0.5, 0.5], "std": [1, 1]}}, "[preprocess] mean", "3 numbers"),
        ({"preprocess": {"mean": [0, 0, 0], "std": [1, 0, 1]}}, "[preprocess] std", "above 0"),
        ({"output": {}}, "[output] kind", "missing"),
        ({"output": {"kind": "detect"}}, "[output] kind", "classify, embed, raw"),
        ({"output": {"kind": "classify", "topk": 5}}, "[output] topk", "unknown key"),
        ({"output": {"kind": "classify", "top_k": 0}}, "[output] top_k", "from 1 to 100"),
        ({"output": {"kind": "classify", "threshold": 0.5}}, "[output] threshold", "sigmoid"),
        ({"output": {"kind": "classify", "normalize": True}}, "[output] normalize", "embed"),
        ({"output": {"kind": "embed", "top_k": 3}}, "[output] top_k", "classify"),
        ({"output": {"kind": "embed", "dtype": "bfloat16"}}, "[output] dtype", "float16, float32"),
        ({"output": {"kind": "embed", "normalize": "yes"}}, "[output] normalize", "true or false"),
        ({"output": {"kind": "classify", "labels": "names.txt"}}, "[output] labels", "not a file"),
        ({"outputs": {"kind": "classify"}}, "unknown table [outputs]", "[model]"),
    ],
)
def test_each_wrong_key_is_named_with_its_file(
    tmp_path: Path, change: dict[str, dict[str, Any]], table_key: str, words: str
) -> None:
    tables = {k: dict(v) for k, v in GOOD.items()}
    for table, keys in change.items():
        if table in ("model", "output"):
            tables[table] = keys
        else:
            tables[table] = {**tables.get(table, {}), **keys}
    root = write(tmp_path / "m", tables)
    with pytest.raises(ConfigError) as err:
        read_manifest(root)
    message = str(err.value)
    assert str(root / "gpufeed.toml") in message and table_key in message and words in message
    assert "\n" not in message


def test_the_config_checks_the_manifest_at_once(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"GPUFEED_MODEL: .*nowhere is not a directory"):
        WorkerConfig.load(env={"GPUFEED_MODEL": str(tmp_path / "nowhere")})
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"has no gpufeed\.toml"):
        WorkerConfig.load(env={"GPUFEED_MODEL": str(tmp_path / "empty")})
    bad = write(tmp_path / "bad", {**GOOD, "output": {"kind": "classify", "top_k": "5"}})
    with pytest.raises(ConfigError, match=r"\[output\] top_k"):
        WorkerConfig.load(env={"GPUFEED_MODEL": str(bad)})
    assert WorkerConfig.load(env={"GPUFEED_MODEL": "resnet18"}).model == "resnet18"


# --------------------------------------------------------------------------- broken models
def entry_dir(
    root: Path, entry: str, *, kind: str = "classify", input_size: int = 32, **output: Any
) -> Path:
    write_tinynet(root)
    tables: dict[str, dict[str, Any]] = {
        "model": {"entry": entry, "input_size": input_size},
        "output": {"kind": kind, **output},
    }
    (root / "gpufeed.toml").write_text(toml_text(tables))
    return root


def rewrite(root: Path, old: str, new: str) -> Path:
    path = root / "gpufeed.toml"
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))
    return root


def broken_dirs(tmp: Path) -> dict[str, tuple[Path, str]]:
    """name -> (directory, what its error must say)."""
    out: dict[str, tuple[Path, str]] = {}
    junk = make_model_dir(tmp / "junk")
    (junk / "model.pt2").write_bytes(b"PK\x03\x04 this is not a program")
    out["not-a-program"] = (junk, "[model] file: model.pt2 is not a torch.export program")
    state = make_model_dir(tmp / "state-dict", fmt="torchscript")
    torch.save(tiny_net().state_dict(), state / "model.ts")
    out["state-dict-as-torchscript"] = (state, "model.ts is not a TorchScript module")
    out["entry-raises"] = (
        entry_dir(tmp / "raises", "tinynet:broken"),
        "[model] entry: tinynet:broken raised ValueError: the checkpoint server is down",
    )
    out["entry-missing"] = (
        entry_dir(tmp / "missing", "tinynet:nothing_here"),
        "[model] entry: tinynet has no nothing_here",
    )
    out["entry-not-a-module"] = (
        entry_dir(tmp / "dict", "tinynet:not_a_module"),
        "returned a dict, not a torch.nn.Module",
    )
    out["input-size-rejected"] = (
        entry_dir(tmp / "flat", "tinynet:flat", input_size=48),
        "[model] input_size: 48, but tinynet:flat rejects a 2x3x48x48 float32 input",
    )
    static = rewrite(make_model_dir(tmp / "static-hw"), "input_size = 32", "input_size = 48")
    out["exported-for-another-size"] = (
        rewrite(static, "resize_size = 36", "resize_size = 52"),
        "[model] input_size: 48, but model.pt2 was exported for [B, 3, 32, 32] inputs",
    )
    out["static-batch"] = (
        make_model_dir(tmp / "static-batch", dynamic_batch=False),
        "model.pt2 was exported for batch 4 only",
    )
    out["labels-count"] = (
        make_model_dir(tmp / "labels", labels=["cat", "dog", "owl"]),
        "labels.txt: 3 lines but the model has 5 classes",
    )
    out["top-k-over-classes"] = (
        make_model_dir(tmp / "top-k", output={"top_k": 9}),
        "[output] top_k: 9 but the model has 5 classes",
    )
    feature_map = make_model_dir(tmp / "raw-as-classify", fmt="entry", kind="raw", out=3)
    out["feature-map-as-classify"] = (
        rewrite(feature_map, 'kind = "raw"', 'kind = "classify"'),
        "[output] kind: classify, but tinynet:build returns [2, 3, 4, 4]; classify needs",
    )
    out["tuple-output"] = (
        entry_dir(tmp / "pair", "tinynet:pair"),
        "[output] kind: classify, but tinynet:pair returns a tuple of 2",
    )
    out["raw-too-large"] = (
        entry_dir(tmp / "wide", "tinynet:wide", kind="raw"),
        "360000 bytes per image in float32, over the limit of 262144",
    )
    weights = make_model_dir(tmp / "weights", fmt="entry")
    torch.save(tiny_net(7).state_dict(), weights / "weights.pt")
    out["weights-do-not-fit"] = (weights, "[model] weights: weights.pt does not fit tinynet:build")
    return out


@pytest.fixture(scope="module")
def broken(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    return broken_dirs(tmp_path_factory.mktemp("broken"))


@pytest.mark.parametrize(
    "name",
    [
        "not-a-program",
        "state-dict-as-torchscript",
        "entry-raises",
        "entry-missing",
        "entry-not-a-module",
        "input-size-rejected",
        "exported-for-another-size",
        "static-batch",
        "labels-count",
        "top-k-over-classes",
        "feature-map-as-classify",
        "tuple-output",
        "raw-too-large",
        "weights-do-not-fit",
    ],
)
def test_a_broken_directory_gets_one_clear_line(
    broken: dict[str, tuple[Path, str]], name: str
) -> None:
    root, expected = broken[name]
    with pytest.raises(ConfigError) as err:
        load_model_dir(root, batch_size=8)
    message = str(err.value)
    assert expected in message, message
    assert str(root) in message and "\n" not in message


@pytest.mark.slow
def test_a_broken_directory_stops_the_worker_with_exit_code_2(
    broken: dict[str, tuple[Path, str]], redis_url: str
) -> None:
    from tests.support.cli_runner import run_module

    root, expected = broken["entry-raises"]
    env = {"REDIS_URL": redis_url, "GPUFEED_MODEL": str(root), "GPUFEED_DEVICE": "cpu"}
    proc = run_module("worker", "--no-wait", env=env, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr.strip().splitlines()[-1]


# --------------------------------------------------------------------------- results
@pytest.mark.parametrize("fmt", ["export", "torchscript", "entry"])
def test_classify_equals_the_eager_reference(tmp_path: Path, fmt: str) -> None:
    names = ["ant", "bee", "cat", "dog", "eel"]
    loaded = load_model_dir(make_model_dir(tmp_path / fmt, fmt=fmt, labels=names), batch_size=4)
    assert loaded.source == ("entry" if fmt == "entry" else fmt) and loaded.num_classes == 5
    rows = decoded(loaded)
    got = step_answers(loaded, rows)
    want = reference_outputs(tiny_net(), rows, input_size=32)
    for answer, logits in zip(got, want, strict=True):
        indices, scores = softmax_topk(logits, 3)
        assert answer.indices == indices
        np.testing.assert_allclose(answer.scores, scores, rtol=1e-5, atol=1e-6)
        assert answer.names == [names[i] for i in indices]


def test_raw_outputs_keep_their_shape(tmp_path: Path) -> None:
    root = make_model_dir(tmp_path / "raw", fmt="entry", kind="raw", out=3)
    loaded = load_model_dir(root, batch_size=4)
    rows = decoded(loaded)
    got = step_answers(loaded, rows)
    want = reference_outputs(tiny_net(3, raw=True), rows, input_size=32)
    for answer, ref in zip(got, want, strict=True):
        assert answer.shape == (3, 4, 4) and answer.dtype == "float32"
        values = np.frombuffer(answer.data, dtype="<f4").reshape(answer.shape)
        np.testing.assert_allclose(values, ref.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("resize", ["squash", "letterbox"])
def test_squash_and_letterbox_reach_the_model(tmp_path: Path, resize: str) -> None:
    pre = {"resize": resize, "mean": list(MEAN), "std": list(STD)}
    loaded = load_model_dir(
        make_model_dir(tmp_path / resize, kind="embed", preprocess=pre), batch_size=4
    )
    assert loaded.resize_mode == resize and loaded.resize_size == loaded.crop_size == 32
    wide = png_bytes(128, 64, seed=7)  # a PNG: no DCT-scaled decode to account for
    rows = decoded(loaded, [wide])
    with Image.open(io.BytesIO(wide)) as im:
        rgb = im.convert("RGB")
        if resize == "squash":
            expected = np.asarray(rgb.resize((32, 32), Image.Resampling.BILINEAR))
        else:
            # 128x64 fits as 32x16, centred: 8 black rows above and below.
            expected = np.zeros((32, 32, 3), dtype=np.uint8)
            expected[8:24] = np.asarray(rgb.resize((32, 16), Image.Resampling.BILINEAR))
    np.testing.assert_array_equal(rows[0], expected)
    answer = step_answers(loaded, rows)[0]
    ref = reference_outputs(tiny_net(), rows, input_size=32)[0]
    vector = np.frombuffer(answer.vector, dtype="<f4")
    assert cosine(vector, ref.numpy()) >= 0.999


# --------------------------------------------------------------------------- through a worker
async def run_jobs(
    redis_url: str, client: redis.Redis, root: Path, images: list[bytes], **settings: Any
) -> dict[str, JobResult]:
    async with running_worker(redis_url, Path("unused"), model=str(root), **settings) as worker:
        for i, data in enumerate(images):
            client.xadd("gpufeed:jobs", {"id": f"j{i}", "image": data})
        entries = await wait_results(client, "gpufeed:results", len(images))
        # Metrics and heartbeats name the model as its results do: by the directory's
        # name, not by the path as typed.
        assert worker.observer.info["model"] == root.name
    results = {r.id: r for r in (JobResult.from_fields(f) for _, f in entries)}
    assert len(results) == len(images) and all(r.ok for r in results.values()), results
    # The hash holds what the stream entry holds.
    for job_id, result in results.items():
        assert JobResult.from_fields(client.hgetall(f"gpufeed:result:{job_id}")) == result
    return results


async def test_classify_through_a_worker(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    names = ["ant", "bee", "cat", "dog", "eel"]
    root = make_model_dir(tmp_path / "clf", labels=names, output={"top_k": 2})
    results = await run_jobs(redis_url, redis_client, root, IMAGES)
    loaded = load_model_dir(root, batch_size=4)
    want = reference_outputs(tiny_net(), decoded(loaded), input_size=32)
    for i, logits in enumerate(want):
        r = results[f"j{i}"]
        indices, scores = softmax_topk(logits, 2)
        assert r.details["top_k"] == indices and r.top1 == indices[0]
        assert r.label == names[indices[0]] and r.labels == [names[j] for j in indices]
        np.testing.assert_allclose(r.details["scores"], scores, atol=1e-5)
        assert r.score == pytest.approx(scores[0], abs=1e-5)
        assert r.details["model"] == "clf"  # the directory's name


async def test_multi_label_through_a_worker(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    names = ["sky", "tree", "road", "car", "dog"]
    root = make_model_dir(
        tmp_path / "tagger",
        fmt="torchscript",
        labels=names,
        output={"activation": "sigmoid", "threshold": 0.45},
    )
    results = await run_jobs(redis_url, redis_client, root, IMAGES)
    loaded = load_model_dir(root, batch_size=4)
    probs = torch.sigmoid(reference_outputs(tiny_net(), decoded(loaded), input_size=32))
    seen_sizes = set()
    for i, p in enumerate(probs):
        r = results[f"j{i}"]
        above = [j for j in torch.argsort(p, descending=True).tolist() if p[j] >= 0.45]
        assert r.labels == [names[j] for j in above]
        assert r.details["label_indices"] == above and r.details["threshold"] == 0.45
        np.testing.assert_allclose(r.details["label_scores"], p[above].numpy(), atol=1e-5)
        assert json.loads(redis_client.hget(f"gpufeed:result:j{i}", "labels")) == r.labels
        assert r.top1 == int(torch.argmax(p))
        seen_sizes.add(len(above))
    assert len(seen_sizes) > 1, "the images should not all get the same number of labels"


@pytest.mark.parametrize("dtype", ["float32", "float16"])
async def test_embed_through_a_worker(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis, dtype: str
) -> None:
    root = make_model_dir(
        tmp_path / "embedder", fmt="entry", kind="embed", out=16, output={"dtype": dtype}
    )
    results = await run_jobs(redis_url, redis_client, root, IMAGES)
    loaded = load_model_dir(root, batch_size=4)
    want = reference_outputs(tiny_net(16), decoded(loaded), input_size=32).numpy()
    size = 4 if dtype == "float32" else 2
    for i, ref in enumerate(want):
        r = results[f"j{i}"]
        raw = redis_client.hget(f"gpufeed:result:j{i}", "embedding")
        assert raw is not None and len(raw) == 16 * size
        assert r.dim == 16 and r.dtype == dtype and r.top1 is None and r.label is None
        assert r.embedding is not None and len(r.embedding) == 16
        vector = np.array(r.embedding)
        np.testing.assert_array_equal(vector, np.frombuffer(raw, f"<f{size}"))
        assert np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-5 if size == 4 else 2e-3)
        assert cosine(vector, ref) >= (0.999 if size == 4 else 0.99)
        assert r.details["embedding"] == raw and r.details["dim"] == 16


# --------------------------------------------------------------------------- the wire, the producer
def test_result_fields_of_an_embedding() -> None:
    job = Job.new(entry_id="1-0", job_id="e1", reply_to="r", meta=None, image=b"x", path=None)
    vector = np.array([0.6, 0.8, 0.0], dtype="<f2").tobytes()
    outcome = Outcome(job=job, ok=True, answer=Embedding(vector, 3, "float16"))
    settings = WriterSettings("s", "g", "p:", 60, 100, "w", "my-embedder")
    flat = result_fields(outcome, settings)
    fields = dict(zip(flat[::2], flat[1::2], strict=True))
    assert fields[b"embedding"] == vector and fields[b"dim"] == "3"
    assert fields[b"dtype"] == "float16" and b"top1" not in fields
    details = msgpack.unpackb(fields[b"result"], raw=False)
    assert details["embedding"] == vector and details["model"] == "my-embedder"
    result = JobResult.from_fields(fields)  # type: ignore[arg-type]
    assert list(result.embedding or []) == pytest.approx([0.6, 0.8, 0.0], abs=1e-3)


def test_the_producer_reads_every_kind_without_torch() -> None:
    vector = np.array([1.0, -2.5], dtype="<f4").tobytes()
    embed = {b"id": b"e", b"entry": b"1-0", b"status": b"ok", b"embedding": vector}
    embed |= {b"dim": b"2", b"dtype": b"float32"}
    r = JobResult.from_fields(embed)
    assert list(r.embedding or []) == [1.0, -2.5] and r.dim == 2 and r.dtype == "float32"
    assert json.loads(json.dumps(r.to_dict()))["embedding"] == [1.0, -2.5]

    tags = {b"id": b"t", b"status": b"ok", b"top1": b"3", b"labels": b'["sky", "tree"]'}
    assert JobResult.from_fields(tags).labels == ["sky", "tree"]

    raw = {b"id": b"r", b"status": b"ok", b"output": b"\x00" * 24, b"shape": b"[2, 3]"}
    raw |= {b"dtype": b"float32"}
    r = JobResult.from_fields(raw)
    assert r.shape == (2, 3) and r.output == b"\x00" * 24
    assert json.loads(json.dumps(r.to_dict()))["shape"] == [2, 3]

    # A result that breaks the contract is skipped by the readers, not fatal.
    assert parse_result({**embed, b"dtype": b"int8"}) is None
    assert parse_result({**embed, b"embedding": b"\x00" * 7}) is None
    assert parse_result({**tags, b"labels": b"sky,tree"}) is None


# --------------------------------------------------------------------------- the tools
def test_model_check_reports_a_good_directory(tmp_path: Path) -> None:
    root = make_model_dir(tmp_path / "tagger", output={"activation": "sigmoid"})
    args = ["model", "check", str(root), "--device", "cpu", "--batch-size", "2"]
    result = CliRunner().invoke(cli, [*args, "--seconds", "0.1", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["kind"] == "classify" and report["source"] == "export"
    assert report["outputs"] == [
        {"name": "indices", "shape": [2, 5], "dtype": "int32"},
        {"name": "scores", "shape": [2, 5], "dtype": "float32"},
        {"name": "probs", "shape": [2, 5], "dtype": "float32"},
    ]
    assert report["input"]["model_input"] == [2, 3, 32, 32]
    assert report["compile"]["mode"] == "off" and report["images_per_s"] > 0
    assert report["result_fields"] == ["top1", "score", "labels"]
    text = CliRunner().invoke(cli, [*args, "--seconds", "0.1"])
    assert text.exit_code == 0
    for word in ("kind", "classify", "sigmoid", "images/s", "compile", "off (eager)"):
        assert word in text.stdout


def test_model_check_takes_a_relative_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_model_dir(tmp_path / "embedder", kind="embed", out=4)
    monkeypatch.chdir(tmp_path)
    args = ["model", "check", "embedder", "--device", "cpu", "--batch-size", "2"]
    result = CliRunner().invoke(cli, [*args, "--seconds", "0.1", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["model"] == "./embedder" and report["name"] == "embedder"
    assert report["outputs"] == [{"name": "embedding", "shape": [2, 4], "dtype": "float32"}]


def test_model_check_refuses_a_broken_directory(broken: dict[str, tuple[Path, str]]) -> None:
    root, expected = broken["labels-count"]
    result = CliRunner().invoke(cli, ["model", "check", str(root), "--device", "cpu"])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0] and lines[0].startswith("gpufeed: ")


async def test_doctor_takes_a_model_directory(tmp_path: Path, redis_url: str) -> None:
    from worker.tools.doctor import DoctorOptions, run_doctor, validate

    root = make_model_dir(tmp_path / "embedder", kind="embed", out=8)
    config = tiny_config(redis_url, Path("unused"), model=str(root))
    options = DoctorOptions(jobs=8, ceiling_seconds=0.2, sync_launches=2, image_size=(160, 120))
    report = await run_doctor(config, options)
    assert validate(report) == []
    assert report["config"]["model"] == str(root) and report["config"]["input_size"] == 32
    assert report["end_to_end"]["results_ok"] == 8
    assert report["ceiling"]["eager"]["images_per_s"] > 0


@pytest.mark.slow
def test_bench_takes_a_model_directory(tmp_path: Path) -> None:
    from measure.bench.profiles import ModelPlan, make_profile
    from measure.bench.report import validate_report
    from measure.bench.suite import run_bench

    root = make_model_dir(
        tmp_path / "letterboxed",
        kind="embed",
        out=8,
        preprocess={"resize": "letterbox", "mean": list(MEAN), "std": list(STD)},
    )
    tiny = make_profile("tiny", cuda=False)
    profile = replace(
        tiny,
        models=(ModelPlan(str(root), batch_size=4),),
        sets=tiny.sets[:1],
        curve=None,
        cache_roles=(),
        # The sections that run the null model or a model of their own say nothing of a
        # model directory.
        overhead=None,
        priority=None,
        tenants=None,
        batch=None,
        load_latency=None,
        warm_start=None,
    )
    base = WorkerConfig.load(env={}, overrides={"device": "cpu", "log_level": "warning"})
    report = run_bench(profile, out_dir=tmp_path / "out", base=base, echo=lambda _line: None)
    assert validate_report(report) == []
    names = {r["name"] for r in report["runs"]}
    assert {"naive", "gpufeed", "gpufeed-cpu-preprocess"} <= names
    for run in report["runs"]:
        assert run["results"] == run["jobs"] == run["results_ok"], run["name"]
        assert run["model"] == str(root) and run["settings"]["resize"] == "letterbox"
        assert run["settings"]["staging_size"] == run["settings"]["input_size"] == 32


# --------------------------------------------------------------------------- on a GPU
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("fmt", "kind", "output"),
    [
        ("export", "classify", {"activation": "sigmoid", "threshold": 0.4}),
        ("torchscript", "embed", {"dtype": "float16"}),
        ("entry", "raw", {}),
    ],
)
def test_every_kind_replays_as_one_cuda_graph(
    tmp_path: Path, fmt: str, kind: str, output: dict[str, Any]
) -> None:
    from worker.model.compiler import compile_step
    from worker.model.precision import output_agreement, precision_check

    root = make_model_dir(tmp_path / kind, fmt=fmt, kind=kind, output=output)
    loaded = load_model_dir(root, batch_size=8)
    device = torch.device("cuda", 0)
    step = build_step(loaded, device=device, dtype=torch.bfloat16, top_k=3)
    s = loaded.resize_size
    example = torch.zeros((8, s, s, 3), dtype=torch.uint8, device=device)
    fn, report = compile_step(step, example, mode="reduce-overhead", allow_eager_fallback=False)
    assert report.compiled and report.cudagraph_replays > 0, report.as_dict()
    assert report.graph_breaks == report.recompiles == 0 and report.cudagraph_skips == []
    if kind == "classify":
        agreement = precision_check(step, fn, batch=8, cudagraphs=True)
        assert agreement.top1_agreement_confident >= 0.9
    else:
        close = output_agreement(step, fn, batch=8, cudagraphs=True)
        assert close.min_cosine >= 0.99, close.as_dict()


def test_output_agreement_of_an_embedder_in_bf16(tmp_path: Path) -> None:
    from worker.model.precision import output_agreement

    loaded = load_model_dir(make_model_dir(tmp_path / "e", kind="embed", out=16), batch_size=4)
    cpu = torch.device("cpu")
    same = output_agreement(build_step(loaded, device=cpu, dtype=torch.float32, top_k=3), batch=4)
    assert same.min_cosine == pytest.approx(1.0, abs=1e-6) and same.max_abs_diff < 1e-6
    half = output_agreement(build_step(loaded, device=cpu, dtype=torch.bfloat16, top_k=3), batch=4)
    assert 0.99 <= half.min_cosine < 1.0 and half.images == 8 and half.dtype == "bfloat16"


def test_agreement_checks_take_a_model_without_parameters(tmp_path: Path) -> None:
    # A loaded TorchScript model holds its weights as constants, not parameters: the checks
    # once looked for the device in its parameters (StopIteration on a GPU host).
    from worker.model.precision import output_agreement, precision_check

    cpu = torch.device("cpu")
    fmt = "torchscript"
    embed = load_model_dir(make_model_dir(tmp_path / "e", fmt=fmt, kind="embed"), batch_size=4)
    step = build_step(embed, device=cpu, dtype=torch.bfloat16, top_k=3)
    assert next(step.parameters(), None) is None
    assert output_agreement(step, batch=4).min_cosine >= 0.99
    classify = load_model_dir(make_model_dir(tmp_path / "c", fmt=fmt), batch_size=4)
    step = build_step(classify, device=cpu, dtype=torch.bfloat16, top_k=3)
    assert precision_check(step, batch=4, batches=1).images == 4

"""`python -m worker model check DIR`: is this model directory ready to serve?

It does what a worker does at start-up, without Redis: reads the manifest, loads the model,
probes its output against the kind, builds the one step, compiles it and checks that it is
one graph (on CUDA: replayed as CUDA graphs), then runs it on generated JPEGs decoded the
way the worker decodes, shows what a result would hold, and times the step with the batch
already on the device (the direct-feed ceiling). A broken directory fails with the same
one-line error the worker would give.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from worker.base.device import make_context, mark_cudagraph_step, resolve_device
from worker.decode.cpu import DecodeSpec, decode_into
from worker.decode.samples import synthetic_jpeg
from worker.model.answers import Answer, Classification, Embedding, RawOutput
from worker.model.ceiling import direct_feed_ceiling
from worker.model.compiler import compile_step
from worker.model.loaded import LoadedModel
from worker.model.loader import load_configured
from worker.model.readers import make_reader
from worker.model.step import build_step, check_step, pick_dtype, resolve_compile_mode

if TYPE_CHECKING:
    # For annotations only: importing it at run time would tie this folder to a layer above it.
    from worker.config.settings import WorkerConfig


def default_batch(device: torch.device) -> int:
    return 64 if device.type == "cuda" else 8


def check_model(config: WorkerConfig, *, seconds: float = 2.0) -> dict[str, Any]:
    """The report of `model check` (ConfigError or CompileRefused for a broken model)."""
    device = resolve_device(config.device)
    ctx = make_context(device)
    batch = config.batch_size or default_batch(device)
    t0 = time.perf_counter()
    loaded = load_configured(
        config.model, config.weights, input_size=config.input_size, batch_size=batch
    )
    load_s = time.perf_counter() - t0
    dtype = pick_dtype(config.precision, device)
    step = build_step(loaded, device=device, dtype=dtype, top_k=config.top_k)
    s = loaded.resize_size
    example = torch.zeros((batch, s, s, 3), dtype=torch.uint8, device=device)
    mode = resolve_compile_mode(config.compile, device)
    cudagraphs = False
    stream = ctx.compute_stream
    # Compile and launch on one thread and stream, as the worker's launch thread does.
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        check_step(step, example, what=f"GPUFEED_MODEL: {loaded.name}")
        fn, report = compile_step(
            step, example, mode=mode, allow_eager_fallback=config.allow_eager_fallback
        )
        cudagraphs = report.cudagraphs
        rows = _generated_batch(loaded, batch)
        x = torch.from_numpy(rows).to(device)
        with torch.inference_mode():
            if cudagraphs:
                mark_cudagraph_step()
            # A tool, not the hot path: the outputs are read back at once.
            outputs = [t.clone().cpu() for t in fn(x)]
        probe = direct_feed_ceiling(fn, example, iters=1, warmup=1, cudagraphs=cudagraphs)
        per_batch_s = max(float(probe["ms_per_batch"]) / 1000.0, 1e-6)
        iters = int(min(200, max(3, seconds / per_batch_s)))
        speed = direct_feed_ceiling(fn, example, iters=iters, warmup=1, cudagraphs=cudagraphs)
    reader = make_reader(loaded.output, loaded.categories)
    answers = reader.read([o.numpy() for o in outputs], [0])
    return {
        "model": config.model,
        "name": loaded.name,
        "source": loaded.source,
        "loaded": loaded.weights_label,
        "load_s": round(load_s, 3),
        "kind": loaded.output.kind,
        "description": describe(loaded, step.layout[0].shape[0]),
        "device": ctx.name,
        "dtype": str(dtype).removeprefix("torch."),
        "batch_size": batch,
        "input": {
            "staging": [batch, s, s, 3],
            "resize": loaded.resize_mode,
            "model_input": [batch, 3, loaded.crop_size, loaded.crop_size],
            "mean": list(loaded.mean),
            "std": list(loaded.std),
        },
        "outputs": [
            {"name": f.name, "shape": [batch, *f.shape], "dtype": _dtype(f.dtype)}
            for f in step.layout
        ],
        "result_fields": _fields(answers[0]),
        "sample": _sample(answers[0]),
        "compile": report.as_dict(),
        "images_per_s": speed["images_per_s"],
        "ms_per_batch": speed["ms_per_batch"],
    }


def describe(loaded: LoadedModel, first_dim: int) -> str:
    """What the model answers, in one line (`first_dim`: the head's top-k or vector size)."""
    spec, shape = loaded.output, loaded.output_shape
    if spec.kind == "classify":
        names = "named" if loaded.categories else "unnamed"
        line = f"classify: {shape[0]} {names} classes, {spec.activation}, top {first_dim}"
        if spec.activation == "sigmoid":
            line += f", labels at or above {spec.threshold}"
        return line
    if spec.kind == "embed":
        norm = "L2-normalised " if spec.normalize else ""
        return f"embed: {norm}{shape[0]}-d {spec.dtype} vectors"
    return f"raw: {list(shape)} {spec.dtype} per image"


def render(report: dict[str, Any]) -> str:
    """The report as aligned lines for a terminal."""
    inp, comp = report["input"], report["compile"]
    if comp["compiled"]:
        compiled = (
            f"{comp['mode']}: compiled in {comp['compile_s']:.1f} s, warm-up "
            f"{comp['warmup_s']:.2f} s; {comp['graph_breaks']} graph breaks, "
            f"{comp['recompiles']} recompiles, {len(comp['cudagraph_skips'])} CUDA-graph "
            f"skips, {comp['cudagraph_replays']} replays"
        )
    elif comp["fell_back_to_eager"]:
        compiled = f"{comp['mode']}: FELL BACK TO EAGER: {comp['reason']}"
    else:
        compiled = "off (eager)"
    norm = (
        "none"
        if inp["mean"] == [0.0, 0.0, 0.0] and inp["std"] == [1.0, 1.0, 1.0]
        else f"mean {_nums(inp['mean'])}, std {_nums(inp['std'])}"
    )
    lines = [
        ("model", f"{report['model']} ({report['source']}: {report['loaded']})"),
        ("kind", report["description"]),
        (
            "input",
            f"JPEG -> {_shape(inp['staging'])} uint8 ({inp['resize']}) -> "
            f"{_shape(inp['model_input'])} {report['dtype']}; normalisation {norm}",
        ),
        (
            "outputs",
            ", ".join(f"{o['name']} {_shape(o['shape'])} {o['dtype']}" for o in report["outputs"]),
        ),
        ("result", ", ".join(report["result_fields"])),
        ("sample", report["sample"]),
        ("compile", compiled),
        (
            "speed",
            f"{report['images_per_s']:,.1f} images/s ({report['ms_per_batch']:.2f} ms per batch "
            f"of {report['batch_size']}, batch on the device) on {report['device']}",
        ),
    ]
    return "\n".join(f"{k:<8}  {v}" for k, v in lines)


def _generated_batch(loaded: LoadedModel, batch: int) -> np.ndarray:
    """[B, S, S, 3] uint8: generated photo-like JPEGs of a few sizes, decoded into rows."""
    spec = DecodeSpec(size=loaded.resize_size, geometry=loaded.resize_mode)
    rows = np.zeros((batch, spec.size, spec.size, 3), dtype=np.uint8)
    sizes = ((640, 480), (480, 640), (1024, 768), (320, 320))
    for i in range(batch):
        w, h = sizes[i % len(sizes)]
        decode_into(synthetic_jpeg(w, h, seed=i), rows[i], spec)
    return rows


def _fields(answer: Answer) -> list[str]:
    pairs = answer.hash_fields()
    out = []
    for name, value in zip(pairs[::2], pairs[1::2], strict=True):
        text = name.decode() if isinstance(name, bytes) else name
        out.append(f"{text} ({len(value)} bytes)" if isinstance(value, bytes) else text)
    return out


def _sample(answer: Answer) -> str:
    if isinstance(answer, Classification):
        names = answer.names or [str(i) for i in answer.indices]
        top = ", ".join(f"{n} {s:.3f}" for n, s in zip(names[:3], answer.scores, strict=False))
        line = f"image 0: {top}"
        if answer.positive_names is not None:
            line += f"; labels at or above {answer.threshold}: {answer.positive_names[:5]}"
        return line
    if isinstance(answer, Embedding):
        vec = np.frombuffer(answer.vector, dtype=np.dtype(answer.dtype).newbyteorder("<"))
        norm = math.sqrt(float(np.square(vec.astype(np.float64)).sum()))
        return f"image 0: norm {norm:.4f}, first values {_nums(vec[:4].tolist())}"
    if isinstance(answer, RawOutput):
        return f"image 0: {len(answer.data)} bytes, shape {list(answer.shape)} {answer.dtype}"
    return "image 0: answered"


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _shape(dims: list[int]) -> str:
    return "[" + ", ".join(str(d) for d in dims) + "]"


def _nums(values: list[float]) -> str:
    return " ".join(f"{v:.3f}" for v in values)

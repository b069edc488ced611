"""One output row per job, and the Arrow schema of those rows.

The columns: id, source, status, error_code, error, model, weights, degraded,
duplicate_of; for a classifier label and score (the best class), labels, scores and top_k
(the top-k names, scores and indices; a multi-label model's labels above its threshold);
for an embedder the vector as a fixed-size list of its dtype (float16 or float32); for a
raw output its bytes, shape and dtype; and timings_ms, each stage's milliseconds.
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any

from producer import wire

if TYPE_CHECKING:
    import pyarrow as pa

Row = dict[str, Any]

SCALARS = ("id", "source", "status", "error_code", "error", "model", "weights")


def result_row(job_id: str, source: str, result: wire.JobResult) -> Row:
    d = result.details
    multi = "threshold" in d
    labels = result.labels if result.labels is not None else _strings(d.get("labels"))
    timings = d.get("timings_ms")
    row: Row = {
        "id": job_id,
        "source": source,
        "status": result.status,
        "error_code": result.error_code,
        "error": result.error,
        "model": result.model,
        "weights": result.weights,
        "degraded": result.degraded,
        "duplicate_of": result.duplicate_of,
        "label": result.label,
        "score": result.score,
        "labels": labels,
        "scores": _floats(d.get("label_scores" if multi else "scores")),
        "top_k": _ints(d.get("label_indices" if multi else "top_k")),
        "embedding": list(result.embedding) if result.embedding is not None else None,
        "dim": result.dim if result.embedding is not None else None,
        "output": result.output,
        "shape": list(result.shape) if result.shape is not None else None,
        "dtype": result.dtype,
        "timings_ms": (
            {str(k): float(v) for k, v in timings.items() if isinstance(v, int | float)}
            if isinstance(timings, dict)
            else None
        ),
    }
    return row


def error_row(job_id: str, source: str, code: wire.ErrorCode, message: str) -> Row:
    """A row for a job that never reached a worker (its file could not be read here)."""
    row: Row = dict.fromkeys(ROW_KEYS)
    row.update(
        id=job_id,
        source=source,
        status=wire.STATUS_ERROR,
        error_code=code.value,
        error=f"{code.value}: {message}",
        degraded=False,
    )
    return row


def json_row(row: Row) -> Row:
    """The row as JSON takes it: raw output bytes as base64, no `dim` (the list says it)."""
    out = {k: v for k, v in row.items() if k != "dim"}
    if isinstance(out.get("output"), bytes):
        out["output"] = base64.b64encode(out["output"]).decode()
    return out


def _strings(value: Any) -> list[str] | None:
    if isinstance(value, list) and all(isinstance(x, str) for x in value):
        return value
    return None


def _floats(value: Any) -> list[float] | None:
    if isinstance(value, list) and all(isinstance(x, int | float) for x in value):
        return [float(x) for x in value]
    return None


def _ints(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(x, int) for x in value):
        return value
    return None


ROW_KEYS = tuple(result_row("", "", wire.JobResult(id="", entry="", status="")).keys())


# ---------------------------------------------------------------------- Arrow
def base_fields() -> list[pa.Field[Any]]:
    import pyarrow as pa

    return [
        *(pa.field(name, pa.string()) for name in SCALARS),
        pa.field("degraded", pa.bool_()),
        pa.field("duplicate_of", pa.string()),
        pa.field("label", pa.string()),
        pa.field("score", pa.float64()),
        pa.field("labels", pa.list_(pa.string())),
        pa.field("scores", pa.list_(pa.float32())),
        pa.field("top_k", pa.list_(pa.int32())),
        pa.field("output", pa.binary()),
        pa.field("shape", pa.list_(pa.int32())),
        pa.field("dtype", pa.string()),
        pa.field("timings_ms", pa.map_(pa.string(), pa.float64())),
    ]


def embedding_type(rows: list[Row]) -> tuple[str, int] | None:
    """(dtype, dim) of the rows' embeddings, or None if no row has one."""
    for row in rows:
        if row["embedding"] is not None:
            return row["dtype"] or "float32", int(row["dim"])
    return None


def record_batch(rows: list[Row], embedding: tuple[str, int] | None) -> pa.RecordBatch:
    """`rows` as Arrow; with `embedding`, an `embedding` column of that dtype and size
    (rows with another size, or none, hold null there)."""
    import numpy as np
    import pyarrow as pa

    fields = base_fields()
    columns = [pa.array([row[f.name] for row in rows], type=f.type) for f in fields]
    if embedding is not None:
        dtype, dim = embedding
        np_type = np.float16 if dtype == "float16" else np.float32
        flat = np.zeros((len(rows), dim), dtype=np_type)
        valid = np.zeros(len(rows), dtype=bool)
        for i, row in enumerate(rows):
            vector = row["embedding"]
            if vector is not None and len(vector) == dim:
                flat[i] = vector
                valid[i] = True
        values = pa.array(flat.reshape(-1), type=pa.from_numpy_dtype(np.dtype(np_type)))
        vectors = pa.FixedSizeListArray.from_arrays(values, dim, mask=pa.array(~valid))
        fields.append(pa.field("embedding", vectors.type))
        columns.append(vectors)
    return pa.RecordBatch.from_arrays(columns, schema=pa.schema(fields))

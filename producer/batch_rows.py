"""The output's rows, built a row group at a time from the results' raw fields.

The columns: id, source, status, error_code, error, model, weights, degraded,
duplicate_of; for a classifier label and score (the best class), labels, scores and top_k
(the top-k names, scores and indices; a multi-label model's labels above its threshold);
for an embedder the vector as a fixed-size list of its dtype (float16 or float32); for a
raw output its bytes, shape and dtype; and timings_ms, each stage's milliseconds.

A result is kept as the fields its stream entry holds (bytes to bytes), and the columns are
made from a whole group of them at once: text columns go to Arrow as binary and are cast
to UTF-8 there, vectors are joined into one numpy array. A group Arrow will not take as it
is (a worker that broke the contract somewhere in it) is built again a row at a time, each
value checked, so one bad result costs its own fields, never the run.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import msgpack

from producer import wire

if TYPE_CHECKING:
    import pyarrow as pa

Fields = dict[bytes, bytes]
Row = dict[str, Any]

SCALARS = ("id", "source", "status", "error_code", "error", "model", "weights")
# The entry fields that hold text columns as they are.
_TEXT_FIELDS = {
    "id": wire.RES_ID,
    "status": wire.RES_STATUS,
    "error": wire.RES_ERROR,
    "model": wire.RES_MODEL,
    "weights": wire.RES_WEIGHTS,
    "duplicate_of": wire.RES_DUPLICATE_OF,
}
JSON_KEYS = (
    *SCALARS,
    "degraded",
    "duplicate_of",
    "label",
    "score",
    "labels",
    "scores",
    "top_k",
    "embedding",
    "output",
    "shape",
    "dtype",
    "timings_ms",
)


def error_fields(job_id: str, code: wire.ErrorCode, message: str) -> Fields:
    """The fields of an error result for a job that never reached a worker (its file could
    not be read here), as a worker would have written them."""
    return {
        wire.RES_ID: job_id.encode(),
        wire.RES_STATUS: wire.STATUS_ERROR.encode(),
        wire.RES_ERROR: f"{code.value}: {message}".encode(),
    }


class Rows:
    """Results (their raw fields), their sources and the manifest's kept columns (`keep`,
    one value each in `extras`), in arrival order."""

    def __init__(self, keep: tuple[str, ...] = ()) -> None:
        self.fields: list[Fields] = []
        self.sources: list[str] = []
        self.keep = keep
        self.extras: list[tuple[str | None, ...]] = []
        self._details: list[dict[str, Any]] | None = None

    def __len__(self) -> int:
        return len(self.fields)

    def add(self, fields: Fields, source: str, extra: tuple[str | None, ...] = ()) -> None:
        self.fields.append(fields)
        self.sources.append(source)
        if self.keep:
            self.extras.append(extra)
        self._details = None

    def changed(self) -> None:
        """Say that `fields` and `sources` were appended to directly."""
        self._details = None

    def details(self) -> list[dict[str, Any]]:
        """Each result's msgpack `result` map ({} where it has none or it is unreadable)."""
        if self._details is None:
            self._details = [_unpack(f.get(wire.RES_RESULT)) for f in self.fields]
        return self._details

    def embedding_type(self) -> tuple[str, int] | None:
        """(dtype, dim) of the first embedding among the rows, or None."""
        key = wire.RES_EMBEDDING
        if not any(key in f for f in self.fields) and not any(
            "embedding" in d for d in self.details()
        ):
            return None
        for f, d in zip(self.fields, self.details(), strict=True):
            if key in f or isinstance(d.get("embedding"), bytes):
                dtype = _text(f.get(wire.RES_DTYPE)) or _str(d.get("dtype")) or "float32"
                dim = _int(f.get(wire.RES_DIM)) or _int(d.get("dim"))
                vector = f.get(wire.RES_EMBEDDING) or d.get("embedding")
                if dim is None and isinstance(vector, bytes):
                    dim = len(vector) // (2 if dtype == "float16" else 4)
                if dim:
                    return dtype, dim
        return None

    def arrow(self, embedding: tuple[str, int] | None) -> pa.RecordBatch:
        """The rows as Arrow; with `embedding`, an `embedding` column of that dtype and
        size (rows with another size, or none, hold null there)."""
        import pyarrow as pa

        details = self.details()
        try:
            if any(d is _BROKEN for d in details):
                raise ValueError("a result map is not msgpack")
            batch = _batch(
                _columns(self.fields, self.sources, details), self.fields, details, embedding
            )
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            checked = [_checked(f, d) for f, d in zip(self.fields, details, strict=True)]
            details = [_unpack(c.get(wire.RES_RESULT)) for c in checked]
            batch = _batch(_columns(checked, self.sources, details), checked, details, embedding)
        if not self.keep:
            return batch
        # The kept manifest columns, as text, after the output's own.
        kept = [
            pa.array([e[i] if i < len(e) else None for e in self.extras], pa.string())
            for i in range(len(self.keep))
        ]
        schema = pa.schema([*batch.schema, *(pa.field(n, pa.string()) for n in self.keep)])
        return pa.RecordBatch.from_arrays([*batch.columns, *kept], schema=schema)


# The details of a result whose `result` field is not msgpack: its row is made the slow way.
_BROKEN: dict[str, Any] = {}


def _unpack(raw: bytes | None) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        # Tuples for arrays: cheaper to make, and Arrow takes them as lists.
        value = msgpack.unpackb(raw, raw=False, use_list=False)
    except (ValueError, msgpack.UnpackException):
        return _BROKEN
    return value if isinstance(value, dict) else {}


def _text(value: Any) -> str | None:
    return value.decode("utf-8", "backslashreplace") if isinstance(value, bytes) else None


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _int(value: Any) -> int | None:
    if isinstance(value, bytes):
        return int(value) if value.isdigit() else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _columns(
    fields: list[Fields], sources: list[str], details: list[dict[str, Any]]
) -> dict[str, Any]:
    """The columns as Python lists (text as bytes), the whole group a column at a time. A
    key that no row of the group has (most results lack error, output, shape...) is a
    column of nulls without a look at each row."""
    n = len(fields)
    present: set[bytes] = set().union(*fields)
    in_details: set[str] = set().union(*details)
    none: list[Any] = [None] * n

    def column(key: bytes) -> list[Any]:
        return [f.get(key) or None for f in fields] if key in present else none

    def detail(key: str) -> list[Any]:
        return [d.get(key) for d in details] if key in in_details else none

    cols: dict[str, Any] = {name: column(key) for name, key in _TEXT_FIELDS.items()}
    cols["source"] = sources
    cols["error_code"] = (
        [e.split(b":", 1)[0] if e else None for e in cols["error"]]
        if wire.RES_ERROR in present
        else none
    )
    cols["degraded"] = (
        [f.get(wire.RES_DEGRADED) == b"1" for f in fields]
        if wire.RES_DEGRADED in present
        else [False] * n
    )
    cols["label"] = column(wire.RES_LABEL)
    cols["score"] = column(wire.RES_SCORE)
    labels = detail("labels")
    if wire.RES_LABELS in present and None in labels:
        # A multi-label model's labels may be a field of their own.
        labels = list(labels)
        for i, f in enumerate(fields):
            if labels[i] is None and wire.RES_LABELS in f:
                labels[i] = json.loads(f[wire.RES_LABELS])
    cols["labels"] = labels
    if "threshold" in in_details:
        cols["scores"] = [d.get("label_scores" if "threshold" in d else "scores") for d in details]
        cols["top_k"] = [d.get("label_indices" if "threshold" in d else "top_k") for d in details]
    else:
        cols["scores"] = detail("scores")
        cols["top_k"] = detail("top_k")
    if wire.RES_OUTPUT in present or "output" in in_details:
        both = list(zip(fields, details, strict=True))
        cols["output"] = [f.get(wire.RES_OUTPUT) or d.get("output") for f, d in both]
    else:
        cols["output"] = none
    if wire.RES_SHAPE in present or "shape" in in_details:
        cols["shape"] = [
            json.loads(f[wire.RES_SHAPE]) if f.get(wire.RES_SHAPE) else d.get("shape")
            for f, d in zip(fields, details, strict=True)
        ]
    else:
        cols["shape"] = none
    if wire.RES_DTYPE in present or "dtype" in in_details:
        cols["dtype"] = [
            f.get(wire.RES_DTYPE) or d.get("dtype") for f, d in zip(fields, details, strict=True)
        ]
    else:
        cols["dtype"] = none
    cols["timings_ms"] = detail("timings_ms")
    return cols


def output_columns() -> list[str]:
    """Every column an output can have (but kept manifest columns)."""
    return [f.name for f in base_fields()] + ["embedding"]


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


_FROM_WIRE = frozenset({*_TEXT_FIELDS, "error_code", "label", "dtype"})


def _array(name: str, values: list[Any], kind: pa.DataType) -> pa.Array[Any]:
    import pyarrow as pa

    if kind == pa.string() and name in _FROM_WIRE:
        # Bytes from the wire (the dtype of some rows a str of their `result` map): checked
        # as UTF-8 by Arrow, in one pass.
        if name == "dtype":
            values = [v.encode() if isinstance(v, str) else v for v in values]
        return pa.array(values, pa.binary()).cast(kind)
    if name == "score":
        return pa.array(values, pa.binary()).cast(pa.string()).cast(kind)
    return pa.array(values, type=kind)


def _batch(
    cols: dict[str, Any],
    fields: list[Fields],
    details: list[dict[str, Any]],
    embedding: tuple[str, int] | None,
) -> pa.RecordBatch:
    import numpy as np
    import pyarrow as pa

    schema = base_fields()
    arrays = [_array(f.name, cols[f.name], f.type) for f in schema]
    if embedding is not None:
        dtype, dim = embedding
        np_type = np.dtype("<f2" if dtype == "float16" else "<f4")
        n = len(fields)
        flat = np.zeros((n, dim), dtype=np_type)
        valid = np.zeros(n, dtype=bool)
        for i, (f, d) in enumerate(zip(fields, details, strict=True)):
            vector = f.get(wire.RES_EMBEDDING) or d.get("embedding")
            kind = f.get(wire.RES_DTYPE) or d.get("dtype") or b"float32"
            kind = kind.decode() if isinstance(kind, bytes) else kind
            size = dim * np_type.itemsize
            if isinstance(vector, bytes) and kind == dtype and len(vector) == size:
                flat[i] = np.frombuffer(vector, dtype=np_type)
                valid[i] = True
        values = pa.array(flat.reshape(-1), type=pa.from_numpy_dtype(np_type.newbyteorder("=")))
        vectors = pa.FixedSizeListArray.from_arrays(values, dim, mask=pa.array(~valid))
        schema.append(pa.field("embedding", vectors.type))
        arrays.append(vectors)
    return pa.RecordBatch.from_arrays(arrays, schema=pa.schema(schema))


def _checked(f: Fields, d: dict[str, Any]) -> Fields:
    """A result's fields with every value checked: what breaks the contract is left out
    (and said in `error` for an ok result whose classify fields are unreadable)."""
    result = _parsed(f)
    out: Fields = {}
    for key in (wire.RES_ID, wire.RES_STATUS, wire.RES_ERROR, wire.RES_MODEL, wire.RES_WEIGHTS):
        text = _text(f.get(key))
        if text:
            out[key] = text.encode()
    if f.get(wire.RES_DEGRADED) == b"1":
        out[wire.RES_DEGRADED] = b"1"
    if result is None:
        out[wire.RES_STATUS] = wire.STATUS_ERROR.encode()
        code = wire.ErrorCode.INTERNAL_ERROR.value
        out[wire.RES_ERROR] = f"{code}: the result does not follow the wire contract".encode()
        return out
    if result.duplicate_of:
        out[wire.RES_DUPLICATE_OF] = result.duplicate_of.encode()
    if result.label:
        out[wire.RES_LABEL] = result.label.encode()
    if result.score is not None:
        out[wire.RES_SCORE] = repr(result.score).encode()
    details: dict[str, Any] = {}
    multi = "threshold" in result.details
    labels = result.labels if result.labels is not None else _strings(d.get("labels"))
    if labels is not None:
        details["labels"] = labels
    if (scores := _floats(d.get("label_scores" if multi else "scores"))) is not None:
        details["scores"] = scores
    if (top := _ints(d.get("label_indices" if multi else "top_k"))) is not None:
        details["top_k"] = top
    timings = d.get("timings_ms")
    if isinstance(timings, dict):
        details["timings_ms"] = {
            str(k): float(v)
            for k, v in timings.items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
    if result.embedding is not None and result.dim:
        out[wire.RES_EMBEDDING] = result.embedding.tobytes()
        out[wire.RES_DIM] = str(result.dim).encode()
        out[wire.RES_DTYPE] = b"float32"
    elif result.output is not None:
        out[wire.RES_OUTPUT] = result.output
        if result.dtype:
            out[wire.RES_DTYPE] = result.dtype.encode()
        if result.shape is not None:
            out[wire.RES_SHAPE] = json.dumps(list(result.shape)).encode()
    out[wire.RES_RESULT] = msgpack.packb(details)
    return out


def _parsed(f: Fields) -> wire.JobResult | None:
    try:
        return wire.JobResult.from_fields(cast(Mapping[bytes | str, bytes], f))
    except (ValueError, TypeError, UnicodeDecodeError):
        return None


def _strings(value: Any) -> list[str] | None:
    if isinstance(value, list | tuple) and all(isinstance(x, str) for x in value):
        return list(value)
    return None


def _floats(value: Any) -> list[float] | None:
    if isinstance(value, list | tuple) and all(
        isinstance(x, int | float) and not isinstance(x, bool) for x in value
    ):
        return [float(x) for x in value]
    return None


def _ints(value: Any) -> list[int] | None:
    if isinstance(value, list | tuple) and all(
        isinstance(x, int) and not isinstance(x, bool) and -(2**31) <= x < 2**31 for x in value
    ):
        return list(value)
    return None


# ---------------------------------------------------------------------- JSON lines
def json_rows(batch: pa.RecordBatch) -> list[Row]:
    """The rows of `batch` as JSON takes them: every column named in JSON_KEYS (null where
    the batch has none), the timings as an object, raw output bytes as base64."""
    names = set(batch.schema.names)
    columns = {k: batch.column(k).to_pylist() if k in names else None for k in JSON_KEYS}
    # Kept manifest columns (--keep-columns): every column that is not the output's own.
    own = {*JSON_KEYS, "embedding"}
    columns.update({k: batch.column(k).to_pylist() for k in batch.schema.names if k not in own})
    rows: list[Row] = []
    for i in range(batch.num_rows):
        row = {k: (v[i] if v is not None else None) for k, v in columns.items()}
        if row["timings_ms"] is not None:
            row["timings_ms"] = dict(row["timings_ms"])
        if isinstance(row["output"], bytes):
            row["output"] = base64.b64encode(row["output"]).decode()
        rows.append(row)
    return rows

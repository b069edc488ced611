"""Rows built column-wise from results' raw fields: the same values a parsed result gives,
and a result that breaks the wire contract costs its own row's fields, never the group."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from producer import wire
from producer.batch_rows import Rows, error_fields, json_rows

pa = pytest.importorskip("pyarrow")


def classify(job_id: str, **extra: bytes) -> dict[bytes, bytes]:
    details = {
        "timings_ms": {"decode": 1.5, "total": 4},
        "top_k": [3, 1],
        "scores": [0.75, 0.25],
        "labels": ["cat", "dog"],
    }
    fields = {
        wire.RES_ID: job_id.encode(),
        wire.RES_ENTRY: b"1-0",
        wire.RES_STATUS: b"ok",
        wire.RES_MODEL: b"null",
        wire.RES_WEIGHTS: b"none",
        wire.RES_LABEL: b"cat",
        wire.RES_SCORE: b"0.75",
        wire.RES_RESULT: msgpack.packb(details),
    }
    fields.update({k.encode(): v for k, v in extra.items()})
    return fields


def test_a_group_of_results_becomes_the_columns_a_parsed_result_gives() -> None:
    rows = Rows()
    rows.add(classify("a"), "/images/a.jpg")
    rows.add(error_fields("b", wire.ErrorCode.PATH_NOT_FOUND, "gone"), "/images/b.jpg")
    out = rows.arrow(rows.embedding_type()).to_pylist()
    assert out[0]["id"] == "a" and out[0]["source"] == "/images/a.jpg"
    assert (out[0]["label"], out[0]["score"], out[0]["labels"]) == ("cat", 0.75, ["cat", "dog"])
    assert out[0]["top_k"] == [3, 1] and dict(out[0]["timings_ms"]) == {"decode": 1.5, "total": 4}
    assert out[0]["error_code"] is None and out[0]["degraded"] is False
    assert (out[1]["status"], out[1]["error_code"]) == ("error", "path_not_found")
    assert out[1]["error"] == "path_not_found: gone"
    as_json = json_rows(rows.arrow(None))
    assert as_json[0]["timings_ms"] == {"decode": 1.5, "total": 4.0}
    assert "embedding" in as_json[0] and as_json[0]["embedding"] is None


def test_a_result_that_breaks_the_contract_is_an_error_row_and_the_others_stand() -> None:
    rows = Rows()
    rows.add(classify("good"), "g")
    rows.add(classify("bad-score", score=b"many"), "s")
    rows.add(classify("bad-map", result=b"\xc1\xc1 not msgpack"), "m")
    rows.add(classify("bad-text", model=b"\xff\xfe"), "t")
    out = {r["id"]: r for r in rows.arrow(None).to_pylist()}
    assert set(out) == {"good", "bad-score", "bad-map", "bad-text"}
    assert out["good"]["labels"] == ["cat", "dog"] and out["good"]["score"] == 0.75
    assert out["bad-score"]["status"] == "error"
    assert out["bad-score"]["error_code"] == "internal_error"
    assert out["bad-map"]["error_code"] == "internal_error"
    assert out["bad-text"]["model"] == "\\xff\\xfe"  # shown, not fatal


values = st.one_of(st.binary(max_size=12), st.sampled_from([b"ok", b"error", b"1", b"0.5", b""]))
keys = st.sampled_from(
    [
        wire.RES_STATUS, wire.RES_ERROR, wire.RES_LABEL, wire.RES_SCORE, wire.RES_RESULT,
        wire.RES_LABELS, wire.RES_EMBEDDING, wire.RES_DIM, wire.RES_DTYPE, wire.RES_OUTPUT,
        wire.RES_SHAPE, wire.RES_DEGRADED, wire.RES_DUPLICATE_OF, wire.RES_MODEL,
    ]
)  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(st.lists(st.dictionaries(keys, values, max_size=8), min_size=1, max_size=6))
def test_any_fields_a_worker_sends_give_one_row_each(results: list[dict[bytes, bytes]]) -> None:
    rows = Rows()
    for n, fields in enumerate(results):
        rows.add({**fields, wire.RES_ID: f"id-{n}".encode()}, f"src-{n}")
    batch = rows.arrow(rows.embedding_type())
    assert batch.column("id").to_pylist() == [f"id-{n}" for n in range(len(results))]
    assert batch.column("source").to_pylist() == [f"src-{n}" for n in range(len(results))]
    json_rows(batch)

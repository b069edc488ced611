"""docs/reference/error-codes.md and result-fields.md, from producer/wire.py (the names) and
producer/wire_help.py (what each means)."""

from __future__ import annotations

from producer import wire, wire_help
from producer.wire import ErrorCode
from worker.config.table import relink
from worker.docs_gen.markdown import notice
from worker.tools.markdown import table


def render_error_codes() -> str:
    missing = [code.value for code in ErrorCode if code not in wire_help.ERROR_CODES]
    if missing:
        raise ValueError(f"producer/wire_help.py ERROR_CODES lacks {', '.join(missing)}")
    rows = [[f"`{code.value}`", relink(wire_help.ERROR_CODES[code], "../")] for code in ErrorCode]
    return (
        notice("producer/wire.py and producer/wire_help.py")
        + "# Error codes\n\n"
        + "An `error` result's `error` field is `code: message`; its `result` map carries the "
        + "code alone as `error_code`. A bad job fails alone: its batch-mates are answered "
        + "normally.\n\n"
        + table(["code", "when"], rows)
        + "\n"
    )


def result_field_names() -> set[bytes]:
    """Every result field producer/wire.py names (its RES_* constants)."""
    return {v for k, v in vars(wire).items() if k.startswith("RES_") and isinstance(v, bytes)}


def render_result_fields() -> str:
    listed = {name for names, _ in wire_help.RESULT_FIELDS for name in names}
    missing = sorted(n.decode() for n in result_field_names() - listed)
    if missing:
        raise ValueError(f"producer/wire_help.py RESULT_FIELDS lacks {', '.join(missing)}")
    rows = [
        [
            ", ".join(f"`{n.decode()}`" for n in names),
            relink(meaning, "../"),
        ]
        for names, meaning in wire_help.RESULT_FIELDS
    ]
    return (
        notice("producer/wire.py and producer/wire_help.py")
        + "# Result fields\n\n"
        + "Every job entry ends with exactly one result, `ok` or `error`: an entry added to "
        + "the job's `reply_to` stream (default `gpufeed:results`) and the hash "
        + "`gpufeed:result:<id>` (expires after `GPUFEED_RESULT_TTL_S`), both with these "
        + "fields. Which fields an `ok` result has depends on the model's output kind. "
        + "Values are bytes; binary ones (`embedding`, `output`, `result`) are best read "
        + "with a client library.\n\n"
        + table(["field", "meaning"], rows)
        + "\n"
    )

"""What each error code and each result field means: the one source of the site's reference
pages (docs/reference/error-codes.md and result-fields.md, written by
`python -m worker.docs_gen`). A new code in `wire.ErrorCode` or a new `wire.RES_*` field
gets its entry here; tests/project/test_docs.py checks that none is missing.

Meanings are Markdown; links name the site's pages relative to docs/ (`priorities.md`).
"""

from __future__ import annotations

from producer import wire
from producer.wire import ErrorCode

# When a result carries each code, in the order of `ErrorCode`.
ERROR_CODES: dict[ErrorCode, str] = {
    ErrorCode.INVALID_JOB: (
        "not exactly one of `image`, `path` and `url`; an empty `path`, `url`, `id` or "
        "`reply_to`; an `s3://` URL without bucket or key, or whose key has `.` or `..` "
        "folders; a `url` over 8 KiB; text fields that are not UTF-8; a `reply_to` that "
        "cannot receive results, or over 1 KiB (the message says why; the answer goes to "
        "the default results stream); a `meta` over the worker's `GPUFEED_MAX_META_BYTES`, "
        "or one that makes the result larger than its `GPUFEED_MAX_RESULT_BYTES` (the "
        "answer names the limit and carries no meta)"
    ),
    ErrorCode.ID_TOO_LONG: (
        "`id` over 128 bytes (the result is stored under the entry ID instead)"
    ),
    ErrorCode.EMPTY_IMAGE: ("the `image` field is empty"),
    ErrorCode.PAYLOAD_TOO_LARGE: (
        "the encoded image (the `path` file, the body at the `url`) is over "
        "`GPUFEED_MAX_IMAGE_BYTES`; a download stops at the limit"
    ),
    ErrorCode.UNSUPPORTED_FORMAT: ("the bytes are not a JPEG, PNG, WebP, BMP or GIF image"),
    ErrorCode.IMAGE_TOO_LARGE: (
        "the header announces more than `GPUFEED_MAX_IMAGE_PIXELS` pixels, or pixels that "
        "would take more than `GPUFEED_MAX_DECODE_MB` to decode (at the JPEG DCT scale that "
        "would be used; a progressive JPEG also holds every coefficient of the whole image "
        "at full size), a JPEG of more than 100 scans, or an RLE-compressed BMP over "
        "1,000,000 pixels (Pillow decodes RLE in pure Python, about 0.3 s a million pixels); "
        "all refused from the header, before any pixel is decoded, so a decompression bomb "
        "costs nothing"
    ),
    ErrorCode.DECODE_ERROR: (
        "truncated or corrupt image data, zero-sized images; a JPEG whose scan data ends "
        "before the image does (cut short but closed with an end-of-image marker, or "
        "damaged, e.g. zero-filled, until the decoder runs out), which Pillow would fill "
        "with grey"
    ),
    ErrorCode.DECODE_TIMEOUT: (
        "decoding the image took longer than the decode budget (10 s); the batch went on without it"
    ),
    ErrorCode.PATH_DISABLED: (
        "a `path` job, but the worker was started without `GPUFEED_PATH_ROOT`"
    ),
    ErrorCode.FORBIDDEN_PATH: ("`path` resolves outside `GPUFEED_PATH_ROOT`"),
    ErrorCode.PATH_NOT_FOUND: ("no readable regular file at `path`"),
    ErrorCode.FORBIDDEN_URL: (
        "the `url` (or a redirect) leads to an address the worker may not fetch from: "
        "loopback, private, link-local (cloud metadata at 169.254.169.254), multicast, "
        "reserved or unspecified, unless `GPUFEED_URL_ALLOW` allows it; a host or network in "
        "`GPUFEED_URL_DENY`; a scheme other than http, https, s3, gs, az"
    ),
    ErrorCode.FETCH_FAILED: (
        "the `url` answered with an HTTP error (the message has the status; 4xx are not "
        "retried, 5xx are, twice), its host does not resolve, the "
        "connection failed, too many redirects, an allowed store key that is not there or "
        "not readable with the worker's credentials (one message for both), or its host has "
        "answered nothing for the read timeout (15 s) while 64 of its jobs wait (`host "
        "busy`: send it again later)"
    ),
    ErrorCode.FETCH_TIMEOUT: (
        "the `url` did not answer within the connect or read timeout, after the retries, or "
        "its fetch took longer than 60 s in all"
    ),
    ErrorCode.OBJECT_NOT_ALLOWED: (
        "an `s3://`, `gs://` or `az://` key that `GPUFEED_OBJECT_ALLOW` does not name for "
        "the job's `reply_to` stream; refused before any request, so it says nothing of "
        "whether the object exists"
    ),
    ErrorCode.INFERENCE_ERROR: ("the model failed on the batch holding this job"),
    ErrorCode.DEAD_LETTER: (
        "the job was delivered `GPUFEED_MAX_DELIVERIES` times without a result (it kept "
        "killing or stalling its workers); its entry is copied to `gpufeed:dead`"
    ),
    ErrorCode.ENTRY_DELETED: ("the job's stream entry was deleted while it was pending"),
    ErrorCode.DEADLINE_EXCEEDED: (
        "the job's `deadline_ms` passed before it could run (checked when it is read and "
        "just before its batch runs); it was not decoded, or not computed"
    ),
    ErrorCode.INTERNAL_ERROR: (
        "a worker bug, or a result the worker cannot store: the model's answer over "
        "`GPUFEED_MAX_RESULT_BYTES`, or a result Redis refused; the message says what happened"
    ),
}

# The fields of a result (its stream entry and its hash), those that go together on one row.
RESULT_FIELDS: tuple[tuple[tuple[bytes, ...], str], ...] = (
    (
        (wire.RES_ID, wire.RES_ENTRY),
        "the job id and the job's stream entry ID (`<level>:<entry ID>` on a priority "
        "level's stream: see [Priorities](priorities.md))",
    ),
    (
        (wire.RES_STATUS,),
        "`ok` or `error`",
    ),
    (
        (wire.RES_MODEL, wire.RES_WEIGHTS),
        "what served it: the model name and its weights (a torchvision weights name, a file "
        "path, or `none`)",
    ),
    (
        (wire.RES_DEGRADED,),
        "(only from a worker that was degrading under a backlog) `1`: the batch ran on the "
        "worker's cheaper degraded step, which `model` (and `weights`) then name; see "
        "[Degrade under backlog](priorities.md)",
    ),
    (
        (wire.RES_DUPLICATE_OF,),
        "(only on a duplicate) the entry ID whose result the job's `id` already had; see "
        "[idempotent ids](guarantees.md)",
    ),
    (
        (wire.RES_TOP1, wire.RES_LABEL, wire.RES_SCORE),
        "(ok, classify) the top class index, its name when the model has class names, its "
        "score as a decimal string (a probability, or the raw output with `activation = "
        '"none"`)',
    ),
    (
        (wire.RES_LABELS,),
        '(ok, classify with `activation = "sigmoid"`: multi-label) a JSON array of the class '
        "names at or above the model's threshold, best first (indices as text where the "
        'model has no names), e.g. `["beach", "sky"]`; `[]` when none is',
    ),
    (
        (wire.RES_EMBEDDING, wire.RES_DIM, wire.RES_DTYPE),
        "(ok, embed) the vector as raw little-endian bytes of `dtype` (`float16` or "
        "`float32`), its length, and that dtype",
    ),
    (
        (wire.RES_OUTPUT, wire.RES_SHAPE, wire.RES_DTYPE),
        "(ok, raw) the model's whole output for the image as raw little-endian bytes of "
        "`dtype`, its shape without the batch as a JSON array (e.g. `[17,64,48]`), and that "
        "dtype",
    ),
    (
        (wire.RES_ERROR,),
        "(error) `code: message`, e.g. `decode_error: image file is truncated`",
    ),
    (
        (wire.RES_RESULT,),
        "a msgpack map: `model`, `degraded` (`true`, only when it is), `worker`, `device`, "
        "`format`, `width`, `height`, `draft_scale` (the JPEG DCT scale used), `cached` "
        "(decoded before for a job answered on the same reply stream: taken from the decode "
        "cache), `timings_ms` (per stage: `redis_wait` (in the stream before a worker read "
        "it), `fetch` for `url` jobs, `queue`, `decode`, `batch_wait`, `compute`, `total`), "
        "for errors `error_code`, and what the model answered: classify: `top_k` (indices), "
        "`scores`, `labels` (the top-k names, when known); multi-label: `top_k`, `scores`, "
        "`labels` (the names at or above the threshold, as in the hash), `label_indices`, "
        "`label_scores`, `threshold`; embed: `embedding` (binary), `dim`, `dtype`; raw: "
        "`output` (binary), `shape`, `dtype`",
    ),
    (
        (wire.RES_META,),
        "the job's `meta`, unchanged",
    ),
)

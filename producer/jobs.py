"""Jobs as `submit_many` takes them, and ids for jobs made from image files."""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from redis.typing import EncodableT, FieldT

from producer import wire
from producer.job_fields import (
    DEADLINE_PROBLEM,
    SOURCES,
    Problem,
    deadline_in_range,
    field_problem,
    sources_problem,
)

# The file names taken as images from a folder: the formats the workers decode
# (worker/decode/cpu.py); anything else would only come back `unsupported_format`.
IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif"})

# Query parameters that sign or authorise a URL rather than name an image: a presigned
# URL's signature must not become an id (a result key, a row of an output), and a URL
# presigned again (a new expiry, a new signature) names the same image, so it keeps its id.
# S3 and GCS (V4: x-amz-*, x-goog-*; V2), CloudFront, and common token parameters.
_SIGNING_PARAMS = frozenset(
    {
        "signature",
        "expires",
        "awsaccesskeyid",
        "googleaccessid",
        "key-pair-id",
        "policy",
        "token",
        "access_token",
        "__token__",
    }
)
_SIGNING_PREFIXES = ("x-amz-", "x-goog-")
# An Azure shared access signature: recognised by its `sig`, and then all of its parameters
# go (its start, expiry and permissions change when it is issued again).
_AZURE_SAS_PARAMS = frozenset(
    {"sig", "sv", "ss", "srt", "sp", "se", "st", "spr", "si", "sr", "sdd", "ses", "skoid",
     "sktid", "skt", "ske", "sks", "skv", "saoid", "suoid", "scid"}
)  # fmt: skip


@dataclass(frozen=True)
class Job:
    """One job for `submit_many`: exactly one of `image` (encoded bytes), `path` (a file
    under the worker's root) or `url` (http://, https://, s3://, gs:// or az://)."""

    image: bytes | None = None
    path: str | None = None
    id: str | None = None
    meta: bytes | None = None
    reply_to: str | None = None
    url: str | None = None
    # Unix time in milliseconds after which the worker answers `deadline_exceeded` instead
    # of running the job (e.g. `int(time.time() * 1000) + 2000` for two seconds from now).
    deadline_ms: int | None = None

    @classmethod
    def from_file(
        cls,
        file: str | os.PathLike[str],
        *,
        id: str | None = None,
        meta: bytes | None = None,
        reply_to: str | None = None,
    ) -> Job:
        """Read `file` into an image job; the id defaults to the file's name."""
        p = Path(file)
        return cls(
            image=p.read_bytes(), id=p.name if id is None else id, meta=meta, reply_to=reply_to
        )

    def fields(self) -> dict[FieldT, EncodableT]:
        """The stream entry fields, only those that are set; ValueError if the job is one
        the workers would refuse, with the words they would answer it with: the rules and
        their order are the workers' (producer/job_fields.py holds them for both sides)."""
        texts = {"path": self.path, "url": self.url, "id": self.id, "reply_to": self.reply_to}
        encoded = {n: v.encode() for n, v in texts.items() if v is not None}
        for name in ("id", "reply_to"):
            if name in encoded:
                _refuse(field_problem(name, encoded[name]))
        if self.deadline_ms is not None and (
            not isinstance(self.deadline_ms, int) or deadline_in_range(self.deadline_ms) is None
        ):
            raise ValueError(DEADLINE_PROBLEM[1])
        given = [n for n in SOURCES if getattr(self, n) is not None]
        _refuse(sources_problem(given))
        for name in ("image", "meta"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (bytes, bytearray, memoryview)):
                raise ValueError(f"{name} must be bytes, not {type(value).__name__}")
        (source,) = given
        value = encoded.get(source, self.image)
        assert value is not None  # one source is given: sources_problem said so
        _refuse(field_problem(source, value))
        if self.url is not None and "://" not in self.url:
            raise ValueError(f"url needs a scheme (http://, https://, s3://...): {self.url!r}")
        out: dict[FieldT, EncodableT] = {}
        if self.image is not None:
            out[wire.JOB_IMAGE] = self.image
        for name, field in (
            ("path", wire.JOB_PATH),
            ("url", wire.JOB_URL),
            ("id", wire.JOB_ID),
            ("reply_to", wire.JOB_REPLY_TO),
        ):
            if name in encoded:
                out[field] = encoded[name]
        if self.meta is not None:
            out[wire.JOB_META] = self.meta
        if self.deadline_ms is not None:
            out[wire.JOB_DEADLINE_MS] = str(self.deadline_ms).encode()
        return out


def _refuse(problem: Problem | None) -> None:
    if problem is not None:
        raise ValueError(problem[1])


def file_job_ids(files: Sequence[str | os.PathLike[str]], *, id_prefix: str = "") -> list[str]:
    """Ids for jobs made from `files`: the file name, or the path relative to the files'
    common folder where names repeat, so that every id is unique and fits the limit."""
    paths = [Path(f).absolute() for f in files]
    names = [p.name for p in paths]
    counts = Counter(names)
    root = Path(os.path.commonpath([p.parent for p in paths])) if paths else Path()
    seen: dict[str, int] = {}
    ids: list[str] = []
    for p, name in zip(paths, names, strict=True):
        base = p.relative_to(root).as_posix() if counts[name] > 1 else name
        nth = seen[base] = seen.get(base, 0) + 1
        # The same file given twice is two jobs; each needs its own id.
        ids.append(_fit_id(id_prefix + (base if nth == 1 else f"{base}#{nth}")))
    return ids


def url_id(url: str) -> str:
    """The id of a job made from `url`, the one rule `producer submit --urls` and
    `producer batch` share: the URL without its fragment and without the query parameters
    that sign it (`_SIGNING_PARAMS`), so `.../get?id=1` and `.../get?id=2` are two ids
    while one image presigned twice is one; fit to MAX_ID_BYTES."""
    return _fit_id(_url_base(url))


def _url_base(url: str) -> str:
    base, _, _ = url.partition("#")
    return _unsigned(base) if "?" in base else base


def _unsigned(url: str) -> str:
    head, _, query = url.partition("?")
    params = [p for p in query.split("&") if p]
    names = [p.partition("=")[0].lower() for p in params]
    sas = "sig" in names
    kept = [
        p
        for p, name in zip(params, names, strict=True)
        if name not in _SIGNING_PARAMS
        and not name.startswith(_SIGNING_PREFIXES)
        and not (sas and name in _AZURE_SAS_PARAMS)
    ]
    return f"{head}?{'&'.join(kept)}" if kept else head


def url_job_ids(urls: Sequence[str], *, id_prefix: str = "") -> list[str]:
    """Ids for jobs made from `urls`: each `url_id`, made unique (a URL given twice is two
    jobs here: `#2` is added to the second) and fit to the limit."""
    seen: dict[str, int] = {}
    ids: list[str] = []
    for url in urls:
        base = _url_base(url)
        nth = seen[base] = seen.get(base, 0) + 1
        ids.append(_fit_id(id_prefix + (base if nth == 1 else f"{base}#{nth}")))
    return ids


def read_url_list(lines: Iterable[str]) -> list[str]:
    """URLs, one a line; blank lines and lines starting with `#` are skipped."""
    return [u for u in (line.strip() for line in lines) if u and not u.startswith("#")]


def _fit_id(job_id: str) -> str:
    if len(job_id.encode()) <= wire.MAX_ID_BYTES:
        return job_id
    # Keep the informative tail (file name) and a digest of the whole, so ids stay unique.
    digest = hashlib.sha1(job_id.encode()).hexdigest()[:16]
    tail = job_id.encode()[-(wire.MAX_ID_BYTES - len(digest) - 1) :].decode("utf-8", "ignore")
    return f"{digest}~{tail}"


def jobs_from_files(
    files: Sequence[str | os.PathLike[str]],
    *,
    id_prefix: str = "",
    meta: bytes | None = None,
    reply_to: str | None = None,
) -> Iterator[Job]:
    """Image jobs for `files`, read lazily one by one, with ids from `file_job_ids`."""
    for file, job_id in zip(files, file_job_ids(files, id_prefix=id_prefix), strict=True):
        yield Job.from_file(file, id=job_id, meta=meta, reply_to=reply_to)

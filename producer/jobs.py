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
        """The stream entry fields, only those that are set; ValueError if the job is invalid."""
        given = [n for n in ("image", "path", "url") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(
                "a job needs exactly one of image (bytes), path or url"
                + (f", not {' and '.join(given)}" if given else "")
            )
        out: dict[FieldT, EncodableT] = {}
        if self.image is not None:
            if not isinstance(self.image, (bytes, bytearray, memoryview)):
                raise ValueError(f"image must be bytes, not {type(self.image).__name__}")
            if len(self.image) == 0:
                raise ValueError("image is empty")
            out[wire.JOB_IMAGE] = self.image
        if self.path is not None:
            if not self.path:
                raise ValueError("path is empty")
            out[wire.JOB_PATH] = self.path.encode()
        if self.url is not None:
            if not self.url.strip():
                raise ValueError("url is empty")
            if "://" not in self.url:
                raise ValueError(f"url needs a scheme (http://, https://, s3://...): {self.url!r}")
            out[wire.JOB_URL] = self.url.encode()
        if self.id is not None:
            _check_id(self.id)
            out[wire.JOB_ID] = self.id.encode()
        if self.reply_to is not None:
            if not self.reply_to:
                raise ValueError("reply_to is empty")
            out[wire.JOB_REPLY_TO] = self.reply_to.encode()
        if self.meta is not None:
            if not isinstance(self.meta, (bytes, bytearray, memoryview)):
                raise ValueError(f"meta must be bytes, not {type(self.meta).__name__}")
            out[wire.JOB_META] = self.meta
        if self.deadline_ms is not None:
            if not isinstance(self.deadline_ms, int) or not 10**12 <= self.deadline_ms < 10**14:
                raise ValueError("deadline_ms must be a Unix time in milliseconds (an int)")
            out[wire.JOB_DEADLINE_MS] = str(self.deadline_ms).encode()
        return out


def _check_id(job_id: str) -> None:
    if not job_id:
        raise ValueError("id is empty; leave it out to use the stream entry ID")
    size = len(job_id.encode())
    if size > wire.MAX_ID_BYTES:
        raise ValueError(
            f"id is {size} bytes, over the limit of {wire.MAX_ID_BYTES}: {job_id[:40]}..."
        )


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

"""What `producer batch` reads its jobs from: a folder, a manifest or an object-store prefix.

Each source yields `Item`s page by page, never the whole list at once, so a manifest of
tens of millions of lines or a bucket of as many keys is read as the run goes. Every item
carries a stable id, the same on every run over the same source: the manifest's `id`
column, else the path or key relative to the source (a URL without its query), so that a
re-run skips what is done and the workers' duplicate handling applies.
"""

from __future__ import annotations

import csv
import json
import operator
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import urlsplit

from producer import wire
from producer.jobs import _fit_id
from producer.object_stores import open_store

if TYPE_CHECKING:
    pass

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"})
STORE_SCHEMES = ("s3", "gs", "az")
# Keys per listing request: S3's own page size (the most one ListObjectsV2 call returns).
LIST_PAGE = 1000
# Manifest rows read at once (Parquet record batches, lines of text).
READ_PAGE = 4096


class SourceError(ValueError):
    """The source cannot be read as given: the message names it and what is wrong."""


def read_file(file: str, buffer: bytearray | None = None) -> bytes:
    """The bytes of `file`, with the fewest system calls: a Python file object would cost
    more than the read itself for a small image. With `buffer`, a file that fits is read
    into it in one call (no fstat)."""
    fd = os.open(file, os.O_RDONLY)
    try:
        if buffer is not None:
            n = os.readv(fd, [buffer])
            if n < len(buffer):
                return bytes(memoryview(buffer)[:n])
            chunks = [bytes(buffer)]
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
            return b"".join(chunks)
        size = os.fstat(fd).st_size
        data = os.read(fd, size + 1)
        if len(data) <= size:
            return data  # a short read of a regular file: its end
        chunks = [data]
        while chunk := os.read(fd, 1 << 20):  # it grew meanwhile
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


class Item(NamedTuple):
    """One job to run: exactly one of `url`, `file` (read here and sent inline) or `path`
    (a path under the workers' GPUFEED_PATH_ROOT, read by the worker). A named tuple: a
    manifest of millions of lines makes one per line."""

    id: str
    source: str
    url: str | None = None
    file: str | None = None
    path: str | None = None

    def fields(self, buffer: bytearray | None = None) -> list[bytes]:
        """The job's stream fields (flat: key, value, ...) but reply_to, meta and deadline;
        OSError if a local file cannot be read, ValueError if it is empty. The checks
        `Job.fields` makes hold by construction: a source's ids fit and its urls have a
        scheme. `buffer`: see `read_file`."""
        # One unpacking: a named tuple's attributes cost a descriptor call each.
        job_id, _, url, file, path = self
        if file is not None:
            image = read_file(file, buffer)
            if not image:
                raise ValueError("image is empty")
            return [wire.JOB_IMAGE, image, wire.JOB_ID, job_id.encode()]
        if path is not None:
            return [wire.JOB_PATH, path.encode(), wire.JOB_ID, job_id.encode()]
        assert url is not None
        return [wire.JOB_URL, url.encode(), wire.JOB_ID, job_id.encode()]


@dataclass(frozen=True)
class Source:
    """A source of items: `pages()` yields them a list at a time; `total` is the number of
    entries where it is cheap to know beforehand (None otherwise)."""

    spec: str
    kind: str  # folder, manifest or prefix
    total: int | None
    path_root: Path | None = None

    def pages(self) -> Iterator[list[Item]]:
        if self.kind == "folder":
            return _folder_pages(Path(self.spec), self.path_root)
        if self.kind == "prefix":
            return _prefix_pages(self.spec)
        return _manifest_pages(Path(self.spec), self.path_root)


def open_source(spec: str, *, path_root: str | os.PathLike[str] | None = None) -> Source:
    """The source `spec` names: `s3://`, `gs://` or `az://` a prefix, a folder, else a
    manifest file. With `path_root`, local files are sent as `path` jobs relative to it
    (the folder the workers know as GPUFEED_PATH_ROOT) instead of being read and sent."""
    root = None if path_root is None else Path(path_root).absolute()
    if root is not None and not root.is_dir():
        raise SourceError(f"--path-root {path_root}: no such folder")
    scheme = urlsplit(spec).scheme
    if scheme in STORE_SCHEMES:
        _split_prefix(spec)  # checks the bucket
        return Source(spec, "prefix", None, root)
    if "://" in spec:
        raise SourceError(f"{spec}: a source is a folder, a manifest or s3://, gs://, az://")
    p = Path(spec)
    if p.is_dir():
        return Source(str(p), "folder", None, root)
    if not p.is_file():
        raise SourceError(f"{spec}: no such file or folder")
    return Source(str(p), "manifest", _count_entries(p), root)


# ---------------------------------------------------------------------- local files
def _local_item(file: str, id: str, root: Path | None) -> Item:
    # Plain string operations: pathlib would cost a manifest line more than the rest of it.
    if root is None:
        return Item(id=id, source=file, file=file)
    absolute = os.path.abspath(file)
    top = str(root)
    if not absolute.startswith(top.rstrip(os.sep) + os.sep):
        raise SourceError(f"{file} is not under --path-root {root}")
    relative = absolute[len(top.rstrip(os.sep)) + 1 :]
    return Item(id=id, source=file, path=relative.replace(os.sep, "/"))


def _folder_pages(folder: Path, root: Path | None) -> Iterator[list[Item]]:
    """Image files under `folder`, in a stable order (a folder's files by name, then its
    subfolders by name, as os.walk with sorted names gives them), id: the path relative
    to `folder`. Symbolic links to folders are not followed."""
    page: list[Item] = []
    for file, relative in _image_files(str(folder), ""):
        # An id of at most 32 characters is at most 128 bytes: no need to measure it.
        job_id = relative if len(relative) <= 32 else _fit_id(relative)
        page.append(
            Item(job_id, file, None, file) if root is None else _local_item(file, job_id, root)
        )
        if len(page) >= READ_PAGE:
            yield page
            page = []
    if page:
        yield page


def _image_files(folder: str, prefix: str) -> Iterator[tuple[str, str]]:
    # os.scandir and string operations: pathlib would cost each file more than the rest
    # of its way to the stream.
    with os.scandir(folder) as it:
        entries = sorted(it, key=_name)
    folders = []
    for entry in entries:
        if entry.is_dir():
            if not entry.is_symlink():
                folders.append(entry)
            continue
        name = entry.name
        dot = name.rfind(".")
        if dot > 0 and name[dot:].lower() in IMAGE_EXTENSIONS:
            yield entry.path, prefix + name
    for entry in folders:
        yield from _image_files(entry.path, f"{prefix}{entry.name}/")


_name = operator.attrgetter("name")


# ---------------------------------------------------------------------- manifests
def _format(manifest: Path) -> str:
    suffix = manifest.suffix.lower()
    if suffix == ".csv":
        return "csv"
    if suffix in (".jsonl", ".ndjson"):
        return "jsonl"
    if suffix == ".parquet":
        return "parquet"
    return "text"


def _count_entries(manifest: Path) -> int | None:
    """Entries in a manifest: Parquet's row count, or its lines (a CSV's, less the header).
    Blank lines count too, so the figure is an upper bound for a progress bar."""
    fmt = _format(manifest)
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            return int(pq.ParquetFile(manifest).metadata.num_rows)
        lines = 0
        last = b"\n"
        with manifest.open("rb") as f:
            while chunk := f.read(1 << 20):
                lines += chunk.count(b"\n")
                last = chunk[-1:]
        lines += last != b"\n"
    except OSError as exc:
        raise SourceError(f"cannot read {manifest}: {exc.strerror or exc}") from None
    except ValueError as exc:  # pyarrow's ArrowInvalid for a file that is not Parquet
        raise SourceError(f"{manifest}: not a Parquet file ({exc})") from None
    return max(0, lines - 1) if fmt == "csv" else lines


def _manifest_pages(manifest: Path, root: Path | None) -> Iterator[list[Item]]:
    # A relative path is one under the workers' root with --path-root, else a file next
    # to the manifest.
    base = str(root if root is not None else manifest.parent)
    label = f"{manifest} {'row' if _format(manifest) == 'parquet' else 'line'}"
    rows = _manifest_rows(manifest)
    page: list[Item] = []
    for line, row in rows:
        item = _row_item(label, line, row, base, root)
        if item is not None:
            page.append(item)
            if len(page) >= READ_PAGE:
                yield page
                page = []
    if page:
        yield page


def _row_item(
    label: str, line: int, row: dict[str, Any], base: str, root: Path | None
) -> Item | None:
    url = _cell(row.get("url"), label, line, "url")
    path = _cell(row.get("path"), label, line, "path")
    given_id = _cell(row.get("id"), label, line, "id")
    where = f"{label} {line}"  # only for the messages below
    if url is None and path is None:
        if all(v in (None, "") for v in row.values()):
            return None  # a blank line
        raise SourceError(f"{where}: no url or path")
    if given_id is not None and len(given_id.encode()) > 128:
        raise SourceError(f"{where}: id is over 128 bytes")
    if url is not None:
        if "://" not in url:
            raise SourceError(f"{where}: url needs a scheme (http://, s3://...): {url!r}")
        job_id = given_id or _fit_id(url.split("#", 1)[0].split("?", 1)[0])
        return Item(id=job_id, source=url, url=url)
    assert path is not None
    if "://" in path:
        job_id = given_id or _fit_id(path.split("#", 1)[0].split("?", 1)[0])
        return Item(id=job_id, source=path, url=path)
    file = path if os.path.isabs(path) else os.path.join(base, path)
    return _local_item(file, given_id or _fit_id(path), root)


def _cell(value: Any, label: str, line: int, column: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        if isinstance(value, int | float) and column == "id":
            value = str(value)
        else:
            raise SourceError(f"{label} {line}: {column} is not text: {value!r}")
    value = value.strip()
    return value or None


def _manifest_rows(manifest: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    fmt = _format(manifest)
    try:
        if fmt == "parquet":
            yield from _parquet_rows(manifest)
            return
        with manifest.open(encoding="utf-8", newline="") as f:
            if fmt == "csv":
                reader = csv.DictReader(f)
                _check_columns(manifest, reader.fieldnames or [])
                for n, row in enumerate(reader, start=2):
                    yield n, dict(row)
            elif fmt == "jsonl":
                for n, text in enumerate(f, start=1):
                    if not text.strip():
                        continue
                    try:
                        obj = json.loads(text)
                    except json.JSONDecodeError as exc:
                        raise SourceError(f"{manifest} line {n}: not JSON ({exc.msg})") from None
                    if not isinstance(obj, dict):
                        raise SourceError(f"{manifest} line {n}: not a JSON object")
                    yield n, obj
            else:
                for n, text in enumerate(f, start=1):
                    entry = text.strip()
                    if entry and not entry.startswith("#"):
                        yield n, {"url": entry} if "://" in entry else {"path": entry}
    except OSError as exc:
        raise SourceError(f"cannot read {manifest}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise SourceError(f"{manifest} is not UTF-8 text") from None


def _check_columns(manifest: Path, columns: Sequence[str]) -> None:
    if "url" not in columns and "path" not in columns:
        raise SourceError(f"{manifest}: needs a `url` or `path` column (has {columns})")


def _parquet_rows(manifest: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(manifest)
    names = parquet.schema_arrow.names
    _check_columns(manifest, names)
    wanted = [c for c in ("id", "url", "path") if c in names]
    row = 0
    for batch in parquet.iter_batches(batch_size=READ_PAGE, columns=wanted):
        for values in batch.to_pylist():
            row += 1
            yield row, values


# ---------------------------------------------------------------------- object stores
def _split_prefix(url: str) -> tuple[str, str, str]:
    parts = urlsplit(url)
    if not parts.netloc:
        raise SourceError(f"{url}: needs a bucket: {parts.scheme}://BUCKET/PREFIX/")
    return parts.scheme, parts.netloc, parts.path.lstrip("/")


def _prefix_pages(spec: str, page_size: int = LIST_PAGE) -> Iterator[list[Item]]:
    """The image keys under the prefix, a listing page at a time; id: the key relative to
    the prefix."""
    import obstore
    from obstore.exceptions import BaseError

    scheme, bucket, prefix = _split_prefix(spec)
    store = open_store(scheme, bucket)
    try:
        for chunk in obstore.list(store, prefix=prefix or None, chunk_size=page_size):
            page: list[Item] = []
            for meta in chunk:
                key = meta["path"]
                if Path(key).suffix.lower() not in IMAGE_EXTENSIONS:
                    continue
                relative = key[len(prefix) :].lstrip("/") if key.startswith(prefix) else key
                page.append(
                    Item(
                        id=_fit_id(relative or key),
                        source=f"{scheme}://{bucket}/{key}",
                        url=f"{scheme}://{bucket}/{key}",
                    )
                )
            if page:
                yield page
    except BaseError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SourceError(f"cannot list {spec}: {first}") from None

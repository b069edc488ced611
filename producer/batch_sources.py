"""What `producer batch` reads its jobs from: a folder, a manifest or an object-store prefix.

Each source yields `Item`s page by page, never the whole list at once, so a manifest of
tens of millions of lines or a bucket of as many keys is read as the run goes. Every item
carries a stable id, the same on every run over the same source: the manifest's `id`
column, else the path or key relative to the source (a URL by `url_id`), so that a re-run
skips what is done and the workers' duplicate handling applies.

Nothing a source names is trusted to be a small regular file: a folder gives only its
regular image files (what else it holds is passed over and reported), every file is opened
without blocking and looked at before a byte is read, and read no further than the
workers' image size limit; a manifest is read a bounded line at a time, and a line it
cannot make sense of ends the run with one message naming that line.

Nor is a folder trusted to be shallow or its names to be UTF-8: it is walked with a list of
folders still to list, not by recursion, so any depth is walked; a file whose name is not
UTF-8 (which the system hands over with each such byte as a lone surrogate, PEP 383) is
served under an id of UTF-8 text, and every path a row, a message or the summary shows is
written with such bytes as `\\xNN`.
"""

from __future__ import annotations

import csv
import hashlib
import itertools
import json
import operator
import os
import stat
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any, NamedTuple
from urllib.parse import urlsplit

from producer import wire
from producer.batch_ids import id_hashes
from producer.batch_parts import Part
from producer.jobs import IMAGE_EXTENSIONS, _fit_id, url_id
from producer.object_stores import open_store

STORE_SCHEMES = ("s3", "gs", "az")
# Keys per listing request: S3's own page size (the most one ListObjectsV2 call returns).
LIST_PAGE = 1000
# Manifest rows read at once (Parquet record batches, lines of text).
READ_PAGE = 4096
# The longest manifest line read (its url, path and id fit in far less): a file without
# line breaks is refused at this point, not read whole.
MAX_LINE_BYTES = 1 << 20
# Bytes of a text manifest read at once (its lines split and checked together).
TEXT_BLOCK = 1 << 20
# The manifests whose rows have named columns, that --keep-columns can copy.
KEEP_FORMATS = ("csv", "jsonl", "parquet")

# Called with a folder entry that is not taken and why (a FIFO, a device, a broken link...).
OnSkip = Callable[[str, str], None]
# Called with each file (a folder's, relative to it; a prefix's key) whose name is not one
# of IMAGE_EXTENSIONS: not read, and said so, since the workers could only refuse it.
OnOther = Callable[[str], None]
# Names of such files kept as examples (all are counted).
NAMED_OTHERS = 5


@dataclass
class NotImages:
    """The files a source passed over for their names: counted by extension, a few named."""

    count: int = 0
    by_extension: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)

    def add(self, name: str) -> None:
        self.count += 1
        base = name.rsplit("/", 1)[-1]
        dot = base.rfind(".")
        ext = base[dot:].lower() if dot > 0 else "(no extension)"
        self.by_extension[ext] = self.by_extension.get(ext, 0) + 1
        if len(self.examples) < NAMED_OTHERS:
            self.examples.append(printable(name))

    def summary(self) -> str:
        """Which extensions, how many of each, and a few names, in one clause."""
        exts = sorted(self.by_extension.items(), key=lambda kv: (-kv[1], kv[0]))
        kinds = ", ".join(f"{ext} {n}" for ext, n in exts[:5])
        more = ", ..." if len(exts) > 5 else ""
        named = ", ".join(self.examples) + (", ..." if self.count > len(self.examples) else "")
        return f"{kinds}{more}; e.g. {named}"


def read_extensions() -> str:
    """The names `producer batch` reads from a folder or a prefix, for a message."""
    return " ".join(sorted(IMAGE_EXTENSIONS))


class SourceError(ValueError):
    """The source cannot be read as given: the message names it and what is wrong."""


class ItemError(ValueError):
    """A local file that is not sent to the workers: its error row's code and message."""

    def __init__(self, code: wire.ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a folder"),
)
# O_NONBLOCK: opening a FIFO returns at once (it would wait for a writer), so that what
# was opened can be looked at.
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)


def is_text(text: str) -> bool:
    """Whether `text` is UTF-8 text: False for a name the system gave with surrogate escapes
    (a file name that is not UTF-8), or a JSON string's lone surrogate."""
    if text.isascii():
        return True
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def printable(text: str) -> str:
    """`text` as UTF-8 text that any output takes (a row, JSON, a terminal): each byte of a
    name that is not UTF-8 written `\\xNN` (any other lone surrogate `\\udNNN`); text that
    is UTF-8 already comes back as it is."""
    if is_text(text):
        return text
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate no file name gives (from a JSON escape)
        return text.encode("utf-8", "backslashreplace").decode()


def file_kind(mode: int) -> str:
    """What a file of `mode` is, in words, for one that is not regular."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _refused(file: str, st: os.stat_result, limit: int) -> ItemError:
    if not stat.S_ISREG(st.st_mode):
        return ItemError(
            wire.ErrorCode.PATH_NOT_FOUND,
            f"{printable(file)} is not a regular file ({file_kind(st.st_mode)})",
        )
    return _too_large(file, limit)


def _too_large(file: str, limit: int) -> ItemError:
    return ItemError(
        wire.ErrorCode.PAYLOAD_TOO_LARGE,
        f"{printable(file)} is over the limit of {limit} bytes (GPUFEED_MAX_IMAGE_BYTES)",
    )


def read_file(
    file: str, buffer: bytearray | None = None, limit: int = wire.DEFAULT_MAX_IMAGE_BYTES
) -> bytes:
    """The bytes of `file`, a regular file of at most `limit` bytes (else ItemError; OSError
    if it cannot be opened), with the fewest system calls: a Python file object would cost
    more than the read itself for a small image. With `buffer`, a file that fits is read
    into it in one call."""
    try:
        fd = os.open(file, _OPEN_FLAGS)
    except ValueError as exc:  # a NUL in the name, a surrogate no file name can hold
        raise ItemError(wire.ErrorCode.INVALID_JOB, f"{file!r}: {exc}") from None
    try:
        # What was opened is judged before a byte is read: a FIFO, a device (a link to
        # /dev/zero) or a file over the limit is never read.
        st = os.fstat(fd)
        size = st.st_size
        if size > limit or not stat.S_ISREG(st.st_mode):
            raise _refused(file, st, limit)
        chunks: list[bytes] = []
        got = 0
        if buffer is not None and size < len(buffer):
            got = os.readv(fd, [buffer])
            if got < len(buffer) and got <= limit:
                return bytes(memoryview(buffer)[:got])
            chunks.append(bytes(memoryview(buffer)[:got]))
        while got <= limit:  # it grew meanwhile, or no buffer: up to the limit and a byte
            chunk = os.read(fd, min(1 << 20, limit + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        if got > limit:
            raise _too_large(file, limit)
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
    # The manifest's --keep-columns values, as text (null where the row has none).
    extra: tuple[str | None, ...] = ()

    def fields(
        self, buffer: bytearray | None = None, limit: int = wire.DEFAULT_MAX_IMAGE_BYTES
    ) -> list[bytes]:
        """The job's stream fields (flat: key, value, ...) but reply_to, meta and deadline;
        OSError if a local file cannot be opened, ItemError if it is not sent (empty, not
        regular, over `limit` bytes). The checks `Job.fields` makes hold by construction: a
        source's ids fit and its urls have a scheme. `buffer`: see `read_file`."""
        # One unpacking: a named tuple's attributes cost a descriptor call each.
        job_id, _, url, file, path, _ = self
        if file is not None:
            image = read_file(file, buffer, limit)
            if not image:
                raise ItemError(wire.ErrorCode.EMPTY_IMAGE, f"{printable(file)}: image is empty")
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
    # Manifest columns carried into each output row (--keep-columns).
    keep: tuple[str, ...] = ()
    # A folder's files whose names are not images, from the listing that counted `total`.
    not_images: NotImages | None = field(default=None, compare=False)

    def pages(
        self,
        on_skip: OnSkip | None = None,
        on_other: OnOther | None = None,
        *,
        part: Part | None = None,
        on_other_part: Callable[[int], None] | None = None,
    ) -> Iterator[list[Item]]:
        """The items, a page at a time; a folder's entries that are not regular image
        files are passed to `on_skip` with the reason, and a folder's files or a prefix's
        keys whose names are not images to `on_other`. With `part`, that part's items
        only (producer/batch_parts.py), the others counted to `on_other_part`."""
        if self.kind == "manifest":
            return _manifest_pages(
                Path(self.spec), self.path_root, self.keep, part=part, on_other_part=on_other_part
            )
        if self.kind == "folder":
            pages = _folder_pages(Path(self.spec), self.path_root, on_skip, on_other)
        else:
            pages = _prefix_pages(self.spec, on_other=on_other)
        if part is None or part.whole:
            return pages
        return part.keep(pages, operator.itemgetter(0), on_other_part)  # Item.id

    def nothing_to_run(self) -> NotImages | None:
        """None when the source names at least one item; otherwise what it passed over for
        the names (a folder's from the listing that counted `total`; a prefix is listed up
        to its first image key, so to its end when it has none)."""
        if self.kind == "folder":
            return (self.not_images or NotImages()) if self.total == 0 else None
        if self.kind == "manifest":
            return NotImages() if self.total == 0 else None
        found = NotImages()
        return None if next(iter(self.pages(on_other=found.add)), None) else found


def open_source(
    spec: str,
    *,
    path_root: str | os.PathLike[str] | None = None,
    keep_columns: Sequence[str] = (),
) -> Source:
    """The source `spec` names: `s3://`, `gs://` or `az://` a prefix, a folder, else a
    manifest file. With `path_root`, local files are sent as `path` jobs relative to it
    (the folder the workers know as GPUFEED_PATH_ROOT) instead of being read and sent.
    `keep_columns`: columns of a .csv, .jsonl or .parquet manifest copied into each row of
    the output, as text."""
    source = _open_source(spec, path_root)
    keep = tuple(dict.fromkeys(n.strip() for n in keep_columns if n.strip()))
    if not keep:
        return source
    return replace(source, keep=_checked_keep(source, keep))


def _checked_keep(source: Source, keep: tuple[str, ...]) -> tuple[str, ...]:
    if source.kind != "manifest" or _format(Path(source.spec)) not in KEEP_FORMATS:
        raise SourceError(
            f"--keep-columns needs a {', '.join('.' + f for f in KEEP_FORMATS)} manifest; "
            f"{source.spec} is a {source.kind if source.kind != 'manifest' else 'text manifest'}"
        )
    from producer.batch_rows import output_columns

    taken = sorted(set(keep) & set(output_columns()))
    if taken:
        raise SourceError(
            f"--keep-columns {', '.join(taken)}: the output has a column of that name "
            "(rename it in the manifest)"
        )
    manifest = Path(source.spec)
    known = _header(manifest)
    missing = [n for n in keep if known is not None and n not in known]
    if missing:
        raise SourceError(
            f"--keep-columns {', '.join(missing)}: {manifest} has no such column "
            f"(it has {', '.join(known or [])})"
        )
    return keep


def _header(manifest: Path) -> list[str] | None:
    """A .csv manifest's header or a .parquet one's columns; None for JSON lines, whose
    rows each have their own keys (a key a row lacks is null in its output row)."""
    fmt = _format(manifest)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return list(pq.read_schema(manifest).names)
    if fmt == "csv":
        try:
            with manifest.open(encoding="utf-8", newline="") as f:
                return next(csv.reader(f), [])
        except (OSError, UnicodeDecodeError, csv.Error) as exc:
            raise SourceError(f"cannot read the header of {manifest}: {exc}") from None
    return None


def _kept(value: Any) -> str | None:
    """A kept column's value as the output holds it: text as it is, anything else as JSON."""
    if value is None:
        return None
    # A JSON string may hold a lone surrogate, which no output can write.
    return printable(
        value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    )


def _open_source(spec: str, path_root: str | os.PathLike[str] | None) -> Source:
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
        # Listed once before the run (as a manifest's lines are counted), so the progress
        # has its total from the start.
        others = NotImages()
        return Source(str(p), "folder", _count_files(str(p), others.add), root, not_images=others)
    try:
        mode = p.stat().st_mode
    except OSError:
        raise SourceError(f"{spec}: no such file or folder") from None
    if not stat.S_ISREG(mode):
        raise SourceError(f"{spec} is {file_kind(mode)}, not a manifest file or a folder")
    return Source(str(p), "manifest", _count_entries(p), root)


# ---------------------------------------------------------------------- local files
def _local_item(file: str, id: str, root: Path | None) -> Item:
    # Plain string operations: pathlib would cost a manifest line more than the rest of it.
    if root is None:
        return Item(id=id, source=file, file=file)
    absolute = os.path.abspath(file)
    top = str(root)
    if not absolute.startswith(top.rstrip(os.sep) + os.sep):
        raise SourceError(f"{printable(file)} is not under --path-root {printable(top)}")
    relative = absolute[len(top.rstrip(os.sep)) + 1 :]
    return Item(id=id, source=file, path=relative.replace(os.sep, "/"))


def _count_files(folder: str, on_other: OnOther | None = None) -> int:
    return sum(1 for _ in _image_files(folder, None, on_other))


def _folder_pages(
    folder: Path, root: Path | None, on_skip: OnSkip | None, on_other: OnOther | None = None
) -> Iterator[list[Item]]:
    """Regular image files under `folder`, in a stable order (a folder's files by name,
    then its subfolders by name, as os.walk with sorted names gives them), id: the path
    relative to `folder`. Symbolic links to folders are not followed; one to a file is
    taken where its target is a regular file."""
    top = str(folder)
    # Whether every path starts as UTF-8 text: then a name that is too is the common case,
    # which costs one isascii.
    plain = is_text(top)
    page: list[Item] = []
    for file, relative in _image_files(top, on_skip, on_other):
        if plain and (relative.isascii() or is_text(relative)):
            # An id of at most 32 characters is at most 128 bytes: no need to measure it.
            job_id = relative if len(relative) <= 32 else _fit_id(relative)
            page.append(
                Item(job_id, file, None, file) if root is None else _local_item(file, job_id, root)
            )
        else:
            page.append(_odd_item(file, relative, root))
        if len(page) >= READ_PAGE:
            yield page
            page = []
    if page:
        yield page


def _odd_item(file: str, relative: str, root: Path | None) -> Item:
    """The item of a file whose path is not all UTF-8 (its own name, a folder's on the way,
    or the source folder's): served as any other, under an id and a source of UTF-8 text.
    A path job names the file in UTF-8 text, which this one has none of: it is read here and
    sent inline."""
    job_id = _fit_id(relative) if is_text(relative) else _bytes_id(relative)
    shown = printable(file)
    if root is not None:
        item = _local_item(file, job_id, root)
        if item.path is not None and is_text(item.path):
            return item._replace(source=shown)
    return Item(job_id, shown, None, file)


def _bytes_id(relative: str) -> str:
    """The id of a relative path that is not UTF-8: a digest of its bytes, then as much of
    its tail as fits, each byte that is not UTF-8 written `\\xNN`. The digest keeps it
    apart from a name that is spelled that way, with a backslash, and from any other id."""
    raw = relative.encode("utf-8", "surrogateescape")
    digest = hashlib.sha1(raw).hexdigest()[:16]
    shown = raw.decode("utf-8", "backslashreplace").encode()
    tail = shown[-(wire.MAX_ID_BYTES - len(digest) - 1) :].decode("utf-8", "ignore")
    return f"{digest}~{tail}"


def _image_files(
    top: str, on_skip: OnSkip | None, on_other: OnOther | None = None
) -> Iterator[tuple[str, str]]:
    """(path, path relative to `top`) of each image-named regular file under `top`, depth
    first. A list of the folders still to list, not recursion: a tree of any depth is
    walked (a path over the system's limit, PATH_MAX, cannot be listed and is reported as
    such), and a folder found inside itself (a bind mount of a parent) is passed over and
    reported, not walked until the path is too long."""
    # os.scandir and string operations: pathlib would cost each file more than the rest
    # of its way to the stream. is_dir and is_file answer from the folder listing's own
    # file types, but for a symbolic link, whose target they look at.
    todo: list[tuple[str, str, int]] = [(top, "", 0)]  # folder, prefix, depth; next last
    # The folders from `top` down to the one being listed, as (device, inode).
    chain: list[tuple[int, int]] = []
    on_chain: set[tuple[int, int]] = set()
    while todo:
        folder, prefix, depth = todo.pop()
        while len(chain) > depth:
            on_chain.discard(chain.pop())
        try:
            st = os.stat(folder)
            with os.scandir(folder) as it:
                entries = sorted(it, key=_name)
        except OSError as exc:
            if on_skip is not None:
                on_skip(printable(folder), f"cannot list it: {exc.strerror or exc}")
            continue
        key = (st.st_dev, st.st_ino)
        if key in on_chain:
            if on_skip is not None:
                on_skip(
                    printable(folder),
                    "the same folder as one it is in (a bind mount): not listed again",
                )
            continue
        chain.append(key)
        on_chain.add(key)
        folders = []
        for entry in entries:
            if entry.is_dir():
                if not entry.is_symlink():
                    folders.append(entry)
                continue
            name = entry.name
            dot = name.rfind(".")
            if dot > 0 and name[dot:].lower() in IMAGE_EXTENSIONS:
                if entry.is_file():
                    yield entry.path, prefix + name
                elif on_skip is not None:
                    on_skip(printable(entry.path), _not_regular(entry.path))
            elif on_other is not None:
                on_other(prefix + name)
        # Reversed: the first subfolder by name is listed next.
        todo.extend((e.path, f"{prefix}{e.name}/", depth + 1) for e in reversed(folders))


def _not_regular(path: str) -> str:
    try:
        return file_kind(os.stat(path).st_mode)
    except FileNotFoundError:
        return "a broken symbolic link"
    except OSError as exc:
        return f"cannot look at it: {exc.strerror or exc}"


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


def _manifest_pages(
    manifest: Path,
    root: Path | None,
    keep: tuple[str, ...] = (),
    *,
    part: Part | None = None,
    on_other_part: Callable[[int], None] | None = None,
) -> Iterator[list[Item]]:
    # A relative path is one under the workers' root with --path-root, else a file next
    # to the manifest.
    base = str(root if root is not None else manifest.parent)
    # A manifest's lines are UTF-8 text: only a base that is not can make a source that
    # is not.
    plain = is_text(base)
    label = f"{manifest} {'row' if _format(manifest) == 'parquet' else 'line'}"
    rows: Iterator[tuple[int, dict[str, Any]]]
    if part is not None and not part.whole and _format(manifest) == "text":
        rows = _text_part_rows(manifest, part, on_other_part)
    elif part is not None and not part.whole:
        # The other parts' rows cost their id only: no item is made of them.
        chunks = _batched(_manifest_rows(manifest, keep), READ_PAGE)
        rows = itertools.chain.from_iterable(part.keep(chunks, _quick_id, on_other_part))
    else:
        rows = _manifest_rows(manifest, keep)
    page: list[Item] = []
    for line, row in rows:
        item = _row_item(label, line, row, base, root)
        if item is not None:
            if not plain:
                item = item._replace(source=printable(item.source))
            if keep:
                item = item._replace(extra=tuple(_kept(row.get(k)) for k in keep))
            page.append(item)
            if len(page) >= READ_PAGE:
                yield page
                page = []
    if page:
        yield page


def _batched(rows: Iterator[tuple[int, dict[str, Any]]], n: int) -> Iterator[list[Any]]:
    while chunk := list(itertools.islice(rows, n)):
        yield chunk


def _entry_id(given_id: str | None, url: str | None, path: str) -> str:
    """A manifest row's job id: its own, else its URL's (url_id), else its path."""
    if given_id:
        return given_id
    if url is not None or "://" in path:
        return url_id(url if url is not None else path)
    return _fit_id(path)


def _quick_id(entry: tuple[int, dict[str, Any]]) -> str | None:
    """The id `_row_item` gives a row, or None where it would refuse or skip the row (so
    that every part meets it)."""
    line, row = entry
    try:
        url = _cell(row.get("url"), "", line, "url")
        path = _cell(row.get("path"), "", line, "path")
        given_id = _cell(row.get("id"), "", line, "id")
    except SourceError:
        return None
    if url is None and path is None:
        return None
    return _entry_id(given_id, url, path or "")


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
        return Item(id=_entry_id(given_id, url, ""), source=url, url=url)
    assert path is not None
    if "://" in path:
        return Item(id=_entry_id(given_id, None, path), source=path, url=path)
    file = path if os.path.isabs(path) else os.path.join(base, path)
    return _local_item(file, _entry_id(given_id, None, path), root)


def _cell(value: Any, label: str, line: int, column: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        if isinstance(value, int | float) and column == "id":
            value = str(value)
        else:
            raise SourceError(f"{label} {line}: {column} is not text: {value!r}")
    elif not is_text(value):  # a JSON string's lone surrogate (`"\\ud800"`)
        raise SourceError(f"{label} {line}: {column} is not UTF-8 text: {value!r}")
    value = value.strip()
    return value or None


def _manifest_rows(
    manifest: Path, keep: tuple[str, ...] = ()
) -> Iterator[tuple[int, dict[str, Any]]]:
    fmt = _format(manifest)
    try:
        if fmt == "parquet":
            yield from _parquet_rows(manifest, keep)
            return
        with manifest.open("rb") as f:
            lines = _lines(f, manifest)
            if fmt == "csv":
                yield from _csv_rows(manifest, lines)
            elif fmt == "jsonl":
                yield from _json_rows(manifest, lines)
            else:
                for entries in _text_entries(f, manifest):
                    for n, entry in entries:
                        yield n, _text_row(entry)
    except OSError as exc:
        raise SourceError(f"cannot read {manifest}: {exc.strerror or exc}") from None


def _text_part_rows(
    manifest: Path, part: Part, on_other_part: Callable[[int], None] | None
) -> Iterator[tuple[int, dict[str, Any]]]:
    """A text manifest's rows of `part`: a block of lines at a time, each line's id and its
    hash made in one pass, so that another part's line costs little more than its reading."""
    try:
        with manifest.open("rb") as f:
            for entries in _text_entries(f, manifest):
                ids = [_entry_id(None, None, e) for _, e in entries]  # a url's or a path's
                mine = part.mine(id_hashes(ids)).tolist()
                kept = [entry for entry, m in zip(entries, mine, strict=True) if m]
                if on_other_part is not None and len(kept) < len(entries):
                    on_other_part(len(entries) - len(kept))
                for n, entry in kept:
                    yield n, _text_row(entry)
    except OSError as exc:
        raise SourceError(f"cannot read {manifest}: {exc.strerror or exc}") from None


def _text_row(entry: str) -> dict[str, Any]:
    return {"url": entry} if "://" in entry else {"path": entry}


def _text_entries(f: IO[bytes], manifest: Path) -> Iterator[list[tuple[int, str]]]:
    """A text manifest's entries (its lines stripped, blank ones and `#` comments left out)
    with their line numbers, a block of TEXT_BLOCK bytes at a time: as `_lines` reads them,
    each line at most MAX_LINE_BYTES and UTF-8 text, the entries before a line refused
    given first."""
    done = 0  # lines before the block
    carry = b""
    while True:
        data = f.read(TEXT_BLOCK)
        buf = carry + data
        if not buf:
            return
        cut = len(buf) if not data else buf.rfind(b"\n") + 1
        if cut == 0:  # no line break yet
            if len(buf) > MAX_LINE_BYTES:
                raise SourceError(f"{manifest} line {done + 1}: longer than {MAX_LINE_BYTES} bytes")
            carry = buf
            continue
        raw = buf[:cut].split(b"\n")
        if raw[-1] == b"":
            raw.pop()  # what followed the block's last line break
        carry = buf[cut:]
        texts = _decoded(raw, ends=bool(data))
        bad = len(texts)
        yield [(done + i, e) for i, t in enumerate(texts, 1) if (e := t.strip()) and e[0] != "#"]
        if bad < len(raw):
            n = done + bad + 1
            if len(raw[bad]) + 1 > MAX_LINE_BYTES:
                raise SourceError(f"{manifest} line {n}: longer than {MAX_LINE_BYTES} bytes")
            raise SourceError(f"{manifest} line {n}: not UTF-8 text")
        done += len(raw)
        if not data:
            return


def _decoded(raw: list[bytes], *, ends: bool) -> list[str]:
    """`raw` lines as text, up to the first that is too long or not UTF-8 (all of them when
    none is). `ends`: each line had its line break (which counts toward MAX_LINE_BYTES)."""
    longest = MAX_LINE_BYTES - 1 if ends else MAX_LINE_BYTES
    if max(map(len, raw), default=0) <= longest:
        try:
            return b"\n".join(raw).decode().split("\n") if raw else []
        except UnicodeDecodeError:
            pass
    texts = []
    for r in raw:
        if len(r) > longest:
            break
        try:
            texts.append(r.decode())
        except UnicodeDecodeError:
            break
    return texts


def _lines(f: IO[bytes], manifest: Path) -> Iterator[tuple[int, str]]:
    """The manifest's lines (line breaks kept, as csv wants them) with their numbers, each
    at most MAX_LINE_BYTES."""
    for n in itertools.count(1):
        raw = f.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        if len(raw) > MAX_LINE_BYTES:
            raise SourceError(f"{manifest} line {n}: longer than {MAX_LINE_BYTES} bytes")
        try:
            yield n, raw.decode("utf-8")
        except UnicodeDecodeError:
            raise SourceError(f"{manifest} line {n}: not UTF-8 text") from None


def _csv_rows(
    manifest: Path, lines: Iterator[tuple[int, str]]
) -> Iterator[tuple[int, dict[str, Any]]]:
    # A quoted field may span lines: a row's number (and an error's) is that of the last
    # line csv took. A field over csv's own limit (131,072 characters) is refused by it.
    taken = [0]

    def texts() -> Iterator[str]:
        for n, text in lines:
            taken[0] = n
            yield text

    reader = csv.DictReader(texts())
    try:
        _check_columns(manifest, reader.fieldnames or [])
        for row in reader:
            yield taken[0], dict(row)
    except csv.Error as exc:
        raise SourceError(f"{manifest} line {taken[0]}: not CSV ({exc})") from None


def _json_rows(
    manifest: Path, lines: Iterator[tuple[int, str]]
) -> Iterator[tuple[int, dict[str, Any]]]:
    for n, text in lines:
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except RecursionError:
            raise SourceError(f"{manifest} line {n}: JSON nested too deeply") from None
        except ValueError as exc:  # JSONDecodeError, or an integer of too many digits
            reason = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
            raise SourceError(f"{manifest} line {n}: not JSON ({reason})") from None
        if not isinstance(obj, dict):
            raise SourceError(f"{manifest} line {n}: not a JSON object")
        yield n, obj


def _check_columns(manifest: Path, columns: Sequence[str]) -> None:
    if "url" not in columns and "path" not in columns:
        raise SourceError(f"{manifest}: needs a `url` or `path` column (has {columns})")


def _parquet_rows(
    manifest: Path, keep: tuple[str, ...] = ()
) -> Iterator[tuple[int, dict[str, Any]]]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(manifest)
    names = parquet.schema_arrow.names
    _check_columns(manifest, names)
    wanted = list(dict.fromkeys(c for c in ("id", "url", "path", *keep) if c in names))
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


def _prefix_pages(
    spec: str, page_size: int = LIST_PAGE, on_other: OnOther | None = None
) -> Iterator[list[Item]]:
    """The image keys under the prefix, a listing page at a time; id: the key relative to
    the prefix. Keys whose names are not images go to `on_other`."""
    import obstore
    from obstore.exceptions import BaseError

    scheme, bucket, prefix = _split_prefix(spec)
    store = open_store(scheme, bucket)
    try:
        for chunk in obstore.list(store, prefix=prefix or None, chunk_size=page_size):
            page: list[Item] = []
            for meta in chunk:
                key = meta["path"]
                relative = key[len(prefix) :].lstrip("/") if key.startswith(prefix) else key
                if Path(key).suffix.lower() not in IMAGE_EXTENSIONS:
                    if on_other is not None:
                        on_other(relative or key)
                    continue
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

"""The output of a batch run: a Parquet or JSON lines file that is valid whenever read.

While a run goes on, rows go to segment files in `PATH.parts/`: a segment is written in
row groups (Parquet) or lines (JSON) as results arrive, under a `.tmp` name, and renamed
to its final name (an atomic step) when it is closed, at each checkpoint of the run; so
every file without `.tmp` in that folder is complete. When every id of the source has
its row, the old output (if any) and the segments are copied into `PATH.tmp`, which is
renamed to `PATH`, and the folder is removed. `PATH` is therefore either absent, the
previous complete output, or the new complete one, never half written.

A client killed mid-run loses only the rows since its last checkpoint: the next run finds
the committed segments, skips their ids, and submits the rest again. The segments of each
run carry the run's number, so when an id has two rows (an error row and the row of its
retry) the newer one is kept.

An output path that is a symbolic link is written through: the link's target (where the
link leads, followed to the end) is the output, its segments folder beside it, and the
link stays a link.

A part of a dataset (see batch_dataset) is such an output with its segments folder and its
`.tmp` elsewhere (under the dataset's `_gpufeed/`), assembled always, in bounded row groups.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

import numpy as np

from producer import wire
from producer.batch_ids import Hashes, contains, id_hashes
from producer.batch_rows import Rows, json_rows

_SEGMENT_RE = re.compile(r"^r(\d{6})-(\d{6})\.(parquet|jsonl)$")
# The reply streams of the runs over this output, one a line (see BatchRun).
_REPLY_STREAMS = "reply-streams"
READ_ROWS = 8192
# Dictionary encoding only where values repeat: on ids, sources and scores it only costs
# time and bytes (Parquet builds a dictionary per row group, then gives up on it).
DICTIONARY_COLUMNS = [
    "status",
    "error_code",
    "error",
    "model",
    "weights",
    "label",
    "labels",
    "top_k",
    "dtype",
]
PARQUET_OPTIONS: dict[str, Any] = {
    "compression": "zstd",
    "use_dictionary": DICTIONARY_COLUMNS,
}


class OutputError(ValueError):
    """The output path cannot be used (unknown extension, unreadable file)."""


class _Segment(Protocol):
    def write(self, rows: Rows) -> None: ...
    def close(self) -> None: ...


class _Keep(Protocol):
    everything: bool  # every row is kept: no need to ask

    def __call__(self, file: int, start: int, ids: list[str]) -> np.ndarray[Any, Any] | None: ...


# ---------------------------------------------------------------------- JSON lines
class _JsonSegment:
    def __init__(self, path: Path) -> None:
        self._f = path.open("w", encoding="utf-8")

    def write(self, rows: Rows) -> None:
        batch = rows.arrow(rows.embedding_type())
        dumps = json.dumps
        self._f.write("".join(dumps(r, ensure_ascii=False) + "\n" for r in json_rows(batch)))
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class JsonLines:
    suffix = ".jsonl"

    def open(self, path: Path) -> _Segment:
        return _JsonSegment(path)

    def keys(self, path: Path) -> Iterator[tuple[list[str], list[str]]]:
        ids: list[str] = []
        statuses: list[str] = []
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, start=1):
                try:
                    row = json.loads(line)
                    ids.append(str(row["id"]))
                    statuses.append(str(row["status"]))
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise OutputError(f"{path} line {n}: not a row of a batch output") from None
                if len(ids) >= READ_ROWS:
                    yield ids, statuses
                    ids, statuses = [], []
        if ids:
            yield ids, statuses

    def tally(self, path: Path) -> Counter[str]:
        counts: Counter[str] = Counter()
        with path.open(encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                counts[_outcome(row["status"], row.get("error_code"))] += 1
        return counts

    def rows(self, path: Path) -> int:
        with path.open("rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))

    def assemble(
        self, files: list[Path], keep: _Keep, out: Path, row_group: int | None = None
    ) -> int:
        del row_group  # lines have no groups
        rows = 0
        with out.open("w", encoding="utf-8") as dst:
            for index, file in enumerate(files):
                with file.open(encoding="utf-8") as src:
                    lines = src.readlines(1 << 24)
                    start = 0
                    while lines:
                        mask = (
                            None
                            if keep.everything
                            else keep(index, start, [json.loads(x)["id"] for x in lines])
                        )
                        kept = (
                            lines
                            if mask is None
                            else [x for x, k in zip(lines, mask, strict=True) if k]
                        )
                        dst.writelines(kept)
                        rows += len(kept)
                        start += len(lines)
                        lines = src.readlines(1 << 24)
        return rows


# ---------------------------------------------------------------------- Parquet
class _ParquetSegment:
    """One Parquet file, a row group per write; a new embedding type starts a new file
    (see `Segments`), as a file has one schema."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._writer: Any = None
        self.embedding: tuple[str, int] | None = None

    def fits(self, rows: Rows) -> bool:
        found = rows.embedding_type()
        return self._writer is None or found is None or found == self.embedding

    def write(self, rows: Rows) -> None:
        import pyarrow.parquet as pq

        if self._writer is None:
            self.embedding = rows.embedding_type()
        batch = rows.arrow(self.embedding)
        if self._writer is None:
            self._writer = pq.ParquetWriter(self.path, batch.schema, **PARQUET_OPTIONS)
        self._writer.write_batch(batch)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        else:
            # No row yet: an empty file of the base schema.
            import pyarrow.parquet as pq

            pq.write_table(Rows().arrow(None).schema.empty_table(), self.path)


class Parquet:
    suffix = ".parquet"

    def open(self, path: Path) -> _Segment:
        return _ParquetSegment(path)

    def keys(self, path: Path) -> Iterator[tuple[list[str], list[str]]]:
        import pyarrow.parquet as pq

        try:
            parquet = pq.ParquetFile(path)
            for batch in parquet.iter_batches(batch_size=READ_ROWS, columns=["id", "status"]):
                yield (
                    [str(i) for i in batch.column(0).to_pylist()],
                    [str(s) for s in batch.column(1).to_pylist()],
                )
        except (OSError, ValueError, KeyError) as exc:
            raise OutputError(f"{path}: not a batch output ({exc})") from None

    def rows(self, path: Path) -> int:
        import pyarrow.parquet as pq

        return int(pq.ParquetFile(path).metadata.num_rows)

    def tally(self, path: Path) -> Counter[str]:
        import pyarrow.parquet as pq

        pairs: Counter[tuple[Any, Any]] = Counter()
        parquet = pq.ParquetFile(path)
        for batch in parquet.iter_batches(batch_size=1 << 16, columns=["status", "error_code"]):
            statuses, codes = batch.column(0).to_pylist(), batch.column(1).to_pylist()
            pairs.update(zip(statuses, codes, strict=True))
        counts: Counter[str] = Counter()
        for (status, code), n in pairs.items():
            counts[_outcome(status, code)] += n
        return counts

    def assemble(
        self, files: list[Path], keep: _Keep, out: Path, row_group: int | None = None
    ) -> int:
        """Copy the kept rows of `files` into `out`. With `row_group`, rows are gathered
        into row groups of that many rows (the last one fewer, and fewer where they reach
        ROW_GROUP_BYTES first); without, each read batch is a row group as it comes."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        schemas = [pq.read_schema(f) for f in files]
        try:
            schema = pa.unify_schemas(schemas, promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise OutputError(f"the segments' columns do not agree ({exc})") from None
        rows = 0
        with pq.ParquetWriter(out, schema, **PARQUET_OPTIONS) as writer:
            groups = _Groups(writer, row_group)
            for index, file in enumerate(files):
                start = 0
                for read in pq.ParquetFile(file).iter_batches(batch_size=READ_ROWS):
                    mask = (
                        None
                        if keep.everything
                        else keep(index, start, [str(i) for i in read.column("id").to_pylist()])
                    )
                    start += read.num_rows
                    batch = read if mask is None else read.filter(pa.array(mask))
                    if batch.num_rows and batch.schema == schema:
                        groups.add(pa.Table.from_batches([batch]))
                        rows += batch.num_rows
                    elif batch.num_rows:
                        table = pa.Table.from_batches([batch])
                        for name in schema.names:
                            if name not in table.schema.names:
                                table = table.append_column(
                                    schema.field(name),
                                    pa.nulls(table.num_rows, schema.field(name).type),
                                )
                        groups.add(table.select(schema.names).cast(schema))
                        rows += batch.num_rows
            groups.close()
        return rows


# A bound on a gathered row group's bytes in memory, whatever its rows: 128 MiB, the row
# group size of Parquet's reference writer (and Spark's), so wide rows (embeddings, raw
# outputs) cost a bounded buffer while narrow rows still fill their row count.
ROW_GROUP_BYTES = 128 << 20


class _Groups:
    """Tables written as row groups of `size` rows (None: each table as it comes)."""

    def __init__(self, writer: Any, size: int | None) -> None:
        self._writer = writer
        self._size = size
        self._held: list[Any] = []
        self._rows = 0
        self._bytes = 0

    def add(self, table: Any) -> None:
        if self._size is None:
            self._writer.write_table(table)
            return
        self._held.append(table)
        self._rows += table.num_rows
        self._bytes += table.nbytes
        if self._rows >= self._size or self._bytes >= ROW_GROUP_BYTES:
            self._write(everything=self._bytes >= ROW_GROUP_BYTES)

    def _write(self, *, everything: bool) -> None:
        import pyarrow as pa

        if not self._rows or self._size is None:
            return
        table = pa.concat_tables(self._held)
        whole = table.num_rows if everything else table.num_rows - table.num_rows % self._size
        # The writer cuts a table into groups of row_group_size rows, whatever its chunks.
        self._writer.write_table(table.slice(0, whole), row_group_size=self._size)
        rest = table.slice(whole)
        self._held = [rest] if rest.num_rows else []
        self._rows = rest.num_rows
        self._bytes = rest.nbytes if rest.num_rows else 0

    def close(self) -> None:
        self._write(everything=True)


def _outcome(status: str, code: str | None) -> str:
    """A row's count key: `ok`, or an error row's code (`unknown` where it has none)."""
    if status == wire.STATUS_OK:
        return wire.STATUS_OK
    return code or "unknown"


def output_format(path: Path) -> JsonLines | Parquet:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return Parquet()
    if suffix in (".jsonl", ".ndjson"):
        return JsonLines()
    raise OutputError(f"{path}: the output's extension says its format: .parquet or .jsonl")


# ---------------------------------------------------------------------- the output
@dataclass
class Existing:
    """What the output already holds when a run starts."""

    done: Hashes  # ids not to submit again
    retried: int  # error rows whose ids are submitted again (--retry-failed)
    rows: int
    ok: int
    errors: int
    # Ids with more than one row (a retried error and its new row): the newest row stays.
    contested: Hashes = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))


class Output:
    """The output file, its segments folder, and the open segment of this run."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        parts: Path | None = None,
        tmp: Path | None = None,
        row_group: int | None = None,
    ) -> None:
        """`parts`: the segments folder (default `PATH.parts`); `tmp`: the final merge's
        file before its rename (default `PATH.tmp`, on PATH's filesystem); `row_group`:
        the final file is always assembled, in row groups of at most that many rows."""
        self.path = _written_through(Path(path))
        self.format = output_format(self.path)
        self.parts = parts if parts is not None else self.path.with_name(self.path.name + ".parts")
        self.tmp = tmp if tmp is not None else self.path.with_name(self.path.name + ".tmp")
        self.row_group = row_group
        self.run = 0
        self._seq = 0
        self._open: _Segment | None = None
        self._open_path: Path | None = None
        self.rows_before = 0
        self._lock: IO[str] | None = None

    def segments(self) -> list[Path]:
        """The committed segments, oldest first."""
        if not self.parts.is_dir():
            return []
        found = [p for p in self.parts.iterdir() if _SEGMENT_RE.match(p.name)]
        return sorted(found, key=lambda p: p.name)

    def files(self) -> list[Path]:
        """Every committed file of the output, oldest first."""
        return ([self.path] if self.path.is_file() else []) + self.segments()

    def start(self, *, retry_failed: bool) -> Existing:
        """Make the segments folder, drop segments a killed run left open, and read what
        the output holds."""
        # Arrow's modules load here, at start-up, not at the first row group: a run's
        # clock (and its CPU per job) starts after this.
        import pyarrow.compute
        import pyarrow.parquet  # noqa: F401

        if self.path.is_dir():
            raise OutputError(f"{self.path} is a folder, not an output file")
        try:
            self.parts.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OutputError(f"cannot write beside {self.path}: {exc.strerror or exc}") from None
        # One writer at a time: a second run would delete the first one's open segment.
        # The lock goes with the process, however it ends.
        self._lock = (self.parts / ".lock").open("w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.release()
            raise OutputError(f"another batch is writing {self.path}") from None
        for p in self.parts.iterdir():
            if p.name.endswith(".tmp"):
                p.unlink()
        self._locked()
        runs = [int(m.group(1)) for p in self.segments() if (m := _SEGMENT_RE.match(p.name))]
        self.run = max(runs, default=0) + 1
        return self._existing(retry_failed)

    def _locked(self) -> None:
        """Called by `start` once this run holds the output, before it reads the segments:
        where a subclass brings the segments up to date."""

    @property
    def display(self) -> str:
        """The output as a summary names it."""
        return str(self.path)

    def _existing(self, retry_failed: bool) -> Existing:
        every: list[Hashes] = []
        errors: list[Hashes] = []
        ok = bad = 0
        for file in self.files():
            for ids, statuses in self.format.keys(file):
                hashes = id_hashes(ids)
                every.append(hashes)
                failed = np.fromiter((s != wire.STATUS_OK for s in statuses), dtype=bool)
                bad += int(failed.sum())
                ok += len(ids) - int(failed.sum())
                if retry_failed:
                    errors.append(hashes[failed])
        all_rows = np.concatenate(every) if every else np.zeros(0, dtype=np.uint64)
        all_rows.sort()
        repeated = all_rows[1:][all_rows[1:] == all_rows[:-1]] if len(all_rows) else all_rows
        contested = np.unique(repeated)
        done = np.unique(all_rows)
        retried = 0
        if retry_failed and errors:
            failed_ids = np.unique(np.concatenate(errors))
            # An id whose newest row is ok is done, whatever error rows it had before; the
            # rest of the failed ids are submitted again.
            ok_hashes = self._ok_hashes() if len(contested) else np.zeros(0, dtype=np.uint64)
            again = failed_ids[~contains(ok_hashes, failed_ids)]
            done = done[~contains(again, done)]
            retried = len(again)
            contested = np.union1d(contested, again)
        self.rows_before = len(all_rows)
        return Existing(done, retried, len(all_rows), ok, bad, contested)

    def _ok_hashes(self) -> Hashes:
        found: list[Hashes] = []
        for file in self.files():
            for ids, statuses in self.format.keys(file):
                found.append(
                    id_hashes(i for i, s in zip(ids, statuses, strict=True) if s == wire.STATUS_OK)
                )
        return np.unique(np.concatenate(found)) if found else np.zeros(0, dtype=np.uint64)

    def reply_streams(self) -> list[str]:
        """The reply streams earlier runs over this output noted (runs that did not finish)."""
        try:
            text = (self.parts / _REPLY_STREAMS).read_text(encoding="utf-8")
        except FileNotFoundError:
            return []
        # Only names a run gives its stream: the file must not make a run delete other keys.
        return [n for n in text.splitlines() if ":batch:" in n]

    def note_reply_stream(self, name: str) -> None:
        with (self.parts / _REPLY_STREAMS).open("a", encoding="utf-8") as f:
            f.write(name + "\n")

    def tally(self) -> Counter[str]:
        """The finished output's rows: `ok` and each error code, counted."""
        return self.format.tally(self.path) if self.path.is_file() else Counter()

    # ------------------------------------------------------------------ writing
    def write(self, rows: Rows) -> None:
        if not len(rows):
            return
        segment = self._open
        if isinstance(segment, _ParquetSegment) and not segment.fits(rows):
            self.commit()
        if self._open is None:
            self._seq += 1
            name = f"r{self.run:06d}-{self._seq:06d}{self.format.suffix}"
            self._open_path = self.parts / name
            self._open = self.format.open(self._open_path.with_name(name + ".tmp"))
        self._open.write(rows)

    def commit(self) -> None:
        """Close the open segment and give it its final name: its rows now count."""
        if self._open is None or self._open_path is None:
            return
        self._open.close()
        tmp = self._open_path.with_name(self._open_path.name + ".tmp")
        _fsync(tmp)
        os.replace(tmp, self._open_path)
        _fsync_dir(self.parts)
        self._open = None

    def finish(self, contested: Hashes) -> int:
        """Write `PATH` from the old output and the segments, newest row of each id, and
        remove the segments. Returns the rows in `PATH`."""
        self.commit()
        files = self.files()
        if files == [self.path] and not len(contested):
            # Nothing new: the output stands as it is.
            shutil.rmtree(self.parts, ignore_errors=True)
            return self.rows_before
        if (
            len(files) == 1
            and files[0] != self.path
            and not len(contested)
            and self.row_group is None
        ):
            # One segment and nothing before it (a run within one checkpoint): it is the
            # output as it stands, moved into place rather than copied.
            rows = self.format.rows(files[0])
            os.replace(files[0], self.path)
            _fsync_dir(self.path.parent)
            shutil.rmtree(self.parts, ignore_errors=True)
            return rows
        keep = _KeepNewest(files, self.format, contested)
        tmp = self.tmp
        if not files:
            # Nothing to run and nothing before: an empty output all the same.
            self.format.open(tmp).close()
            rows = 0
        else:
            rows = self.format.assemble(files, keep, tmp, self.row_group)
        _fsync(tmp)
        os.replace(tmp, self.path)
        _fsync_dir(self.path.parent)
        shutil.rmtree(self.parts, ignore_errors=True)
        return rows

    def release(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None


def _written_through(path: Path) -> Path:
    """The file an output path names: a symbolic link's final target (whether or not it
    exists yet), so the output replaces the target and the link stays."""
    if not path.is_symlink():
        return path
    target = Path(os.path.realpath(path, strict=False))
    if target.is_symlink():  # realpath stops at a loop of links
        raise OutputError(f"{path}: a symbolic link that leads round in a loop")
    return target


class _KeepNewest:
    """Which rows of each file go into the final output: all of them, except for the ids in
    `contested`, whose newest row alone is kept (files are listed oldest first)."""

    def __init__(self, files: list[Path], fmt: JsonLines | Parquet, contested: Hashes) -> None:
        self.contested = contested
        self.everything = not len(contested)
        self.newest: dict[int, tuple[int, int]] = {}
        if not len(contested):
            return
        for index, file in enumerate(files):
            start = 0
            for ids, _ in fmt.keys(file):
                hashes = id_hashes(ids)
                for row in np.flatnonzero(contains(contested, hashes)):
                    self.newest[int(hashes[row])] = (index, start + int(row))
                start += len(ids)

    def __call__(self, file: int, start: int, ids: list[str]) -> np.ndarray[Any, Any] | None:
        if not len(self.contested):
            return None
        hashes = id_hashes(ids)
        mask = ~contains(self.contested, hashes)
        for row in np.flatnonzero(~mask):
            mask[row] = self.newest.get(int(hashes[row])) == (file, start + int(row))
        return mask


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    # Some filesystems cannot sync a folder; the rename is still atomic.
    with contextlib.suppress(OSError):
        _fsync(path)

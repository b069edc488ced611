"""The output of a batch run as a Parquet dataset: one file per part, in a folder or under an
object-store prefix, so N clients on N machines can each write their part of one source.

`--out` ending in `/` names the dataset. Part I of N (I from 0; below, PART stands for
`part-IIIII-of-NNNNN`, both numbers in five digits, e.g. `part-00001-of-00003`) writes:

    OUT/PART.parquet            the part's rows, once the part has finished
    OUT/_SUCCESS                once every part has finished (JSON, see below)
    OUT/_gpufeed/dataset.json   {"parts": N, "source": SOURCE}, from the first part's start
    OUT/_gpufeed/PART.json      the finished part's marker and counts
    OUT/_gpufeed/PART/          the part's working state while it runs: committed segments,
                                the lock, its reply streams, the final merge's .tmp

Readers skip names that start with `_` or `.` (`pyarrow.dataset.dataset("OUT/")`, Spark)
or take `OUT/*.parquet` (DuckDB's `read_parquet`), so while parts run and after, they see
finished part files only: a part file appears whole, by an atomic rename (a folder) or an
object put (a store), and nothing temporary ever lies directly in OUT. A part file is
always assembled from its segments, in row groups of at most DATASET_ROW_GROUP rows (fewer
where they reach batch_output.ROW_GROUP_BYTES first), however small the checkpoints were.
A dataset is Parquet only; JSON lines go to one file.

The first part to start records the dataset's shape in `dataset.json` (created
exclusively; a part that loses the race reads it and compares), and a part started with
another N or another source is refused, naming both. Each part's run is an `Output` as for
one file (see batch_output): it resumes from its committed segments, and `--retry-failed`
runs its error rows again. A part that starts removes its own marker, then `_SUCCESS`:
its counts are about to change. A part that finishes writes its part file, then its marker
(part, parts, file, rows, ok, errors, error_codes, finished_at in UTC), then looks at the
markers: where all N are present it writes `_SUCCESS` with their counts summed (parts,
rows, ok, errors, error_codes, files, finished_at). Each part writes its own marker before
it looks, so the last part to finish always sees all N; a look that raced a part starting
again takes its `_SUCCESS` back. Every one of these files is written whole (a rename, or
a put).

An object-store prefix (`s3://`, `gs://`, `az://BUCKET/PREFIX/`) holds the same names as
keys under it. The run writes into a local staging folder (by default
`$XDG_CACHE_HOME/gpufeed/batch/<16 hex of the sha1 of the prefix URL>/PART/`, with
`~/.cache` where XDG_CACHE_HOME is not set) and mirrors it under the prefix:
- at each checkpoint, the newly committed segment is put under `_gpufeed/PART/` (a put is
  whole or absent); one that fails is put again at the next checkpoint;
- at start, committed segments and a finished part file under the prefix that the staging
  folder lacks are fetched first, so a part resumed on another machine skips what the
  first one committed; what the staging folder holds and the prefix no longer has (merged
  by a finish elsewhere, or the prefix emptied) is dropped: the prefix is the dataset, the
  staging folder a copy;
- at finish, the part file is put, then its marker, then the segment objects are deleted,
  then `_SUCCESS` as above. The staging folder keeps the part file (a later run of the
  part starts from it), and its record of what it put (`mirror.json`).
`dataset.json` is put only where absent (a conditional put; a store without them: read
and compare). One client at a time runs a part: its lock holds on one machine only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from producer import wire
from producer.batch_ids import Hashes
from producer.batch_output import _SEGMENT_RE, Existing, Output, OutputError
from producer.object_stores import ENV_PREFIX, open_store

if TYPE_CHECKING:
    from obstore import ObjectMeta
    from obstore.store import ObjectStore

# Rows per row group of a part file. Readers split their work by row group (DuckDB a
# thread per group, Spark a task), so a part of some hundred thousand rows should hold
# several; and they keep statistics per group, which tiny groups make costly. 65,536 rows
# of a classifier's output (a few hundred bytes each) is some ten MiB in memory; wider rows
# are bounded by bytes (batch_output.ROW_GROUP_BYTES).
DATASET_ROW_GROUP = 65_536
SUCCESS = "_SUCCESS"  # Spark's name for it; its readers know to skip it
STATE = "_gpufeed"
DATASET_JSON = f"{STATE}/dataset.json"
STORE_SCHEMES = tuple(ENV_PREFIX)
_PART_RE = re.compile(r"^part-(\d{5})-of-(\d{5})\.parquet$")
_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_REPLY_STREAMS = "reply-streams"  # batch_output's file of a run's reply streams
_MIRROR = "mirror.json"  # the staging folder's record of what the prefix holds


def part_name(part: int, parts: int) -> str:
    return f"part-{part:05d}-of-{parts:05d}"


def open_output(
    out: str, *, part: int = 0, parts: int = 1, source: str, staging: Path | None = None
) -> Output:
    """The output `--out OUT` names: one file (`Output`), or with OUT ending in `/` part
    `part` of `parts` of a dataset in that folder or under that object-store prefix (see
    the module's docstring). `source`: the source's spec, recorded in the dataset;
    `staging`: the local folder of a part under a prefix."""
    if parts < 1 or not 0 <= part < parts:
        raise OutputError(f"part {part} of {parts}: a part is 0 to N-1 of N parts, N at least 1")
    if not out.endswith("/"):
        if _URL_RE.match(out):
            raise OutputError(
                f"{out}: not a local file; an object store takes a dataset: "
                "--out s3://BUCKET/PREFIX/ (ending in /)"
            )
        if parts > 1:
            raise OutputError(f"{out}: a part writes into a dataset, give --out ending in /")
        return Output(out)
    if Path(out.rstrip("/")).suffix.lower() in (".jsonl", ".ndjson"):
        raise OutputError(f"{out}: a dataset is Parquet files; JSON lines go to one file")
    name = part_name(part, parts)
    if _URL_RE.match(out):
        place = _Prefix.parse(out)
        if staging is None:
            digest = hashlib.sha1(place.url("").encode()).hexdigest()[:16]
            staging = _cache_home() / "gpufeed" / "batch" / digest / name
        return MirroredPart(place, part, parts, source, staging=staging)
    root = Path(out)
    return DatasetPart(
        _Folder(root), part, parts, source, path=root / f"{name}.parquet", work=root / STATE / name
    )


def _cache_home() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    # The XDG spec: a relative path is to be ignored.
    return Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _same_source(a: object, b: str) -> bool:
    # A prefix or a folder with or without its final slash lists the same items.
    return isinstance(a, str) and a.rstrip("/") == b.rstrip("/")


# ---------------------------------------------------------------------- where it lives
class _Folder:
    """The dataset's shared files in a local folder."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def url(self, name: str) -> str:
        return str(self.root / name) if name else f"{self.root}/"

    def prepare(self) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise OutputError(f"{self.root}: a file; a dataset's --out is a folder")
        try:
            (self.root / STATE).mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise OutputError(f"{self.url('')}: a file where a folder should be") from None
        except OSError as exc:
            raise OutputError(f"cannot make {self.url('')}: {exc.strerror or exc}") from None
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise OutputError(f"{self.url('')}: not writable")

    def read(self, name: str) -> bytes | None:
        try:
            return (self.root / name).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise OutputError(f"cannot read {self.root / name}: {exc.strerror or exc}") from None

    def _staged(self, name: str, data: bytes) -> Path:
        """`data` in a new file beside the dataset's state, never directly in the root
        (readers take every visible file there)."""
        tmp = self.root / STATE / f".{Path(name).name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def write(self, name: str, data: bytes) -> None:
        try:
            tmp = self._staged(name, data)
            os.replace(tmp, self.root / name)
        except OSError as exc:
            raise OutputError(f"cannot write {self.root / name}: {exc.strerror or exc}") from None

    def create(self, name: str, data: bytes) -> bool:
        """Write `name` whole unless it exists: True where this call made it."""
        target = self.root / name
        try:
            tmp = self._staged(name, data)
            try:
                # A link fails where the name exists: exclusive, and whole when it appears.
                os.link(tmp, target)
                return True
            except FileExistsError:
                return False
            except OSError:
                # A filesystem without hard links: the last writer wins, and each writer
                # then reads what stands and compares.
                if target.exists():
                    return False
                os.replace(tmp, target)
                return True
            finally:
                tmp.unlink(missing_ok=True)
        except OSError as exc:
            raise OutputError(f"cannot write {target}: {exc.strerror or exc}") from None

    def delete(self, name: str) -> None:
        try:
            (self.root / name).unlink(missing_ok=True)
        except OSError as exc:
            raise OutputError(f"cannot remove {self.root / name}: {exc.strerror or exc}") from None

    def names(self, folder: str) -> list[str]:
        """The files directly in `folder` ("" for the root)."""
        try:
            return [e.name for e in os.scandir(self.root / folder) if e.is_file()]
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise OutputError(f"cannot list {self.root / folder}: {exc.strerror or exc}") from None


class _Prefix:
    """The dataset's objects under `scheme://bucket/prefix`."""

    def __init__(self, scheme: str, bucket: str, prefix: str, store: ObjectStore) -> None:
        self.scheme, self.bucket, self.prefix, self.store = scheme, bucket, prefix, store

    @classmethod
    def parse(cls, out: str) -> _Prefix:
        parts = urlsplit(out)
        scheme = parts.scheme.lower()
        if scheme not in STORE_SCHEMES:
            raise OutputError(
                f"{out}: unknown scheme {parts.scheme}://; a dataset goes to a folder or to "
                "s3://, gs://, az://BUCKET/PREFIX/"
            )
        if not parts.netloc or parts.query or parts.fragment:
            raise OutputError(f"{out}: a dataset under a store is {scheme}://BUCKET/PREFIX/")
        prefix = parts.path.lstrip("/")
        segments = prefix.rstrip("/").split("/") if prefix.rstrip("/") else []
        if any(s in ("", ".", "..") for s in segments):
            raise OutputError(f"{out}: an empty, . or .. step in the prefix")
        from obstore.exceptions import BaseError

        try:
            store = open_store(scheme, parts.netloc)
        except (BaseError, ValueError) as exc:
            raise OutputError(f"{out}: {_reason(exc)}") from None
        return cls(scheme, parts.netloc, prefix, store)

    def url(self, name: str) -> str:
        return f"{self.scheme}://{self.bucket}/{self.prefix}{name}"

    def key(self, name: str) -> str:
        return self.prefix + name

    @contextlib.contextmanager
    def _errors(self, doing: str, name: str) -> Iterator[None]:
        from obstore.exceptions import BaseError

        try:
            yield
        except (BaseError, OSError) as exc:
            raise OutputError(f"cannot {doing} {self.url(name)}: {_reason(exc)}") from None

    def prepare(self) -> None:
        """Nothing to make: a prefix exists once an object is under it."""

    def read(self, name: str) -> bytes | None:
        import obstore

        with self._errors("read", name):
            try:
                return bytes(obstore.get(self.store, self.key(name)).bytes())
            except FileNotFoundError:
                return None

    def head(self, name: str) -> ObjectMeta | None:
        import obstore

        with self._errors("read", name):
            try:
                return obstore.head(self.store, self.key(name))
            except FileNotFoundError:
                return None

    def write(self, name: str, data: bytes) -> None:
        import obstore

        with self._errors("write", name):
            obstore.put(self.store, self.key(name), data)

    def create(self, name: str, data: bytes) -> bool:
        import obstore
        from obstore.exceptions import AlreadyExistsError, NotSupportedError, PreconditionError

        with self._errors("write", name):
            try:
                obstore.put(self.store, self.key(name), data, mode="create")
                return True
            except (AlreadyExistsError, PreconditionError):
                return False
            except NotSupportedError:
                # A store without conditional puts: each writer reads what stands and
                # compares, which catches all but a race to the first put.
                if self.read(name) is not None:
                    return False
                obstore.put(self.store, self.key(name), data)
                return True

    def delete(self, name: str) -> None:
        self.delete_keys([self.key(name)], name)

    def delete_keys(self, keys: list[str], name: str) -> None:
        import obstore

        if not keys:
            return
        with self._errors("remove", name), contextlib.suppress(FileNotFoundError):
            obstore.delete(self.store, keys)

    def names(self, folder: str) -> list[str]:
        """The objects directly under `folder` ("" for the prefix itself)."""
        import obstore

        with self._errors("list", folder):
            found = obstore.list_with_delimiter(self.store, self.key(folder) or None)
        return [o["path"].rsplit("/", 1)[-1] for o in found["objects"]]

    def listed(self, folder: str) -> dict[str, ObjectMeta]:
        """The objects under `folder`, by name relative to it."""
        import obstore

        start = self.key(folder)
        found: dict[str, ObjectMeta] = {}
        with self._errors("list", folder):
            for chunk in obstore.list(self.store, start, chunk_size=1000):
                for meta in chunk:
                    found[meta["path"][len(start) :]] = meta
        return found

    def put_file(self, name: str, path: Path) -> str | None:
        """Put the file `path` at `name`; its e_tag."""
        import obstore

        with self._errors("write", name):
            return obstore.put(self.store, self.key(name), path)["e_tag"]

    def get_file(self, name: str, path: Path) -> ObjectMeta:
        """Fetch `name` into `path` whole (through `path.tmp`); its metadata."""
        import obstore

        tmp = path.with_name(path.name + ".tmp")
        with self._errors("fetch", name):
            result = obstore.get(self.store, self.key(name))
            with tmp.open("wb") as f:
                for chunk in result.stream():
                    f.write(chunk)
            os.replace(tmp, path)
            return result.meta


def _reason(exc: BaseException) -> str:
    """An error's one line: a store's HTTP status and message, or its first line."""
    text = str(exc).strip()
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    message = re.search(r"<Message>(.*?)</Message>", text)
    status = re.search(r"status code: ([^:<]+)", text)
    if message and status:
        # The store's own words; the request's URL and timing say nothing to a user.
        return f"{status.group(1).strip()}: {message.group(1)}"
    first = text.splitlines()[0] if text else type(exc).__name__
    return first.split(": <?xml", 1)[0]


# ---------------------------------------------------------------------- a part
class DatasetPart(Output):
    """Part `part` of `parts` of a dataset in a local folder."""

    def __init__(
        self,
        place: _Folder | _Prefix,
        part: int,
        parts: int,
        source: str,
        *,
        path: Path,
        work: Path,
    ) -> None:
        self.name = part_name(part, parts)
        self.file_name = f"{self.name}.parquet"
        super().__init__(
            path,
            parts=work,
            tmp=work / f"{self.file_name}.tmp",
            row_group=DATASET_ROW_GROUP,
        )
        self.place = place
        self.part = part
        self.parts_total = parts
        self.source = source
        self._marker = f"{STATE}/{self.name}.json"
        self._counts: Counter[str] | None = None

    @property
    def display(self) -> str:
        return self.place.url(self.file_name)

    # ------------------------------------------------------------------ start
    def start(self, *, retry_failed: bool) -> Existing:
        self._counts = None
        self.place.prepare()
        self._check_shape()
        try:
            return super().start(retry_failed=retry_failed)
        except BaseException:
            self.release()
            raise

    def _check_shape(self) -> None:
        """Record the dataset's shape, or refuse a part of another shape."""
        want = {"parts": self.parts_total, "source": self.source}
        for _ in range(2):
            found = self.place.read(DATASET_JSON)
            if found is None:
                self._check_alone()
                if self.place.create(DATASET_JSON, _json(want)):
                    return
                found = self.place.read(DATASET_JSON)
                if found is None:  # removed between the two: try again
                    continue
            try:
                shape = json.loads(found)
                parts, source = shape["parts"], shape["source"]
            except (ValueError, KeyError, TypeError):
                raise OutputError(
                    f"{self.place.url(DATASET_JSON)}: not a gpufeed dataset's record"
                ) from None
            if parts != self.parts_total or not _same_source(source, self.source):
                raise OutputError(
                    f"{self.place.url('')}: a dataset of {parts} parts of {source}, "
                    f"not {self.parts_total} parts of {self.source}"
                )
            return
        raise OutputError(f"{self.place.url(DATASET_JSON)}: removed while this part started")

    def _check_alone(self) -> None:
        """A new dataset's folder holds no other Parquet file: its readers would take it."""
        for name in self.place.names(""):
            match = _PART_RE.match(name)
            if name.lower().endswith(".parquet") and (
                match is None or int(match.group(2)) != self.parts_total
            ):
                raise OutputError(
                    f"{self.place.url('')} holds {name}, not a part of this dataset: "
                    "a dataset's folder holds its parts alone"
                )

    def _locked(self) -> None:
        # This part's counts are about to change: its marker goes first, so no part
        # finishing now can count it into a new _SUCCESS, then _SUCCESS.
        self.place.delete(self._marker)
        self.place.delete(SUCCESS)

    # ------------------------------------------------------------------ finish
    def tally(self) -> Counter[str]:
        return Counter(self._counts) if self._counts is not None else super().tally()

    def finish(self, contested: Hashes) -> int:
        rows = super().finish(contested)
        counts = super().tally()
        self._counts = counts
        self._published()
        ok = counts.get(wire.STATUS_OK, 0)
        codes = {k: v for k, v in sorted(counts.items()) if k != wire.STATUS_OK}
        marker = {
            "part": self.part,
            "parts": self.parts_total,
            "file": self.file_name,
            "rows": rows,
            "ok": ok,
            "errors": rows - ok,
            "error_codes": codes,
            "finished_at": _now(),
        }
        self.place.write(self._marker, _json(marker))
        self._finished()
        self._succeed()
        return rows

    def _published(self) -> None:
        """The part file stands where readers find it (a folder: it was renamed there)."""

    def _finished(self) -> None:
        """The marker is written: what the part no longer needs can go."""

    def _succeed(self) -> None:
        """`_SUCCESS` where every part's marker is present."""
        markers = [f"{part_name(i, self.parts_total)}.json" for i in range(self.parts_total)]
        present = set(self.place.names(f"{STATE}/"))
        if not present.issuperset(markers):
            return
        total: dict[str, Any] = {"parts": self.parts_total, "rows": 0, "ok": 0, "errors": 0}
        codes: Counter[str] = Counter()
        files: list[str] = []
        for name in markers:
            data = self.place.read(f"{STATE}/{name}")
            if data is None:  # a part started again since the listing
                return
            try:
                marker = json.loads(data)
                for key in ("rows", "ok", "errors"):
                    total[key] += int(marker[key])
                codes.update({str(k): int(v) for k, v in marker["error_codes"].items()})
                files.append(str(marker["file"]))
            except (ValueError, KeyError, TypeError, AttributeError):
                raise OutputError(f"{self.place.url(STATE + '/' + name)}: unreadable") from None
        total["error_codes"] = dict(sorted(codes.items()))
        total["files"] = files
        total["finished_at"] = _now()
        self.place.write(SUCCESS, _json(total))
        # A part that started again after the listing removed its marker before _SUCCESS:
        # where its removal of _SUCCESS came before this write, the write is taken back.
        if not set(self.place.names(f"{STATE}/")).issuperset(markers):
            self.place.delete(SUCCESS)


def _json(value: object) -> bytes:
    return (json.dumps(value, ensure_ascii=False, indent=1) + "\n").encode()


# ---------------------------------------------------------------------- a mirrored part
class MirroredPart(DatasetPart):
    """Part `part` of `parts` of a dataset under an object-store prefix, written in a local
    staging folder and mirrored there."""

    def __init__(
        self, place: _Prefix, part: int, parts: int, source: str, *, staging: Path
    ) -> None:
        name = part_name(part, parts)
        super().__init__(
            place, part, parts, source, path=staging / f"{name}.parquet", work=staging / "work"
        )
        self.prefix = place
        self.staging = staging
        self._work = f"{STATE}/{name}/"
        # The last checkpoint's failure to mirror, if any (tried again at the next one).
        self.mirror_error: str | None = None

    def start(self, *, retry_failed: bool) -> Existing:
        try:
            self.staging.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OutputError(
                f"cannot make the staging folder {self.staging}: {exc.strerror or exc}"
            ) from None
        return super().start(retry_failed=retry_failed)

    # ------------------------------------------------------------------ the record
    def _state(self) -> dict[str, Any]:
        """What the staging folder knows the prefix holds: `segments` it put there, and
        the `part` file it put or fetched (e_tag, size, mtime_ns)."""
        try:
            state = json.loads((self.staging / _MIRROR).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {"segments": [], "part": None}
        if not isinstance(state, dict) or state.get("prefix") != self.prefix.url(""):
            return {"segments": [], "part": None}
        return state

    def _save(self, state: dict[str, Any]) -> None:
        state["prefix"] = self.prefix.url("")
        tmp = self.staging / f"{_MIRROR}.tmp"
        tmp.write_text(json.dumps(state), encoding="utf-8")
        os.replace(tmp, self.staging / _MIRROR)

    def _local_part(self, e_tag: str | None) -> dict[str, Any]:
        stat = self.path.stat()
        return {"e_tag": e_tag, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}

    # ------------------------------------------------------------------ start
    def _locked(self) -> None:
        super()._locked()
        state = self._state()
        remote = self.prefix.head(self.file_name)
        known = state.get("part")
        # The part file under the prefix is not the one this folder last put or fetched:
        # another machine finished the part, or the prefix was emptied. What this folder
        # holds and the prefix lacks is older than that, and goes.
        superseded = (remote is None) != (known is None) or (
            remote is not None and known is not None and remote["e_tag"] != known["e_tag"]
        )
        if remote is None:
            if superseded:
                self.path.unlink(missing_ok=True)
                state["part"] = None
        elif superseded or not self.path.is_file():
            meta = self.prefix.get_file(self.file_name, self.path)
            state["part"] = self._local_part(meta["e_tag"])
        listed = self.prefix.listed(self._work)
        segments = {n: m for n, m in listed.items() if _SEGMENT_RE.match(n)}
        mirrored = set(state.get("segments", []))
        for local in self.segments():
            there = segments.get(local.name)
            if there is None and (superseded or local.name in mirrored):
                local.unlink()
                mirrored.discard(local.name)
            elif there is not None and there["size"] != local.stat().st_size:
                self.prefix.get_file(self._work + local.name, local)
        have = {p.name for p in self.segments()}
        for name in sorted(set(segments) - have):
            self.prefix.get_file(self._work + name, self.parts / name)
        state["segments"] = sorted(mirrored | set(segments))
        self._merge_reply_streams(listed)
        self._save(state)
        self._mirror(state)

    def _merge_reply_streams(self, listed: dict[str, ObjectMeta]) -> None:
        """Earlier runs' reply streams, from this folder and the prefix."""
        if _REPLY_STREAMS not in listed:
            return
        theirs = (self.prefix.read(self._work + _REPLY_STREAMS) or b"").decode("utf-8", "replace")
        path = self.parts / _REPLY_STREAMS
        mine = path.read_text(encoding="utf-8") if path.is_file() else ""
        names = dict.fromkeys([*mine.splitlines(), *theirs.splitlines()])
        path.write_text("".join(f"{n}\n" for n in names if n), encoding="utf-8")

    # ------------------------------------------------------------------ running
    def _mirror(self, state: dict[str, Any] | None = None) -> None:
        """Put the committed segments the prefix lacks; a failure waits for the next
        checkpoint (the rows are safe in the staging folder)."""
        state = state if state is not None else self._state()
        mirrored = set(state.get("segments", []))
        try:
            for segment in self.segments():
                if segment.name not in mirrored:
                    self.prefix.put_file(self._work + segment.name, segment)
                    mirrored.add(segment.name)
            self.mirror_error = None
        except OutputError as exc:
            self.mirror_error = str(exc)
        state["segments"] = sorted(mirrored)
        self._save(state)

    def commit(self) -> None:
        new = self._open is not None
        super().commit()
        if new or self.mirror_error is not None:
            self._mirror()

    def note_reply_stream(self, name: str) -> None:
        super().note_reply_stream(name)
        # The stream is deleted by whichever machine runs the part next; failing that, by
        # its own run at its end.
        with contextlib.suppress(OutputError):
            self.prefix.put_file(self._work + _REPLY_STREAMS, self.parts / _REPLY_STREAMS)

    # ------------------------------------------------------------------ finish
    def _published(self) -> None:
        state = self._state()
        known = state.get("part")
        stat = self.path.stat()
        if known is not None and (known["size"], known["mtime_ns"]) == (
            stat.st_size,
            stat.st_mtime_ns,
        ):
            remote = self.prefix.head(self.file_name)
            if remote is not None and remote["e_tag"] == known["e_tag"]:
                return  # the prefix holds this file already
        e_tag = self.prefix.put_file(self.file_name, self.path)
        state["part"] = self._local_part(e_tag)
        self._save(state)

    def _finished(self) -> None:
        keys = [self.prefix.key(self._work + n) for n in self.prefix.listed(self._work)]
        self.prefix.delete_keys(keys, self._work)
        state = self._state()
        state["segments"] = []
        self._save(state)

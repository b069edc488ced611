"""Reading the image of a `path` job, confined to the worker's GPUFEED_PATH_ROOT.

Called from decode threads; it only opens, stats and reads one file.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from producer.wire import ErrorCode
from worker.decode.cpu import DecodeError

_MAX_SHOWN = 200
_PROC_FD = "/proc/self/fd"
# O_NONBLOCK: opening a FIFO someone left under the root must fail the job, not block a
# decode thread until a writer shows up. O_NOFOLLOW: the final component was a regular name
# when we resolved it; if it has become a symlink since, refuse rather than follow it.
_OPEN_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_NOFOLLOW", 0)
)


def read_job_path(raw_path: bytes, root: Path | None, max_bytes: int) -> bytes:
    """The bytes of the file `raw_path` names, which must lie inside `root`.

    Relative paths are relative to `root`; absolute ones must resolve inside it. Symlinks
    are followed, and the resolved target must be inside the resolved root.
    """
    if root is None:
        raise DecodeError(
            ErrorCode.PATH_DISABLED,
            "path jobs are disabled: the worker has no GPUFEED_PATH_ROOT",
        )
    try:
        text = raw_path.decode("utf-8")
    except UnicodeDecodeError:
        raise DecodeError(ErrorCode.INVALID_JOB, "path is not valid UTF-8") from None
    if not text:
        raise DecodeError(ErrorCode.INVALID_JOB, "path is empty")
    if "\x00" in text:
        # No file name can hold a NUL; it is a malformed job (and the classic trick to cut
        # a path short in C APIs), refused before it reaches the OS.
        raise DecodeError(ErrorCode.INVALID_JOB, "path contains a NUL byte")
    shown = _shown(text)

    # Strings, not pathlib: the same resolution (os.path.realpath is what Path.resolve
    # calls) at a third of the cost, which a decode process pays per `path` job. The root
    # is resolved each time: a symlinked root swapped to a new folder is followed.
    try:
        base = os.path.realpath(root)
        # Containment is judged on the non-strict resolution first, so a path outside the
        # root is forbidden whether or not it exists: the answer must not reveal which
        # files exist outside the root.
        target = os.path.realpath(os.path.join(base, text))
    except (OSError, RuntimeError, ValueError):  # RuntimeError: a symlink loop (< 3.13)
        raise DecodeError(ErrorCode.PATH_NOT_FOUND, f"cannot resolve path {shown}") from None
    if not _inside(target, base):
        raise DecodeError(ErrorCode.FORBIDDEN_PATH, f"path {shown} is outside the allowed root")

    try:
        fd = os.open(target, _OPEN_FLAGS)
    except OSError:
        raise DecodeError(ErrorCode.PATH_NOT_FOUND, f"no readable file at {shown}") from None
    try:
        # Judge what was opened, not what the name pointed at a moment earlier: a path
        # component swapped for a symlink between resolve() and open() would otherwise
        # escape the root.
        real = _opened_path(fd)
        if real is not None and not _inside(real, base):
            raise DecodeError(ErrorCode.FORBIDDEN_PATH, f"path {shown} is outside the allowed root")
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DecodeError(ErrorCode.PATH_NOT_FOUND, f"{shown} is not a regular file")
        if st.st_size > max_bytes:
            # The limit, not the file's size: errors tell no more about a file than that.
            raise DecodeError(
                ErrorCode.PAYLOAD_TOO_LARGE, f"{shown} is over the limit of {max_bytes} bytes"
            )
        # One byte past the limit tells a file that grew since the fstat apart from one
        # that is exactly at it.
        data = _read_up_to(fd, max_bytes + 1, first=st.st_size + 1)
    except OSError:
        raise DecodeError(ErrorCode.PATH_NOT_FOUND, f"cannot read {shown}") from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise DecodeError(
            ErrorCode.PAYLOAD_TOO_LARGE, f"{shown} is over the limit of {max_bytes} bytes"
        )
    return data


def _opened_path(fd: int) -> str | None:
    """Where the kernel says `fd` points, where it can tell (Linux /proc), else None."""
    try:
        return os.readlink(f"{_PROC_FD}/{fd}")
    except OSError:
        return None


def _inside(path: str, base: str) -> bool:
    """`path` is `base` or below it (both resolved): Path.is_relative_to, on strings."""
    return path == base or path.startswith(base.rstrip(os.sep) + os.sep)


def _read_up_to(fd: int, limit: int, first: int) -> bytes:
    chunks: list[bytes] = []
    remaining = limit
    # The first read asks for the whole file as fstat saw it (plus one byte to see EOF), so
    # the usual case is one read and no join copy; the loop only serves files that grow.
    want = min(remaining, first)
    while remaining > 0:
        chunk = os.read(fd, want)
        if not chunk:
            break
        chunks.append(chunk)
        remaining -= len(chunk)
        want = min(remaining, 1 << 20)
    return b"".join(chunks)


def _shown(text: str) -> str:
    """The path as echoed in error messages: quoted, and never unboundedly long."""
    if len(text) > _MAX_SHOWN:
        text = text[: _MAX_SHOWN - 3] + "..."
    return repr(text)

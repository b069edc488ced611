"""Looking up what a setting names on the file system, without a traceback."""

from __future__ import annotations

import os
from pathlib import Path


def path_problem(text: str | Path) -> str | None:
    """Why the file system cannot even look `text` up (a name or path too long for it, a
    link loop, a folder on the way it may not search, a NUL, ~user of no user); None when
    it can, whether or not anything is there. Every setting that names a file or folder
    goes through here (or `lookup`) first: pathlib's is_dir() and is_file() raise for
    most of these, and the worker would end in a traceback, not a setting error."""
    return _stat(text)[1]


def lookup(text: str | Path) -> os.stat_result | None:
    """What `text` names (links followed), or None when nothing is there or `path_problem`
    says why it cannot be looked up."""
    return _stat(text)[0]


def _stat(text: str | Path) -> tuple[os.stat_result | None, str | None]:
    try:
        return os.stat(Path(text).expanduser()), None
    except (FileNotFoundError, NotADirectoryError):
        return None, None
    except RuntimeError:
        return None, "names the home of a user who does not exist"
    except OSError as exc:
        return None, f"cannot be looked up ({exc.strerror or type(exc).__name__})"
    except ValueError:  # a NUL, or text the file system's encoding cannot take
        return None, "cannot be a file name (a NUL or text that is no file name)"

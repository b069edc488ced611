"""quiet_native_stderr(): the profiler's native log lines kept out of the report."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator

# Kineto's own log lines ("USDT:... profiler_start", "ERROR:... gpuGetDeviceCount failed"
# on hosts without a GPU, and its complaint that the profiler starts on another thread than
# the one that first registered it: the launch thread, on purpose) go straight to file
# descriptor 2; they are noise in a report.
_KINETO_LINE = re.compile(
    rb"^(USDT|INFO|WARNING|ERROR|STAGE):\d{4}-\d\d-\d\d "
    rb"|^ERROR: External init callback must run in same thread"
)


@contextlib.contextmanager
def quiet_native_stderr() -> Iterator[None]:
    """Hold back what native code writes to fd 2 meanwhile, and pass on all but kineto's
    own chatter."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    with tempfile.TemporaryFile() as capture:
        sys.stderr.flush()
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            kept = [
                line for line in capture.read().splitlines(True) if not _KINETO_LINE.match(line)
            ]
            if kept:
                os.write(2, b"".join(kept))

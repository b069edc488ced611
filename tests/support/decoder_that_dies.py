"""A decode process that ends as soon as it is given work, before it starts any row (a
fault outside any decode): `tests/decode/test_decode_processes.py` runs it in place of the real
one (`worker.decode.processes.CHILD_MODULE`)."""

from __future__ import annotations

import os
import sys
from typing import Any

from worker.decode import process_main


def _end(*args: Any, **kwargs: Any) -> Any:
    os._exit(3)


if __name__ == "__main__":
    # Ready, it is given a run and ends before its first row.
    process_main.decode_run = _end
    sys.exit(process_main.main(sys.argv[1:]))

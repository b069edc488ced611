"""A decode process that takes longer over some images: `tests/decode/test_decode_routing.py` runs
it in place of the real one (`worker.decode.processes.CHILD_MODULE`). An image ending in
`TAIL` sleeps `DECODE_ROUTING_TEST_SLOW_S` seconds before its decode, and the process notes
its pid in the file `DECODE_ROUTING_TEST_LOG` names as it starts it. Sleeping keeps the
timings the same on a busy two-core machine as on an idle one. Only what the real process
imports is imported here, so it starts as fast."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from worker.decode import process_main

# The last 64 bytes every slow image ends with (the routing fingerprint's tail).
TAIL = b"slow-image-tail:" + bytes(range(48))
SLOW_ENV = "DECODE_ROUTING_TEST_SLOW_S"
LOG_ENV = "DECODE_ROUTING_TEST_LOG"


def main(argv: list[str]) -> int:
    delay = float(os.environ.get(SLOW_ENV, "0"))
    log = os.environ[LOG_ENV]
    decode = process_main.RowDecoder.decode

    def slow_decode(self: Any, row: int, data: Any, *args: Any) -> None:
        if data is not None and bytes(data[-len(TAIL) :]) == TAIL:
            with open(log, "a") as f:
                f.write(f"{os.getpid()}\n")
            time.sleep(delay)
        decode(self, row, data, *args)

    process_main.RowDecoder.decode = slow_decode  # type: ignore[method-assign]
    return process_main.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

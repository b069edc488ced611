import signal
import sys

# `python -m worker [run] ...` is the worker: a SIGTERM before its own handlers exist
# (importing torch takes seconds on a busy host) finds nothing read from the stream yet,
# so stopping is simply exiting, with 0 like a drained worker, not death by signal.
if len(sys.argv) < 2 or sys.argv[1] == "run" or sys.argv[1].startswith("-"):
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))

from worker.cli import main

main()

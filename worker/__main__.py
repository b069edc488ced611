import signal
import sys

# `python -m worker [run] ...` is the worker: a SIGTERM before its own handlers exist
# (importing torch takes seconds on a busy host) finds nothing read from the stream yet,
# so stopping is simply exiting, with 0 like a drained worker, not death by signal.
from worker.quick_exit import exit_now

if len(sys.argv) < 2 or sys.argv[1] == "run" or sys.argv[1].startswith("-"):
    signal.signal(signal.SIGTERM, lambda signum, frame: exit_now())

# After the handler: importing the CLI takes a while.
from worker.cli import main

main()

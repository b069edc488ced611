"""The worker's child processes, the one way they are built: `child.py` starts a child with
its sockets and inherited files, waits for its ready message with a timeout, ends it, and
counts the children that ended before they proved themselves (`Restarts`, where a protocol
decides to replace one or give up); `frames.py` is what crosses their sockets (a
length-prefixed msgpack frame, an optional raw tail sent from the caller's buffers, the
exact-receive helper, one sender thread); `messages.py` holds the typed messages, one
NamedTuple each, whose field order is written once, in the class. The decode processes
(worker/decode/processes.py), the intake's process (worker/delivery/intake_process.py) and
the result writer's process (worker/delivery/writer_process.py) are built on it.

It imports nothing else of the project: the decode processes import it, and they must start
without torch.

May import: base.
"""

"""The child-process toolkit (worker/ipc/): frames cross whole and in order however the
socket cuts them, a tail's buffers arrive as sent, every typed message of every protocol
comes back as it went, a side a field short fails instead of reading the wrong field, and
a child is ready, late or dead as it says.

Run as ``python -m tests.ipc.test_ipc <fds>``, this module is the child of the tests below."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import select
import socket
import sys
import threading
import time
import types
import typing
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.decode.process_main import DECODE
from worker.delivery.intake_main import INTAKE
from worker.delivery.writer_main import WRITER
from worker.ipc import frames
from worker.ipc.child import Child, ChildNotReady, Restarts, owned_by_the_worker
from worker.ipc.frames import HEAD, BadFrame, FrameBuffer, Receiver, Sender
from worker.ipc.messages import Ready, Wire

# ----------------------------------------------------------------- a protocol of tests


class Start(NamedTuple):
    mode: str  # "echo", "exit" (before ready), "silent" (never ready)


class Note(NamedTuple):
    token: int
    text: str
    data: bytes | None
    values: list[float]
    extra: dict[str, int]


class Echoed(NamedTuple):
    note: list[Any]  # a Note's fields: a message holds plain values, not messages
    tail: bytes


TESTS = Wire("test", Start, Note, Echoed)


def _protocols() -> list[Wire]:
    """Every protocol's table: a message added to one is round-tripped below."""
    return [TESTS, DECODE, INTAKE, WRITER]


# ------------------------------------------------------------- values from the fields


def _values(hint: Any) -> st.SearchStrategy[Any]:
    """Values of type `hint` as a message field may hold them."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    scalars: dict[Any, st.SearchStrategy[Any]] = {
        int: st.integers(-(2**63), 2**64 - 1),
        float: st.floats(allow_nan=False),
        bool: st.booleans(),
        str: st.text(max_size=20),
        bytes: st.binary(max_size=40),
        type(None): st.none(),
    }
    if hint in scalars:
        return scalars[hint]
    if hint is Any:
        return st.one_of(*scalars.values())
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(_values(a) for a in args))
    if origin is list:
        return st.lists(_values(args[0]), max_size=4)
    if origin is tuple:
        items = [_values(a) for a in args if a is not Ellipsis]
        return st.lists(items[0], max_size=4).map(tuple) if Ellipsis in args else st.tuples(*items)
    if origin is dict:
        return st.dictionaries(_values(args[0]), _values(args[1]), max_size=4)
    if dataclasses.is_dataclass(hint):
        return _built(hint, [f.name for f in dataclasses.fields(hint)])
    raise TypeError(f"no values for {hint!r}: give the test a strategy for it")


def _built(kind: type[Any], names: list[str]) -> st.SearchStrategy[Any]:
    """Instances of `kind`, each of `names` drawn from the type its class declares."""
    hints = typing.get_type_hints(kind, globalns=vars(sys.modules[kind.__module__]))
    return st.builds(kind, **{name: _values(hints[name]) for name in names})


def _messages(kind: type[Any]) -> st.SearchStrategy[Any]:
    """Messages of `kind`: a NamedTuple's fields, or a dataclass's (one that crosses by
    `to_wire`, by name)."""
    if dataclasses.is_dataclass(kind):
        return _values(kind)
    return _built(kind, list(kind._fields))


def _plain(value: Any) -> Any:
    """`value` as msgpack gives it back: tuples as lists."""
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _every_message() -> st.SearchStrategy[tuple[Wire, Any]]:
    pairs = [
        st.tuples(st.just(wire), _messages(kind)) for wire in _protocols() for kind in wire.kinds
    ]
    return st.one_of(*pairs)


@settings(max_examples=400, deadline=None)
@given(_every_message())
def test_every_message_of_every_protocol_comes_back_as_it_went(pair: tuple[Wire, Any]) -> None:
    wire, message = pair
    frame = wire.frame(message)
    (got,) = _buffer_of(frame).take(wire.message)
    assert type(got) is type(message)
    if hasattr(message, "_fields"):
        assert _plain(tuple(got)) == _plain(tuple(message))
    else:
        assert got == message


def _buffer_of(data: bytes) -> FrameBuffer:
    buffer = FrameBuffer()
    buffer.feed(data)
    return buffer


def test_a_side_a_field_short_fails_at_its_first_message() -> None:
    """The sender's message has a field the receiver's class has not (or the other way
    round): the message is refused whole, never read one field off."""

    class NoteWithMore(NamedTuple):
        token: int
        text: str
        data: bytes | None
        values: list[float]
        extra: dict[str, int]
        added: str

    newer = Wire("test", Start, NoteWithMore, Echoed)
    with pytest.raises(BadFrame, match="a test Note has 5 fields, not"):
        TESTS.message(newer.body(NoteWithMore(1, "a", None, [], {}, "new")))
    with pytest.raises(BadFrame, match="a test NoteWithMore has 6 fields, not"):
        newer.message(TESTS.body(Note(1, "a", None, [], {})))
    with pytest.raises(BadFrame, match="a test Ready has 0 fields, not 7"):
        TESTS.message(TESTS.body(Ready())[:-1] + b"\x07")
    unknown = TESTS.body(Ready())
    with pytest.raises(BadFrame, match="not a test message"):
        TESTS.message(bytes([unknown[0], 99, *unknown[2:]]))
    with pytest.raises(BadFrame, match="not a test message"):
        TESTS.message(b"\xc1")


# --------------------------------------------------------------------------- frames


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.builds(Note, st.integers(0, 9), st.text(), st.none(), st.just([]), st.just({}))),
    st.lists(st.integers(1, 64), min_size=1),
)
def test_frames_cut_anywhere_come_whole_and_in_order(notes: list[Note], cuts: list[int]) -> None:
    data = b"".join(TESTS.frame(n) for n in notes)
    buffer = FrameBuffer()
    got: list[Any] = []
    at = 0
    for size in cuts * (len(data) // len(cuts) + 1):
        if at >= len(data):
            break
        buffer.feed(data[at : at + size])
        at += size
        got.extend(buffer.take(TESTS.message))
    assert got == notes
    assert buffer.take(TESTS.message) == []


def test_a_frame_out_of_step_is_an_error() -> None:
    buffer = _buffer_of(b"GARBAGE!" * 4)
    with pytest.raises(BadFrame, match="a frame starts with"):
        buffer.take(TESTS.message)


def test_a_tail_of_many_buffers_arrives_as_sent_without_a_copy_into_the_message() -> None:
    """More buffers than one sendmsg takes, some large enough to be sent in pieces: the
    receiver gets the message and the tail byte for byte, frame after frame."""
    mine, theirs = socket.socketpair()
    sender = Sender(mine, "test-send")
    sender.start()
    tails = [
        [os.urandom(n) for n in ([3] * 1500 + [2_000_000, 0, 5])],
        [memoryview(bytearray(os.urandom(70_000)))[10:60_000]],
        [],
    ]
    received: list[tuple[Any, bytes]] = []

    def receive() -> None:
        receiver = Receiver(theirs, tail_bytes=16)
        while (frame := receiver.next()) is not None:
            body, tail = frame
            received.append((TESTS.message(body), bytes(tail)))

    reading = threading.Thread(target=receive)
    reading.start()
    for i, tail in enumerate(tails):
        sender.put(TESTS.parts(Note(i, "t", None, [], {}), tail))
    sender.close()
    sender.join(30)
    reading.join(30)
    mine.close()
    theirs.close()
    assert [(n.token, t) for n, t in received] == [
        (i, b"".join(bytes(b) for b in tail)) for i, tail in enumerate(tails)
    ]


def test_a_frame_cut_short_is_the_end_of_the_stream() -> None:
    mine, theirs = socket.socketpair()
    with mine, theirs:
        frame = TESTS.frame(Note(1, "x", b"abc", [1.0], {"a": 1}))
        mine.sendall(frame[: HEAD.size + 3])
        mine.shutdown(socket.SHUT_WR)
        assert Receiver(theirs).next() is None


async def test_read_async_reads_what_a_sender_sends() -> None:
    mine, theirs = socket.socketpair()
    reader, writer = await asyncio.open_connection(sock=theirs)
    sender = Sender(mine, "test-send")
    sender.start()
    sender.put(TESTS.parts(Note(4, "n", None, [], {}), [b"tail"]))
    sender.put([TESTS.frame(Start("echo"))])
    sender.close()
    first = await frames.read_async(reader)
    assert first is not None and TESTS.message(first[0]) == Note(4, "n", None, [], {})
    assert first[1] == b"tail"
    second = await frames.read_async(reader)
    assert second is not None and TESTS.message(second[0]) == Start("echo")
    assert await frames.read_async(reader) is None
    sender.join(5)
    writer.close()
    mine.close()


# ------------------------------------------------------------------------- children


def _child(mode: str) -> Child:
    child = Child("tests.ipc.test_ipc", wire=TESTS, sender="test-ipc-send")
    child.send(Start(mode))
    return child


def _until_ready(child: Child, timeout_s: float = 60.0) -> list[Any]:
    seen: list[Any] = []
    child.wait_ready(time.monotonic() + timeout_s, seen.append)
    return seen


def _messages_of(child: Child, count: int) -> Iterator[Any]:
    got = 0
    deadline = time.monotonic() + 30
    while got < count:
        assert time.monotonic() < deadline, "timed out"
        select.select([child.answers], [], [], 1.0)
        messages = child.receive()
        assert messages is not None, "the child ended"
        for message in messages:
            got += 1
            yield message


def test_a_child_is_ready_answers_and_ends_by_itself_once_its_input_closes() -> None:
    child = _child("echo")
    try:
        assert _until_ready(child) == [Ready()]
        assert child.ready
        note = Note(7, "hello", b"\x00\xff", [0.5], {"k": 3})
        child.send_parts(TESTS.parts(note, [b"payload ", bytearray(b"bytes")]))
        (echoed,) = _messages_of(child, 1)
        assert echoed == Echoed(list(note), b"payload bytes")
    finally:
        code = child.end(10)
    # Not killed: it read the end of its socket and exited.
    assert code == 0


def test_a_child_that_exits_before_it_is_ready_says_its_exit_code() -> None:
    child = _child("exit")
    try:
        with pytest.raises(ChildNotReady) as raised:
            _until_ready(child)
    finally:
        child.end(1)
    assert raised.value.child_exit == 3
    said = raised.value.said("the test's process")
    assert said == "the test's process exited with 3 before it was ready (its error is above)"


def test_a_child_that_does_not_answer_in_time_is_not_ready_and_is_killed() -> None:
    child = _child("silent")
    try:
        with pytest.raises(ChildNotReady) as raised:
            _until_ready(child, timeout_s=1.0)
    finally:
        code = child.end(0.2)
    assert raised.value.child_exit is None
    assert raised.value.said("one", "the test's processes") == (
        "the test's processes did not start in 60 s"
    )
    assert code < 0  # killed: its input closed, it still waited for nothing


async def test_the_event_loop_hears_a_child_that_dies() -> None:
    child = _child("echo")
    _until_ready(child)
    loop = asyncio.get_running_loop()
    ended = loop.create_future()

    def readable() -> None:
        if child.receive() is None and not ended.done():
            ended.set_result(None)

    child.watch(loop, readable)
    os.kill(child.pid, 9)
    await asyncio.wait_for(ended, 30)
    assert child.end(5) == -9


def test_restarts_give_up_at_the_limit_of_children_not_proved_in_a_row() -> None:
    restarts = Restarts(3)
    assert not restarts.charge() and not restarts.charge()
    restarts.proved()
    assert [restarts.charge() for _ in range(3)] == [False, False, True]
    assert restarts.given_up


def _serve_as_child(argv: list[str]) -> int:
    owned_by_the_worker()
    data_fd, answers_fd = (int(a) for a in argv[:2])
    with socket.socket(fileno=data_fd) as data, socket.socket(fileno=answers_fd) as answers:
        receiver = Receiver(data)
        first = receiver.next()
        assert first is not None
        start = TESTS.message(first[0])
        if start.mode == "exit":
            return 3
        if start.mode == "silent":
            while receiver.next() is not None:
                pass
            time.sleep(60)
            return 0
        answers.sendall(TESTS.frame(Ready()))
        while (frame := receiver.next()) is not None:
            body, tail = frame
            answers.sendall(TESTS.frame(Echoed(list(TESTS.message(body)), bytes(tail))))
    return 0


if __name__ == "__main__":
    sys.exit(_serve_as_child(sys.argv[1:]))

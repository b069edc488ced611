"""`path` jobs: only regular files inside the worker's root, never anything outside it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from producer.wire import ErrorCode
from worker.decode.cpu import DecodeError
from worker.decode.job_path import read_job_path

LIMIT = 1024
CONTENT = b"\xff\xd8\xff not really a jpeg"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "root"
    (r / "sub").mkdir(parents=True)
    (r / "a.jpg").write_bytes(CONTENT)
    (r / "sub" / "b.jpg").write_bytes(CONTENT + b"b")
    return r


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    o = tmp_path / "outside"
    o.mkdir()
    (o / "secret.jpg").write_bytes(b"secret")
    return o


def refused(raw: bytes, root: Path | None, max_bytes: int = LIMIT) -> DecodeError:
    with pytest.raises(DecodeError) as caught:
        read_job_path(raw, root, max_bytes)
    return caught.value


def test_disabled_without_root() -> None:
    err = refused(b"a.jpg", None)
    assert err.code is ErrorCode.PATH_DISABLED
    assert "GPUFEED_PATH_ROOT" in err.message


def test_relative_path(root: Path) -> None:
    assert read_job_path(b"a.jpg", root, LIMIT) == CONTENT
    assert read_job_path(b"sub/b.jpg", root, LIMIT) == CONTENT + b"b"
    assert read_job_path(b"./sub/../a.jpg", root, LIMIT) == CONTENT


def test_absolute_path_under_root(root: Path) -> None:
    assert read_job_path(str(root / "sub" / "b.jpg").encode(), root, LIMIT) == CONTENT + b"b"


def test_unicode_name(root: Path) -> None:
    (root / "café ☕.png").write_bytes(b"x")
    assert read_job_path("café ☕.png".encode(), root, LIMIT) == b"x"


def test_root_given_through_a_symlink(root: Path, tmp_path: Path) -> None:
    alias = tmp_path / "alias"
    alias.symlink_to(root)
    assert read_job_path(b"a.jpg", alias, LIMIT) == CONTENT
    assert read_job_path(str(root / "a.jpg").encode(), alias, LIMIT) == CONTENT


def test_dotdot_escape(root: Path, outside: Path) -> None:
    err = refused(b"../outside/secret.jpg", root)
    assert err.code is ErrorCode.FORBIDDEN_PATH
    assert refused(b"sub/../../outside/secret.jpg", root).code is ErrorCode.FORBIDDEN_PATH


def test_escape_to_missing_file_is_still_forbidden(root: Path, outside: Path) -> None:
    # Answering path_not_found here would tell a client which files exist outside the root.
    assert refused(b"../nope/nothing.jpg", root).code is ErrorCode.FORBIDDEN_PATH
    there = refused(b"../outside/secret.jpg", root).message
    missing = refused(b"../outside/secret.jpx", root).message
    assert there.replace("secret.jpg", "X") == missing.replace("secret.jpx", "X")


def test_absolute_path_outside_root(root: Path, outside: Path) -> None:
    assert refused(str(outside / "secret.jpg").encode(), root).code is ErrorCode.FORBIDDEN_PATH
    assert refused(b"/etc/passwd", root).code is ErrorCode.FORBIDDEN_PATH


def test_sibling_with_common_prefix(root: Path, tmp_path: Path) -> None:
    # "/x/root2/f" starts with the string "/x/root" but is not inside it.
    sibling = tmp_path / "root2"
    sibling.mkdir()
    (sibling / "f.jpg").write_bytes(b"f")
    assert refused(str(sibling / "f.jpg").encode(), root).code is ErrorCode.FORBIDDEN_PATH


def test_symlink_escape(root: Path, outside: Path) -> None:
    (root / "link.jpg").symlink_to(outside / "secret.jpg")
    assert refused(b"link.jpg", root).code is ErrorCode.FORBIDDEN_PATH
    (root / "linkdir").symlink_to(outside)
    assert refused(b"linkdir/secret.jpg", root).code is ErrorCode.FORBIDDEN_PATH


def test_symlink_inside_root(root: Path) -> None:
    (root / "link.jpg").symlink_to(root / "sub" / "b.jpg")
    (root / "rel.jpg").symlink_to("sub/b.jpg")
    (root / "subalias").symlink_to("sub")
    assert read_job_path(b"link.jpg", root, LIMIT) == CONTENT + b"b"
    assert read_job_path(b"rel.jpg", root, LIMIT) == CONTENT + b"b"
    assert read_job_path(b"subalias/b.jpg", root, LIMIT) == CONTENT + b"b"


def test_missing_file(root: Path) -> None:
    assert refused(b"nope.jpg", root).code is ErrorCode.PATH_NOT_FOUND
    assert refused(b"a.jpg/child", root).code is ErrorCode.PATH_NOT_FOUND


def test_dangling_symlink(root: Path) -> None:
    (root / "dangling.jpg").symlink_to(root / "gone.jpg")
    assert refused(b"dangling.jpg", root).code is ErrorCode.PATH_NOT_FOUND


def test_symlink_loop(root: Path) -> None:
    (root / "loop1").symlink_to(root / "loop2")
    (root / "loop2").symlink_to(root / "loop1")
    assert refused(b"loop1", root).code is ErrorCode.PATH_NOT_FOUND


def test_directory(root: Path) -> None:
    assert refused(b"sub", root).code is ErrorCode.PATH_NOT_FOUND
    assert refused(b".", root).code is ErrorCode.PATH_NOT_FOUND
    assert refused(str(root).encode(), root).code is ErrorCode.PATH_NOT_FOUND


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.timeout(10)
def test_fifo_does_not_block(root: Path) -> None:
    os.mkfifo(root / "pipe")
    assert refused(b"pipe", root).code is ErrorCode.PATH_NOT_FOUND


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_file(root: Path) -> None:
    (root / "a.jpg").chmod(0)
    try:
        assert refused(b"a.jpg", root).code is ErrorCode.PATH_NOT_FOUND
    finally:
        (root / "a.jpg").chmod(0o644)


def test_too_large(root: Path) -> None:
    (root / "big.jpg").write_bytes(b"x" * 2000)
    err = refused(b"big.jpg", root, max_bytes=1999)
    assert err.code is ErrorCode.PAYLOAD_TOO_LARGE
    # The limit is named, the file's own size is not.
    assert "1999" in err.message and "2000" not in err.message
    assert read_job_path(b"big.jpg", root, 2000) == b"x" * 2000


def test_empty_file_is_read(root: Path) -> None:
    # Empty content is the decoder's business (empty_image), not a path problem.
    (root / "empty.jpg").write_bytes(b"")
    assert read_job_path(b"empty.jpg", root, LIMIT) == b""


@pytest.mark.parametrize(
    "raw",
    [b"\xff\xfe.jpg", b"", b"a.jpg\x00.png", b"\x00"],
    ids=["not-utf8", "empty", "nul-inside", "nul"],
)
def test_malformed_path(root: Path, raw: bytes) -> None:
    assert refused(raw, root).code is ErrorCode.INVALID_JOB


def test_long_path_is_not_found_and_message_is_bounded(root: Path) -> None:
    raw = b"x" * 5000
    err = refused(raw, root)
    assert err.code is ErrorCode.PATH_NOT_FOUND
    assert len(err.message) < 400


_SEGMENTS = st.sampled_from(["a.jpg", "sub", "b.jpg", "..", ".", "", "out", "secret.jpg", "up"])


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(parts=st.lists(_SEGMENTS, min_size=1, max_size=6), absolute=st.booleans())
def test_any_path_is_read_exactly_when_pathlib_puts_a_regular_file_inside_the_root(
    root: Path, outside: Path, parts: list[str], absolute: bool
) -> None:
    # A symlink out of the root and one that stays in it, beside the plain files.
    if not (root / "out").exists():
        (root / "out").symlink_to(outside)
        (root / "up").symlink_to(root / "sub")
    text = "/".join(parts)
    if absolute:
        text = f"{root}/{text}"
    base = root.resolve()
    target = (base / text).resolve()
    try:
        data = read_job_path(text.encode(), root, LIMIT)
    except DecodeError as exc:
        if not target.is_relative_to(base):
            assert exc.code == ErrorCode.FORBIDDEN_PATH
        else:
            assert exc.code in (ErrorCode.PATH_NOT_FOUND, ErrorCode.INVALID_JOB)
            assert not target.is_file()
        return
    assert target.is_relative_to(base) and target.is_file()
    assert data == target.read_bytes()

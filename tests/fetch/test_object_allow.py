"""GPUFEED_OBJECT_ALLOW: which s3:// keys a job may read, per reply stream, through a real
worker, redis-server and an S3-compatible server (moto); and that no error a job sees tells
whether an object it may not read exists, or how large an object is."""

from __future__ import annotations

import asyncio
import posixpath
from pathlib import Path
from urllib.parse import unquote

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st

from tests.fetch import test_fetch
from tests.fetch.test_fetch import FAST_FETCH, assert_exactly_once, put_objects, results_by_id
from tests.support.cli_runner import run_module
from tests.support.images import jpeg_bytes
from tests.support.worker_harness import running_worker, wait_results
from worker.base.errors import ConfigError
from worker.config.settings import WorkerConfig
from worker.fetch.objects import parse_object_allow, split_store_url
from worker.fetch.result import FetchError

pytest.importorskip("aiohttp")

s3_endpoint = test_fetch.s3_endpoint  # moto, a fixture of this module too

ALLOW = "catalog/public/, images-* ; tenant-a:results=s3://tenant-a"


def test_the_syntax_buckets_prefixes_wildcards_schemes_and_streams() -> None:
    allow = parse_object_allow(ALLOW)
    assert allow.allows("gpufeed:results", "s3", "catalog", "public/cats/1.jpg")
    assert allow.allows("gpufeed:results", "gs", "catalog", "public/1.jpg")  # no scheme: all
    assert not allow.allows("gpufeed:results", "s3", "catalog", "private/1.jpg")
    assert not allow.allows("gpufeed:results", "s3", "catalog", "public")  # the folder itself
    assert allow.allows("gpufeed:results", "s3", "images-eu", "a.jpg")
    assert not allow.allows("gpufeed:results", "s3", "images", "a.jpg")  # `images-*` only
    # A stream's own entries add to everyone's, for that stream only, and name their scheme.
    assert allow.allows("tenant-a:results", "s3", "tenant-a", "x.jpg")
    assert allow.allows("tenant-a:results", "s3", "catalog", "public/x.jpg")
    assert not allow.allows("tenant-a:results", "gs", "tenant-a", "x.jpg")
    assert not allow.allows("gpufeed:results", "s3", "tenant-a", "x.jpg")
    # ... and for the streams under it (a tenant's batch runs, its clients), no other.
    assert allow.allows("tenant-a:results:batch:1f:9c", "s3", "tenant-a", "x.jpg")
    assert not allow.allows("tenant-a:resultsx", "s3", "tenant-a", "x.jpg")
    assert not allow.allows("tenant-a", "s3", "tenant-a", "x.jpg")
    assert not allow.allows("other:tenant-a:results", "s3", "tenant-a", "x.jpg")
    assert not parse_object_allow("")  # empty: nothing at all
    assert not parse_object_allow(" ; ")


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        ("Bad_Bucket!", "does not start with a bucket name"),
        ("ftp://bucket", "the scheme must be s3, gs or az"),
        ("images*-eu", "does not start with a bucket name"),
        ("a b=bucket", "is not a reply stream name"),
        ("tenant-a:results=", "names no bucket"),
        ("bucket/../other/", "no '.' or '..' folders"),
    ],
)
def test_a_malformed_allow_list_stops_start_up_naming_the_setting(raw: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=f"GPUFEED_OBJECT_ALLOW: .*{problem}"):
        WorkerConfig.load(env={"GPUFEED_OBJECT_ALLOW": raw})


def test_a_malformed_allow_list_is_one_line_and_exit_2() -> None:
    proc = run_module("worker", env={"GPUFEED_OBJECT_ALLOW": "images;a b=c"}, timeout=60)
    assert proc.returncode == 2
    assert "GPUFEED_OBJECT_ALLOW: 'a b' is not a reply stream name" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@given(st.text(max_size=200))
def test_any_text_either_parses_or_is_refused_with_a_value_error(raw: str) -> None:
    # Nothing but ValueError (which start-up turns into its one-line exit 2) may escape.
    try:
        parse_object_allow(raw)
    except ValueError as exc:
        assert str(exc)


@pytest.mark.parametrize(
    "url",
    [
        "s3://catalog/public/../private/a.jpg",
        "s3://catalog/public/%2e%2e/private/a.jpg",
        "s3://catalog/public/%252e%252e/private/a.jpg",
        "s3://catalog/public/./a.jpg",
        "s3://catalog/public\\..\\private/a.jpg",
        "s3://catalog/public/a.jpg?versionId=1",
    ],
)
def test_a_key_cannot_step_out_of_its_prefix(url: str) -> None:
    with pytest.raises(FetchError) as caught:
        split_store_url(url)
    assert caught.value.code.value == "invalid_job"


_SEGMENTS = ["a", ".", "..", "%2e", "%2E%2e", "%252e%252e", "%25252e.", ".%2e", "\\", "%5c", ""]


@given(
    st.lists(st.sampled_from(_SEGMENTS), max_size=6),
    st.sampled_from(["/", "%2f", "%252F"]),
)
def test_a_key_the_worker_accepts_never_resolves_outside_its_prefix(
    segments: list[str], slash: str
) -> None:
    # Whatever a layer below does with dot folders or percent escapes (decoding them once,
    # twice, or until nothing is left), an accepted key stays inside its prefix.
    try:
        _, _, key = split_store_url("s3://catalog/public/" + slash.join(segments))
    except FetchError as exc:
        assert exc.code.value == "invalid_job"
        return
    form = key
    for _ in range(6):
        resolved = posixpath.normpath(form.replace("\\", "/"))
        assert resolved == "public" or resolved.startswith("public/"), key
        form = unquote(form)


async def test_tenants_read_only_what_the_list_gives_their_stream_and_errors_tell_nothing(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path, s3_endpoint: str
) -> None:
    image = jpeg_bytes(96, 72, seed=3, quality=80)
    big = b"\xff" * (FAST_FETCH["max_image_bytes"] + 1)
    await asyncio.to_thread(
        put_objects, s3_endpoint, "catalog", {"public/1.jpg": image, "public/big.jpg": big}
    )
    await asyncio.to_thread(put_objects, s3_endpoint, "tenant-a", {"a.jpg": image})
    await asyncio.to_thread(
        put_objects, s3_endpoint, "tenant-b-private", {"passport.jpg": image, "dump.sql": big}
    )
    jobs: dict[str, dict[str, str]] = {
        "public": {"url": "s3://catalog/public/1.jpg"},
        "public-missing": {"url": "s3://catalog/public/2.jpg"},
        "public-big": {"url": "s3://catalog/public/big.jpg"},
        "escape": {"url": "s3://catalog/public/../private/1.jpg"},
        # Another tenant's bucket: an object that exists, a large one and a missing one.
        "b-exists": {"url": "s3://tenant-b-private/passport.jpg"},
        "b-big": {"url": "s3://tenant-b-private/dump.sql"},
        "b-missing": {"url": "s3://tenant-b-private/salaries.jpg"},
        # Tenant A's bucket, from the default stream and from tenant A's stream.
        "a-elsewhere": {"url": "s3://tenant-a/a.jpg"},
        "a-own": {"url": "s3://tenant-a/a.jpg", "reply_to": "tenant-a:results"},
    }
    async with running_worker(redis_url, tiny_weights, object_allow=ALLOW, **FAST_FETCH):
        for job_id, fields in jobs.items():
            redis_client.xadd("gpufeed:jobs", {"id": job_id, **fields})
        entries = await wait_results(redis_client, "gpufeed:results", len(jobs) - 1)
        own = await wait_results(redis_client, "tenant-a:results", 1)

    results = results_by_id(entries + own)
    codes = {k: results[k].error_code for k in jobs}
    assert codes == {
        "public": None,
        "public-missing": "fetch_failed",
        "public-big": "payload_too_large",
        "escape": "invalid_job",
        "b-exists": "object_not_allowed",
        "b-big": "object_not_allowed",
        "b-missing": "object_not_allowed",
        "a-elsewhere": "object_not_allowed",
        "a-own": None,
    }
    assert results["public"].ok and results["a-own"].ok
    # Refused keys: the same words whether the object exists, is large, or is not there.
    refused = {
        (results[k].error or "").replace(jobs[k]["url"], "URL")
        for k in ("b-exists", "b-big", "b-missing")
    }
    assert len(refused) == 1 and "GPUFEED_OBJECT_ALLOW" in refused.pop()
    # No size anywhere: the limit is named, the object's length is not.
    big_error = results["public-big"].error or ""
    assert f"{len(big):,}" not in big_error and str(len(big)) not in big_error
    assert f"{FAST_FETCH['max_image_bytes']:,}" in big_error
    assert_exactly_once(redis_client, entries, set(jobs) - {"a-own"})

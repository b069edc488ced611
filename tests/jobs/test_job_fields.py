"""One table of job field rules (producer/job_fields.py), read by both sides: whatever a
producer refuses before sending, a worker answers `invalid_job` (or its own code) with the
same words when the same fields reach it another way; whatever a producer sends, a worker
runs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from producer import wire
from producer.jobs import Job
from worker.jobs import parse_job

# What a producer may be asked for: text fields as str (some empty, blank, or over their
# limits), bytes for image and meta, deadlines in and out of range.
texts = st.one_of(
    st.none(),
    st.just(""),
    st.just("   "),
    st.text(max_size=20),
    st.text(alphabet="é", min_size=60, max_size=70),  # 120-140 bytes: around the id limit
)
jobs = st.builds(
    Job,
    image=st.one_of(st.none(), st.just(b""), st.binary(min_size=1, max_size=8)),
    path=texts,
    id=texts,
    meta=st.one_of(st.none(), st.binary(max_size=16)),
    reply_to=texts,
    url=st.one_of(
        st.none(), st.just(""), st.just("https://h/x.jpg"), st.just("https://" + "a" * 9000)
    ),
    deadline_ms=st.one_of(st.none(), st.just(1_700_000_000), st.just(1_700_000_000_000)),
)


def as_entry(job: Job) -> dict[bytes, bytes]:
    """The fields a client without our producer would send for the same job."""
    out: dict[bytes, bytes] = {}
    for name, field in (
        ("image", wire.JOB_IMAGE),
        ("meta", wire.JOB_META),
    ):
        value = getattr(job, name)
        if value is not None:
            out[field] = value
    for name, field in (
        ("path", wire.JOB_PATH),
        ("url", wire.JOB_URL),
        ("id", wire.JOB_ID),
        ("reply_to", wire.JOB_REPLY_TO),
    ):
        value = getattr(job, name)
        if value is not None:
            out[field] = value.encode()
    if job.deadline_ms is not None:
        out[wire.JOB_DEADLINE_MS] = str(job.deadline_ms).encode()
    return out


@settings(max_examples=400, deadline=None)
@given(jobs)
def test_the_producer_refuses_what_a_worker_rejects_in_the_same_words(job: Job) -> None:
    parsed = parse_job("1-0", as_entry(job), "gpufeed:results")
    try:
        job.fields()
    except ValueError as exc:
        if "needs a scheme" in str(exc):
            return  # the producer's own early word; the worker's fetch stage answers it
        assert parsed.rejected is not None, f"the producer refused ({exc}), the worker ran it"
        assert parsed.rejected[1] == str(exc)
        return
    assert parsed.rejected is None, f"the producer sent it, the worker rejected {parsed.rejected}"


@pytest.mark.parametrize(
    ("job", "code", "words"),
    [
        (Job(image=b""), "empty_image", "image is empty"),
        (Job(image=b"x", id=""), "invalid_job", "id is empty; leave it out to use the stream"),
        (Job(image=b"x", id="é" * 65), "id_too_long", "id is 130 bytes; at most 128 are allowed"),
        (Job(image=b"x", reply_to=" "), "invalid_job", "reply_to is empty"),
        (Job(url="https://" + "a" * 9000), "invalid_job", "url is 9,008 bytes; at most 8,192"),
        (Job(), "invalid_job", "give exactly one of image, path or url; the job has none"),
        (Job(image=b"x", path="a"), "invalid_job", "give exactly one of image, path or url, not"),
    ],
)
def test_both_sides_say_the_same_words(job: Job, code: str, words: str) -> None:
    with pytest.raises(ValueError) as refused:
        job.fields()
    parsed = parse_job("1-0", as_entry(job), "gpufeed:results")
    assert parsed.rejected is not None
    assert parsed.rejected[0].value == code
    assert words in parsed.rejected[1] and words in str(refused.value)

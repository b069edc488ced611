"""Which object-store keys a job may name: GPUFEED_OBJECT_ALLOW.

The worker reads s3://, gs:// and az:// keys with its own credentials, which reach far more
than any one tenant should: without a check, a job naming another tenant's bucket would be
answered with what the image holds, and its errors would tell which keys exist. So a key is
read only when the allow-list names its bucket (or a key prefix in it) for the job's reply
stream; an empty list allows none. The check runs before any request, so a refused key costs
nothing and says nothing about the object.

Syntax: groups separated by `;`, each `[REPLY_STREAM=]ENTRY[,ENTRY...]`. A group without a
stream applies to every job; a group with one only to jobs answered on that stream or on a
stream whose name starts with it and `:` (a tenant's own reply streams). An
entry is `[s3://|gs://|az://]BUCKET[/PREFIX]`: without a scheme it holds for all three
stores; a BUCKET ending in `*` matches every bucket name starting with what precedes it;
PREFIX is matched literally against the start of the key (end it with `/` to mean a folder).

    images-*, catalog/public/ ; tenant-a:results=s3://tenant-a ; tenant-b:results=tenant-b/in/

Only stdlib here: the configuration validates the list without the store client installed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

from producer.wire import ErrorCode
from worker.fetch.result import FetchError

SCHEMES = ("s3", "gs", "az")
_BUCKET_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._-]{0,221}\*?$|^\*$")
# A reply stream name as the allow-list may give it: no separators of the syntax.
_STREAM_PATTERN = re.compile(r"^[^\s,;=]{1,256}$")
_MAX_RAW = 64 * 1024
# Bucket and container names of the three stores fit this (lower case, digits, dots,
# hyphens, underscores); anything else is refused before a client is built for it.
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")


def split_store_url(url: str) -> tuple[str, str, str]:
    """`s3://bucket/a/b.jpg` -> ("s3", "bucket", "a/b.jpg"); FetchError(invalid_job) when
    it is not a store URL with a bucket and a key, or when the key has `.` or `..` folders
    (a layer below might resolve them, and step out of an allowed prefix)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        parts = urlsplit("invalid:")
    scheme, bucket, key = parts.scheme, parts.netloc, parts.path.lstrip("/")
    if scheme not in SCHEMES or not _BUCKET_RE.match(bucket) or not key:
        raise FetchError(
            ErrorCode.INVALID_JOB,
            f"{scheme[:8]}:// URLs need a bucket and a key: {scheme[:8]}://BUCKET/KEY",
            status="invalid",
            host_class="store",
        )
    if parts.query or parts.fragment or _dotted(key):
        raise FetchError(
            ErrorCode.INVALID_JOB,
            f"{scheme}:// keys have no '.' or '..' folders, no '\\', no '?' and no '#'",
            status="invalid",
            host_class="store",
        )
    return scheme, bucket, key


def _dotted(key: str) -> bool:
    """A backslash, or a `.` or `..` folder, in the key or in any decoding of its percent
    escapes (a layer below may decode once, or twice)."""
    while True:
        if "\\" in key or any(part in (".", "..") for part in key.split("/")):
            return True
        decoded = unquote(key)
        if decoded == key:
            return False
        key = decoded


@dataclass(frozen=True)
class ObjectRule:
    schemes: tuple[str, ...]
    bucket: str  # exact name, or a name prefix when `wildcard`
    wildcard: bool
    prefix: str

    def allows(self, scheme: str, bucket: str, key: str) -> bool:
        if scheme not in self.schemes:
            return False
        if self.wildcard:
            if not bucket.startswith(self.bucket):
                return False
        elif bucket != self.bucket:
            return False
        return key.startswith(self.prefix)


@dataclass(frozen=True)
class ObjectAllow:
    """The parsed GPUFEED_OBJECT_ALLOW: rules for every job, and rules per reply stream."""

    everyone: tuple[ObjectRule, ...] = ()
    by_stream: dict[str, tuple[ObjectRule, ...]] = field(default_factory=dict)

    def allows(self, reply_to: str, scheme: str, bucket: str, key: str) -> bool:
        if any(rule.allows(scheme, bucket, key) for rule in self.everyone):
            return True
        # A stream's group holds for the streams under it too (`<name>:...`): a tenant's
        # results stream gives its rules to the tenant's own reply streams (a batch run's,
        # a client's), whose names the tenant's Redis user alone may read.
        name = reply_to
        while True:
            rules = self.by_stream.get(name, ())
            if any(rule.allows(scheme, bucket, key) for rule in rules):
                return True
            name, sep, _ = name.rpartition(":")
            if not sep:
                return False

    def __bool__(self) -> bool:
        return bool(self.everyone or self.by_stream)


def parse_object_allow(raw: str) -> ObjectAllow:
    """GPUFEED_OBJECT_ALLOW -> ObjectAllow; ValueError (one line) names the bad part."""
    if len(raw) > _MAX_RAW:
        raise ValueError(f"is {len(raw)} characters long; at most {_MAX_RAW}")
    everyone: list[ObjectRule] = []
    by_stream: dict[str, list[ObjectRule]] = {}
    for group in raw.split(";"):
        if not group.strip():
            continue
        stream, sep, entries = group.partition("=")
        target = everyone
        if sep:
            stream = stream.strip()
            if not _STREAM_PATTERN.match(stream):
                raise ValueError(f"{stream!r} is not a reply stream name (before '=')")
            target = by_stream.setdefault(stream, [])
        else:
            entries = group
        rules = [_parse_entry(e.strip()) for e in entries.split(",") if e.strip()]
        if not rules:
            raise ValueError(f"{group.strip()!r} names no bucket")
        target.extend(rules)
    return ObjectAllow(tuple(everyone), {k: tuple(v) for k, v in by_stream.items()})


def _parse_entry(entry: str) -> ObjectRule:
    schemes: tuple[str, ...] = SCHEMES
    rest = entry
    if "://" in entry:
        scheme, rest = entry.split("://", 1)
        if scheme.lower() not in SCHEMES:
            raise ValueError(f"{entry!r}: the scheme must be s3, gs or az")
        schemes = (scheme.lower(),)
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET_PATTERN.match(bucket):
        raise ValueError(
            f"{entry!r} does not start with a bucket name (lower case, digits, '.', '-', '_'; "
            "a '*' only at its end)"
        )
    if any(part in (".", "..") for part in prefix.split("/")[:-1]):
        raise ValueError(f"{entry!r}: a prefix has no '.' or '..' folders")
    wildcard = bucket.endswith("*")
    return ObjectRule(schemes, bucket.rstrip("*"), wildcard, prefix)


def object_allow_problem(raw: str) -> str | None:
    try:
        parse_object_allow(raw)
    except ValueError as exc:
        return str(exc)
    return None

"""`url` jobs for the benchmark: the image set behind a loopback HTTP server, and the jobs
that name its URLs. Each job of a unique-bytes run gets its own URL and its own bytes (the
same per-job trailer as inline jobs, `redis_env.job_image`), so it is downloaded and decoded
like an inline job is decoded; a repeats run names the distinct images' URLs over and over.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import redis

from worker.tools.harness.image_server import ImageServer
from worker.tools.harness.redis_env import job_image


class JobImages(Mapping[str, bytes]):
    """`/img/<i>` -> job i's bytes, made when asked for: a large set's unique bytes are not
    all held in memory at once."""

    def __init__(self, images: Sequence[bytes], count: int, *, unique: bool) -> None:
        self.images, self.count, self.unique = images, count, unique

    def __getitem__(self, path: str) -> bytes:
        i = self._index(path)
        if i is None:
            raise KeyError(path)
        return job_image(self.images, i, f"url-{i}", unique=self.unique)

    def _index(self, path: str) -> int | None:
        tail = path.removeprefix("/img/")
        if tail == path or not tail.isdigit() or int(tail) >= len(self):
            return None
        return int(tail)

    def __iter__(self) -> Iterator[str]:
        return (f"/img/{i}" for i in range(len(self)))

    def __len__(self) -> int:
        return self.count if self.unique else len(self.images)


def url_server(images: Sequence[bytes], jobs: int, *, unique: bool) -> ImageServer:
    return ImageServer(JobImages(images, jobs, unique=unique))


def push_url_jobs(
    client: redis.Redis,
    stream: str,
    server: ImageServer,
    count: int,
    id_prefix: str,
    *,
    distinct: int,
    unique: bool,
) -> None:
    """`count` jobs naming the server's URLs (job i: its own, or distinct image i % n)."""
    for start in range(0, count, 64):
        pipe = client.pipeline(transaction=False)
        for i in range(start, min(count, start + 64)):
            path = f"/img/{i if unique else i % distinct}"
            pipe.xadd(stream, {"id": f"{id_prefix}-{i}", "url": server.url(path)})
        pipe.execute()

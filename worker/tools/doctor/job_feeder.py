"""Feeder: the end-to-end run's synthetic jobs, pushed into Redis a bounded step ahead."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from producer.shards import connect_async


class Feeder:
    """Keeps the job stream ahead of the worker, never far ahead: at most `ahead` jobs
    beyond those answered, so a production Redis never holds more than that many images
    for the doctor (the worker's own trimming removes the processed ones)."""

    def __init__(
        self,
        url: str,
        stream: str,
        images: list[bytes],
        jobs: int,
        ahead: int,
        *,
        image_urls: list[str] | None = None,
    ) -> None:
        self.url, self.stream, self.images = url, stream, images
        self.jobs, self.ahead = jobs, ahead
        # `url` jobs naming these instead of carrying the images.
        self.image_urls = image_urls
        self.pushed = 0

    async def push(self, answered: int, limit: int = 256) -> int:
        """Push up to `limit` jobs, as many as the bound allows; returns how many."""
        room = min(self.jobs - self.pushed, self.ahead - (self.pushed - answered), limit)
        if room <= 0:
            return 0
        client = await connect_async(self.url)
        try:
            pipe = client.pipeline(transaction=False)
            for i in range(self.pushed, self.pushed + room):
                if self.image_urls:
                    source = "url", self.image_urls[i % len(self.image_urls)].encode()
                else:
                    source = "image", self.images[i % len(self.images)]
                pipe.xadd(self.stream, {"id": f"doctor-{i}", source[0]: source[1]})
            await pipe.execute()
        finally:
            await client.aclose()
        self.pushed += room
        return room

    async def run(self, answered: Callable[[], int]) -> None:
        while self.pushed < self.jobs:
            if not await self.push(answered()):
                await asyncio.sleep(0.002)

"""Images where they live: the fetch stage for jobs that name a `url` (a `path` job's file is
read where it is decoded: worker/decode/job_path.py).

One module per source, side by side: `http.py` (http and https, aiohttp), `s3.py` (s3://,
gs:// and az://, obstore); `policy.py` decides which addresses may be reached and
`objects.py` which buckets and keys (GPUFEED_OBJECT_ALLOW); `stage.py`
runs the fetches between the reader and the batcher. The clients are imported only when a
worker builds its stage, so a host without them still runs `image` and `path` jobs.

May import: base, decode, jobs, producer.
"""

"""Decoding. The executors that run a batch's rows, side by side behind one contract
(`executor`: submit, settle, redecode, shut down): `pool` (decode threads in the worker)
and `processes` (decode processes, each running `process_main`, writing into the memory
`arena` shares with them, reading image bytes from the `payloads` memory the intake's
process fills); both decide each row by one policy (`row_policy`). The CPU decoders (`cpu`:
Pillow and libjpeg-turbo with DCT scaling; `rows`, a row at its own size). The GPU JPEG
codecs, side by side behind one contract and chosen by name from one table (`codecs`:
`nvimgcodec`, `torchvision_jpeg`), and what feeds them: `gpu` (the decode threads' rows)
and `gpu_packed` (the decode processes' packed rows), `split` (each batch's share for the
GPU), `samples` (the JPEGs they are probed and timed with). `cache`, decoded rows of images
seen before; `job_path`, the file a `path` job names, read under its root; `gil_account`,
who holds the GIL while they run.

May import: base, ipc, producer.
"""

"""Decoding, one module per implementation, side by side: `cpu` (Pillow and libjpeg-turbo
with DCT scaling), `gpu` (nvImageCodec or torchvision's nvJPEG, in batches); what runs
them into staging rows, side by side too: `processes` (decode processes, each running
`process_main`, writing into the memory `arena` shares with them, reading image bytes from
the `payloads` memory the intake's process fills) and `pool` (decode
threads in the worker); `cache`, decoded rows of images seen before; `job_path`, the file a
`path` job names, read under its root; `gil_account`, who holds the GIL while they run.

May import: base, ipc, producer.
"""

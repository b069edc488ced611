"""Decoding, one module per implementation, side by side: `cpu` (Pillow and libjpeg-turbo
with DCT scaling), `gpu` (nvImageCodec or torchvision's nvJPEG, in batches); `pool`, the
decode threads that run them into staging rows; `cache`, decoded rows of images seen
before.

May import: fetch, jobs, observe, pipeline, producer.
"""

"""The model: loading (torchvision names, model directories, `loaded.py`), the output kinds
(heads, readers, answers), the one compiled step, its compile checks, precision and
ceiling; what the step returns per image (`outputs.py`).

May import: base, decode, producer.
"""

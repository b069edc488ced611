"""gpufeed worker: Redis Streams in, batched GPU inference, results out.

Layers, bottom first; a part of worker/ (a folder, or a module flat at its top) imports only
from the layers below its own and from `producer`, never from its own layer's other parts or
from above. Imports for annotations only (under `if TYPE_CHECKING:`) are no run-time tie and
do not count. tests/project/test_layout.py checks it and docs/development.md shows it.

Layers: base, quick_exit | ipc | decode | model | jobs | fetch | config | delivery | pipeline |
observe | lifecycle | notebook, tools | cli | docs_gen
"""

"""What every other part stands on: the one error a setting raises (`errors.py`), the
file-system look-ups a setting may need (`paths.py`), the device's own helpers (`device.py`:
contexts, events, CUDA graph marks) and the log set-up every process shares (`logs.py`).

May import: producer.
"""

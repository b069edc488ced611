"""Tests of the operator tools (worker/tools/, worker/notebook.py)."""

"""Tests of the child-process toolkit (worker/ipc/)."""

"""Tests of the stages between reader and writer (worker/pipeline/)."""

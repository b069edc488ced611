"""Tests of the bench and the GPU check (measure/)."""

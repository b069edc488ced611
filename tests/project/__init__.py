"""Tests of the repository as a whole: docs, layout, references, make, deploy."""

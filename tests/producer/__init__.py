"""Tests of the client library, CLI and batch jobs (producer/)."""

"""Tests of url jobs (worker/fetch/)."""

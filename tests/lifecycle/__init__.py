"""Tests of a worker's life (worker/lifecycle/)."""

"""Tests of metrics and health (worker/observe/)."""

"""Tests of errors and log lines (worker/base/)."""

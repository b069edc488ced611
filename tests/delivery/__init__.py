"""Tests of Redis in and out (worker/delivery/)."""

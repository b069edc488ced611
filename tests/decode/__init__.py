"""Tests of decoding (worker/decode/)."""

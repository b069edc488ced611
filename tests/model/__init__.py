"""Tests of the model and its step (worker/model/)."""

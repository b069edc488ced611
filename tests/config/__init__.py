"""Tests of settings and the command line (worker/config/, worker/cli.py)."""

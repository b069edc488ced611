"""Tests of job parsing (worker/jobs.py, producer/job_fields.py)."""

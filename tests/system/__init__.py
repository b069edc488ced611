"""Tests of the whole system: contract, bad and hostile input, faults, security."""

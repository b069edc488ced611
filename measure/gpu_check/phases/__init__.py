"""The GPU check's phases: the table of them (table.py: each phase's name, budget, needs and
body, in run order), what they share (state.py), and their bodies, a module per group."""

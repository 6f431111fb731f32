"""Mutation testing (`./dev mutate`): mutate.py (the sample, the per-file test selections BY_FILE, the EQUIVALENT
list, the report) and mutate_coverage.py (its coverage.py plugin: which tests execute which line)."""

"""Measurement scripts behind the figures in docs/: step-time prediction against real runs (predict_step.py), tile
sweeps (tile_sweep.py), sequence-parallel timing (parallel_bench.py) and the multi-GPU estimate
(multigpu_estimate.py). Run as `python -m tools.measure.NAME` from the repository root."""

"""Tools beside the training path: parity check, attention benchmark, compute profiling, process launcher.

Nothing in the training loop imports from here; `python -m app verify | bench` do.
"""

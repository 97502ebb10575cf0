"""Benchmarks that train: `bench train` (policies interleaved in one session) and `bench peer` (vs TRL).

    driver.py   the `bench train` driver: one planner per policy, one worker group, steps interleaved
    summary.py  a BenchRun's report, one row per policy (the public --json fields)
    peer/       `bench peer`: this project against TRL's SFTTrainer on the same rows
"""

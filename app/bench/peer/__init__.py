"""`bench peer`: this project against TRL's SFTTrainer on the same model, tokens and steps.

    rows.py       the global batches both sides train: the run's own tokenized rows, in the planner's order
    trl_side.py   one TRL SFTTrainer run (padding-free, one process), timed per optimizer step
    our_side.py   one `bench train` run of skrull and balanced_packed (app/bench/driver.py), in the same form

Each side runs as its own process (`python -m app.bench.peer.trl_side` / `app.bench.peer.our_side`),
alternately, driven by app/commands/bench_peer.py; docs/benchmarks.md ("Against TRL's SFTTrainer") says
what differs.
TRL is a dev/bench dependency: nothing here imports it at module level.
"""

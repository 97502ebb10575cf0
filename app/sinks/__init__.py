"""Metric sinks: where every reported step's metrics go, behind one interface (base.py: write, close).

    registry.py     which sinks a run opens, opened and closed together (open_sinks)
    run_log.py      <run_dir>/metrics.jsonl and worker_starts.jsonl (always on for `train`)
    tensorboard.py  <run_dir>/tensorboard/ event files (always on for `train`)
    mlflow.py       train.mlflow_uri
    wandb.py        train.wandb_project
"""

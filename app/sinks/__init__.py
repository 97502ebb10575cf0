"""Metric sinks: where every reported step's metrics go besides the run directory.

    tensorboard.py  <run_dir>/tensorboard/ event files (always on for `train`)
    mlflow.py       train.mlflow_uri
    wandb.py        train.wandb_project
"""

"""The `train` driver and what runs beside it on the driver process.

    driver.py       train(): preflight, the run directory, Ray, data, planner, workers, summary
    preflight.py    every check that can fail before a worker starts (exit 2, one knob named)
    cluster.py      the Ray a driver runs on: RAY_ADDRESS's cluster or an embedded one on loopback
    components.py   the planner actor, the workers' settings, the TorchTrainer, the step count
    dataset.py      tokenized once, scanned, split into training and eval rows
    fit.py          trainer.fit() under the metric sinks and the progress bar, interruptible
    signals.py      Ctrl-C and SIGTERM take the same way out (RunInterrupted)
    failures.py     a stopped run as one line (RunFailed)
    console.py      the quiet terminal: the libraries' output to <run_dir>/logs/driver.log
    progress.py     the progress bar fed by the workers' reports; the Ray Train callback
    run_monitor.py  the tiny actor the callback reports into
    report.py       `report`: a run in one screen from its run directory
"""

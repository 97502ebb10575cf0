"""The `train` driver and what runs beside it on the driver process.

    driver.py       preflight, Ray, data, planner actor, Ray Train workers, summary
    preflight.py    every check that can fail before a worker starts (exit 2, one knob named)
    failures.py     a stopped run as one line (RunFailed)
    console.py      the quiet terminal: the libraries' output to <run_dir>/logs/driver.log
    progress.py     the progress bar fed by the workers' reports; the Ray Train callback
    run_monitor.py  the tiny actor the callback reports into
    report.py       `report`: a run in one screen from its run directory
"""

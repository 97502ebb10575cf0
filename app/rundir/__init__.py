"""The run directory: the files a run persists, its lock, and which of its checkpoints can be resumed.

    files.py               metrics.jsonl, worker_starts.jsonl, data_summary.json, JSON helpers, RunLog
    lock.py                one driver per run (a lease file, local or on an object store)
    resume_checkpoints.py  checkpoints that cannot load are set aside before a resume
"""

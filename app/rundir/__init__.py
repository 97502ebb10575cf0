"""The run directory: the files a run persists, its lock, and which of its checkpoints can be resumed.

    files.py               the file names; metrics.jsonl, worker_starts.jsonl, data_summary.json; JSON helpers
    snapshot.py            the config, data and template a run started with; may a rerun resume it?
    location.py            <run.storage_path>/<name>, checked writable; fresh start or resume
    lock.py                one driver per run (a lease file, local or on an object store)
    resume_checkpoints.py  checkpoints that cannot load are set aside before a resume
"""

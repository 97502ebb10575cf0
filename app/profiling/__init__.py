"""Hardware profiles, the cost model built from the config, and what the dry run and `profile` model.

    hardware.py     load a hardware profile; the CostModel of a config
    memory.py       the memory per rank and the C it leaves (activation/: what a forward keeps, from the
                    model's shapes, per kernel set and checkpointing setting; docs/memory.md)
    checkpointing.py  train.activation_checkpointing=auto: the fastest setting that fits
    budget.py       resolve both autos (checkpointing, then scheduling.bucket_size) before a run
    plan_report.py  `plan`: sample global batches, plan them with every policy, model them
    steps.py        `profile`'s whole training steps and the step-scale fit
    stale_check.py  is the profile stale? measured vs predicted step times
"""

"""Hardware profiles, the cost model built from the config, and what the dry run and `profile` model.

    hardware.py     load a hardware profile; the CostModel of a config
    plan_report.py  `plan`: sample global batches, plan them with every policy, model them
    steps.py        `profile`'s whole training steps and the step-scale fit
    stale_check.py  is the profile stale? measured vs predicted step times
"""

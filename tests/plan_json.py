"""`plan --json` run in process, for the tests of the memory model and the checkpointing choice."""

from __future__ import annotations

import argparse
import json


def plan_json(capsys, config: str, *overrides: str) -> dict:
    """The --json object of `plan --config CONFIG --set OVERRIDE...` (capsys: pytest's fixture)."""
    from app.commands import plan

    parser = argparse.ArgumentParser()
    plan.add_arguments(parser)
    argv = ["--config", config, "--json", *[a for o in overrides for a in ("--set", o)]]
    assert plan.run(parser.parse_args(argv)) == 0
    return json.loads(capsys.readouterr().out)

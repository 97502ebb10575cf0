"""`python -m app config reference | show`: the config tree documented from the code, and one config resolved.

    python -m app config reference                 docs/config.md: every key with its type, default, allowed
                                                   values and docstring, by section (app/commands/
                                                   config_reference.py); `> docs/config.md` regenerates it
    python -m app config show --config X [--set KEY=VALUE ...] [--json]
                                                   the config a run would use: every default filled, every
                                                   auto value known without a GPU resolved (BucketSize with
                                                   its source, CP degrees, tokenizer and template, worker
                                                   and tokenize-task counts: app/train/resolved_config.py)

`show` prints YAML that `--config` loads again (the resolutions as comments); `--json` prints {"config":
the same tree, "resolved": {key: {"setting", "value", "source", "why"}}, "derived": {"workers", "dp_size",
"cp_size", "max_sequence_length"}}. Neither starts Ray or imports torch.
"""

from __future__ import annotations

import argparse
import json
import shlex

from app.commands.common import add_config_arguments, add_json_argument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="config_command", required=True, metavar="SUBCOMMAND")
    sub.add_parser("reference", help="every config key with type, default, allowed values and docstring, "
                                     "as Markdown (docs/config.md)")
    show = sub.add_parser("show", help="the config a run would use: defaults filled, auto values resolved, "
                                       "as YAML loadable with --config (or --json)")
    add_config_arguments(show)
    add_json_argument(show)


def run(args: argparse.Namespace) -> int:
    if args.config_command == "reference":
        from app.commands.config_reference import render

        print(render(), end="")
        return 0
    from app.train.resolved_config import show_config, to_yaml

    shown = show_config(args.config, args.overrides)
    if args.json:
        print(json.dumps({"config": shown.as_tree(),
                          "resolved": {r.key: r.as_json() for r in shown.resolutions},
                          "derived": shown.derived}))
        return 0
    command = ["python", "-m", "app", "config", "show"] + (["--config", args.config] if args.config else [])
    command += [part for override in args.overrides for part in ("--set", override)]
    print(to_yaml(shown, [f"{shlex.join(command)}: the config a run would use (loadable with --config)"]),
          end="")
    return 0

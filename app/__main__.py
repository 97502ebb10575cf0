"""`python -m app <command>` (also installed as `skrull`).

Each command lives in its own module under app/commands/ and is imported only when chosen, so that
`skrull plan` never imports torch, Ray or DeepSpeed.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

from app.config import ConfigError

# command name -> (module under app.commands, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("plan", "dry run: plan sampled global batches with every policy and compare modeled step times"),
    "bench": ("bench", "benchmarks: `bench train` (measured step time per policy, interleaved), "
              "`bench planner` (planning latency), `bench step` (the training step per config variant), "
              "`bench peer` (vs TRL's SFTTrainer), "
              "`bench compute` (the compute part of `profile`), "
              "`bench attention` (DACP overlap)"),
    "profile": ("profile", "measure this machine with the configured model and write a hardware profile"),
    "verify": ("verify", "parity check: one sharded DACP forward+backward vs the unsharded model"),
    "train": ("train", "train on Ray (embedded local Ray by default, or the cluster at RAY_ADDRESS)"),
    "data": ("data", "data tools: `data synth` writes a synthetic chat dataset, `data preview` shows rows "
             "as training sees them (template, labels, length limit), `data prepare` tokenizes once"),
    "export": ("export", "a run's checkpoint as a Hugging Face model directory (LoRA: a peft adapter)"),
    "config": ("config", "`config show`: the resolved config a run would use (defaults filled, auto values "
               "resolved); `config reference`: every config key documented (docs/config.md)"),
    "report": ("report", "a finished or running run in one screen (loss, tokens/s, imbalance, planner lead, "
               "restarts, data) from its run directory; --plot, --json"),
}


def _top_level_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="skrull", description="Skrull on Ray: long-context SFT scheduling.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def build_command_parser(name: str) -> argparse.ArgumentParser:
    """The parser of one command; only that command's module is imported."""
    module_name, help_text = COMMANDS[name]
    module = importlib.import_module(f"app.commands.{module_name}")
    parser = argparse.ArgumentParser(prog=f"skrull {name}", description=help_text)
    module.add_arguments(parser)
    parser.set_defaults(_module=module, command=name)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        _top_level_parser().parse_args(argv)  # prints usage / the unknown-command error and exits
        return 2
    from app.data.ray_env import apply_ray_data_defaults

    apply_ray_data_defaults()  # before anything imports Ray Data
    args = build_command_parser(argv[0]).parse_args(argv[1:])
    from app.train.failures import RunFailed
    from scheduling import SchedulingError
    from workers.storage import redact_text

    if sys.excepthook is sys.__excepthook__:  # the interpreter's own printer (not an embedding one's)
        sys.excepthook = _redacting_excepthook
    try:
        return int(args._module.run(args) or 0)
    except (ConfigError, SchedulingError) as err:
        print(f"skrull {args.command}: error: {redact_text(str(err))}", file=sys.stderr)
        return 2
    except RunFailed as err:  # the run stopped for a reason it names (a divergence, a full disk)
        print(f"skrull {args.command}: error: {err}", file=sys.stderr)
        return 1


def _redacting_excepthook(kind: type[BaseException], error: BaseException, trace: Any) -> None:
    """Print an unhandled error's traceback without URI secrets (workers/storage.py redact_text): library
    errors repeat the URIs they failed on, credentials included."""
    import traceback

    from workers.storage import redact_text

    sys.stderr.write(redact_text("".join(traceback.format_exception(kind, error, trace))))


if __name__ == "__main__":
    sys.exit(main())

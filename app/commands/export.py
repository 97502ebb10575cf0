"""`python -m app export RUN_DIR [--checkpoint latest|PATH] --out DIR [--dtype bf16|fp32] [--merge] [--json]`.

Writes a Hugging Face model directory (config, safetensors weights, generation config, tokenizer files)
consolidated from the run's ZeRO checkpoint; a LoRA run writes its peft adapter, or with --merge the merged
model (app/model/export.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from dataclasses import asdict

from app.commands.common import add_json_argument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR",
                        help="the run directory: <run.storage_path>/<run.name> (a local path or an "
                             "object-store URI such as s3://bucket/runs/NAME)")
    parser.add_argument("--checkpoint", default="latest", metavar="latest|PATH",
                        help="latest (default: the newest complete checkpoint) or a checkpoint_* directory")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="output directory (must not exist, or be empty); written atomically")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                        help="weights' dtype (default: the run's model.dtype)")
    parser.add_argument("--merge", action="store_true",
                        help="LoRA runs: write the base model with the adapter merged in, not the adapter")
    add_json_argument(parser)


def run(args: argparse.Namespace) -> int:
    from app.model.export import export

    # DeepSpeed's consolidation prints progress on stdout; keep stdout for the result (one JSON line).
    with contextlib.redirect_stdout(sys.stderr):
        result = export(args.run_dir, args.out, checkpoint=args.checkpoint, dtype=args.dtype,
                        merge=args.merge)
    if args.json:
        print(json.dumps(asdict(result)))
        return 0
    what = {"model": "model", "adapter": "LoRA adapter (peft)", "merged": "merged LoRA model"}[result.kind]
    print(f"exported the {what} of step {result.step} ({result.checkpoint}, {result.dtype}) to {result.out}")
    if result.kind == "adapter":
        print(f"load it: PeftModel.from_pretrained(base_model, {result.out!r})")
    else:
        print(f"load it: AutoModelForCausalLM.from_pretrained({result.out!r})")
    return 0

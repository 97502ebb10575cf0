"""`python -m app verify`: one sharded DACP forward+backward vs the unsharded Hugging Face model.

Starts --cp processes (gloo on CPU, NCCL when CUDA is available: one GPU per rank, so `--cp 2` over NCCL
needs 2 GPUs; `--backend gloo` runs every rank on CPU on any host), runs the model on each rank's DACP
stream, sums loss and every parameter gradient over the ranks, and compares with the model's own
single-process forward/backward (transformers' "sdpa" attention, one sequence at a time, loss = summed
CE / label tokens). Exit code 1 when a difference exceeds the tolerance.

`--degrees 1,2,4` checks per-sequence CP degrees (docs/design.md §13): one micro-batch whose sequences are
local (1), sharded over aligned subgroups of d ranks (1 < d < cp) and over all ranks (cp), at once
(workers/tools/parity.py: plan_with_degrees).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from app.commands.common import add_config_arguments, add_json_argument
from app.config import ConfigError, ModelConfig, SkrullConfig
from workers.presets import TINY_DEFAULTS, is_tiny_preset

NUM_SAMPLED = 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    add_json_argument(parser)
    parser.add_argument("--cp", type=int, default=2, help="context-parallel processes (default 2)")
    parser.add_argument("--model", default=None,
                        help="tiny-qwen2 | tiny-llama | HF name | local dir (default: the config's "
                             "model.name_or_path, else tiny-qwen2)")
    parser.add_argument("--lengths", default=None,
                        help="comma-separated sequence lengths, e.g. 1,7,300,5000 (default: sample "
                             f"{NUM_SAMPLED} from data.distribution scaled by data.length_scale)")
    parser.add_argument("--distribute", choices=("all", "none", "auto"), default=None,
                        help="all: shard every sequence; none: all local; auto: plan with DACP (default)")
    parser.add_argument("--degrees", default=None,
                        help="comma-separated CP degrees the micro-batch must use, each dividing --cp, e.g. "
                             "1,2,4 with --cp 4: 1 = local, d = sharded over an aligned subgroup of d ranks, "
                             "cp = over all ranks; the longest sequences get the highest degree, each "
                             "degree at least one sequence (needs as many --lengths); replaces --distribute")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                        help="compute dtype of the sharded run (default: model.dtype)")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and tokens")
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                        help="auto: nccl (one GPU per rank) when CUDA is available, else gloo; gloo: every "
                             "rank on CPU, whatever the host has")
    parser.add_argument("--force", action="store_true",
                        help="run even when the memory estimate exceeds what this machine has available")
    parser.epilog = ("grad rel diff of a parameter = max|sharded - reference| / max|reference| over that "
                     "tensor (robust to near-zero entries); tolerance fp32 1e-5, bf16 5e-2 or 1.5x the "
                     "HF model's own bf16 error when larger (both vs an fp32 reference of the same weights)")


def _lengths(args: argparse.Namespace, cfg: SkrullConfig) -> tuple[int, ...]:
    if args.lengths:
        try:
            return tuple(int(x) for x in args.lengths.split(",") if x.strip())
        except ValueError:
            raise ConfigError(f"--lengths {args.lengths!r}: expected comma-separated integers") from None
    from scheduling import sample_lengths

    raw = sample_lengths(cfg.data.distribution, NUM_SAMPLED, cfg.data.seed)
    return tuple(max(1, round(float(n) * cfg.data.length_scale)) for n in raw)


def _degrees(args: argparse.Namespace) -> tuple[int, ...]:
    """--degrees as a tuple of ints (empty when absent); ConfigError on a malformed value or a clash."""
    if args.degrees is None:
        return ()
    if args.distribute is not None:
        raise ConfigError("--degrees chooses the plan itself: drop --distribute")
    try:
        degrees = tuple(int(x) for x in args.degrees.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--degrees {args.degrees!r}: expected comma-separated integers") from None
    if not degrees:
        raise ConfigError("--degrees needs at least one degree")
    return degrees


def _model_kwargs(m: ModelConfig, model: str) -> tuple[tuple[str, int], ...]:
    """build_model's dimension arguments for `model` (a tiny preset takes the config's tiny dims)."""
    dims = dict(vocab_size=m.vocab_size, num_attention_heads=m.num_attention_heads,
                num_key_value_heads=m.num_key_value_heads, hidden_size=m.hidden_size,
                num_layers=m.num_layers, intermediate_size=m.intermediate_size)
    if not is_tiny_preset(model):
        dims = {"vocab_size": m.vocab_size, "random_init": m.random_init}
    return tuple((k, v) for k, v in dims.items() if v)


PROCESS_BYTES = 0.4e9
"""Resident size of one Python process with torch and transformers imported, before any tensor."""
FP32_ACTIVATION_BYTES_PER_HIDDEN = 68.0
"""Saved activations per token, layer and hidden unit in fp32 (twice the 34 of bf16, see docs/design.md
§2); the MLP's wider intermediate is folded in as a rough factor, which is all a refusal threshold needs."""


def estimate_peak_bytes(*, hidden: int, layers: int, vocab: int, lengths: tuple[int, ...], cp: int) -> float:
    """Peak memory of `verify`: cp rank processes plus the parent running the unsharded reference.

    Each process holds the weights and their gradients (fp32, ~12*h^2*L + 2*V*h parameters); the
    reference runs the longest sequence whole (activations plus its full fp32 logits, probabilities and
    their gradient: 3 * V floats a token); a rank runs about sum(lengths)/cp tokens (its loss is chunked).
    """
    params = 12 * hidden * hidden * layers + 2 * vocab * hidden
    per_token = FP32_ACTIVATION_BYTES_PER_HIDDEN * hidden * layers
    reference = max(lengths) * (per_token + 12 * vocab)
    rank = sum(lengths) / cp * per_token
    return (cp + 1) * (PROCESS_BYTES + 8 * params) + reference + cp * rank


def _check_memory(args: argparse.Namespace, cfg: SkrullConfig, model: str, lengths: tuple[int, ...]) -> str:
    """The estimate line to print; ConfigError (asking for --force) when it exceeds available memory."""
    import psutil

    from app.profiling.hardware import model_dims

    dims_model = dataclasses.replace(cfg.model, name_or_path=model)
    if is_tiny_preset(model):  # its vocabulary would load the tokenizer; the estimate takes the default
        dims_model = dataclasses.replace(dims_model, vocab_size=dims_model.vocab_size or 1)
    dims = model_dims(dims_model)
    hidden, layers = dims.hidden_size, dims.num_layers
    default = TINY_DEFAULTS["vocab_size"] if is_tiny_preset(model) else dims.vocab_size
    vocab = cfg.model.vocab_size or default
    need = estimate_peak_bytes(hidden=hidden, layers=layers, vocab=vocab, lengths=lengths, cp=args.cp)
    have = psutil.virtual_memory().available
    line = f"verify: estimated peak memory {need / 1e9:.1f} GB ({have / 1e9:.1f} GB available)"
    if need > 0.8 * have and not args.force:
        raise ConfigError(f"{line}: too much for this machine; use shorter --lengths or a smaller --cp, "
                          "or pass --force to run anyway")
    return line


def refuse_unsupported_model(cfg: SkrullConfig, model: str, lengths: tuple[int, ...]) -> None:
    """ConfigError naming --model and every feature the DACP path cannot compute at these lengths
    (app/model/support.py: a sliding window shorter than the longest, soft-capping, ...), before any
    process starts: the ranks would raise mid-run or the reference refuse (transformers has no sdpa
    Gemma-2), a traceback instead of an answer."""
    from app.model.support import attention_problems, logit_problems, model_config_dict

    hf = model_config_dict(dataclasses.replace(cfg.model, name_or_path=model))
    problems = attention_problems(hf, max(lengths)) + logit_problems(hf) if hf else []
    if problems:
        raise ConfigError(f"--model {model!r} needs math the DACP training path cannot compute at --lengths "
                          f"up to {max(lengths)}: {'; '.join(problems)}")


def resolve_backend(requested: str, cp: int) -> str:
    """The process-group backend for `cp` ranks; ConfigError naming --cp when NCCL lacks a GPU per rank.

    Refused rather than run on CPU instead: on a GPU host `verify` is the check of the CUDA path (kernels,
    NCCL ring), and a silent CPU run would print OK for a path it never ran.
    """
    import torch

    from workers.tools.launch import default_backend

    backend = default_backend() if requested == "auto" else requested
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "nccl" and gpus == 0:
        raise ConfigError("--backend nccl needs CUDA, and none is available here: use --backend gloo")
    if backend == "nccl" and cp > gpus:
        raise ConfigError(f"--cp {cp} over NCCL needs {cp} GPUs (one per rank: NCCL cannot put two ranks "
                          f"on one GPU), this machine has {gpus}: use --cp {gpus} (the ring itself needs "
                          "--cp >= 2, so 2 GPUs), or --backend gloo to run every rank on CPU")
    return backend


def _print_table(result: dict) -> None:
    print(f"plan: {result['plan']}  tokens per rank: {result['rank_tokens']}")
    print(f"loss  sharded {result['loss']:.8f}  reference {result['ref_loss']:.8f}  "
          f"abs diff {result['loss_abs_diff']:.3e}")
    width = max(len(n) for n in result["params"])
    print(f"{'parameter':<{width}}  {'max abs diff':>12}  {'max rel diff':>12}")
    for name, d in result["params"].items():
        print(f"{name:<{width}}  {d['abs']:>12.3e}  {d['rel']:>12.3e}")
    verdict = "OK" if result["ok"] else "FAIL"
    floor = result["hf_own_grad_max_rel_diff"]
    own = "" if floor is None else f" (the HF model's own bf16 gradients: {floor:.3e})"
    print(f"{verdict}: grad max abs {result['grad_max_abs_diff']:.3e}, grad max rel "
          f"{result['grad_max_rel_diff']:.3e}, tolerance {result['tolerance']:g}{own}")


def run(args: argparse.Namespace) -> int:
    from app.commands.common import config_from_args
    from workers.tools.parity import ParitySpec, run_parity

    cfg = config_from_args(args)
    model = args.model or cfg.model.name_or_path or "tiny-qwen2"
    lengths = _lengths(args, cfg)
    if not lengths or min(lengths) < 1 or args.cp < 1:
        raise ConfigError("--lengths needs at least one length, each >= 1, and --cp must be >= 1")
    degrees = _degrees(args)
    refuse_unsupported_model(cfg, model, lengths)
    backend = resolve_backend(args.backend, args.cp)
    estimate = _check_memory(args, cfg, model, lengths)
    if not args.json:
        print(estimate, flush=True)
    try:
        spec = ParitySpec(model=model, lengths=lengths, cp_size=args.cp,
                          distribute=args.distribute or "auto", dtype=args.dtype or cfg.model.dtype,
                          seed=args.seed, model_kwargs=_model_kwargs(cfg.model, model), degrees=degrees)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    result = run_parity(spec, backend=backend)
    if args.json:
        keys = ("loss_abs_diff", "grad_max_abs_diff", "grad_max_rel_diff", "tolerance", "ok", "loss",
                "ref_loss", "plan", "rank_tokens", "hf_own_grad_max_rel_diff", "reference_device")
        print(json.dumps({k: result[k] for k in keys} | {"lengths": list(spec.lengths), "cp": spec.cp_size,
                                                          "backend": backend, "dtype": spec.dtype,
                                                          "degrees": list(spec.degrees)}))
    else:
        how = (f"degrees={','.join(map(str, spec.degrees))}" if spec.degrees
               else f"distribute={spec.distribute}")
        print(f"verify: model={model} cp={spec.cp_size} lengths={list(spec.lengths)} "
              f"{how} dtype={spec.dtype} backend={backend}")
        _print_table(result)
    return 0 if result["ok"] else 1

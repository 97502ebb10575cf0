"""Parity check: one sharded DACP forward+backward over N CP processes vs the unsharded HF model.

    parent: model (seeded) -> state_dict ; tokens + labels ; DACP plan
      |-- spawn N ranks (gloo / NCCL): same weights, AttentionRuntime over a CP group of N ranks,
      |   build_rank_batch, micro_batch_loss_sum / total labels, backward -> (loss, grads) per rank
      '-- reference: the same weights with transformers' own "sdpa" attention, each sequence run
          separately with labels and num_items_in_batch = total label tokens (HF's summed CE / count)
    compare: sum over ranks vs reference; loss abs diff, per-parameter max |a - b| and
    max |a - b| / max |b| (relative to the largest reference entry of that tensor: robust to zeros).
`run_parities` checks several models over one spawn of the N ranks (each rank runs them in turn).

Per-sequence CP degrees (docs/design.md §13): `degrees=(1, 2, 4)` (verify --degrees) replaces the DACP plan
by one that uses exactly those degrees (`plan_with_degrees`), so one micro-batch holds local sequences,
sequences sharded over aligned CP subgroups and over the whole group; each rank builds its CP group and
subgroups once with ParallelGroups.create, as a training worker does.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from scheduling.payload import IGNORE_INDEX

# fp32: both sides accumulate the same sums in different orders (per-sequence vs packed, ring merges):
# measured ~1e-7..1e-6 relative, so 1e-5 leaves headroom while catching any real mistake (a leaked
# token or a missing gradient block moves gradients by >1e-2). bf16: the sharded run computes in bf16
# (8 mantissa bits, ~4e-3 per rounding, compounded over layers) against an fp32 reference of the
# same bf16 weights, so 5e-2 relative, or BF16_FLOOR_FACTOR x the HF model's own bf16 error when that is
# larger: the error bf16 itself makes grows with depth (measured on CPU, hidden 256, lengths 3/300/900: the
# HF model's own bf16 gradients 1.5e-2 off the fp32 reference at 4 layers, 2.2e-2 at 12; ours 1.9e-2 and
# 2.0e-2), and Qwen2.5-0.5B's 24 layers gave ours 5.6e-2 on an H200: a fixed bound would fail a correct
# kernel on deep models, the floor never passes one worse than bf16 explains.
TOLERANCE = {"fp32": 1e-5, "bf16": 5e-2}
BF16_FLOOR_FACTOR = 1.5


@dataclass(frozen=True, slots=True, kw_only=True)
class ParitySpec:
    model: str
    lengths: tuple[int, ...]
    cp_size: int
    distribute: str = "auto"
    dtype: str = "fp32"
    seed: int = 0
    model_kwargs: tuple[tuple[str, Any], ...] = ()
    degrees: tuple[int, ...] = ()
    """CP degrees the plan must use (plan_with_degrees); empty: the plan `distribute` asks for."""

    def __post_init__(self) -> None:
        if self.distribute not in ("all", "none", "auto"):
            raise ValueError(f"--distribute {self.distribute!r} is not one of: all, none, auto")
        if not self.lengths or min(self.lengths) < 1:
            raise ValueError("--lengths needs at least one length, each >= 1")
        if self.cp_size < 1:
            raise ValueError("--cp must be >= 1")
        if self.degrees:
            check_degrees(self.degrees, self.cp_size, len(self.lengths))


def check_degrees(degrees: tuple[int, ...], cp_size: int, num_sequences: int) -> None:
    """ValueError naming --degrees unless every degree is 1, cp_size or a divisor of it in between, none
    repeats, and there are enough sequences to give each degree one."""
    bad = [d for d in degrees if d < 1 or d > cp_size or cp_size % d]
    if bad or len(set(degrees)) != len(degrees):
        raise ValueError(f"--degrees {','.join(map(str, degrees))}: each must divide --cp {cp_size} "
                         f"(1 = local, {cp_size} = sharded over all ranks), without repeats")
    if num_sequences < len(degrees):
        raise ValueError(f"--degrees asks for {len(degrees)} degrees but --lengths gives {num_sequences} "
                         "sequences: at least one sequence per degree")


def plan_with_degrees(lengths: tuple[int, ...], cp_size: int, degrees: tuple[int, ...]) -> Any:
    """A DacpPlan using exactly `degrees` (each at least once), the longest sequences on the most ranks.

    The sequences, longest first, are cut into len(degrees) runs of near-equal count (earlier runs one
    longer), the k-th run going to the k-th largest degree; each sequence then goes to the least-loaded
    place of its degree (tokens per rank so far): a rank for degree 1, an aligned subgroup
    [g*d, (g+1)*d) for 1 < d < N, the whole CP group for N. A check of the runtime, not a planner: it
    ignores BucketSize and the cost model.
    """
    from scheduling import DacpPlan, SubgroupShards, shard_tokens

    check_degrees(degrees, cp_size, len(lengths))
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    runs = np.array_split(np.array(order, dtype=np.int64), len(degrees))
    load = [0] * cp_size
    local: list[list[int]] = [[] for _ in range(cp_size)]
    distributed: list[int] = []
    groups: dict[tuple[int, int], list[int]] = {}
    for degree, run in zip(sorted(degrees, reverse=True), runs, strict=True):
        for i in map(int, run):
            shard = shard_tokens(lengths[i], degree)
            if degree == cp_size > 1:
                distributed.append(i)
                load = [x + shard for x in load]
                continue
            g = min(range(cp_size // degree), key=lambda g: (max(load[g * degree:(g + 1) * degree]), g))
            for r in range(g * degree, (g + 1) * degree):
                load[r] += shard
            if degree == 1:
                local[g].append(i)
            else:
                groups.setdefault((degree, g), []).append(i)
    partial = tuple(SubgroupShards(degree=d, group=g, indices=tuple(groups[(d, g)]))
                    for d, g in sorted(groups, key=lambda key: (-key[0], key[1])))
    return DacpPlan(local=tuple(map(tuple, local)), distributed=tuple(distributed), partial=partial)


def make_plan(lengths: tuple[int, ...], cp_size: int, distribute: str, model) -> Any:
    """all: every sequence sharded; none: greedy longest-first onto the least-loaded rank; auto: plan_dacp."""
    from scheduling import CostModel, DacpPlan, plan_dacp

    if distribute == "all":
        return DacpPlan(local=((),) * cp_size, distributed=tuple(range(len(lengths))))
    if distribute == "none":
        local: list[list[int]] = [[] for _ in range(cp_size)]
        load = [0] * cp_size
        for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
            r = load.index(min(load))
            local[r].append(i)
            load[r] += lengths[i]
        return DacpPlan(local=tuple(map(tuple, local)), distributed=())
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cost = CostModel.from_model_dims(hidden_size=cfg.hidden_size, num_layers=cfg.num_hidden_layers,
                                     kv_hidden_size=cfg.num_key_value_heads * head_dim)
    # A bucket 25% above an even split: the longest sequences no longer fit whole on one rank, so a
    # mixed batch gets both local and distributed sequences.
    bucket = max(math.ceil(1.25 * sum(lengths) / cp_size), math.ceil(max(lengths) / cp_size) + 2)
    return plan_dacp(list(lengths), cp_size=cp_size, bucket_size=bucket, cost=cost)


def make_tokens(spec: ParitySpec, vocab_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """Random token ids; labels mask a prompt-like first ~25% of each sequence with -100."""
    rng = np.random.default_rng(spec.seed)
    ids, labels = [], []
    for n in spec.lengths:
        seq = rng.integers(0, vocab_size, size=n).tolist()
        lab = list(seq)
        for t in range(n // 4):
            lab[t] = IGNORE_INDEX
        ids.append(seq)
        labels.append(lab)
    return ids, labels


def _build(spec: ParitySpec, attn: str | None = None):
    from workers.models import build_model

    return build_model(spec.model, dtype=spec.dtype, seed=spec.seed, attn_implementation=attn,
                       **dict(spec.model_kwargs))


def _rank_device():
    """The process group's backend decides, not what the host has: gloo ranks stay on CPU on a GPU host
    (tests, `verify --backend gloo`); NCCL ranks use the GPU launch.py gave each of them."""
    import torch
    import torch.distributed as dist

    nccl = dist.get_backend() == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def _runtime(world: int):
    """This rank's attention runtime over a CP group of all `world` ranks and its aligned subgroups
    (collective: every rank calls it alike), as a training worker builds it."""
    from workers.distributed import ParallelGroups

    return ParallelGroups.create(world, device=_rank_device()).attention


def _rank(rank: int, world: int, spec: ParitySpec, weights: str, plan, ids, labels, total: int,
          runtime=None) -> dict:
    """One rank's loss share and parameter gradients; `runtime`: the rank's AttentionRuntime (None: build
    one here, collectively)."""
    import torch

    from workers.batch import build_rank_batch
    from workers.forward import micro_batch_loss_sum

    device = _rank_device()
    model = _build(spec).to(device)
    model.load_state_dict(torch.load(weights, weights_only=True))
    runtime = runtime or _runtime(world)
    batch = build_rank_batch(plan, ids, labels, cp_rank=rank, cp_size=world)
    loss = micro_batch_loss_sum(model, batch, runtime=runtime) / total
    loss.backward()
    grads = {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss.item(), "grads": grads, "tokens": batch.num_tokens}


def _reference(spec: ParitySpec, weights: str, ids, labels, total: int, *, fp32: bool = True,
               device: str = "cpu") -> tuple[float, dict]:
    """The HF model's own loss and gradients ("sdpa" attention, one sequence at a time): in fp32 (the
    reference), or in the spec's dtype (the error that dtype alone makes), on `device`; grads on the CPU.
    fp32 on CUDA runs at torch's "highest" fp32 matmul precision (no TF32), whatever the process set."""
    import torch

    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        return _reference_at(spec, weights, ids, labels, total, fp32=fp32, device=device)
    finally:
        torch.set_float32_matmul_precision(precision)


def _reference_at(spec: ParitySpec, weights: str, ids, labels, total: int, *, fp32: bool,
                  device: str) -> tuple[float, dict]:
    import torch

    model = _build(spec, attn="sdpa")
    state = torch.load(weights, weights_only=True)
    if fp32:
        model, state = model.float(), {k: v.float() for k, v in state.items()}
    model.load_state_dict(state)
    model.to(device)
    loss = torch.zeros((), device=device)
    for seq, lab in zip(ids, labels, strict=True):
        out = model(input_ids=torch.tensor([seq], device=device), labels=torch.tensor([lab], device=device),
                    use_cache=False, num_items_in_batch=torch.tensor(total, device=device))
        loss = loss + out.loss
    loss.backward()
    return loss.item(), {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}


def _max_rel_diff(grads: dict, ref_grads: dict) -> float:
    return max(float((grads[n] - ref).abs().max()) / max(float(ref.abs().max()), 1e-30)
               for n, ref in ref_grads.items())


def run_parity(spec: ParitySpec, backend: str | None = None) -> dict[str, Any]:
    """Run the check; returns diffs, per-parameter stats, the plan and ok (within TOLERANCE; in bf16 the
    gradient bound is the larger of TOLERANCE and BF16_FLOOR_FACTOR x hf_own_grad_max_rel_diff, the HF
    model's own bf16 gradients against the same fp32 reference).

    backend: gloo (every rank on CPU) or nccl (one GPU per rank); None: nccl when CUDA is available.
    """
    return run_parities([spec], backend)[0]


@dataclass(frozen=True, slots=True)
class _Case:
    """One spec's inputs, shared by its ranks and its reference."""

    spec: ParitySpec
    weights: str
    plan: Any
    ids: list[list[int]]
    labels: list[list[int]]
    total: int
    trainable: int

    @property
    def job(self) -> tuple:
        """_rank's arguments after (rank, world)."""
        return self.spec, self.weights, self.plan, self.ids, self.labels, self.total


def run_parities(specs: list[ParitySpec], backend: str | None = None) -> list[dict[str, Any]]:
    """run_parity for each spec, every spec's ranks in one set of processes (one spawn, one import of torch
    and transformers per rank: most of a tiny model's check); the specs share one cp_size."""
    from workers.tools.launch import run_workers

    sizes = {spec.cp_size for spec in specs}
    if len(sizes) != 1:
        raise ValueError(f"run_parities runs specs of one cp_size, got {sorted(sizes)}")
    with tempfile.TemporaryDirectory(prefix="skrull-verify-") as tmp:
        cases = [_prepare(spec, str(Path(tmp) / f"weights{i}.pt")) for i, spec in enumerate(specs)]
        per_rank = run_workers(_rank_each, sizes.pop(), args=([case.job for case in cases],), backend=backend)
        return [_judge(case, [ranks[i] for ranks in per_rank], backend) for i, case in enumerate(cases)]


def _rank_each(rank: int, world: int, jobs: list[tuple]) -> list[dict]:
    """_rank for every job in turn, on this one process, with one attention runtime (groups built once)."""
    runtime = _runtime(world)
    return [_rank(rank, world, *job, runtime=runtime) for job in jobs]


def _prepare(spec: ParitySpec, weights: str) -> _Case:
    """The spec's seeded model saved to `weights`, its tokens, labels and DACP plan."""
    import torch

    model = _build(spec)
    _randomize_lora_b(model, spec.seed)
    ids, labels = make_tokens(spec, model.config.vocab_size)
    if spec.degrees:
        plan = plan_with_degrees(spec.lengths, spec.cp_size, spec.degrees)
    else:
        plan = make_plan(spec.lengths, spec.cp_size, spec.distribute, model)
    total = sum(sum(1 for t in lab[1:] if t != IGNORE_INDEX) for lab in labels)
    torch.save(model.state_dict(), weights)
    return _Case(spec, weights, plan, ids, labels, total, sum(p.requires_grad for p in model.parameters()))


def _judge(case: _Case, ranks: list[dict], backend: str | None) -> dict[str, Any]:
    """The ranks' summed loss and gradients against the HF model's own (run_parity's result)."""
    import torch

    spec = case.spec
    # bf16 runs: both references on the ranks' device (a 0.5B fp32 reference took minutes on a GPU host's
    # CPU); its fp32 rounding (~1e-7) is far below bf16's 5e-2 tolerance. fp32 runs: on the CPU.
    ranks_device = "cuda" if backend == "nccl" or (backend is None and torch.cuda.is_available()) else "cpu"
    device = ranks_device if spec.dtype == "bf16" else "cpu"
    try:
        ref_loss, ref_grads = _reference(spec, case.weights, case.ids, case.labels, case.total, device=device)
    except torch.cuda.OutOfMemoryError:  # long --lengths: the full logits fit host memory, not the GPU's
        torch.cuda.empty_cache()
        device = "cpu"
        ref_loss, ref_grads = _reference(spec, case.weights, case.ids, case.labels, case.total, device=device)
    floor = None
    if spec.dtype == "bf16":  # the same model in bf16, on the device the ranks ran on
        _, own = _reference(spec, case.weights, case.ids, case.labels, case.total, fp32=False,
                            device=ranks_device)
        floor = _max_rel_diff(own, ref_grads)
    loss = sum(r["loss"] for r in ranks)
    params = {}
    for name, ref in ref_grads.items():
        ours = sum(r["grads"][name] for r in ranks if name in r["grads"])
        diff = float((ours - ref).abs().max())
        params[name] = {"abs": diff, "rel": diff / max(float(ref.abs().max()), 1e-30)}
    tol = TOLERANCE[spec.dtype]
    loss_tol = tol
    if floor is not None:
        tol = max(tol, BF16_FLOOR_FACTOR * floor)
    loss_abs = abs(loss - ref_loss)
    plan = case.plan
    result = {
        "loss": loss, "ref_loss": ref_loss, "loss_abs_diff": loss_abs,
        "grad_max_abs_diff": max(p["abs"] for p in params.values()),
        "grad_max_rel_diff": max(p["rel"] for p in params.values()),
        "tolerance": tol, "params": params, "plan": plan.to_dict() if hasattr(plan, "to_dict") else None,
        "rank_tokens": [r["tokens"] for r in ranks], "hf_own_grad_max_rel_diff": floor,
        "reference_device": device,
    }
    result["ok"] = bool(loss_abs <= loss_tol * max(1.0, abs(ref_loss)) and result["grad_max_rel_diff"] <= tol
                        and len(params) == case.trainable)
    return result


def _randomize_lora_b(model, seed: int) -> None:
    """LoRA (model_kwargs lora_r > 0): give every lora_B random values instead of peft's zeros.

    With B = 0 every lora_A gradient is exactly 0 on both sides, so the check would be blind to A; the
    ranks and the reference load these same weights from the parent's state_dict.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.1)

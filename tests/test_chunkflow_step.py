"""The chunkflow policy's step is exact, and its activation memory is bounded by its kept chunks.

Exactness: one DeepSpeed ZeRO-2 step over 2 gloo ranks with chunkflow plans equals the Hugging Face model's
own forward/backward on each whole sequence (fp32, its default attention), the reference of
tests/test_train_step.py, whose helpers (samples, plain SGD read-out, reference gradients) this reuses. With
ChunkSize 8 the batch holds sequences cut into N = 5, 3 and 2 dependent chunks and short ones packed whole
(N = 1), run with K = 1, 2 and 5 (= the longest N: nothing recomputed) kept chunks, once with activation
checkpointing on top (the chunk's layers recomputed inside its backward too), and once at DP 1 x CP 2, where
the two CP ranks train different chunks as two ChunkFlow ranks. One start of the two ranks runs every case.

Memory: a ledger of the tensors autograd saves for backward (torch.autograd.graph.saved_tensors_hooks; the
parameters left out, each storage counted once while any saved tensor holds it) gives the peak activation
bytes of one long sequence's step, unchunked and as N dependent chunks; the chunked figures add the
sequence's K/V store (K, V and their fp32 gradients, every layer), which lives beside the activations.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from scheduling import CostModel, plan_step
from scheduling.payload import Cursor, Sample, build_rank_payloads
from tests.planned_steps import labelled_samples
from tests.test_train_step import MODEL, VOCAB, _ds_config

CHUNK = 8
LENGTHS = [40, 9, 17, 3, 33, 12, 5, 1, 16, 7]
COST = CostModel.from_model_dims(hidden_size=64, kv_hidden_size=32, num_layers=2)
LR = 2.0**20
# (dp_size, cp_size, K, activation checkpointing)
CASES = {
    "dp2_keep1": (2, 1, 1, False),
    "dp2_keep2": (2, 1, 2, False),
    "dp2_keep5": (2, 1, 5, False),
    "dp2_keep1_recompute": (2, 1, 1, True),
    "dp1_cp2_keep2": (1, 2, 2, False),
}


def _samples() -> list[Sample]:
    return labelled_samples(LENGTHS, vocab=VOCAB, seed=11)


def _plan(dp: int, cp: int, keep: int):
    return plan_step("chunkflow", LENGTHS, dp_size=dp, cp_size=cp, bucket_size=CHUNK, cost=COST,
                     chunkflow_keep=keep)


def _reference_grads() -> dict[str, torch.Tensor]:
    from workers.models import build_model

    model = build_model(**MODEL, attn_implementation="sdpa")
    samples = _samples()
    label_tokens = sum(s.num_label_tokens for s in samples)
    total = 0.0
    for s in samples:
        out = model(input_ids=torch.as_tensor(s.input_ids)[None], labels=torch.as_tensor(s.labels)[None],
                    use_cache=False)
        total = total + out.loss * s.num_label_tokens if s.num_label_tokens else total
    (total / label_tokens).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def _worker(rank: int, world: int, out_dir: str) -> None:
    """One rank (workers/tools/launch.py run_workers: the gloo world group is up)."""
    import torch.distributed as dist

    from workers.distributed import ParallelGroups
    from workers.engine import import_deepspeed
    from workers.models import build_model
    from workers.step import run_step

    deepspeed = import_deepspeed()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    samples = _samples()
    for name, (dp, cp, keep, recompute) in CASES.items():
        groups = ParallelGroups.create(cp)
        payloads = build_rank_payloads(_plan(dp, cp, keep), samples, step=1, epoch=0,
                                       cursor=Cursor(epoch=0, rows=len(samples)), plan_ms=0.0)
        model = build_model(**MODEL, activation_checkpointing=recompute)
        model.train()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        engine, *_ = deepspeed.initialize(model=model, config=_ds_config(),
                                          optimizer=torch.optim.SGD(model.parameters(), lr=LR))
        stats = run_step(engine, payloads[groups.dp_rank, groups.cp_rank], groups, device=torch.device("cpu"),
                         loss_chunk_tokens=16)
        loss = stats.loss_sum.clone()
        dist.all_reduce(loss)
        if rank == 0:
            grads = {n: (before[n] - p.detach()) / LR for n, p in engine.module.named_parameters()}
            torch.save({"grads": grads, "loss_sum": float(loss)}, Path(out_dir, f"{name}.pt"))
        dist.barrier()


@pytest.fixture(scope="module")
def chunkflow_grads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from workers.tools.launch import run_workers

    out_dir = tmp_path_factory.mktemp("chunkflow")
    run_workers(_worker, 2, args=(str(out_dir),), backend="gloo")
    return out_dir


def test_the_cases_cut_sequences_into_1_2_and_5_chunks_and_recompute_all_but_k() -> None:
    for dp, cp, keep, _ in CASES.values():
        plan = _plan(dp, cp, keep)
        spans = [span for rank in plan.micro_batches for mb in rank for span in mb.chunks if span is not None]
        assert {s.num_chunks for s in spans} == {2, 3, 5}
        assert any(not mb.chunks for rank in plan.micro_batches for mb in rank)  # standalone packs (N = 1)
        assert all(s.recompute == (s.chunk < s.num_chunks - keep) for s in spans)
        if cp == 2:  # both CP ranks train chunks in one micro-batch: each is a ChunkFlow rank
            assert any(sum(s is not None for s in mb.chunks) == 2 for mb in plan.micro_batches[0])


@pytest.mark.parametrize("case", list(CASES))
def test_one_chunkflow_step_equals_the_unchunked_reference(chunkflow_grads: Path, case: str) -> None:
    reference = _reference_grads()
    ours = torch.load(chunkflow_grads / f"{case}.pt")
    assert set(ours["grads"]) == set(reference)
    for name, ref in reference.items():
        # fp32: the chunks sum the same terms in another order (log-sum-exp merges of the prior and own
        # blocks, dK/dV accumulated over later chunks, chunked CE, gloo reductions), as in test_train_step.
        scale = ref.abs().max().item() + 1e-12
        diff = (ours["grads"][name] - ref).abs().max().item()
        assert diff <= 1e-5 * scale + 1e-9, f"{case}: {name} differs by {diff:.3g} (scale {scale:.3g})"


class _SavedTensorLedger:
    """Bytes of the storages autograd holds for backward, now and at peak (parameters left out)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.holders: dict[int, int] = {}
        self.nbytes: dict[int, int] = {}
        self.now = self.peak = 0

    def pack(self, tensor: torch.Tensor) -> object:
        ledger, key = self, tensor.untyped_storage().data_ptr()
        if key in self.params:
            return tensor
        if not self.holders.get(key):
            self.nbytes[key] = tensor.untyped_storage().nbytes()
            self.now += self.nbytes[key]
            self.peak = max(self.peak, self.now)
        self.holders[key] = self.holders.get(key, 0) + 1

        class Held:
            def __init__(self) -> None:
                self.tensor = tensor

            def __del__(self) -> None:
                ledger.holders[key] -= 1
                if not ledger.holders[key]:
                    ledger.now -= ledger.nbytes[key]

        return Held()

    @staticmethod
    def unpack(held: object) -> torch.Tensor:
        return held if isinstance(held, torch.Tensor) else held.tensor


def _peak_bytes(length: int, chunk: int | None, keep: int = 1) -> tuple[int, int]:
    """(peak saved-activation bytes, K/V store bytes) of one sequence's forward + backward, unchunked
    (`chunk` None) or as dependent chunks of `chunk` tokens with `keep` kept."""
    import workers.chunkflow
    from workers.attention.chunked import ChunkKV
    from workers.chunkflow import run_chunked
    from workers.forward import micro_batch_loss_sum
    from workers.models import build_model
    from workers.step import rank_batch

    ids = np.random.default_rng(5).integers(1, VOCAB, size=length)
    sample = Sample(sample_id=0, input_ids=ids, labels=ids.copy())
    bucket = chunk or length
    plan = plan_step("chunkflow", [length], dp_size=1, cp_size=1, bucket_size=bucket, cost=COST,
                     chunkflow_keep=keep)
    payload = build_rank_payloads(plan, [sample], step=1, epoch=0, cursor=Cursor(epoch=0, rows=1),
                                  plan_ms=0.0)[0, 0]
    batches = [rank_batch(mb, 0, 1, torch.device("cpu")) for mb in payload.micro_batches]
    model = build_model(**MODEL)
    model.train()
    stores: list[ChunkKV] = []

    class Recorded(ChunkKV):
        def __init__(self, length: int) -> None:
            super().__init__(length)
            stores.append(self)

    ledger = _SavedTensorLedger(model)
    original, workers.chunkflow.ChunkKV = workers.chunkflow.ChunkKV, Recorded
    try:
        with torch.autograd.graph.saved_tensors_hooks(ledger.pack, ledger.unpack):
            if chunk is None:
                micro_batch_loss_sum(model, batches[0], loss_chunk_tokens=64).backward()
            else:
                assert len(batches) == -(-length // chunk)
                run_chunked(model, batches, runtime=None, loss_chunk_tokens=64,
                            backward=torch.Tensor.backward)
    finally:
        workers.chunkflow.ChunkKV = original
    assert ledger.now == 0  # every saved tensor was released after its backward
    return ledger.peak, sum(store.nbytes for store in stores)


def test_peak_activation_memory_is_bounded_by_the_kept_chunks_not_the_sequence() -> None:
    chunk, n = 64, 8
    whole, _ = _peak_bytes(chunk * n, None)
    one_chunk, _ = _peak_bytes(chunk, None)  # a standalone chunk: the activations of C tokens
    keep1, store = _peak_bytes(chunk * n, chunk, keep=1)
    keep2, _ = _peak_bytes(chunk * n, chunk, keep=2)
    longer, _ = _peak_bytes(chunk * 2 * n, chunk, keep=1)
    # K = 1, even with the sequence's K/V store and its gradients, under half of the unchunked step ...
    assert keep1 + store < 0.5 * whole, (keep1, store, whole)
    # ... and the activations are K chunks' worth, whatever the sequence's length
    assert keep1 <= 1.1 * one_chunk, (keep1, one_chunk)
    assert 1.5 * one_chunk <= keep2 <= 2.2 * one_chunk, (keep2, one_chunk)
    assert longer <= 1.1 * keep1, (longer, keep1)


def test_the_eval_loss_of_chunked_sequences_is_the_hf_models_loss() -> None:
    from types import SimpleNamespace

    from workers.eval_step import eval_loss_sum
    from workers.models import build_model

    samples = _samples()
    payload = build_rank_payloads(_plan(1, 1, 1), samples, step=1, epoch=0, cursor=Cursor(epoch=0, rows=10),
                                  plan_ms=0.0)[0, 0]
    groups = SimpleNamespace(is_spare=False, cp_rank=0, cp_size=1, attention=None)
    ours = eval_loss_sum(build_model(**MODEL), (payload,), groups, device=torch.device("cpu"),
                         loss_chunk_tokens=16)
    reference = build_model(**MODEL, attn_implementation="sdpa")
    with torch.no_grad():
        expected = sum(float(reference(input_ids=torch.as_tensor(s.input_ids)[None],
                                       labels=torch.as_tensor(s.labels)[None]).loss) * s.num_label_tokens
                       for s in samples if s.num_label_tokens)
    assert float(ours) == pytest.approx(expected, rel=1e-5)

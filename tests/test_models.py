"""Model level: the DACP-attention model's summed loss / gradients equal the HF model's own.

Reference: the same weights with transformers' "sdpa" attention, one sequence at a time, HF's loss with
num_items_in_batch = all label tokens (summed CE / count). fp32 tolerance 1e-5 relative (measured
~1e-6: only the order of fp32 sums differs - packed vs per-sequence, chunked CE, ring merges).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from scheduling import DacpPlan
from workers.attention import AttentionRuntime
from workers.batch import build_rank_batch
from workers.forward import micro_batch_loss_sum
from workers.loss import linear_cross_entropy_sum
from workers.models import build_model
from workers.tools.parity import ParitySpec, run_parity

TOL = 1e-5


def _hf_reference(model, ids, labels, total):
    loss = torch.zeros(())
    for seq, lab in zip(ids, labels, strict=True):
        loss = loss + model(input_ids=torch.tensor([seq]), labels=torch.tensor([lab]), use_cache=False,
                            num_items_in_batch=torch.tensor(total)).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-llama"])
def test_single_rank_matches_hf_model(name: str) -> None:
    model = build_model(name, seed=3)
    assert model.config._attn_implementation == "dacp" and model.config.use_cache is False
    ref = build_model(name, seed=3, attn_implementation="sdpa")
    ref.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(0)
    lengths = [1, 2, 17, 40, 9]
    ids = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in lengths]
    labels = [[-100] * (n // 3) + seq[n // 3:] for n, seq in zip(lengths, ids, strict=True)]
    total = sum(sum(1 for t in lab[1:] if t != -100) for lab in labels)
    # cp_size 1 with "distributed" sequences: padding + diagonal-block path, no process group.
    batch = build_rank_batch(DacpPlan(local=((4, 0, 2),), distributed=(1, 3)), ids, labels, cp_rank=0,
                             cp_size=1)
    assert batch.num_label_tokens == total
    runtime = AttentionRuntime.create(None, torch.device("cpu"), "torch")
    loss = micro_batch_loss_sum(model, batch, runtime=runtime, loss_chunk_tokens=7) / total
    loss.backward()
    ref_loss, ref_grads = _hf_reference(ref, ids, labels, total)
    assert abs(loss.item() - ref_loss) <= TOL * abs(ref_loss)
    for n, p in model.named_parameters():
        rel = float((p.grad - ref_grads[n]).abs().max() / ref_grads[n].abs().max())
        assert rel <= TOL, f"{name} {n}: grad rel diff {rel:.3g}"


def test_chunked_cross_entropy_matches_full_logits() -> None:
    gen = torch.Generator().manual_seed(1)
    head = torch.nn.Linear(16, 50, bias=True)
    hidden = torch.randn(23, 16, generator=gen, requires_grad=True)
    targets = torch.randint(0, 50, (23,), generator=gen)
    targets[::4] = -100
    ours = linear_cross_entropy_sum(hidden, head, targets, chunk_tokens=5)
    ours.backward()
    grads = [hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()]
    hidden.grad = head.weight.grad = head.bias.grad = None
    ref = torch.nn.functional.cross_entropy(head(hidden), targets, reduction="sum", ignore_index=-100)
    ref.backward()
    # fp32, same math in a different summation order: 1e-5 relative.
    assert torch.allclose(ours, ref, rtol=1e-5, atol=1e-5)
    for ours_g, ref_g in zip(grads, [hidden.grad, head.weight.grad, head.bias.grad], strict=True):
        assert torch.allclose(ours_g, ref_g, rtol=1e-5, atol=1e-6)


class _MatmulDtypes(TorchDispatchMode):
    """Records the input dtypes of every matrix product dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[torch.dtype, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
            self.seen.append(tuple(a.dtype for a in args if isinstance(a, torch.Tensor)))
        return func(*args, **(kwargs or {}))


def test_chunked_cross_entropy_in_bf16_is_as_close_to_fp32_as_torchs_own_bf16() -> None:
    """bf16 weights: every product runs in bf16 (an fp32 [V, C] x [C, E] product runs on CUDA cores, not
    tensor cores) and the gradients are as close to an fp32 reference as torch's own bf16 linear + CE."""
    gen = torch.Generator().manual_seed(2)
    tokens, embed, vocab = 300, 64, 1000
    hidden = torch.randn(tokens, embed, generator=gen)
    weight = torch.randn(vocab, embed, generator=gen) * 0.1
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    targets[::5] = -100

    def grads(dtype: torch.dtype, loss_fn) -> tuple[torch.Tensor, torch.Tensor]:
        h = hidden.to(dtype).clone().requires_grad_()
        head = torch.nn.Linear(embed, vocab, bias=False, dtype=dtype)
        with torch.no_grad():
            head.weight.copy_(weight.to(torch.bfloat16))  # the same bf16-representable weights everywhere
        loss_fn(h, head).backward()
        return h.grad.float(), head.weight.grad.float()

    def full_logits(h, head):
        return torch.nn.functional.cross_entropy(head(h).float(), targets, reduction="sum")

    hidden = hidden.to(torch.bfloat16).float()
    ref = grads(torch.float32, full_logits)
    torch_bf16 = grads(torch.bfloat16, full_logits)
    with _MatmulDtypes() as products:
        ours = grads(torch.bfloat16, lambda h, head: linear_cross_entropy_sum(h, head, targets, 64))
    assert products.seen and all(d == (torch.bfloat16, torch.bfloat16) for d in products.seen), products.seen
    for name, o, t, r in zip(("hidden", "weight"), ours, torch_bf16, ref, strict=True):
        ours_rel, torch_rel = (float((g - r).abs().max() / r.abs().max()) for g in (o, t))
        # Both round bf16 products differently (chunked vs whole): 1.25x torch's own error, measured ~1.03x.
        assert ours_rel <= 1.25 * torch_rel, f"{name}: {ours_rel:.3g} vs torch bf16 {torch_rel:.3g}"


def test_chunked_cross_entropy_holds_one_chunk_at_a_time_within_the_memory_model() -> None:
    """Tensor accounting (workers/tools/tensor_ledger.py) of the loss's forward and backward in bf16: the
    peak is the same for one chunk and for four (a chunk's [C, V] buffers are gone before the next chunk's
    exist), and within app/profiling/memory.py's loss term, C x V x 8 + V x E x 4 bytes. On an H200 a
    0.5B micro-batch of four chunks once peaked 7 GB over that model, chunks overlapping."""
    from workers.tools.tensor_ledger import DeviceLedger

    gen = torch.Generator().manual_seed(3)
    embed, vocab, chunk = 64, 4096, 256
    head = torch.nn.Linear(embed, vocab, bias=False, dtype=torch.bfloat16)
    peaks = {}
    for tokens in (chunk, 4 * chunk):
        hidden = torch.randn(tokens, embed, generator=gen).to(torch.bfloat16).requires_grad_()
        targets = torch.randint(0, vocab, (tokens,), generator=gen)
        with DeviceLedger() as ledger:
            linear_cross_entropy_sum(hidden, head, targets, chunk, label_rows=torch.arange(tokens)).backward()
        peaks[tokens] = ledger.peak
    modeled = chunk * vocab * 8 + vocab * embed * 4
    # The four-chunk run also holds d_hidden and the gradient of 4x the tokens: 2 x 3C x E bytes more.
    assert peaks[4 * chunk] <= peaks[chunk] + 2 * 3 * chunk * embed * 2 + 4096, peaks
    assert max(peaks.values()) <= modeled, (peaks, modeled)


def test_build_model_errors() -> None:
    with pytest.raises(ValueError, match="model.name_or_path"):
        build_model("./no/such/model_dir")
    with pytest.raises(ValueError, match="model.dtype"):
        build_model("tiny-qwen2", dtype="fp8")
    model = build_model("tiny-llama", hidden_size=32, num_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, vocab_size=100, dtype="bf16")
    assert model.config.num_hidden_layers == 1 and model.dtype == torch.bfloat16


@pytest.mark.slow
def test_llama_cp3_mixed_plan_matches_hf_model() -> None:
    """CP=3 over gloo: local + distributed sequences (DACP plan), GQA, lengths 1 and 2 included."""
    result = run_parity(ParitySpec(model="tiny-llama", lengths=(1, 2, 13, 5, 97, 40), cp_size=3,
                                   distribute="auto"), backend="gloo")
    assert result["plan"]["distributed"] and any(result["plan"]["local"]), result["plan"]
    assert result["ok"], {k: result[k] for k in ("loss_abs_diff", "grad_max_rel_diff", "tolerance")}
    assert result["grad_max_rel_diff"] <= TOL


def test_a_sliding_window_no_shorter_than_the_sequences_is_full_causal_attention() -> None:
    """Mistral v0.1's kind of config: with every sequence within the window, the dacp attention equals
    transformers' own sliding-window attention (sdpa); a longer sequence is refused, never silently
    attended in full (app/model/support.py refuses such a run before Ray starts)."""
    from transformers import MistralConfig, MistralForCausalLM

    from workers.attention.hf import register_dacp_attention

    config = MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=16, use_cache=False)
    torch.manual_seed(0)
    # Each model its own config: the attention implementation is set on the config object.
    dacp = register_dacp_attention()
    ours = MistralForCausalLM._from_config(copy.deepcopy(config), attn_implementation=dacp)
    ref = MistralForCausalLM._from_config(copy.deepcopy(config), attn_implementation="sdpa")
    assert (ours.config._attn_implementation, ref.config._attn_implementation) == ("dacp", "sdpa")
    ref.load_state_dict(ours.state_dict())
    ids = torch.randint(0, 256, (1, 16))
    assert torch.allclose(ours(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    longer = torch.randint(0, 256, (1, 17))
    with pytest.raises(ValueError, match="16-token window is shorter than a 17-token sequence"):
        ours(input_ids=longer)

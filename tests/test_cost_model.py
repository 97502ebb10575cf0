"""The model cost formula (scheduling.cost_formula: model) against FLOPs counted on the HF module itself.

Reference: torch's FlopCounterMode over the Hugging Face Qwen2 forward (the decoder body on the whole
sequence, then the LM head on the label positions only, which is what the chunked loss computes), built
on the meta device so real Qwen2.5 shapes cost no memory. The counter counts every matmul the module runs
and attention as a full S x S product (torch's flop_counter does not discount the causal mask), so the
formula is compared with causal=False; tolerance 5% (what the formula leaves out: nothing that the
counter counts, so the observed difference is ~0).
"""

from __future__ import annotations

import pytest

from scheduling import CostModel, plan_step, simulate

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# (hidden, heads, kv_heads, intermediate, vocab): the tiny preset, Qwen2.5-0.5B and Qwen2.5-7B shapes.
SHAPES = {"tiny": (64, 4, 2, 128, 512), "qwen2.5-0.5b": (896, 14, 2, 4864, 151936),
          "qwen2.5-7b": (3584, 28, 4, 18944, 152064)}
LAYERS = 2


def _meta_model(hidden: int, heads: int, kv_heads: int, intermediate: int, vocab: int):
    config = transformers.Qwen2Config(hidden_size=hidden, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads, intermediate_size=intermediate,
                                      vocab_size=vocab, num_hidden_layers=LAYERS, tie_word_embeddings=False)
    config._attn_implementation = "eager"
    with torch.device("meta"):
        return transformers.Qwen2ForCausalLM(config)


def _counted_flops(model, length: int, labels: int) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    ids = torch.zeros((1, length), dtype=torch.long, device="meta")
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
        model.lm_head(hidden[0, :labels])
    return counter.get_total_flops()


def _cost(shape: tuple[int, int, int, int, int]) -> CostModel:
    hidden, heads, kv_heads, intermediate, vocab = shape
    return CostModel.from_model_dims(hidden_size=hidden, kv_hidden_size=kv_heads * (hidden // heads),
                                     num_layers=LAYERS, formula="model", intermediate_size=intermediate,
                                     vocab_size=vocab)


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("length", [16, 300, 2048])
@pytest.mark.parametrize("label_fraction", [0.0, 0.3, 1.0])
def test_model_formula_matches_the_flop_counter(name: str, length: int, label_fraction: float) -> None:
    shape = SHAPES[name]
    labels = int(length * label_fraction)
    counted = _counted_flops(_meta_model(*shape), length, labels)
    modeled = sum(_cost(shape).flop_terms(length, labels, causal=False).values())
    assert modeled == pytest.approx(counted, rel=0.05)


def test_the_paper_formula_misses_what_dominates_a_small_model() -> None:
    """Why `model` exists: on the tiny preset with Qwen's vocabulary the LM head dominates."""
    shape = SHAPES["tiny"][:4] + (151936,)
    counted = _counted_flops(_meta_model(*shape), 256, 256)
    paper = CostModel.from_model_dims(hidden_size=64, kv_hidden_size=32, num_layers=LAYERS).flops(256)
    assert paper < 0.05 * counted
    assert _cost(shape).flops(256) < counted  # causal attention: below the counter's full S x S


def test_causal_attention_is_what_the_mask_keeps() -> None:
    cost = _cost(SHAPES["tiny"])
    for length in (1, 7, 1000):
        dense = cost.flop_terms(length, 0, causal=False)["attention"]
        assert cost.flop_terms(length, 0)["attention"] == pytest.approx(dense * (length + 1) / (2 * length))


def test_label_tokens_steer_the_plan() -> None:
    """Two sequences of equal length: the one with labels costs more, so the modeled step does too."""
    cost = _cost(SHAPES["tiny"][:4] + (151936,))
    lengths = [400, 400, 50, 50]
    plan = plan_step("skrull", lengths, dp_size=2, cp_size=1, bucket_size=1000, cost=cost, labels=[0] * 4)
    no_labels = simulate(plan, lengths, cost, labels=[0] * 4).step_s
    with_labels = simulate(plan, lengths, cost, labels=[400, 0, 0, 0]).step_s
    assert with_labels > no_labels
    # GDS balances FLOPs: with all labels on one long sequence, the other DP rank takes both short ones
    # and the second long one.
    loaded = plan_step("skrull", lengths, dp_size=2, cp_size=1, bucket_size=1000, cost=cost,
                       labels=[400, 0, 0, 0])
    ranks = [sorted(i for mb in rank for i in mb.indices) for rank in loaded.micro_batches]
    assert [0] in ranks and [1, 2, 3] in ranks


def test_ring_overlap_interpolates_between_hidden_and_serialized() -> None:
    from scheduling import HardwareProfile

    def cost(overlap: float) -> CostModel:
        return CostModel.from_model_dims(hidden_size=64, kv_hidden_size=32, num_layers=2,
                                         profile=HardwareProfile(ring_overlap=overlap))

    assert cost(1.0).overlapped(0.3, 0.5) == pytest.approx(0.5)
    assert cost(0.0).overlapped(0.3, 0.5) == pytest.approx(0.8)
    assert cost(0.5).overlapped(0.3, 0.5) == pytest.approx(0.65)
    with pytest.raises(ValueError, match="ring_overlap"):
        HardwareProfile(ring_overlap=1.5)

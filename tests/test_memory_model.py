"""The memory per rank and the BucketSize it leaves (app/profiling/memory.py; scheduling.bucket_size: auto),
`plan`'s report of both, and the activation checkpointing knobs' config rules.

The terms are checked against the arithmetic written out here for Qwen2.5-7B (configs/qwen2.5-7b-gpu.yaml:
7,615,616,512 parameters, h 3584, h_kv 512, 28 layers, I 18944, V 152064, bf16, 8 ranks, 80 GB H100
profile; its config.json is not in the cache, so 3584 / 64 = 56 heads of 64), so a changed term is a failing
test, not a silently different C. What the per-token terms are made of is measured against torch's own
accounting in tests/test_activation_memory.py.
"""

from __future__ import annotations

import argparse
import math

import pytest

from app.commands import plan
from app.config import ConfigError, load_config
from app.profiling.budget import bucket_budget, resolve_bucket_size
from app.profiling.memory import SAFETY_FRACTION, memory_terms
from tests.plan_json import plan_json

GPU_7B = "configs/qwen2.5-7b-gpu.yaml"
P, H, HKV, L, I, V = 7_615_616_512, 3584, 512, 28, 18944, 152_064
HEADS, HEAD_DIM = 56, 64
SYNTHETIC = ["data.source=synthetic", "data.distribution=chatqa2", "plan.num_batches=1"]
RECOMPUTE = ["train.activation_checkpointing=true"]
RUNTIME = 2.5e9
"""configs/hardware/h100.yaml's runtime_memory_bytes."""




def _layer_saved() -> float:
    """One decoder layer's saved tensors per token, bf16 (app/profiling/activation/torch_kernels.py): two
    RMSNorms (fp32 upcast 4h, normalized 2h, output 2h, rsqrt 4), q 2h, k and v 2 h_kv each, the
    attention's output 2h (o_proj saves a view of it) and fp32 lse (4 per head), the MLP's gate, SiLU(gate),
    up and product 2I each."""
    norm = 4 * H + 2 * H + 2 * H + 4
    return 2 * norm + 2 * H + 4 * HKV + 2 * H + 4 * HEADS + 8 * I


def test_the_7b_terms_are_the_written_out_arithmetic() -> None:
    config = load_config(GPU_7B, RECOMPUTE)
    w, e, bucket = 8, 2, 5e7  # the elastic run's smallest group: each rank holds the most
    zero2 = memory_terms(config, zero_stage=2)
    assert zero2.workers == w and zero2.device == 80e9 and zero2.safety == SAFETY_FRACTION * 80e9
    assert zero2.weights == P * e and zero2.runtime == RUNTIME
    assert zero2.gradients == pytest.approx(P * 4 / w + 2 * bucket * e)
    assert zero2.optimizer == pytest.approx(P * 12 / w)
    # every layer recomputes: each keeps its bf16 input (2h); around them the final norm (fp32 input and
    # its normalized copy), the loss's saved input gradient (2h), the rotary tables (cos and sin, 2 x 2 x 64)
    # and the batch's four int64 index tensors
    head = (4 * H + 2 * H + 4) + 2 * H + 2 * 2 * HEAD_DIM + 32
    loss = (4096 * V * 8 + V * H * 4, L * 2 * H + head + 2 * H)  # + the final hidden states the loss reads
    norm = (V * H * 2, L * 2 * H + head - 2 * H + 20 * H)  # five fp32 temporaries of its backward
    backward = (V * H * 2, L * 2 * H + _layer_saved() + 2 * 2 * HEAD_DIM + 32 + 2 * 2 * I + 2 * 2 * H)
    phases = [(p.fixed, p.per_token) for p in zero2.activations.phases]
    assert phases == [pytest.approx(loss), pytest.approx(norm), pytest.approx(backward)]
    free = 80e9 - zero2.static - RUNTIME - zero2.safety
    assert zero2.tokens == min(int((free - fixed) // per_token) for fixed, per_token in phases)
    at_c = max(phases, key=lambda p: p[0] + p[1] * zero2.tokens)
    assert (zero2.loss, zero2.activation_per_token) == pytest.approx(at_c)
    assert zero2.peak_bytes == pytest.approx(zero2.static + RUNTIME + at_c[0] + at_c[1] * zero2.tokens)
    assert zero2.headroom >= zero2.safety
    zero3 = memory_terms(config, zero_stage=3)
    persistent, largest = L * (3 * H + 2 * HKV) + H, V * H  # norms and biases; the embedding
    assert zero3.weights == pytest.approx((P / w + persistent + largest + bucket) * e)
    assert zero3.tokens > zero2.tokens
    # building and loading: ZeRO-2 every rank the whole model, on the host first; ZeRO-3 its partition and
    # the largest module whole (the embedding here), the checkpoint's embedding mapped while it is read
    assert (zero2.load.device, zero2.load.host, zero2.load.host_per_node) == (P * e, P * e, P * e * 8)
    assert zero3.load.device == pytest.approx(P * e / w + V * H * e) and zero3.load.host == V * H * e
    assert zero3.load_fits and zero3.load.device < zero3.static
    offload = memory_terms(config, zero_stage=3, offload=True)
    assert offload.recompute == "every layer + offload"
    assert offload.activations.kept_per_token == pytest.approx(head)  # the inputs are in host memory


def test_recomputing_every_nth_layer_and_lora_change_the_terms_they_should() -> None:
    config = load_config(GPU_7B, [*RECOMPUTE, "train.activation_checkpointing_every=4"])
    c = math.ceil(L / 4)  # layers 0, 4, ..., 24 recompute
    kept = memory_terms(config).activations.kept_per_token
    every = memory_terms(load_config(GPU_7B, RECOMPUTE)).activations.kept_per_token
    assert kept - every == pytest.approx((L - c) * (_layer_saved() - 2 * H))
    assert memory_terms(config).recompute == "every 4th layer"
    lora = memory_terms(load_config(GPU_7B, [*RECOMPUTE, "model.lora.r=16"]), zero_stage=2)
    full = memory_terms(load_config(GPU_7B, RECOMPUTE), zero_stage=2)
    adapters = 16 * L * (9 * H + 2 * HKV + 3 * I)  # r x (in + out) of the 7 linears of a layer
    assert lora.optimizer == pytest.approx(adapters * 12 / 8) and lora.weights == full.weights
    none = memory_terms(load_config(GPU_7B, ["train.activation_checkpointing=false"]))
    assert none.activations.kept_per_token == pytest.approx(L * _layer_saved() + (every - L * 2 * H))
    assert none.recompute == "off"


def test_auto_resolves_to_the_derived_c_and_a_set_value_stays() -> None:
    config = load_config(GPU_7B, RECOMPUTE)
    assert config.scheduling.bucket_size == "auto"
    with pytest.raises(ConfigError, match="scheduling.bucket_size=auto"):
        _ = config.max_sequence_length  # derived first, by the commands and `train`
    resolved, budget = resolve_bucket_size(config)
    assert budget.source == "memory" and budget.checkpointing is None  # checkpointing was set
    assert resolved.scheduling.bucket_size == budget.tokens == budget.terms.tokens
    assert "scheduling.bucket_size=auto" in budget.line() and "ZeRO-2 over 8 ranks" in budget.line()
    fixed = bucket_budget(load_config(GPU_7B, [*RECOMPUTE, "scheduling.bucket_size=13000"]))
    assert (fixed.tokens, fixed.source) == (13000, "config")
    with pytest.raises(ConfigError, match="scheduling.bucket_size"):
        load_config(GPU_7B, ["scheduling.bucket_size=big"])


def test_auto_with_nothing_left_is_an_error_naming_the_knobs() -> None:
    config = load_config("configs/qwen2.5-72b-gpu.yaml", ["train.zero_stage=2"])
    with pytest.raises(ConfigError, match="no checkpointing setting fits.*train.zero_stage=3"):
        resolve_bucket_size(config)
    with pytest.raises(ConfigError, match="train.zero_stage=3.*scheduling.bucket_size by hand"):
        resolve_bucket_size(load_config("configs/qwen2.5-72b-gpu.yaml", ["train.zero_stage=2", *RECOMPUTE]))


@pytest.mark.parametrize("config", ["configs/qwen2.5-32b-gpu.yaml", "configs/qwen2.5-72b-gpu.yaml"])
def test_plan_of_the_32b_and_72b_configs_shows_c_step_times_and_memory_at_both_stages(capsys,
                                                                                     config: str) -> None:
    out = plan_json(capsys, config, "plan.num_batches=1")
    assert out["bucket_size_source"] == "memory" and out["bucket_size"] > 1000
    assert out["policies"]["skrull"]["modeled_step_s"] > 0
    memory = out["memory"]
    assert set(memory) == {"zero2", "zero2_offload", "zero3", "zero3_offload"}
    assert memory["zero2"]["tokens"] == 0  # the bf16 weights alone fill most of an 80 GB GPU
    assert 0 < memory["zero3"]["tokens"] < memory["zero3_offload"]["tokens"]
    own = "zero3_offload" if load_config(config).train.activation_offload else "zero3"
    assert out["bucket_size"] == memory[own]["tokens"] == out["memory_terms"]["tokens"]
    assert out["checkpointing"]["source"] == "auto" and out["checkpointing"]["tokens"] == out["bucket_size"]
    assert memory[own]["recompute"] == out["checkpointing"]["setting"]
    assert memory[own]["peak_bytes"] + memory[own]["safety"] <= memory[own]["device"]
    # the peak while the model is built and loaded, per rank: at ZeRO-2 a whole bf16 copy on every rank
    # (72B: more than a GPU), at ZeRO-3 (workers/sharded.py) 1/32 of it plus the largest module, which fits
    params = out["model_dims"]["num_params"]
    assert out["model_dims"]["source"] == "config.json"  # configs/models/<model>/config.json
    zero2 = memory["zero2"]
    assert zero2["load"]["device"] == params * 2
    assert zero2["load"]["fits"] == (params * 2 <= zero2["device"] - zero2["safety"]) == ("32b" in config)
    for key in ("zero3", "zero3_offload"):
        load = memory[key]["load"]
        assert params * 2 / 32 < load["device"] < params * 2 / 32 + 3e9 and load["fits"]
        assert load["host"] == 0  # random weights: no checkpoint is read
    assert out["memory_terms"]["load"] == memory[own]["load"] and out["memory_terms"]["load"]["fits"]


def test_plan_of_a_config_with_a_set_bucket_says_so(capsys) -> None:
    out = plan_json(capsys, GPU_7B, *SYNTHETIC, "scheduling.bucket_size=13000")
    assert (out["bucket_size"], out["bucket_size_source"]) == (13000, "config")
    assert out["memory"]["zero2"]["at_tokens"] == 13000
    parser = argparse.ArgumentParser()
    plan.add_arguments(parser)
    argv = ["--config", GPU_7B, *[a for o in SYNTHETIC for a in ("--set", o)]]
    assert plan.run(parser.parse_args(argv)) == 0
    text = capsys.readouterr().out
    assert "BucketSize C = " in text and "scheduling.bucket_size=auto, modeled" in text
    assert "modeled, not measured" in text and "ZeRO-3, recompute every layer + offload" in text
    # the run's own setting by term, down to what is left free
    for term in ("weights", "gradients", "optimizer", "loss (", "activations at C = ", "runtime", "headroom"):
        assert term in text, term
    assert "activation checkpointing = " in text and "<- chosen" in text


@pytest.mark.parametrize(("overrides", "knob"), [
    (["train.activation_offload=true"], "train.activation_checkpointing=true"),
    (["train.activation_checkpointing=auto", "train.activation_checkpointing_every=2"],
     "auto picks which layers recompute"),
    (["train.activation_checkpointing=sometimes"], "train.activation_checkpointing"),
    (["train.activation_checkpointing_every=2"], "train.activation_checkpointing=true"),
    (["train.activation_checkpointing=true", "train.activation_checkpointing_every=0"],
     "train.activation_checkpointing_every must be >= 1"),
    (["train.activation_checkpointing=true", "train.activation_offload=true"], "resources.gpus_per_worker"),
])
def test_activation_knobs_that_cannot_apply_are_config_errors(overrides: list[str], knob: str) -> None:
    with pytest.raises(ConfigError, match=knob):
        load_config(None, overrides)


def test_an_older_transformers_without_the_options_is_an_error_naming_the_knob(monkeypatch) -> None:
    """transformers before 5.17 has only the plain checkpointing: checked before Ray starts."""
    from transformers import PreTrainedModel

    from app.model.support import check_model_support

    config = load_config(None, ["train.activation_checkpointing=true",
                                "train.activation_checkpointing_every=2"])
    check_model_support(config)  # the installed transformers has it

    def plain(self, gradient_checkpointing_kwargs=None):  # the signature before 5.17
        raise AssertionError("not called: the options are checked first")

    monkeypatch.delattr(PreTrainedModel, "activation_checkpointing_enable", raising=False)
    monkeypatch.setattr(PreTrainedModel, "gradient_checkpointing_enable", plain)
    with pytest.raises(ConfigError, match="train.activation_checkpointing_every need transformers >= 5.17"):
        check_model_support(config)


def test_transformers_5_17_takes_the_options_on_gradient_checkpointing_enable(monkeypatch) -> None:
    """transformers 5.17 (the GPU image's) has every_n_layers and offload on gradient_checkpointing_enable
    and no activation_checkpointing_enable: a stand-in with 5.17's signature, delegating to today's method,
    receives the options and the layers are marked as asked."""
    from transformers import PreTrainedModel

    from app.model.support import check_model_support
    from workers.models import build_model

    newer = getattr(PreTrainedModel, "activation_checkpointing_enable",  # 5.17 itself: its own method
                    PreTrainedModel.gradient_checkpointing_enable)
    calls = []

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, every_n_layers: int = 1,
                                      offload: bool = False):
        calls.append((gradient_checkpointing_kwargs, every_n_layers, offload))
        newer(self, gradient_checkpointing_kwargs, every_n_layers=every_n_layers, offload=offload)

    monkeypatch.delattr(PreTrainedModel, "activation_checkpointing_enable", raising=False)
    monkeypatch.setattr(PreTrainedModel, "gradient_checkpointing_enable", gradient_checkpointing_enable)
    check_model_support(load_config(None, ["train.activation_checkpointing=true",
                                           "train.activation_checkpointing_every=2"]))
    model = build_model("tiny-qwen2", vocab_size=128, num_layers=4, activation_checkpointing=True,
                        activation_checkpointing_every=2, activation_offload=True)
    assert calls == [({"use_reentrant": False}, 2, True)]
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [True, False, True, False]


def test_every_nth_layer_recomputes_those_layers_and_the_gradient_is_unchanged() -> None:
    """transformers' every_n_layers marks layers 0, n, 2n, ...; recomputation changes no number."""
    import torch

    from scheduling import DacpPlan
    from workers.batch import build_rank_batch
    from workers.forward import micro_batch_loss_sum
    from workers.models import build_model

    ids = [list(range(1, 50)), list(range(3, 30))]
    batch = build_rank_batch(DacpPlan(local=((0, 1),), distributed=()), ids, ids, cp_rank=0, cp_size=1)
    grads = []
    for every in (0, 2):
        model = build_model("tiny-qwen2", vocab_size=128, num_layers=4, seed=1,
                            activation_checkpointing=bool(every), activation_checkpointing_every=every or 1)
        model.train()
        if every:
            flags = [layer.gradient_checkpointing for layer in model.model.layers]
            assert flags == [True, False, True, False]
        micro_batch_loss_sum(model, batch).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1], rtol=1e-5, atol=1e-8)


def test_activation_offload_lowers_the_peak_device_memory_of_a_long_sequence() -> None:
    """Tensor accounting (workers/tools/tensor_ledger.py) of one forward+backward of a 2048-token sequence:
    recomputation keeps each layer's input instead of its activations, offload moves those inputs to host
    memory, so the peak drops by about layers x tokens x hidden x 4 bytes (fp32) more."""
    import numpy as np

    from scheduling import DacpPlan
    from workers.batch import build_rank_batch
    from workers.models import build_model
    from workers.tools.tensor_ledger import peak_device_bytes

    tokens, layers, hidden = 2048, 4, 64
    ids = [np.random.default_rng(0).integers(1, 128, tokens).tolist()]
    batch = build_rank_batch(DacpPlan(local=((0,),), distributed=()), ids, ids, cp_rank=0, cp_size=1)
    peaks = {}
    for name, knobs in {"none": {}, "recompute": {"activation_checkpointing": True},
                        "offload": {"activation_checkpointing": True, "activation_offload": True}}.items():
        model = build_model("tiny-qwen2", vocab_size=128, num_layers=layers, hidden_size=hidden, **knobs)
        model.train()
        peaks[name] = peak_device_bytes(model, batch, loss_chunk_tokens=1024)
    inputs = layers * tokens * hidden * 4
    assert peaks["recompute"] < peaks["none"] / 2, peaks
    assert peaks["recompute"] - peaks["offload"] >= 0.75 * inputs, (peaks, inputs)


def test_train_says_the_choice_and_the_derived_c_once() -> None:
    import io

    from app.model.dims import dims_note
    from app.train.driver import _with_bucket_size

    out = io.StringIO()
    config = _with_bucket_size(load_config(GPU_7B, SYNTHETIC), out)
    assert isinstance(config.scheduling.bucket_size, int)
    assert isinstance(config.train.activation_checkpointing, bool)
    _, budget = resolve_bucket_size(load_config(GPU_7B, SYNTHETIC))
    note = dims_note(load_config(GPU_7B).model)  # where Qwen2.5-7B's config.json is not cached here
    said = [*([note] if note else []), budget.checkpointing.line(), budget.line()]
    assert out.getvalue().splitlines() == said
    assert budget.checkpointing.line().startswith("activation checkpointing = ")
    out = io.StringIO()
    assert _with_bucket_size(load_config(None, []), out).scheduling.bucket_size == 26000
    assert out.getvalue() == ""  # a set bucket_size is what the user wrote: nothing to say

"""LoRA (model.lora, peft): DACP gradient parity of the adapters, a training run, resume, and its export.

References nobody here wrote: transformers' own single-process forward/backward ("sdpa") with peft's
adapters for the gradients (workers/tools/parity.py, fp32 1e-5 relative as for the full model); DeepSpeed's
own zero_to_fp32 consolidation and peft's `PeftModel.from_pretrained` / transformers' `from_pretrained`
(in a fresh process) for the export.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from app.config import ConfigError, load_config
from app.model.export import export
from tests.export_utils import load_in_fresh_process, max_relative_diff, random_sequences, reference_logits
from tests.run_configs import SMALL_VOCAB
from tests.test_train_e2e import _config
from workers.tools.parity import ParitySpec, run_parity

ray = pytest.importorskip("ray")

TOL = 1e-5
LORA = ("model.lora.r=8", "model.lora.alpha=16", "train.lr=0.01")
STEPS = 3


def test_lora_config_is_checked_and_off_by_default(tmp_path: Path) -> None:
    assert load_config("configs/tiny-cpu.yaml").model.lora.r == 0
    config = load_config("configs/tiny-cpu.yaml", ["model.lora.r=4",
                                                   "model.lora.target_modules=[q_proj, v_proj]"])
    assert config.model.lora.target_modules == ["q_proj", "v_proj"]
    for bad, key in (("model.lora.r=-1", "model.lora.r"), ("model.lora.rank=4", "rank"),
                     ("model.lora.target_modules=[]", "model.lora.target_modules"),
                     ("model.lora.dropout=1.5", "model.lora.dropout")):
        with pytest.raises(ConfigError, match=key):
            load_config("configs/tiny-cpu.yaml", [bad])


def test_adapter_gradients_of_a_sharded_dacp_step_match_the_hf_model() -> None:
    """CP=2 over gloo (local and distributed sequences) vs transformers + peft, one sequence at a time."""
    spec = ParitySpec(model="tiny-qwen2", lengths=(1, 9, 120, 33), cp_size=2, distribute="auto",
                      model_kwargs=(("lora_r", 4), ("lora_alpha", 8.0)))
    result = run_parity(spec, backend="gloo")
    assert result["plan"]["distributed"] and any(result["plan"]["local"]), result["plan"]
    params = result["params"]
    # Only adapters train: 2 layers x 7 linear modules (q k v o gate up down) x (A, B); no base weight.
    assert len(params) == 28 and all(".lora_A." in n or ".lora_B." in n for n in params), sorted(params)
    assert result["ok"], {k: result[k] for k in ("loss_abs_diff", "grad_max_rel_diff", "tolerance")}
    assert result["grad_max_rel_diff"] <= TOL


@pytest.fixture(scope="module")
def lora_run(local_ray, tmp_path_factory):
    """A 3-step LoRA run; the adapter and the merged model exported."""
    from app.train.driver import train

    tmp = tmp_path_factory.mktemp("lora")
    run = train(_config(tmp, "lora", *LORA, f"train.steps={STEPS}", SMALL_VOCAB), progress=False)
    # In this process (the CLI is covered by test_export.py): a fresh interpreter costs ~10 s here.
    exports = {kind: export(run.run_dir, str(tmp / kind), merge=kind == "merged")
               for kind in ("adapter", "merged")}
    return tmp, run, exports


def test_a_lora_run_trains_only_the_adapters_and_its_loss_decreases(lora_run) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    _, run, _ = lora_run
    assert run.steps == STEPS and run.loss_last < run.loss_first - 0.05, run.losses
    saved = get_fp32_state_dict_from_zero_checkpoint(run.checkpoint, exclude_frozen_parameters=True)
    assert len(saved) == 28 and all(".lora_" in name for name in saved), sorted(saved)[:5]


def test_exported_adapter_and_merged_model_give_the_trained_models_logits(lora_run) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from app.model.spec import model_spec

    tmp, run, exports = lora_run
    assert [exports[k].kind for k in ("adapter", "merged")] == ["adapter", "merged"]
    # the run's own export (train.export_on_finish): the adapter, file for file what `export` writes
    own, cli = Path(run.export), Path(exports["adapter"].out)
    assert {p.name for p in own.iterdir()} == {p.name for p in cli.iterdir()}
    configs = [json.loads((d / "adapter_config.json").read_text()) for d in (own, cli)]
    for config in configs:  # peft writes all-linear's resolved modules from a set: in any order
        config["target_modules"] = sorted(config["target_modules"])
    assert configs[0] == configs[1]
    assert exports["adapter"].step == exports["merged"].step == STEPS
    adapter_dir = Path(exports["adapter"].out)
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {
        p.name for p in adapter_dir.iterdir()}
    config = _config(tmp, "lora", *LORA, SMALL_VOCAB)
    spec = model_spec(config.model, config.train, tokenizer=config.data.tokenizer)
    # The trained model: the run's LoRA model ("eager" attention) + DeepSpeed's consolidated adapter weights.
    model = spec.build("eager").eval()
    loaded = model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(run.checkpoint,
                                                                           exclude_frozen_parameters=True),
                                   strict=False)
    assert not loaded.unexpected_keys and not [k for k in loaded.missing_keys if ".lora_" in k]
    sequences = random_sequences(spec.vocab_size)
    reference = reference_logits(model, sequences)
    base = {"name_or_path": spec.name_or_path, "vocab_size": spec.vocab_size, "seed": spec.seed}
    fresh = load_in_fresh_process(tmp, sequences, models={"merged": exports["merged"].out},
                                  adapters={"adapter": (str(adapter_dir), base), "own": (str(own), base)})
    assert fresh["merged"]["attn"] != "dacp"
    for kind in ("adapter", "merged"):
        assert max_relative_diff(fresh[kind]["logits"], reference) <= TOL, kind
    assert max_relative_diff(fresh["own"]["logits"], fresh["adapter"]["logits"]) <= 1e-6
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.zero_()
    assert max_relative_diff(reference_logits(model, sequences), reference) > 1e-3  # the adapter matters


def _train_save_resume(rank: int, world: int, directory: str) -> dict:
    """One LoRA step, saved as the train loop saves (frozen weights excluded), loaded into a fresh engine
    as the train loop resumes (non-strict module load); then one more step on both engines."""
    from app.config import load_config
    from app.model.deepspeed_config import deepspeed_config
    from scheduling import DacpPlan
    from workers.batch import build_rank_batch
    from workers.engine import build_engine
    from workers.forward import micro_batch_loss_sum
    from workers.models import ModelSpec

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))  # DeepSpeed asserts them
    spec = ModelSpec(lora_r=4, vocab_size=512)
    ds = deepspeed_config(load_config(None, ["train.lr=0.01"]).train, dtype="fp32", on_gpu=False)
    batch = build_rank_batch(DacpPlan(local=((0, 1),), distributed=()), [list(range(1, 40)), [7, 3, 9, 4]],
                             [list(range(1, 40)), [7, 3, 9, 4]], cp_rank=0, cp_size=1)

    def step(engine) -> float:
        loss = micro_batch_loss_sum(engine, batch) / batch.num_tokens
        engine.backward(loss)
        engine.step()
        return float(loss)

    trained = build_engine(spec, ds, torch.device("cpu"), seed=0)
    step(trained)
    trained.save_checkpoint(directory, tag="step1", exclude_frozen_parameters=True)
    resumed = build_engine(spec, ds, torch.device("cpu"), seed=0)
    resumed.load_checkpoint(directory, tag="step1", load_module_strict=not spec.frozen_base)
    same = all(torch.equal(a, b) for a, b in zip(trained.module.state_dict().values(),
                                                 resumed.module.state_dict().values(), strict=True))
    step(trained), step(resumed)  # the second update uses Adam's moments: restored, or not
    saved = torch.load(Path(directory, "step1", "mp_rank_00_model_states.pt"), weights_only=False)["module"]
    return {"same_weights": same, "losses": (step(trained), step(resumed)), "saved": sorted(saved)}


def test_a_lora_checkpoint_holds_the_adapters_and_resumes_exactly(tmp_path: Path) -> None:
    """The train loop's save (exclude_frozen_parameters) and resume (non-strict load) of a LoRA engine:
    the resumed engine has the trained weights and optimizer state (its next step's loss is the same)."""
    from workers.tools.launch import run_workers

    (result,) = run_workers(_train_save_resume, 1, args=(str(tmp_path),), backend="gloo")
    assert len(result["saved"]) == 28 and all(".lora_" in k for k in result["saved"]), result["saved"][:3]
    assert result["same_weights"]
    assert result["losses"][1] == pytest.approx(result["losses"][0], rel=1e-6)

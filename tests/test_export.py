"""`python -m app export`: one tiny Ray training run, exported, loaded by transformers in a fresh process.

The run is tests/conftest.py's `tiny_run` (6 steps, DP 1 x CP 2), shared with test_train_e2e/test_report;
its own end-of-run export (train.export_on_finish, on by default: <run_dir>/hf/, streamed from the workers'
ZeRO state) is loaded in the same fresh process and must give the CLI export's logits within 1e-6.

References nobody here wrote: the trained model is rebuilt in this process from the checkpoint with
DeepSpeed's own `load_state_dict_from_zero_checkpoint` into the run's model with transformers' "eager"
attention (the export uses "sdpa": fp32 logits agree to ~1e-7 relative, so 1e-5 leaves headroom while a
wrong or missing weight moves them by > 1e-2); the run's own DACP forward (the training path) gives the
loss the exported model must reproduce; the run's tokenizer gives the ids the exported tokenizer must give.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from app.__main__ import main
from app.config import ConfigError
from app.model.export import export
from tests.conftest import TINY_RUN_STEPS
from tests.doc_commands import doc_argv
from tests.export_utils import load_in_fresh_process, max_relative_diff, random_sequences, reference_logits
from tests.test_train_e2e import _config

ray = pytest.importorskip("ray")

TOL = 1e-5
TEXTS = ["Hello world, it's 2026!  Ünïcödé\n\n  tabs\tand  spaces", "e\u0301 composed: 12345 6789"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "It is 4.\nDone."}]


@pytest.fixture(scope="module")
def trained(tiny_run, tmp_path_factory):
    """The shared DP 1 x CP 2 run, exported with the CLI (--json, fp32), and the export loaded afresh.

    No Ray runs while it exports: `export` reads the run directory alone, as after a finished job.
    """
    summary, _ = tiny_run
    tmp = tmp_path_factory.mktemp("export")
    out = tmp / "hf"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):  # the CLI, in this process (a fresh interpreter costs ~10 s)
        # the quickstart's command (tests/doc_commands.py), with --json to read its result
        argv = doc_argv("export RUN_DIR --out my-model", RUN_DIR=summary.run_dir, **{"my-model": str(out)})
        assert main([*argv, "--json"]) == 0
    result = json.loads(stdout.getvalue())  # stdout holds only the JSON line
    config = _config(tmp, "run")
    sequences = random_sequences(151643)
    fresh = load_in_fresh_process(tmp, sequences, models={"model": str(out), "hf": f"{summary.run_dir}/hf"},
                                  tokenizer=str(out), texts=TEXTS, messages=MESSAGES)
    return summary, config, out, result, sequences, fresh


def _rebuilt(config, checkpoint: str, attn: str):
    """The trained model: the run's ModelSpec, weights from DeepSpeed's own consolidation."""
    from deepspeed.utils.zero_to_fp32 import load_state_dict_from_zero_checkpoint

    from app.model.spec import model_spec

    model = model_spec(config.model, config.train, tokenizer=config.data.tokenizer).build(attn)
    return load_state_dict_from_zero_checkpoint(model, checkpoint).eval()


def test_exported_model_gives_the_trained_models_logits(trained) -> None:
    summary, config, out, result, sequences, fresh = trained
    assert result["kind"] == "model" and result["step"] == TINY_RUN_STEPS and result["dtype"] == "fp32"
    assert result["checkpoint"] == Path(summary.checkpoint).name  # latest = the run's newest checkpoint
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    assert fresh["model"]["attn"] != "dacp" and fresh["model"]["dtype"] == "torch.float32"
    reference = reference_logits(_rebuilt(config, summary.checkpoint, "eager"), sequences)
    assert max_relative_diff(fresh["model"]["logits"], reference) <= TOL
    # ...and not the untrained model's: the export carries the trained weights.
    from app.model.spec import model_spec

    initial = model_spec(config.model, config.train, tokenizer="qwen").build("eager").eval()
    assert max_relative_diff(reference_logits(initial, sequences), reference) > 1e-2


def test_the_runs_own_hf_directory_is_the_export_of_its_final_checkpoint(trained) -> None:
    summary, _, out, _, _, fresh = trained
    hf = Path(summary.run_dir) / "hf"
    assert summary.export == str(hf)
    assert {p.name for p in out.iterdir()} == {p.name for p in hf.iterdir()}  # same files, tokenizer too
    assert fresh["hf"]["attn"] != "dacp" and fresh["hf"]["dtype"] == "torch.float32"
    assert max_relative_diff(fresh["hf"]["logits"], fresh["model"]["logits"]) <= 1e-6
    assert not (Path(summary.run_dir) / ".hf-export").exists()  # published: nothing left behind


def test_exported_model_reproduces_the_training_forward_loss(trained) -> None:
    """The CE sum of the run's DACP forward (the training path, one rank) equals the exported model's."""
    from scheduling import DacpPlan
    from workers.batch import build_rank_batch
    from workers.forward import micro_batch_loss_sum

    summary, config, _, _, sequences, fresh = trained
    dacp = _rebuilt(config, summary.checkpoint, None)
    plan = DacpPlan(local=(tuple(range(len(sequences))),), distributed=())
    batch = build_rank_batch(plan, sequences, sequences, cp_rank=0, cp_size=1)
    with torch.no_grad():
        ours = float(micro_batch_loss_sum(dacp, batch))
    theirs = sum(float(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(seq[1:]), reduction="sum"))
                 for logits, seq in zip(fresh["model"]["logits"], sequences, strict=True))
    assert theirs == pytest.approx(ours, rel=TOL)


def test_exported_tokenizer_encodes_like_the_runs(trained) -> None:
    from app.data.template import TemplateSettings, tokenize_rows
    from app.data.tokenizer import load_tokenizer

    fresh = trained[-1]
    run_tok = load_tokenizer("qwen")
    assert fresh["text_ids"] == [run_tok.encode(t) for t in TEXTS]
    chat = tokenize_rows([{"messages": MESSAGES}], run_tok, TemplateSettings()).input_ids[0].tolist()
    assert fresh["chat_ids"] == chat  # data.chat_template: the run's ChatML rendering
    assert fresh["eos_token"] == "<|im_end|>"
    # the template recorded when the run started (app/rundir/snapshot.py write_snapshot) is the one shipped
    summary, out = trained[0], trained[2]
    recorded = (Path(summary.run_dir) / "chat_template.jinja").read_text()
    shipped = json.loads((out / "tokenizer_config.json").read_text()).get("chat_template")
    if shipped is None:  # transformers 5 writes it beside the config
        shipped = (out / "chat_template.jinja").read_text()
    assert shipped == recorded and "<|im_start|>" in recorded


def test_bf16_export_of_a_named_checkpoint(trained, tmp_path: Path) -> None:
    from safetensors import safe_open

    summary, *_ = trained
    result = export(summary.run_dir, str(tmp_path / "bf16"), checkpoint=summary.checkpoint, dtype="bf16")
    assert result.dtype == "bf16" and result.step == TINY_RUN_STEPS
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as weights:
        assert {weights.get_tensor(k).dtype for k in weights.keys()}  # noqa: SIM118 == {torch.bfloat16}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"


def test_export_mistakes_name_the_argument_and_write_nothing(trained, tmp_path: Path) -> None:
    summary, *_ = trained
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("x")
    with pytest.raises(ConfigError, match="--out"):
        export(summary.run_dir, str(taken))
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]
    with pytest.raises(ConfigError, match="not a run directory"):
        export(str(tmp_path), str(tmp_path / "a"))
    with pytest.raises(ConfigError, match="--checkpoint"):
        export(summary.run_dir, str(tmp_path / "b"), checkpoint=str(tmp_path))
    with pytest.raises(ConfigError, match="--merge"):
        export(summary.run_dir, str(tmp_path / "c"), merge=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]  # no staging directory left

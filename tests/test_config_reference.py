"""docs/config.md is generated from the config tree (`python -m app config reference`): the committed file is
exactly what the command writes, and every key of the tree is in it with a docstring."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from app.__main__ import main
from app.config import SkrullConfig

REPO = Path(__file__).resolve().parent.parent
CONFIG_MD = REPO / "docs" / "config.md"
REGENERATE = "python -m app config reference > docs/config.md"


def _reference(capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["config", "reference"]) == 0
    return capsys.readouterr().out


def tree_keys(cls: type = SkrullConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the tree, walked here from the dataclasses themselves."""
    hints, keys = typing.get_type_hints(cls), []
    for item in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[item.name]):
            keys += tree_keys(hints[item.name], f"{prefix}{item.name}.")
        else:
            keys.append(f"{prefix}{item.name}")
    return keys


def test_docs_config_md_is_what_the_command_writes(capsys: pytest.CaptureFixture[str]) -> None:
    written = _reference(capsys)
    committed = CONFIG_MD.read_text() if CONFIG_MD.exists() else ""
    assert committed == written, (f"docs/config.md differs from the config tree (app/config.py): run "
                                  f"`{REGENERATE}` and commit it")


def test_every_key_of_the_tree_is_documented(capsys: pytest.CaptureFixture[str]) -> None:
    """One table row per key, with its type, default and a docstring (a key without one fails here, named)."""
    rows = {line.split("|")[1].strip().strip("`"): [cell.strip() for cell in line.split("|")[2:-1]]
            for line in _reference(capsys).splitlines() if line.startswith("| `")}
    keys = tree_keys()
    assert len(keys) > 90 and set(keys) == set(rows), set(keys) ^ set(rows)
    undocumented = [key for key in keys if not rows[key][3].replace("**math**", "").strip()]
    assert not undocumented, f"keys without a docstring in app/config.py: {undocumented}"
    assert rows["scheduling.bucket_size"][:3] == ["int or choice", "`26000`", "`auto`"]
    assert rows["model.dtype"][2] == "`fp32`, `bf16`"
    assert "`skrull`" in rows["scheduling.policy"][2] and "`chunkflow`" in rows["scheduling.policy"][2]
    assert rows["train.adam_betas"][:2] == ["[float, float]", "`[0.9, 0.95]`"]
    assert rows["data.name"][1] == '`""`' and rows["model.lora.target_modules"][0] == "str or list of str"
    assert rows["train.lr"][3].endswith("**math**") and not rows["train.log_every"][3].endswith("**math**")

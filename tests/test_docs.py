"""The front door cannot rot: README.md stays one page whose first screen holds the commands, every command of
README.md and docs/quickstart.md runs in the suite (or is marked as needing a GPU, a cluster, or being CI's
own: tests/doc_commands.py), the README's config example loads, every link of README.md and docs/ resolves
(files and #anchors), and docs/troubleshooting.md names every config key an exit-2 error names."""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pytest
import yaml

from app.__main__ import main
from app.config import load_config
from tests.doc_commands import FRONT_DOOR, MARKERS, REPO, doc_commands, fenced_blocks
from tests.test_config_reference import tree_keys

README_LIMIT = 12 * 1024
FIRST_SCREEN = 75
"""README lines a reader sees first: the two commands, the your-model example and the GPU launch."""
SETUP = "bash scripts/setup.sh"
"""Runs before the suite in CI (scripts/test.sh calls it): the first half of `setup && command`."""
ELSEWHERE = {
    "train --config configs/tiny-cpu.yaml": "tests/test_ray_job.py",
    "export RUN_DIR --out my-model": "tests/test_export.py",
}
"""Commands run by a test that trains or exports anyway, through doc_argv (its overrides only shrink it)."""
ON_THE_SHARED_RUN = {"report RUN_DIR"}
"""Commands run here against tests/conftest.py's shared tiny run (RUN_DIR: its directory)."""
ERRORS = {"ConfigError", "DataError", "SchedulingError", "RunLocked", "_require"}
"""What raises an exit-2 error (app/__main__.py) or builds one (app/config.py _require)."""


def _markdown_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_readme_is_one_page_with_the_commands_on_its_first_screen() -> None:
    text = (REPO / "README.md").read_text()
    assert len(text.encode()) <= README_LIMIT, f"README.md is {len(text.encode())} bytes, over {README_LIMIT}"
    first = "\n".join(text.splitlines()[:FIRST_SCREEN])
    for needle in (".venv/bin/python -m app train --config configs/tiny-cpu.yaml", "bash scripts/test.sh",
                   "```yaml", "ray job submit", "Not yet on GPUs"):
        assert needle in first, f"{needle!r} is not in README.md's first {FIRST_SCREEN} lines"


def test_every_front_door_command_runs_in_the_suite_or_is_marked() -> None:
    commands = doc_commands()
    assert {c.doc for c in commands} == set(FRONT_DOOR)
    assert all(c.marker in (None, *MARKERS) for c in commands), [c for c in commands if c.marker]
    for command in commands:
        if command.marker or command.key in ON_THE_SHARED_RUN or command.key == SETUP:
            continue
        assert command.app_argv is not None, (
            f"{command.doc}:{command.line}: `{command.text}` is neither `python -m app ...` nor marked; "
            "run it in tests/test_docs.py or mark its block <!-- doc-test: gpu|cluster|ci -->")
        if command.key in ELSEWHERE:  # that test must take the command from the docs
            source = (REPO / ELSEWHERE[command.key]).read_text()
            assert f'doc_argv("{command.key}"' in source, (command.key, ELSEWHERE[command.key])
    assert SETUP in {c.key for c in commands if c.marker is None}
    assert (REPO / "scripts/test.sh").read_text().count("bash scripts/setup.sh") == 1  # CI runs it first


def _quick_commands() -> list[list[str]]:
    """The unmarked app commands run here in process, in the docs' order."""
    return [c.app_argv or [] for c in doc_commands()
            if c.marker is None and c.app_argv is not None and c.key not in ELSEWHERE
            and c.key not in ON_THE_SHARED_RUN]


def test_the_quickstart_commands_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """In a fresh directory that holds the repository's configs/, as a user's checkout would (outputs such as
    data synth's --out land there)."""
    (tmp_path / "configs").symlink_to(REPO / "configs")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ran = []
    for argv in _quick_commands():
        assert main(argv) == 0, (shlex.join(argv), capsys.readouterr().err[-2000:])
        ran.append((argv[0], capsys.readouterr().out))
    assert [name for name, _ in ran] == ["plan", "config", "data", "data"]
    outputs = dict(ran[:2])
    assert "BucketSize C = 1,024 tokens per rank" in outputs["plan"]
    shown = yaml.safe_load(outputs["config"])
    assert shown["parallel"]["cp_size"] == 1 and shown["scheduling"]["bucket_size"] == 1024
    assert "row 0: ok" in ran[-1][1]


@pytest.mark.slow
def test_the_commands_on_a_trained_run_run(tiny_run, capsys: pytest.CaptureFixture[str]) -> None:
    summary, _ = tiny_run
    for key in sorted(ON_THE_SHARED_RUN):
        argv = [summary.run_dir if word == "RUN_DIR" else word for word in shlex.split(key)]
        assert main(argv) == 0, key
    assert f"run {Path(summary.run_dir).name}: finished" in capsys.readouterr().out


def test_the_readme_config_example_loads(tmp_path: Path) -> None:
    """The your-model example as a file (as the block below it uses it): it loads strictly, as written."""
    blocks = fenced_blocks("README.md", "yaml")
    assert len(blocks) == 1 and len(blocks[0][2]) <= 10, "the your-model example is one block of <= 10 lines"
    path = tmp_path / "my-sft.yaml"
    path.write_text("\n".join(blocks[0][2]) + "\n")
    config = load_config(path)
    assert config.model.dtype == "bf16" and config.resources.gpus_per_worker == 1
    assert config.scheduling.bucket_size == "auto" and config.parallel.dp_size == 1


# ------------------------------------------------------------------------------------------------- links


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but `-` and `_` dropped, spaces as `-`."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file (a repeated heading gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6} (.+)$", _prose(path.read_text()), flags=re.M):
        slug = github_slug(heading)
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return found


def _prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def links(path: Path) -> list[str]:
    """The targets of the markdown links outside code (fenced blocks and inline spans)."""
    prose = re.sub(r"`[^`\n]*`", "", _prose(path.read_text()))
    return re.findall(r"\]\(([^)\s]+)\)", prose)


def test_github_slugs_follow_githubs_rule() -> None:
    assert github_slug("Tokenizing: `bench data`, and a million conversations (2026-11-27)") == \
        "tokenizing-bench-data-and-a-million-conversations-2026-11-27"
    assert github_slug("Per-sequence CP degrees: `[1, N]` vs `dynamic_cp`") == \
        "per-sequence-cp-degrees-1-n-vs-dynamic_cp"
    assert github_slug("5. Against TRL's SFTTrainer") == "5-against-trls-sfttrainer"


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_resolves(path: Path) -> None:
    broken = []
    for target in links(path):
        if re.match(r"[a-z]+:", target):  # https:, mailto:: not fetched here (no network in CI)
            assert target.startswith(("https://", "http://")), target
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.relative_to(REPO)}")
    assert not broken, f"{path.relative_to(REPO)}: {broken}"


# ------------------------------------------------------------------------------------------ troubleshooting


def error_knobs() -> dict[str, str]:
    """{config key: a file} for every key the text of an exit-2 error names (app/, scheduling/, workers/)."""
    keys, found = set(tree_keys()), {}
    for root in ("app", "scheduling", "workers"):
        for path in (REPO / root).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                func = getattr(node, "func", None)
                name = getattr(func, "id", None) or getattr(func, "attr", None)
                if not isinstance(node, ast.Call) or name not in ERRORS:
                    continue
                for part in ast.walk(node):
                    if isinstance(part, ast.Constant) and isinstance(part.value, str):
                        for word in re.findall(r"\b[a-z_]+\.[a-z_]+(?:\.[a-z_]+)?", part.value):
                            key = word if word in keys else word.rsplit(".", 1)[0]
                            if key in keys:
                                found.setdefault(key, str(path.relative_to(REPO)))
    return found


def test_troubleshooting_names_every_key_an_error_names() -> None:
    knobs = error_knobs()
    assert {"scheduling.bucket_size", "data.chat_template", "run.storage_path", "model.dtype"} <= set(knobs)
    text = (REPO / "docs" / "troubleshooting.md").read_text()
    missing = {key: where for key, where in knobs.items() if f"`{key}`" not in text}
    assert not missing, f"docs/troubleshooting.md lacks these keys of exit-2 errors (key: where): {missing}"

"""The command blocks of the front door (README.md, docs/quickstart.md), for the tests that run them.

A command block is a fenced ```bash block. The HTML comment on the line before it may say why the suite
does not run it:

    <!-- doc-test: gpu -->       needs a GPU
    <!-- doc-test: cluster -->   needs a Ray cluster of GPU nodes
    <!-- doc-test: ci -->        the test command itself (`bash scripts/test.sh`, which CI runs)

Every other command runs in the suite: tests/test_docs.py runs the cheap ones, and a test that already
trains (tests/test_ray_job.py) or exports (tests/test_export.py) a run takes its command line from here with
`doc_argv`, so the documented command is the one that runs (with overrides that only shrink it).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FRONT_DOOR = ("README.md", "docs/quickstart.md")
MARKERS = ("gpu", "cluster", "ci")
APP_PREFIXES = (".venv/bin/python -m app ", "python -m app ")
_MARKER = re.compile(r"<!--\s*doc-test:\s*(\w+)\s*-->")


@dataclass(frozen=True)
class DocCommand:
    doc: str
    line: int
    """1-based line of the block's opening fence."""
    text: str
    """One command: continuation lines joined, the trailing comment dropped, one side of `&&`."""
    marker: str | None

    @property
    def app_argv(self) -> list[str] | None:
        """The arguments after `python -m app`, or None for another program."""
        for prefix in APP_PREFIXES:
            if self.text.startswith(prefix):
                return shlex.split(self.text[len(prefix):])
        return None

    @property
    def key(self) -> str:
        """The command as tests name it: its app arguments joined, or the text."""
        argv = self.app_argv
        return shlex.join(argv) if argv is not None else self.text


def fenced_blocks(doc: str, language: str) -> list[tuple[int, str | None, list[str]]]:
    """(fence line, marker, lines) of every ```language block of `doc`."""
    lines = (REPO / doc).read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == f"```{language}":
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            found = _MARKER.search(before)
            start, i = i, i + 1
            body = []
            while lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            blocks.append((start + 1, found.group(1) if found else None, body))
        i += 1
    return blocks


def _commands_of(body: list[str]) -> list[str]:
    joined, current = [], ""
    for line in body:
        current += line.rstrip().removesuffix("\\")
        if not line.rstrip().endswith("\\"):
            joined.append(current)
            current = ""
    commands = []
    for line in joined:
        words = shlex.split(line, comments=True)
        for part in " ".join(shlex.quote(w) if w != "&&" else w for w in words).split(" && "):
            if part.strip():
                commands.append(part.strip())
    return commands


def doc_commands(docs: tuple[str, ...] = FRONT_DOOR) -> list[DocCommand]:
    """Every command of the docs' bash blocks, in order."""
    return [DocCommand(doc, line, text, marker) for doc in docs
            for line, marker, body in fenced_blocks(doc, "bash") for text in _commands_of(body)]


def doc_argv(key: str, **placeholders: str) -> list[str]:
    """The app arguments of the unmarked front-door command whose key is `key`, each argument equal to a
    placeholder's name (RUN_DIR, ...) replaced by its value. KeyError when no such command is documented:
    the test that runs it must follow the docs."""
    for command in doc_commands():
        if command.marker is None and command.key == key:
            return [placeholders.get(word, word) for word in command.app_argv or []]
    raise KeyError(f"no unmarked command `{key}` in {', '.join(FRONT_DOOR)}")

"""The import graph: app -> workers -> scheduling, nothing upward, no circle; light commands stay light."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LAYERS = {"scheduling": 0, "workers": 1, "app": 2}
HEAVY = ("torch", "deepspeed", "transformers")


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every project module `path` imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {name for name in names if name.split(".")[0] in LAYERS}
    return found


def _graph() -> dict[str, set[str]]:
    files = [p for layer in LAYERS for p in (REPO / layer).rglob("*.py")]
    modules = {_module_name(p): p for p in files}
    # "from pkg import name" names a module when pkg.name is one, else the package itself.
    return {name: {imp for imp in _imports(path) if imp in modules} - {name}
            for name, path in modules.items()}


def test_no_layer_imports_a_layer_above_it() -> None:
    upward = [f"{src} -> {dst}" for src, dsts in _graph().items() for dst in dsts
              if LAYERS[dst.split(".")[0]] > LAYERS[src.split(".")[0]]]
    assert not upward, upward


def test_no_import_circle_between_modules() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1 = on the DFS stack, 2 = done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            # importing a package runs its __init__, which is not a circle through the importer's own package
            if nxt == node.rsplit(".", 1)[0]:
                continue
            if state.get(nxt) == 1:
                return path + [node, nxt]
            if nxt not in state and (cycle := visit(nxt, path + [node])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [])):
            pytest.fail(f"import circle: {' -> '.join(cycle)}")


@pytest.mark.parametrize("argv", [
    ["plan", "--config", "configs/paper/qwen2.5-0.5b-lmsys.yaml", "--json", "--set", "plan.num_batches=2"],
    ["plan", "--config", "configs/tiny-cpu.yaml", "--json", "--set", "plan.num_batches=2"],
    ["bench", "planner", "--repeats", "1", "--json"],
])
def test_light_commands_never_import_torch_deepspeed_or_transformers(argv: list[str]) -> None:
    script = (
        "import json, sys\n"
        "from app.__main__ import main\n"
        f"code = main({argv!r})\n"
        f"print(json.dumps({{'code': code, 'heavy': [m for m in {HEAVY!r} if m in sys.modules]}}))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    verdict = json.loads(result.stdout.strip().splitlines()[-1])
    assert verdict == {"code": 0, "heavy": []}

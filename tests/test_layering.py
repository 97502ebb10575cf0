"""The import graph: app -> workers -> scheduling, nothing upward, no circle; app's rooms in their order;
light commands stay light."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LAYERS = {"scheduling": 0, "workers": 1, "app": 2}
APP_ROOMS = ("config", "data", "rundir", "sinks", "model", "profiling", "train", "bench", "commands",
             "__main__")
"""app/'s rooms from the bottom up (docs/design.md §1): a module may import its own room and those below."""
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


def _app_room(module: str) -> int | None:
    """The rank of an app module's room (app/__init__ is below them all), None outside app."""
    parts = module.split(".")
    if parts[0] != "app":
        return None
    return APP_ROOMS.index(parts[1]) if len(parts) > 1 else -1


def upward_app_imports(graph: dict[str, set[str]]) -> list[str]:
    """`src -> dst` for every app module that imports a module of a higher room."""
    upward = []
    for src, dsts in graph.items():
        low = _app_room(src)
        upward += [f"{src} -> {dst}" for dst in sorted(dsts)
                   if low is not None and (_app_room(dst) if dst.startswith("app") else low) > low]
    return upward


def test_every_app_module_sits_in_a_room() -> None:
    """app/'s top level holds config.py, __main__.py and the rooms (subpackages) only."""
    flat = {p.name for p in (REPO / "app").glob("*.py")} - {"__init__.py", "__main__.py", "config.py"}
    rooms = {p.name for p in (REPO / "app").iterdir() if (p / "__init__.py").is_file()}
    assert not flat, f"modules at app/'s top level: {sorted(flat)}; move each into the room of its role"
    assert rooms | {"config", "__main__"} == set(APP_ROOMS), sorted(rooms)


def test_no_app_room_imports_a_room_above_it() -> None:
    graph = _graph()
    assert upward_app_imports(graph) == []
    # The check itself: a data module importing the train driver is caught.
    graph["app.data.tokenizer"] = graph["app.data.tokenizer"] | {"app.train.driver"}
    assert upward_app_imports(graph) == ["app.data.tokenizer -> app.train.driver"]


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
    ["config", "show", "--config", "configs/qwen2.5-0.5b-gpu.yaml", "--json"],
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

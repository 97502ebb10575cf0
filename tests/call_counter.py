"""Count the calls of a function in this process, however the callers imported it."""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from typing import Any

PROJECT = ("app", "workers", "scheduling")


@contextlib.contextmanager
def counted_calls(module_name: str, function_name: str) -> Iterator[list[tuple[Any, ...]]]:
    """Every call of module.function while the block runs, as its positional arguments.

    `from module import function` bound the function into each importing module: every project module that
    holds it is patched too (a function-level import reads the patched module attribute when it runs).
    """
    module = importlib.import_module(module_name)
    original = getattr(module, function_name)
    calls: list[tuple[Any, ...]] = []

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return original(*args, **kwargs)

    holders = [m for name, m in list(sys.modules.items())
               if name.split(".")[0] in PROJECT and getattr(m, function_name, None) is original]
    for holder in holders:
        setattr(holder, function_name, counting)
    try:
        yield calls
    finally:
        for holder in holders:
            setattr(holder, function_name, original)

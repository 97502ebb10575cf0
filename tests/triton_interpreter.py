"""Triton's interpreter (TRITON_INTERPRET=1: a kernel's body runs in numpy on CPU tensors), made to run
liger-kernel 0.8.5's kernels, for tests/liger_interpreted.py.

Three gaps of the interpreter of triton 3.6.0 (the version scripts/setup.sh installs for this) stop liger's
kernels where compiled Triton runs them:
- a Python float argument stays a float, where compiled Triton passes an fp32 scalar: liger's RMSNorm calls
  `eps.to(tl.float32)` on it;
- libdevice's functions (liger imports `rsqrt` and `tanh` from triton.language.extra.libdevice) have no
  interpreted version, while triton.language.math's do;
- a scalar's `__index__` calls `int()` on a one-element array, which numpy 2 refuses: liger's backward
  kernels loop `for row in range(row_start, row_end)` over such scalars.

`enable()` closes each, before liger is imported (its kernels bind libdevice's names at import).
"""

from __future__ import annotations

from typing import Any


def enable() -> None:
    import numpy as np
    import triton.language as tl
    from triton.language.extra import libdevice
    from triton.runtime import interpreter

    convert = interpreter._implicit_cvt

    def implicit_cvt(arg: Any) -> Any:
        if isinstance(arg, float):
            return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32),
                             tl.float32)
        return convert(arg)

    patch_tensor = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor: Any, scope: Any) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._implicit_cvt = implicit_cvt
    interpreter._patch_lang_tensor = patch_lang_tensor
    # Looked up when called: the interpreter patches triton.language.math only while a kernel runs.
    libdevice.rsqrt = lambda x, **_: tl.math.rsqrt(x)
    libdevice.tanh = lambda x, **_: 2 * tl.sigmoid(2 * x) - 1

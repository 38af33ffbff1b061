"""`row_independent_interpreter_dot()`: make the Triton interpreter's `tl.dot` give each row of a
tile the bits it has alone. Installed by tests/conftest.py, and by the spawned processes of
tests/distributed/harness.py (they do not load conftest), whenever TRITON_INTERPRET=1."""
from __future__ import annotations

_INSTALLED = [False]


def row_independent_interpreter_dot() -> None:
    """Under the interpreter `tl.dot` is one numpy matmul of the whole tile, and whether a row's
    result depends on where it sits in the tile is up to the CPU's BLAS kernel: OpenBLAS's
    Haswell sgemm (an AVX2 machine, such as this project's CI) gives rows 6.. of a 16-row tile
    other bits than the same row alone. A kernel's width invariance (one tile shape and one K
    order at every n: a row's bits never depend on n) is what the tests check, as the GPU's MMA
    gives it; so here each row of a dot is its own matmul of the same shape, whatever tile it sits
    in. Nothing else about the interpreter changes (inputs, dtypes, the accumulator add)."""
    if _INSTALLED[0]:
        return
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.ndim < 2 or a.data.shape[-2] == 1:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        rows = [original(self, interpreter.TensorHandle(a.data[..., i:i + 1, :], a.dtype),
                         b, interpreter.TensorHandle(d.data[..., i:i + 1, :], d.dtype),
                         input_precision, max_num_imprecise_acc).data
                for i in range(a.data.shape[-2])]
        return interpreter.TensorHandle(np.concatenate(rows, axis=-2), d.dtype.scalar)

    builder.create_dot = create_dot
    _INSTALLED[0] = True



"""Test-wide setup: Triton runs in its interpreter when no GPU is present; a test marked `cuda`
(`runners.testing.cuda` or plain `@pytest.mark.cuda`) is skipped when no GPU is present.

TRITON_INTERPRET must be set before triton is first imported, so it is set here,
before any test module imports the packages (runners.device imports torch only). Hugging
Face's `kernels` (a transformers dependency) is imported here too, before pytest's
`pythonpath = ["."]` lets this checkout's `kernels/` folder shadow it
(draft_circuit/installed.py). Interpreted, `tl.dot` gives each row of a tile its own bits
whatever the CPU's BLAS does with a whole tile (tests/interpreter_dot.py).
"""
import os

import pytest

from draft_circuit.installed import prefer_installed
from draft_circuit.runners.device import cuda_available
from tests.interpreter_dot import row_independent_interpreter_dot

if not cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

prefer_installed("kernels")  # after TRITON_INTERPRET: it may import triton


if os.environ.get("TRITON_INTERPRET") == "1":
    row_independent_interpreter_dot()  # (tests/interpreter_dot.py says why)


def pytest_addoption(parser):
    parser.addoption("--regen-golden", action="store_true",
                     help="rewrite tests/golden/* from the current code instead of comparing")


def pytest_collection_modifyitems(config, items):
    from draft_circuit.runners.testing import skip_cuda_without_gpu

    skip_cuda_without_gpu(items)


@pytest.fixture
def interpreted_launches(monkeypatch):
    """The names of the Triton kernels the interpreter runs during the test, in order (warm-up
    runs left out): what a binding's declared launch count is checked against."""
    from triton.runtime import interpreter

    seen: list[str] = []
    run = interpreter.InterpretedFunction.run

    def counted(self, *args, grid, warmup, **kwargs):
        if not warmup:
            seen.append(self.fn.__name__)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)
    monkeypatch.setattr(interpreter.InterpretedFunction, "run", counted)
    return seen

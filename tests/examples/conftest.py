"""Fixtures for the engine's tests: one torch thread (the ops are tiny; threads only add
waits) and a small random checkpoint (helpers.SMALL)."""
from __future__ import annotations

import pytest
import torch

from draft_circuit.circuit.layers.checkpoint_writer import write_random_checkpoint
from tests.examples.helpers import SMALL


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def small_checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("ck") / "small", SMALL, seed=3)

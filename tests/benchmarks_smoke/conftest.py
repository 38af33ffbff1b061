"""Shared fixtures of the benchmarks' CPU smoke tests."""
import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny CPU ops: a thread pool only adds contention (and time) on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

"""Shared pytest fixtures."""
import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny tensors: one thread avoids thread-pool stalls on a shared 2-core machine (about 80x faster here)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

"""Shared pytest fixtures: one thread for tiny tensors, the MGK backends available here, one closeness check."""
import importlib.util
import os

import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny tensors: one thread avoids thread-pool stalls on a shared 2-core machine (about 80x faster here)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def available_mgk_backends() -> list[str]:
    """The ``mgk_attention`` backends that can run on this machine's CPU: "kernel" once the C++ kernel is built
    (not with MGK_CPU_KERNEL=0), "sdpa" and "explicit" always, "triton" under TRITON_INTERPRET=1 when installed."""
    from mgk.functional import _mixture_flash

    names = ["sdpa", "explicit"]
    if _mixture_flash.available(torch.zeros(1), 0.0):
        names.insert(0, "kernel")
    if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None:
        names.insert(0, "triton")
    return names


@pytest.fixture(params=available_mgk_backends())
def backend(request):
    """Each available ``mgk_attention`` backend in turn (the one backend fixture of the suite)."""
    return request.param


def _assert_close(name, ref, got, atol, rtol):
    """``|got - ref| <= atol + rtol |ref|`` elementwise (compared in float64), with a message naming ``name``."""
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}"
    torch.testing.assert_close(got.to(torch.float64), ref.to(torch.float64), atol=atol, rtol=rtol,
                               msg=lambda m: f"{name}: {m}")


@pytest.fixture
def assert_close():
    """The suite's closeness check: ``assert_close(name, ref, got, atol, rtol)``."""
    return _assert_close

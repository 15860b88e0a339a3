"""Fixtures shared by the tests of the native CPU kernels."""

from __future__ import annotations

import pytest

from aioinfer.model.cpu import kernels as cpu_native


@pytest.fixture(scope="module", params=["native", "haswell"])
def kernels(request: pytest.FixtureRequest) -> cpu_native.NativeKernels:
    """The build for this machine, and the AVX2 + FMA build (8 lanes) wherever it runs, so an
    AVX-512 machine tests both code paths."""
    built = cpu_native.load(request.param)
    if built is None:
        pytest.skip(cpu_native.unavailable_reason(request.param))
    return built

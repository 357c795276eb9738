"""Shared test fixtures and the ``gpu`` marker skip.

Tests marked ``@pytest.mark.gpu`` are skipped cleanly when ``torch.cuda.is_available()`` is False
(CPU CI); everything else must pass on a CPU-only machine.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # CuTe DSL reads the target once, at import: compile for Hopper without a GPU.
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def gen() -> torch.Generator:
    """A seeded CPU generator: fresh random data per test, reproducible across runs."""
    return torch.Generator().manual_seed(0x5EED)


@pytest.fixture
def randn(gen: torch.Generator) -> Callable[..., torch.Tensor]:
    """``randn(*shape, dtype=torch.bfloat16, device="cpu")``: standard normal data, never all zeros.

    Drawn on the CPU from the test's generator (so CPU and GPU tests see the same values), then
    rounded to ``dtype`` and moved to ``device``.
    """

    def make(*shape: int, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu") -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    return make

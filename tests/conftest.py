"""Shared test fixtures and the ``gpu`` marker skip.

Tests marked ``@pytest.mark.gpu`` are skipped cleanly when ``torch.cuda.is_available()`` is False
(CPU CI); everything else must pass on a CPU-only machine. Tests (or parameters) marked
``@pytest.mark.full`` are the rest of a matrix whose representative part always runs: they run
with ``--full`` (CI: ``python -m pytest -q -m full --full``, a step of ``.ci/run``).
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


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full", action="store_true", default=False,
        help="also run the tests marked full (the whole matrices: every kernel variant of a family "
             "compiled, the whole multi_token search space enumerated). The default run keeps a "
             "representative part of each; CI runs the rest as a step of its own: "
             "python -m pytest -q -m full --full")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--full"):
        skip_full = pytest.mark.skip(reason="full matrix: python -m pytest -m full --full (a step of .ci/run)")
        for item in items:
            if "full" in item.keywords:
                item.add_marker(skip_full)
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


PREFILL_SAMPLE = 100_000


@pytest.fixture(scope="session")
def sampled_multi_token_legality():
    """``legality(shape)`` of the multi_token search space from a seeded uniform sample of
    PREFILL_SAMPLE of its 2.6 M points (the real static filter on real points), once per shape per
    test run: enumerating the whole space takes ~40 s on one core (the full test does that once,
    tests/test_tuning_space.py::test_multi_token_space_whole). Do not use it with patched rules."""
    from directkv_cute.tuning.space import get_space

    space, memo = get_space("multi_token"), {}

    def legality(shape):
        if shape not in memo:
            memo[shape] = space.sample_legality(shape, PREFILL_SAMPLE, seed=0)
        return memo[shape]

    return legality


@pytest.fixture
def cwd(tmp_path, monkeypatch):
    """An empty current directory (where a command's default output would land)."""
    d = tmp_path / "cwd"
    d.mkdir()
    monkeypatch.chdir(d)
    return d


@pytest.fixture
def isolated_profiles(monkeypatch, tmp_path):
    """Every profile lookup folder under tmp_path: env, user (XDG), a stand-in for the bundled one,
    and the tuner's cache; the lookup's caches cleared before and after."""
    from directkv_cute import env as envvars
    from directkv_cute.tuning import lookup, profiles

    for d in ("env", "xdg", "bundled", "cache"):
        (tmp_path / d).mkdir()
    monkeypatch.setenv(profiles.PROFILE_DIR_ENV, str(tmp_path / "env"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv(envvars.CACHE_DIR, str(tmp_path / "cache"))
    monkeypatch.setattr(profiles, "bundled_profile_dir", lambda: tmp_path / "bundled")
    monkeypatch.delenv(lookup.REQUIRE_ENV, raising=False)
    lookup.clear_cache()
    yield tmp_path
    lookup.clear_cache()

"""One validation for every entry point of the op: the same mistakes get the package's own
errors from paged_attention (CPU reference path), paged_attention_tables and the torch op,
before any work."""

from __future__ import annotations

import pytest
import torch

import directkv_cute as dk
from directkv_cute.config import ConfigError, DecodeConfig


@pytest.fixture
def setup(randn):
    cache = dk.PagedKVCache(2, 2, 64, 16, num_host_pages=16, dtype=torch.bfloat16, device="cpu")
    ids = [cache.add_sequence(), cache.add_sequence()]
    for sid, n in zip(ids, (20, 3)):
        cache.append(sid, randn(n, 2, 2, 64), randn(n, 2, 2, 64))
    q = randn(2, 4, 64)
    return cache, ids, q


def _entries(cache, ids, q, **kw):
    """Call every entry point with the same (possibly wrong) arguments."""
    layer = kw.pop("layer", 0)
    q = kw.pop("q", q)
    seq_ids = kw.pop("seq_ids", ids)
    yield "paged_attention", lambda: dk.paged_attention(q, cache, layer, seq_ids, **kw)
    if isinstance(seq_ids, list) and not kw.get("out") is not None:
        t = cache.kernel_tables(ids)
        op_kw = {k: v for k, v in kw.items() if k in ("q_lens", "softmax_scale")}
        yield "torch op", lambda: torch.ops.directkv_cute.paged_attention(
            q, cache.host_pool, cache.hbm_pool, t.page_table, t.seq_lens, layer, **op_kw)
        yield "tables", lambda: dk.paged_attention_tables(q, cache, layer, t, **kw)


@pytest.mark.parametrize("kw, error, match", [
    (dict(layer=-1), IndexError, "layer -1 out of range"),
    (dict(layer=2), IndexError, "out of range"),
    (dict(layer=True), TypeError, "layer must be an int"),
    (dict(layer=0.5), TypeError, "layer must be an int"),
    (dict(layer="0"), TypeError, "layer must be an int"),
    (dict(q_lens=[1.7, 1]), TypeError, "q_len must be an int"),
    (dict(q_lens=[1]), ValueError, "1 entries for 2 sequences"),
    (dict(q_lens=[0, 2]), ValueError, ">= 1"),
    (dict(softmax_scale=float("nan")), ValueError, "finite"),
])
def test_bad_arguments_get_the_same_error_everywhere(setup, kw, error, match):
    cache, ids, q = setup
    for name, call in _entries(cache, ids, q, **kw):
        if name == "torch op" and error is TypeError:
            # the dispatcher checks the schema's types first: its own error, before any work
            # (a bool layer is an int to it: True is layer 1)
            if kw.get("layer") is True:
                continue
            with pytest.raises(RuntimeError, match="Expected a value of type"):
                call()
            continue
        with pytest.raises(error, match=match):
            call()


def test_the_dispatcher_refuses_non_int_layers(setup):
    cache, ids, q = setup
    t = cache.kernel_tables(ids)
    for layer in (0.5, "0"):
        with pytest.raises(RuntimeError, match="Expected a value of type 'int' for argument 'layer'"):
            torch.ops.directkv_cute.paged_attention(q, cache.host_pool, cache.hbm_pool, t.page_table, t.seq_lens,
                                                    layer)


def test_q_len_beyond_the_sequence_is_refused(setup, randn):
    cache, ids, _ = setup
    q = randn(1 + 4, 4, 64)  # the second sequence holds 3 tokens
    for name, call in _entries(cache, ids, q, q_lens=[1, 4]):
        with pytest.raises(ValueError, match=r"q_lens\[1\] = 4 exceeds"):
            call()


def test_shape_dtype_and_head_dim_mismatches(setup, randn):
    cache, ids, q = setup
    for bad, error, match in [(randn(2, 4, 128), ValueError, "head_dim 128"),
                              (randn(2, 3, 64), ValueError, "multiple"),
                              (randn(2, 4, 64, dtype=torch.float16), TypeError, "dtype"),
                              (randn(2, 4, 64, 1), ValueError, "dense")]:
        for name, call in _entries(cache, ids, bad):
            with pytest.raises(error, match=match):
                call()


def test_out_must_match_q(setup):
    cache, ids, q = setup
    for out in (torch.empty(1, 4, 64, dtype=q.dtype), torch.empty(2, 4, 64, dtype=torch.float32),
                torch.empty(2, 64, 4, dtype=q.dtype).transpose(1, 2)):
        with pytest.raises(ValueError, match="out must be"):
            dk.paged_attention(q, cache, 0, ids, out=out)


def test_seq_ids_and_config(setup):
    cache, ids, q = setup
    with pytest.raises(TypeError, match="seq_ids"):
        dk.paged_attention(q[:1], cache, 0, 0)
    with pytest.raises(TypeError, match="seq_id must be an int"):
        dk.paged_attention(q, cache, 0, [ids[0], "1"])
    with pytest.raises(KeyError, match="unknown sequence"):
        dk.paged_attention(q, cache, 0, [ids[0], 99])
    with pytest.raises(ConfigError):
        dk.paged_attention(q, cache, 0, ids, config=DecodeConfig(tile_n=48))
    with pytest.raises(TypeError, match="DecodeConfig"):
        dk.paged_attention(q, cache, 0, ids, config={"tile_n": 64})


def test_int64_tables_and_cpu_q_on_the_kernel_path(setup):
    cache, ids, q = setup
    t = cache.kernel_tables(ids)
    with pytest.raises(ValueError, match="int32"):
        torch.ops.directkv_cute.paged_attention(q, cache.host_pool, cache.hbm_pool, t.page_table.long(),
                                                t.seq_lens, 0)
    with pytest.raises(ValueError, match="CUDA device"):
        dk.paged_attention_tables(q, cache, 0, t)


def test_the_op_exists_right_after_import():
    import subprocess
    import sys

    code = "import torch, directkv_cute; print(hasattr(torch.ops.directkv_cute, 'paged_attention'))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "True"


def test_valid_calls_still_agree_with_the_reference(setup):
    cache, ids, q = setup
    o = dk.paged_attention(q, cache, 1, ids, q_lens=torch.tensor([1, 1]))
    ro, _ = dk.paged_attention_ref(q, cache, 1, ids)
    assert torch.equal(o, ro)

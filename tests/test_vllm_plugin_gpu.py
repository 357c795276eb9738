"""vLLM 0.26 with the DirectKV backend (``--attention-backend CUSTOM``, KV in pinned host memory)
against vLLM's own FLASH_ATTN backend on a tiny Llama: the same seeded weights, five concurrent
requests of different lengths under chunked prefill (mixed prefill / decode steps), the same greedy
tokens and logprobs within bf16 tolerance. Each engine runs in its own process (tests/vllm_engine.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_engine import compare_generations

pytestmark = pytest.mark.gpu

HERE = Path(__file__).resolve().parent
LOGPROB_TOL = 0.08  # bf16 activations through 2 layers: two attention kernels differ by rounding
TIE = 2 * LOGPROB_TOL  # a reference step whose top two are closer may pick either

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
    "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
    "head_dim": 64, "vocab_size": 1024, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
    "bos_token_id": 1, "eos_token_id": 2,
}


def _engine(tmp_path: Path, backend: str, eager: bool, mode: str = "ragged", extra_env: dict | None = None,
            log: list | None = None) -> list:
    """The engine's generations (``log``: a list that gets the engine's output, stdout and stderr)."""
    pytest.importorskip("vllm")
    model = tmp_path / "tiny-llama"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    out = tmp_path / f"{backend}-{'eager' if eager else 'graphs'}-{mode}.json"
    # apply_model ships a function to the engine: allowed by this variable.
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)  # keep where vLLM is
    env = dict(os.environ, VLLM_ALLOW_INSECURE_SERIALIZATION="1", PYTHONPATH=path) | (extra_env or {})
    cmd = [sys.executable, str(HERE / "vllm_engine.py"), str(model), backend, "eager" if eager else "graphs", str(out),
           mode]
    if log is None:
        subprocess.run(cmd, check=True, env=env, timeout=900)
    else:
        done = subprocess.run(cmd, env=env, timeout=900, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        log.append(done.stdout)
        assert done.returncode == 0, done.stdout[-4000:]
    return json.loads(out.read_text())


def _compare(ours: list, ref: list) -> None:
    compare_generations(ours, ref, logprob_tol=LOGPROB_TOL, tie=TIE)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return _engine(tmp_path_factory.mktemp("fa"), "FLASH_ATTN", eager=True)


def test_directkv_matches_flash_attn_eager(tmp_path, reference):
    _compare(_engine(tmp_path, "CUSTOM", eager=True), reference)


def test_directkv_matches_flash_attn_with_piecewise_graphs(tmp_path, reference):
    """vLLM's default compilation: the rest of the model in CUDA graphs, attention between them."""
    _compare(_engine(tmp_path, "CUSTOM", eager=False), reference)


def test_directkv_matches_flash_attn_over_prefix_cached_blocks(tmp_path):
    """Requests sharing a 200-token prefix with prefix caching on: requests scheduled after the
    prefix was computed get its cached blocks' ids, so their block tables share blocks (which the
    planner reads once for all sharers where its cascade pays)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    reference = _engine(tmp_path, "FLASH_ATTN", eager=True, mode="prefix")
    _compare(_engine(tmp_path, "CUSTOM", eager=True, mode="prefix"), reference)


def test_directkv_with_a_small_hbm_tier_matches_flash_attn(tmp_path, reference):
    """DIRECTKV_VLLM_HBM_GB for 6 block mirrors (a block of the tiny Llama is 16 KiB over its 2
    layers) while the five requests use about 40 blocks: mirrors are made, taken back and read
    next to host blocks in the same steps."""
    from directkv_cute.env import VLLM_HBM_GB

    budget = 6 * 16384 / 2**30
    _compare(_engine(tmp_path, "CUSTOM", eager=True, extra_env={VLLM_HBM_GB: repr(budget)}), reference)


def test_directkv_in_full_cuda_graphs_over_a_tier_of_every_block_matches_flash_attn(tmp_path, reference):
    """An HBM tier as large as the host pool (1 GiB each): every block is mirrored at its own
    index, the backend declares full CUDA graphs of decode steps, and vLLM (its default
    FULL_AND_PIECEWISE mode) captures and replays them; prompt and mixed steps run piecewise."""
    from directkv_cute.env import VLLM_HBM_GB

    log: list = []
    ours = _engine(tmp_path, "CUSTOM", eager=False, extra_env={VLLM_HBM_GB: "1"}, log=log)
    assert "Capturing CUDA graphs (FULL)" in log[0], log[0][-3000:]  # vLLM's capture of whole decode steps
    _compare(ours, reference)

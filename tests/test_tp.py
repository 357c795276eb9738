"""Tensor parallelism with the DirectKV cache: the head sharding and NUMA helpers
(``directkv_cute.tp``), and transformers' ``tp_plan="auto"`` under torchrun with two gloo ranks on
the CPU reference path, whose greedy tokens must equal one process's DynamicCache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from directkv_cute.tp import _parse_cpulist, node_cpus, numa_node, on_node, shard_heads


@pytest.mark.parametrize("hq,hkv,world", [(32, 8, 2), (64, 8, 8), (8, 2, 2), (40, 8, 4), (4, 4, 4)])
def test_shards_cover_every_head_once_with_whole_groups(hq, hkv, world):
    shards = [shard_heads(hq, hkv, world, r) for r in range(world)]
    assert sorted(h for s in shards for h in s.q_heads) == list(range(hq))
    assert sorted(h for s in shards for h in s.kv_heads) == list(range(hkv))
    group = hq // hkv
    for s in shards:
        # a rank's query heads use exactly its KV heads (the GQA map h -> h // group)
        assert {h // group for h in s.q_heads} == set(s.kv_heads)


def test_bad_shardings_are_refused():
    with pytest.raises(ValueError, match="do not split"):
        shard_heads(32, 8, 3, 0)
    with pytest.raises(ValueError, match="rank"):
        shard_heads(32, 8, 2, 2)
    with pytest.raises(ValueError, match="GQA"):
        shard_heads(30, 8, 2, 0)
    with pytest.raises(ValueError, match="world"):
        shard_heads(32, 8, 0, 0)


def test_numa_helpers_read_sysfs(tmp_path):
    dev = tmp_path / "bus/pci/devices/0000:3b:00.0"
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text("1\n")
    node = tmp_path / "devices/system/node/node1"
    node.mkdir(parents=True)
    (node / "cpulist").write_text("0-1,4\n")
    assert numa_node("0000:3B:00.0", str(tmp_path)) == 1
    assert numa_node("0000:99:00.0", str(tmp_path)) is None
    (dev / "numa_node").write_text("-1\n")
    assert numa_node("0000:3b:00.0", str(tmp_path)) is None
    assert node_cpus(1, str(tmp_path)) == {0, 1, 4} and node_cpus(7, str(tmp_path)) == set()
    assert _parse_cpulist("2,5-7") == {2, 5, 6, 7}
    before = os.sched_getaffinity(0)
    with on_node(1, str(tmp_path)):
        assert os.sched_getaffinity(0) == ({0, 1, 4} & before or before)
    assert os.sched_getaffinity(0) == before
    with on_node(None):
        assert os.sched_getaffinity(0) == before


def test_generate_under_two_gloo_ranks_equals_one_process(tmp_path):
    pytest.importorskip("accelerate")  # transformers needs it for tp_plan
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    from directkv_cute.hf import cache_kwargs

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path / "tiny")
    g = torch.Generator().manual_seed(3)
    lens = [37, 20]
    ids = torch.randint(1, 512, (2, 37), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :17] = 0
    ids[1, :17] = 0
    torch.save(ids, tmp_path / "ids.pt")
    torch.save(mask, tmp_path / "mask.pt")
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0,
                             **cache_kwargs(model, DynamicCache(config=model.config)))
    worker = Path(__file__).with_name("tp_worker.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(29500 + os.getpid() % 1000), str(worker), str(tmp_path / "tiny"),
                          str(tmp_path)], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, info in enumerate(ranks):
        assert info["tokens"] == ref.tolist(), f"rank {r} generated other tokens"
        assert info["kv_heads"] == 1 and info["q_heads"] == 4 and info["shard_kv"] == [r]
        assert info["seq_lengths"] == [n + 23 for n in lens]
    assert ranks[0]["host_bytes"] == ranks[1]["host_bytes"]

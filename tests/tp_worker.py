"""One rank of the tensor-parallel test (run by tests/test_tp.py under torchrun with gloo): load
the saved tiny model with transformers' ``tp_plan="auto"``, generate greedily with a
DirectKVCache on the CPU reference path, and write this rank's tokens and cache shape."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import directkv_cute.hf as dkhf


def main(model_dir: str, out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float32).eval()
    ids = torch.load(f"{out_dir}/ids.pt")
    mask = torch.load(f"{out_dir}/mask.pt")
    cache = dkhf.DirectKVCache(model, max_tokens=4000, max_batch_size=ids.shape[0], page_size=16, device="cpu")
    model.set_attn_implementation("directkv")
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0,
                             **dkhf.cache_kwargs(model, cache))
    info = {"tokens": out.tolist(), "kv_heads": cache.kv.num_kv_heads, "q_heads": cache.spec.num_q_heads,
            "shard_kv": list(cache.shard.kv_heads), "host_bytes": cache.host_bytes(),
            "seq_lengths": cache.seq_lengths()}
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(info, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

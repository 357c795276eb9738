"""One vLLM engine of the plugin's GPU test (run by tests/test_vllm_plugin_gpu.py, one process
per engine so that each frees its GPU memory on exit): load the tiny Llama with dummy weights,
give every parameter the same seeded values (identical in both engines), generate greedily for
prompts of different lengths at once, and write each request's tokens and logprobs as JSON."""

from __future__ import annotations

import json
import sys

import torch

PROMPT_LENS = (3, 17, 64, 150, 333)  # ragged: within one page, page-aligned, several pages
SHARED_PREFIX = 200  # the "prefix" mode: requests that share a 200-token prompt prefix ...
OWN_LENS = (5, 40, 90, 1)  # ... then tokens of their own (prefix caching gives them one block id)
MAX_TOKENS = 12
TOP_LOGPROBS = 2


def reweight(model) -> int:
    """Seeded weights of a usable scale (vLLM's dummy weights are +-1e-3, logits near ties):
    norms 1, everything else N(0, 0.05^2), drawn on the CPU in name order."""
    g = torch.Generator(device="cpu").manual_seed(0)
    n = 0
    for name, p in sorted(model.named_parameters()):
        if "norm" in name:
            p.data.fill_(1.0)
        else:
            p.data.copy_((torch.randn(p.shape, generator=g) * 0.05).to(p.dtype))
        n += 1
    return n


def prompts(mode: str, g: torch.Generator) -> list[dict]:
    """"ragged": PROMPT_LENS of distinct tokens; "prefix": one shared prefix, OWN_LENS after it."""
    if mode == "prefix":
        prefix = torch.randint(0, 1000, (SHARED_PREFIX,), generator=g).tolist()
        return [{"prompt_token_ids": prefix + torch.randint(0, 1000, (n,), generator=g).tolist()} for n in OWN_LENS]
    return [{"prompt_token_ids": torch.randint(0, 1000, (n,), generator=g).tolist()} for n in PROMPT_LENS]


def compare_generations(ours: list, ref: list, *, logprob_tol: float, tie: float) -> int:
    """Assert that two engines' greedy generations (``main``'s records) agree; returns the number
    of steps compared token for token. Each request's tokens must be equal, with logprobs within
    ``logprob_tol``, up to a step where the reference's top two are within ``tie`` of each other
    (there either token is a correct greedy pick): at such a step ours may take the other one,
    whose reference logprob it must then match, and the request ends there. At least half of
    all steps must be compared, so a run that leaves every request at its first step fails."""
    assert len(ours) == len(ref), f"{len(ours)} requests against {len(ref)}"
    compared = total = 0
    for r, (a, b) in enumerate(zip(ours, ref)):
        assert len(a["tokens"]) == len(b["tokens"]), f"request {r}: {len(a['tokens'])} tokens vs {len(b['tokens'])}"
        total += len(b["tokens"])
        for step, (ta, tb) in enumerate(zip(a["tokens"], b["tokens"])):
            la, lb = a["logprobs"][step], b["logprobs"][step]
            if ta != tb:
                assert str(ta) in lb, f"request {r} step {step}: token {ta} is not in the reference's top {sorted(lb)}"
                margin = lb[str(tb)] - lb[str(ta)]
                assert margin < tie, f"request {r} step {step}: token {ta} vs {tb}, reference margin {margin:.3f}"
                assert abs(la[str(ta)] - lb[str(ta)]) < logprob_tol, \
                    f"request {r} step {step}: logprob of {ta} {la[str(ta)]:.4f} vs {lb[str(ta)]:.4f}"
                break  # past a tie the two continuations differ by design
            assert abs(la[str(ta)] - lb[str(tb)]) < logprob_tol, \
                f"request {r} step {step}: logprob {la[str(ta)]:.4f} vs {lb[str(tb)]:.4f}"
            compared += 1
    assert 2 * compared >= total, f"only {compared} of {total} steps compared: the runs part too early"
    return compared


def main(model_dir: str, backend: str, eager: str, out_path: str, mode: str = "ragged") -> None:
    from vllm import LLM, SamplingParams

    if backend == "CUSTOM":
        from directkv_cute.vllm import plugin_installed

        assert plugin_installed(), "the directkv plugin's entry point is not installed: pip install -e ."

    llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0,
              max_model_len=1024, block_size=16, max_num_batched_tokens=128,  # chunked prefill: mixed steps
              kv_cache_memory_bytes=1 << 30, attention_backend=backend, enforce_eager=eager == "eager",
              enable_prefix_caching=mode == "prefix")
    assert llm.apply_model(reweight)[0] > 0
    g = torch.Generator(device="cpu").manual_seed(1)
    requests = prompts(mode, g)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP_LOGPROBS, detokenize=False,
                            ignore_eos=True)
    result = []
    for out in llm.generate(requests, params):
        c = out.outputs[0]
        result.append({"tokens": list(c.token_ids),
                       "logprobs": [{str(t): lp.logprob for t, lp in step.items()} for step in c.logprobs]})
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:6])

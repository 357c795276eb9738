"""One method of ``python -m bench vllm`` in its own process: ``python -P -m bench.vllm_worker SPEC.json``.

Builds one vLLM engine from the spec (``bench.vllm.worker_spec``), warms it up, runs every
(context, batch) row and the short non-attention rows, and writes its result document to
``spec["out"]`` after every row: {"method", "status", "error", "vllm_version", "engine": {...},
"rows": [...]}. Exit status 0 when the engine ran (rows may still hold errors), 1 when it could
not start (or, for ``directkv``, runs another attention backend), 2 when vLLM is not importable
(one line naming the fix).

``directkv``: the worker sets ``DIRECTKV_VLLM_HBM_GB`` to the spec's ``hbm_gib`` (0: no HBM
tier) before vLLM starts, so that the engine's processes size the plugin's HBM tier from it.
vLLM's engine core runs in its own process, so the frontend's config only says what
was asked for (``attention_config.backend``). The worker asks the engine's workers themselves
(``LLM.collective_rpc(backend_probe)``: which backend class each attention layer runs, whether its
KV tensor lies in the plugin's pinned host memory, the model runner); shipping that function needs
``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (pickle between this process and its engine only), which
this worker sets for ``directkv`` alone. A layer on another backend, or KV outside pinned host
memory, fails the worker before any row; a probe that cannot run leaves ``backend_verified`` None
(the frontend's config values are still recorded).
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

from bench.common import load_json, write_json
from bench.vllm import (DIRECTKV_BACKEND, METHOD_NAMES, PLUGIN_MISSING, VLLM_MISSING, max_batch, new_row,
                        reduce_timing, resolve_batches)
from directkv_cute.env import VLLM_HBM_GB

GiB = 1 << 30


class GpuMemory:
    """Device memory in use (bytes): NVML where available (no CUDA context in this process),
    else ``torch.cuda.mem_get_info``; ``peak`` is the most seen by ``sample`` since ``reset``."""

    def __init__(self):
        self._nvml = None
        try:
            import pynvml

            pynvml.nvmlInit()
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
            self._nvml = pynvml.nvmlDeviceGetHandleByIndex(int(visible)) if visible.isdigit() else None
            self._info = pynvml.nvmlDeviceGetMemoryInfo
        except Exception:  # noqa: BLE001 - no NVML: torch's view of the device
            self._nvml = None
        self.peak = 0
        self._last = 0.0

    def used(self) -> int:
        if self._nvml is not None:
            return int(self._info(self._nvml).used)
        import torch

        free, total = torch.cuda.mem_get_info()
        return int(total - free)

    def sample(self, every_s: float = 0.05) -> None:
        now = time.perf_counter()
        if now - self._last >= every_s:
            self._last = now
            self.peak = max(self.peak, self.used())

    def reset(self) -> None:
        self.peak, self._last = self.used(), time.perf_counter()


def engine_kwargs(spec: dict) -> dict:
    """``vllm.LLM``'s arguments for the spec: dummy weights from the local config.json, bf16,
    token-id prompts only, vLLM's generation defaults; offload adds the native host buffer;
    directkv picks the plugin's backend (``CUSTOM``) and gives the host KV as vLLM's
    ``kv_cache_memory_bytes``, which skips vLLM's HBM profiling for the KV size (the plugin
    allocates those bytes in pinned host memory, not in HBM)."""
    kw = dict(model=spec["model_dir"], load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
              generation_config="vllm", max_model_len=spec["max_model_len"], enable_prefix_caching=True,
              gpu_memory_utilization=spec["gpu_memory_utilization"], seed=spec["seed"],
              enforce_eager=spec["enforce_eager"])
    if spec["method"] == "offload":
        kw.update(kv_offloading_size=float(spec["host_gib"]), kv_offloading_backend="native")
    elif spec["method"] == "directkv":
        kw.update(attention_backend=DIRECTKV_BACKEND, kv_cache_memory_bytes=int(spec["host_gib"] * GiB))
    return kw


def engine_entry(engine, spec: dict) -> dict:
    """The engine's KV sizes from its config after startup (``engine``: ``LLM.llm_engine``).

    gpu_kv_tokens: tokens in vLLM's GPU blocks (0 for directkv, whose blocks are all host pages);
    host_kv_tokens: tokens in host memory (offload: the buffer over the token size; directkv: the
    blocks x block size); capacity_tokens: both, what ``max`` batches are sized by; staging_bytes:
    KV bytes in HBM blocks (directkv: its HBM tier's mirrors, ``hbm_mirror_blocks`` of the spec's
    ``hbm_gib`` over every layer, copies of host blocks; the planner's own staging buffers are in
    the measured GPU bytes, not here); host_bytes: KV bytes in host memory."""
    config = engine.vllm_config
    cache = config.cache_config
    block = int(cache.block_size)
    token_bytes = int(spec["token_bytes"])
    mirrors = 0
    if spec["method"] == "directkv":
        from directkv_cute.vllm.step import hbm_pages

        gpu_tokens, host_tokens = 0, int(cache.num_gpu_blocks) * block  # vLLM's "GPU" blocks are host pages
        host_bytes = host_tokens * token_bytes
        if spec.get("hbm_gib"):
            mirrors = hbm_pages(int(float(spec["hbm_gib"]) * GiB), *spec["kv_layout"], block)
    else:
        gpu_tokens = int(cache.kv_cache_size_tokens or cache.num_gpu_blocks * block)
        host_bytes = int(spec["host_gib"] * GiB) if spec.get("host_gib") else 0
        host_tokens = host_bytes // token_bytes
    entry = {"block_size": block, "num_gpu_blocks": cache.num_gpu_blocks, "gpu_kv_tokens": gpu_tokens,
             "host_kv_tokens": host_tokens, "capacity_tokens": gpu_tokens + host_tokens,
             "staging_bytes": (gpu_tokens + mirrors * block) * token_bytes, "host_bytes": host_bytes,
             "max_num_seqs": config.scheduler_config.max_num_seqs,
             "kv_connector": getattr(config.kv_transfer_config, "kv_connector", None)}
    if spec["method"] == "directkv":
        backend = config.attention_config.backend
        entry.update(attention_backend_requested=DIRECTKV_BACKEND, hbm_gib=float(spec.get("hbm_gib") or 0),
                     hbm_mirror_blocks=mirrors,
                     attention_config_backend=getattr(backend, "name", backend),
                     kv_cache_memory_bytes=cache.kv_cache_memory_bytes,
                     use_v2_model_runner=bool(config.use_v2_model_runner))
    return entry


def backend_probe(worker) -> dict:
    """Run on each of the engine's workers (``LLM.collective_rpc``): the backend class of every
    attention layer, how many layers' KV tensors lie in the directkv plugin's pinned host memory,
    and the model runner's class. Plain values only (they travel back to the frontend)."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    layers = get_layers_from_vllm_config(worker.vllm_config, AttentionLayerBase)
    backends = sorted({".".join(layer.get_attn_backend().full_cls_name()) for layer in layers.values()})
    try:
        from directkv_cute.vllm.memory import is_pinned_host
    except ImportError:  # the plugin is not importable in the engine: nothing is pinned by it
        pinned = 0
    else:
        pinned = sum(1 for layer in layers.values()
                     if getattr(layer, "kv_cache", None) is not None and is_pinned_host(layer.kv_cache))
    runner = type(getattr(worker, "model_runner", None))
    return {"backends": backends, "layers": len(layers), "kv_pinned_host_layers": pinned,
            "model_runner": f"{runner.__module__}.{runner.__qualname__}"}


def backend_verdict(probes: list[dict], backend_path: str) -> str | None:
    """None when every worker's attention layers run ``backend_path`` over pinned host KV, else
    what is wrong (one line)."""
    if not probes:
        return "no engine worker answered"
    for i, p in enumerate(probes):
        if p["backends"] != [backend_path]:
            return f"engine worker {i} runs attention backends {p['backends']}, not {backend_path}"
        if p["kv_pinned_host_layers"] != p["layers"]:
            return (f"engine worker {i}: {p['kv_pinned_host_layers']} of {p['layers']} layers have their KV in "
                    "pinned host memory (the V2 model runner and the directkv plugin are needed)")
    return None


def drive(engine, prompts: list[list[int]], params, mem: GpuMemory, tag: str) -> tuple[dict, list]:
    """Submit every prompt, then step the engine until all are finished, stamping each growth of
    a request's (cumulative) output: (submit times, [(time, request, tokens)])."""
    submit = {}
    for i, ids in enumerate(prompts):
        rid = f"{tag}-{i}"
        submit[rid] = time.perf_counter()
        engine.add_request(rid, {"prompt_token_ids": ids}, params)
    counts: dict[str, int] = {}
    events = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        t = time.perf_counter()
        for o in outs:
            n = len(o.outputs[0].token_ids)  # RequestOutput.request_id is the id given to add_request
            if n > counts.get(o.request_id, 0):
                counts[o.request_id] = n
                events.append((t, o.request_id, n))
        mem.sample()
    return submit, events


def measure(engine, prompts: list[list[int]], max_tokens: int, sampling, mem: GpuMemory, tag: str) -> dict:
    """One row's timings from two passes over the same prompts. Pass 1 generates one token per
    request: its TTFT is the prompts' prefill (``ttft_ms`` / ``ttft_max_ms``), and the finished
    requests leave their KV blocks in vLLM's prefix cache (offload: in its host buffer too).
    Pass 2 submits the same prompts for ``max_tokens``: their blocks are found cached, so the
    requests start decoding together instead of after one another's prefill chunks, and its
    stamps give the decode timings (``reduce_timing``) and ``resume_ms``, the median time to
    its first token (the cached prompts reloaded or read where they are). ``sampling(n)``: the
    sampling parameters for n tokens."""
    submit, events = drive(engine, prompts, sampling(1), mem, f"{tag}p")
    first = reduce_timing(submit, events)
    submit, events = drive(engine, prompts, sampling(max_tokens), mem, f"{tag}d")
    decode = reduce_timing(submit, events)
    return decode | {"ttft_ms": first["ttft_ms"], "ttft_max_ms": first["ttft_max_ms"], "resume_ms": decode["ttft_ms"]}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = load_json(argv[0])
    out = Path(spec["out"])
    name = spec.get("name") or METHOD_NAMES[spec["method"]]
    result = {"method": spec["method"], "name": name, "status": "ok", "error": None, "vllm_version": None,
              "engine": {}, "rows": []}

    def write():
        write_json(out, result)

    if spec["method"] == "directkv":  # backend_probe travels to the engine's process (module docstring)
        from directkv_cute.vllm import plugin_installed

        if not plugin_installed():
            result.update(status="error", error=PLUGIN_MISSING)
            print(PLUGIN_MISSING, file=sys.stderr)
            write()
            return 2
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        os.environ[VLLM_HBM_GB] = repr(float(spec.get("hbm_gib") or 0))  # the plugin's HBM tier, 0: none
    try:
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.sampling_params import RequestOutputKind
    except ImportError as e:
        print(f"{VLLM_MISSING} ({type(e).__name__}: {e})", file=sys.stderr)
        result.update(status="error", error=VLLM_MISSING)
        write()
        return 2
    import torch

    result["vllm_version"] = vllm.__version__
    mem = GpuMemory()
    before = mem.used()
    t0 = time.perf_counter()
    try:
        llm = LLM(**engine_kwargs(spec))
    except Exception as e:  # noqa: BLE001 - the engine's failure is this method's result
        traceback.print_exc()
        result.update(status="error", error=f"engine did not start: {type(e).__name__}: {str(e).strip()[:400]}")
        write()
        return 1
    engine = llm.llm_engine
    result["engine"] = entry = {"startup_s": time.perf_counter() - t0, **engine_entry(engine, spec),
                                "gpu_bytes_after_start": mem.used() - before}
    block, max_seqs = entry["block_size"], entry["max_num_seqs"]
    gpu_tokens, capacity = entry["gpu_kv_tokens"], entry["capacity_tokens"]
    staging, host_bytes = entry["staging_bytes"], entry["host_bytes"]
    print(f"{name}: {gpu_tokens} GPU KV tokens ({staging / GiB:.1f} GiB, block {block}), host {host_bytes / GiB:g} "
          f"GiB ({entry['host_kv_tokens']} tokens), max_num_seqs {max_seqs}, started in {entry['startup_s']:.0f} s",
          flush=True)
    if spec["method"] == "directkv":
        from directkv_cute.vllm import BACKEND_PATH

        try:
            entry["backend_probe"] = llm.collective_rpc(backend_probe)
        except Exception as e:  # noqa: BLE001 - unverified, not wrong: the config values stay recorded
            entry["backend_probe_error"] = f"{type(e).__name__}: {str(e).strip()[:300]}"
            entry["backend_verified"] = None
            print(f"{name}: the engine's attention backend could not be probed ({entry['backend_probe_error']}); "
                  f"attention_config.backend is {entry['attention_config_backend']}", flush=True)
        else:
            wrong = backend_verdict(entry["backend_probe"], BACKEND_PATH)
            entry["backend_verified"] = wrong is None
            print(f"{name}: attention {entry['backend_probe']}" + (f": {wrong}" if wrong else ""), flush=True)
            if wrong:
                result.update(status="error", error=f"not the DirectKV backend: {wrong}")
                write()
                return 1
    write()

    def sampling(max_tokens: int):
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                              output_kind=RequestOutputKind.CUMULATIVE)

    vocab = engine.model_config.get_vocab_size()
    gen = torch.Generator().manual_seed(int(spec["seed"]))
    rows_done = [0]

    def prompts(batch: int, context: int) -> list[list[int]]:
        return torch.randint(0, vocab, (batch, context), generator=gen).tolist()

    def run_row(context: int, batch: int, spec_text: str, role: str) -> dict:
        base = dict(method=name, role=role, context=context, batch=batch, batch_spec=spec_text,
                    new_tokens=spec["seq_extra"] - 1, staging_bytes=staging, host_bytes=host_bytes)
        t_row = time.perf_counter()
        try:
            mem.reset()
            timing = measure(engine, prompts(batch, context), spec["seq_extra"], sampling, mem,
                             f"c{context}b{batch}r{rows_done[0]}")
            mem.sample(0.0)
            return new_row(**base, status="ok", gpu_bytes=mem.peak - before, wall_s=time.perf_counter() - t_row,
                           **timing)
        except Exception as e:  # noqa: BLE001 - a failing row is a result; the next row goes on
            traceback.print_exc()
            return new_row(**base, status="error", error=f"{type(e).__name__}: {str(e).strip()[:400]}",
                           wall_s=time.perf_counter() - t_row)
        finally:
            rows_done[0] += 1

    def emit(row: dict) -> bool:
        result["rows"].append(row)
        write()
        r = row
        print(f"{name} {r['role']} ctx {r['context']} B{r['batch']} ({r['batch_spec']}): {r['status']} "
              f"TTFT {r['ttft_ms'] or 0:.0f} ms, {r['decode_ms'] or 0:.2f} ms/token/seq (median step "
              f"{r['step_ms'] or 0:.2f} ms), "
              f"{r['tokens_per_s'] or 0:.0f} tok/s, peak {r['peak_concurrent']}"
              + (f" [{r['error']}]" if r["error"] else ""), flush=True)
        return "EngineDead" not in (r["error"] or "")

    # Warm-up: compilation, CUDA graph capture and the first steps are not timed.
    drive(engine, prompts(2, 64), sampling(spec["seq_extra"]), mem, "warmup")
    own_batches = []
    alive = True
    for context in spec["contexts"]:
        for spec_text, batch in resolve_batches(spec["batches"], capacity, context, spec["seq_extra"], block,
                                                max_seqs):
            if not alive:
                break
            if batch < 1:
                emit(new_row(method=name, context=context, batch_spec=spec_text, status="skipped",
                             error=f"not one sequence of {context} tokens fits {capacity} tokens"))
                continue
            own_batches.append(batch)
            alive = emit(run_row(context, batch, spec_text, "measured"))
    if spec["short_context"] and alive:
        fits = max_batch(gpu_tokens, spec["short_context"], spec["seq_extra"], block, max_seqs)
        for batch in sorted({1, *own_batches, *spec["short_batches"]}):
            if not alive:
                break
            if batch > fits:  # not all decoding at once: no clean non-attention time
                emit(new_row(method=name, role="non-attention", context=spec["short_context"], batch=batch,
                             batch_spec=str(batch), status="skipped",
                             error=f"more than the {fits} sequences that decode together at this context"))
                continue
            alive = emit(run_row(spec["short_context"], batch, str(batch), "non-attention"))
    if not alive:
        result.update(status="error", error="the engine died; the rows after it were not run")
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())

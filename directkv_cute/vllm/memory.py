"""The backend's KV blocks in pinned host memory, inside vLLM's V2 model runner.

vLLM's V2 model runner (``vllm/v1/worker/gpu/model_runner.py``, ``initialize_kv_cache``) calls
``attn_utils.init_kv_cache``, which takes one raw int8 tensor per ``KVCacheTensor`` from
``attn_utils._allocate_kv_cache`` (``torch.zeros(size, int8, device)``) and views it per layer with
the backend's ``get_kv_cache_shape``. ``install`` wraps the runner's ``init_kv_cache``: while it
runs for attention groups of ``DirectKVBackend``, ``_allocate_kv_cache`` gives those layers' tensors
as CUDA tensors over pinned, GPU-mapped host memory (``PinnedHostBuffer.cuda_view``: no copy, the
GPU reaches the pages through unified addressing). vLLM's own code keeps treating them as CUDA
tensors; the kernels read them in place. Other layers are allocated as vLLM does.

The host bytes are vLLM's ``--kv-cache-memory-bytes``, which skips vLLM's HBM profiling
(``gpu_worker.Worker.determine_available_memory``): the backend refuses to start without it, and
refuses a size the host's available memory cannot hold: first where vLLM turns its arguments
into a config (``install_host_check`` wraps ``EngineArgs.create_engine_config``, in the process
that parses them, before any engine starts or loads weights), and again before pinning.
"""

from __future__ import annotations

import bisect
import functools
import inspect
import logging

import torch

from directkv_cute._pinned import PinnedHostBuffer, available_host_bytes
from directkv_cute.tp import gpu_numa_node, on_node
from directkv_cute.vllm.names import BACKEND_PATH
from directkv_cute.vllm.step import check_host_bytes

log = logging.getLogger(__name__)

# (device address, bytes) of every pinned KV allocation, sorted: which tensors are ours.
_RANGES: list[tuple[int, int]] = []


def pinned_tensor(nbytes: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` of zeroed, pinned host memory as an int8 CUDA tensor on ``device`` (no copy)."""
    buf = PinnedHostBuffer(nbytes, torch.device(device))
    t = buf.cuda_view(torch.uint8).view(torch.int8)  # the view keeps the buffer alive
    bisect.insort(_RANGES, (buf.device_ptr, nbytes))
    return t


def is_pinned_host(t: torch.Tensor) -> bool:
    """Whether ``t`` lies in KV memory that ``pinned_tensor`` made."""
    ptr = t.data_ptr()
    i = bisect.bisect_right(_RANGES, (ptr, float("inf"))) - 1
    return i >= 0 and _RANGES[i][0] <= ptr < _RANGES[i][0] + _RANGES[i][1]


def allocate(kv_cache_config, shared_layers: dict, device, ours: set, kv_cache_memory_bytes) -> dict:
    """``attn_utils._allocate_kv_cache`` with the tensors of layers in ``ours`` in pinned host
    memory: {layer name: raw int8 tensor}."""
    tensors = kv_cache_config.kv_cache_tensors
    mine = [t for t in tensors if set(t.shared_by) & ours]
    for t in mine:
        if not set(t.shared_by) <= ours:
            raise ValueError(f"a KV cache tensor is shared by DirectKV layers and others ({sorted(t.shared_by)[:4]}); "
                             "the DirectKV backend needs every attention layer on it")
        if t.block_stride > 0:
            raise ValueError("the DirectKV backend reads one KV tensor per layer; vLLM planned a packed cross-layer "
                             "layout (enable_cross_layers_blocks): turn it off")
    if mine and not kv_cache_memory_bytes:
        raise ValueError("the DirectKV backend keeps the KV cache in host memory: give its size with "
                         "--kv-cache-memory-bytes (e.g. 64G)")
    total = sum(t.size for t in mine)
    check_host_bytes(total, available_host_bytes())
    raw: dict = {}
    packed = None
    pinned = {id(t) for t in mine}
    # each rank (its own process and GPU) pins its pages on the NUMA node nearest its GPU
    node = gpu_numa_node(device) if torch.device(device).type == "cuda" else None
    for t in tensors:
        if id(t) in pinned:
            with on_node(node):
                tensor = pinned_tensor(t.size, device)
        elif t.block_stride > 0:  # as vLLM: one backing for every packed tensor
            if packed is None:
                packed = torch.zeros(t.size, dtype=torch.int8, device=device)
            tensor = packed
        else:
            tensor = torch.zeros(t.size, dtype=torch.int8, device=device)
        for name in t.shared_by:
            raw[name] = tensor
    names = {n for g in kv_cache_config.kv_cache_groups for n in g.layer_names}
    missing = names - (raw.keys() | shared_layers.keys())
    if missing:
        raise ValueError(f"no KV cache tensor for layers {sorted(missing)[:4]}")
    if mine:
        log.info("DirectKV: %d KV tensors, %.3g GiB of pinned host memory (NUMA node %s)", len(mine), total / 2**30,
                 "unknown" if node is None else node)
    return raw


def _ours(backend) -> bool:
    """Whether an attention group's backend class is ``DirectKVBackend`` (by its path: this module
    is imported by the backend's)."""
    return isinstance(backend, type) and any(f"{c.__module__}.{c.__qualname__}" == BACKEND_PATH for c in backend.__mro__)


def install() -> None:
    """Route the V2 model runner's KV allocation of ``DirectKVBackend`` layers to pinned host
    memory (idempotent; vLLM loads general plugins once per process, maybe more)."""
    import vllm.v1.worker.gpu.attn_utils as attn_utils
    import vllm.v1.worker.gpu.model_runner as model_runner

    original = model_runner.init_kv_cache
    if getattr(original, "directkv", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def init_kv_cache(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        groups = bound.arguments["attn_groups"]
        ours = {name for per_group in groups for g in per_group if _ours(g.backend) for name in g.layer_names}
        if not ours:
            return original(*args, **kwargs)
        memory_bytes = bound.arguments["vllm_config"].cache_config.kv_cache_memory_bytes
        vllm_allocate = attn_utils._allocate_kv_cache

        def pinned_allocate(kv_cache_config, shared_layers, device):
            return allocate(kv_cache_config, shared_layers, device, ours, memory_bytes)

        attn_utils._allocate_kv_cache = pinned_allocate
        try:
            return original(*args, **kwargs)
        finally:
            attn_utils._allocate_kv_cache = vllm_allocate

    init_kv_cache.directkv = True
    model_runner.init_kv_cache = init_kv_cache


def host_ranks(parallel_config) -> int:
    """The GPUs of one host whose KV caches the host pins together: vLLM's world size (tensor x
    pipeline parallel) per node."""
    world = int(getattr(parallel_config, "world_size", 1) or 1)
    return max(1, world // max(1, int(getattr(parallel_config, "nnodes", 1) or 1)))


def check_config_host_bytes(vllm_config, available: int | None) -> None:
    """Refuse a config whose DirectKV KV caches (``--kv-cache-memory-bytes`` per GPU, for every
    GPU of this host) exceed the host's ``available`` memory: one line (``MemoryError``). A config
    of another backend, or without the size, passes (the allocation refuses the latter)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    backend = getattr(vllm_config.attention_config, "backend", None)
    per_gpu = vllm_config.cache_config.kv_cache_memory_bytes
    if backend != AttentionBackendEnum.CUSTOM or not per_gpu:
        return
    try:
        if AttentionBackendEnum.CUSTOM.get_path() != BACKEND_PATH:
            return  # CUSTOM names another backend
    except ValueError:
        return  # CUSTOM names no backend: vLLM refuses it itself
    ranks = host_ranks(vllm_config.parallel_config)
    check_host_bytes(int(per_gpu) * ranks, available, ranks)


def install_host_check() -> None:
    """Check the host bytes where vLLM builds its config from the arguments (idempotent)."""
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config
    if getattr(original, "directkv", False):
        return

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        config = original(self, *args, **kwargs)
        check_config_host_bytes(config, available_host_bytes())
        return config

    create_engine_config.directkv = True
    EngineArgs.create_engine_config = create_engine_config

"""Tensor parallelism with the DirectKV cache: which KV heads a rank holds, and where its pinned
host pool should live.

transformers shards a model over ranks itself (``from_pretrained(..., tp_plan="auto")`` under
``torchrun``): each rank's q/k/v projections produce a contiguous block of the heads, so the
attention function of rank r sees query heads ``[r * Hq / W, (r + 1) * Hq / W)`` and KV heads
``[r * Hkv / W, (r + 1) * Hkv / W)`` (a whole number of GQA groups per rank). The DirectKV cache of
each rank then holds only its own KV heads, in its own pinned host pool, and its kernels read only
those: host bytes per token per rank = 1 / W of the model's. Every rank sees the same batch, so
the page tables (and capacity) are the same on every rank and need no communication.

A GPU reaches host memory fastest on the NUMA node nearest its PCIe root; ``numa_node`` reads
that from sysfs and ``on_node`` runs the pool's allocation (pages are placed where they are first
touched: ``cudaHostRegister`` pins, and so touches, them) with the thread bound to that node's
CPUs.

Plain Python (plus ``os``), testable on a CPU.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``world``: its query heads and KV heads (global indices)."""

    world: int
    rank: int
    q_heads: range
    kv_heads: range


def shard_heads(num_q_heads: int, num_kv_heads: int, world: int, rank: int) -> Shard:
    """The heads rank ``rank`` of ``world`` holds, as transformers' colwise split of the q/k/v
    projections gives them; a ``ValueError`` where the KV heads do not split evenly."""
    for name, v, low in (("num_q_heads", num_q_heads, 1), ("num_kv_heads", num_kv_heads, 1), ("world", world, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank!r}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads over {num_kv_heads} KV heads is not a whole GQA group")
    if num_kv_heads % world:
        raise ValueError(f"{num_kv_heads} KV heads do not split over {world} ranks (tensor parallel needs "
                         "a multiple of the world size; transformers would replicate them)")
    kv = num_kv_heads // world
    q = num_q_heads // world
    return Shard(world, rank, range(rank * q, (rank + 1) * q), range(rank * kv, (rank + 1) * kv))


def model_shard(model, num_q_heads: int, num_kv_heads: int) -> Shard | None:
    """The shard of this process for a model loaded with a tensor-parallel plan, else None."""
    world = getattr(model, "_tp_size", None) or 1
    if not isinstance(world, int) or world <= 1:
        return None
    mesh = getattr(model, "_device_mesh", None)
    rank = None
    if mesh is not None:
        try:
            rank = int(mesh.get_local_rank())
        except Exception:  # pragma: no cover - meshes without a local rank
            rank = None
    if rank is None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("the model is tensor parallel but torch.distributed is not initialised")
        rank = dist.get_rank() % world
    return shard_heads(num_q_heads, num_kv_heads, world, rank)


def _parse_cpulist(text: str) -> set[int]:
    """``0-3,8,10-11`` -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def numa_node(pci_bus_id: str, sysfs: str = "/sys") -> int | None:
    """The NUMA node of a PCI device (``0000:3b:00.0``), None when the host reports none."""
    path = Path(sysfs, "bus/pci/devices", pci_bus_id.lower(), "numa_node")
    try:
        node = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def node_cpus(node: int, sysfs: str = "/sys") -> set[int]:
    """The CPUs of NUMA node ``node`` (empty when unknown)."""
    try:
        return _parse_cpulist(Path(sysfs, f"devices/system/node/node{node}/cpulist").read_text())
    except OSError:
        return set()


def gpu_numa_node(device) -> int | None:
    """The NUMA node nearest CUDA device ``device``, None when unknown."""
    import torch

    try:
        props = torch.cuda.get_device_properties(device)
        bus_id = "%04x:%02x:%02x.0" % (props.pci_domain_id, props.pci_bus_id, props.pci_device_id)
    except Exception:
        return None
    return numa_node(bus_id)


@contextlib.contextmanager
def on_node(node: int | None, sysfs: str = "/sys"):
    """Run the block with this thread bound to the CPUs of NUMA node ``node`` (the whole block
    runs unbound when the node or its CPUs are unknown, or binding is not allowed)."""
    cpus = node_cpus(node, sysfs) if node is not None else set()
    if not cpus or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    allowed = cpus & before
    if not allowed:
        yield
        return
    os.sched_setaffinity(0, allowed)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)

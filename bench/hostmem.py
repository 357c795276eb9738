"""Pinned host buffers and their zero-copy CUDA views (UVA), for the baselines and ceilings.

A buffer is plain host memory of the exact size, page-locked with ``cudaHostRegister`` (as the
cache's host pool is), so no power-of-two rounding and nothing kept in torch's pinned cache.
With unified addressing a registered host pointer is also a valid device pointer: the CUDA
view is a ``torch.as_tensor`` of an object exposing ``__cuda_array_interface__`` at that
pointer, so a GPU kernel given the view reads host memory over the link (zero-copy).
"""

from __future__ import annotations

import math

import torch

_CUDA_HOST_REGISTER_PORTABLE = 1
_CUDA_HOST_REGISTER_MAPPED = 2


class _CudaArrayView:
    """Exposes a device-accessible pointer through the CUDA Array Interface (v3).

    It keeps ``owner`` alive; torch holds a reference to this object for as long as the
    tensor built from it lives.
    """

    def __init__(self, ptr: int, nbytes: int, owner: object):
        self._owner = owner
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 3}


def device_pointer(host_ptr: int) -> int:
    """The address at which GPU kernels reach registered host memory.

    ``cudaHostGetDevicePointer`` through cuda-bindings (shipped with nvidia-cutlass-dsl) when
    it is importable; otherwise the host address itself, which is the device address under
    unified virtual addressing (every 64-bit Linux system with a current GPU).
    """
    try:
        from cuda.bindings import runtime as rt
    except ImportError:
        return host_ptr
    (err,) = rt.cudaSetDevice(torch.cuda.current_device())  # bind torch's primary context
    if err == rt.cudaError_t.cudaSuccess:
        err, ptr = rt.cudaHostGetDevicePointer(host_ptr, 0)
        if err == rt.cudaError_t.cudaSuccess:
            return int(ptr)
    raise RuntimeError(f"cudaHostGetDevicePointer(0x{host_ptr:x}) failed: {err!r}")


def uva_alias(host: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor of the same shape and dtype aliasing page-locked host tensor ``host``.

    Reads and writes through it cross the CPU-GPU link; nothing is copied. ``host`` must be
    contiguous and registered (or allocated pinned) for the current device.
    """
    if not host.is_contiguous():
        raise ValueError("uva_alias needs a contiguous host tensor")
    nbytes = host.numel() * host.element_size()
    ptr = device_pointer(host.data_ptr())
    raw = torch.as_tensor(_CudaArrayView(ptr, nbytes, host), device="cuda")
    if raw.data_ptr() != ptr:
        raise RuntimeError("torch.as_tensor copied the pinned buffer instead of aliasing it")
    alias = raw.view(host.dtype).view(host.shape)
    _check_alias(host, alias)
    return alias


def _check_alias(host: torch.Tensor, alias: torch.Tensor) -> None:
    """Read a few bytes through the alias and compare them with the host copy."""
    h = host.view(-1).view(torch.uint8)
    if h.numel() == 0:
        return
    steps = min(64, h.numel())
    idx = torch.arange(steps) * (h.numel() - 1) // max(1, steps - 1)  # exact integer positions
    through_gpu = alias.view(-1).view(torch.uint8)[idx.cuda()].cpu()
    if not torch.equal(through_gpu, h[idx]):
        raise RuntimeError("the UVA view of pinned host memory reads different bytes than the host: "
                           "registered host pointers are not device pointers on this system")


class PinnedBuffer:
    """Exact-size page-locked host memory with a zero-copy CUDA view.

    ``cpu``: the host tensor (shape, dtype as asked); ``cuda``: the UVA alias, or None when
    ``device`` is "cpu" (CPU runs use ordinary memory). Call ``close()`` once no kernel uses
    the memory any more (after a synchronize): it unregisters the pages.
    """

    def __init__(self, shape, dtype: torch.dtype, device: str):
        self.shape = tuple(shape)
        self.dtype = dtype
        self.cpu = torch.empty(self.shape, dtype=dtype)
        self.nbytes = math.prod(self.shape) * self.cpu.element_size()
        self._registered = False
        self.cuda = None
        if device == "cuda" and self.nbytes:
            flags = _CUDA_HOST_REGISTER_PORTABLE | _CUDA_HOST_REGISTER_MAPPED
            torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(self.cpu.data_ptr(), self.nbytes, flags))
            self._registered = True
            self.cuda = uva_alias(self.cpu)

    @property
    def device_view(self) -> torch.Tensor:
        """The tensor a GPU kernel should read: the UVA alias on CUDA, the host tensor on CPU."""
        return self.cuda if self.cuda is not None else self.cpu

    def close(self) -> None:
        """Unregister the pages and drop the views (the caller has synchronized)."""
        self.cuda = None
        if self._registered:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(self.cpu.data_ptr()))
            self._registered = False

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass

"""Host memory for the KV cache: one exact-size allocation, page-locked and mapped for the GPU.

Why not ``torch.empty(..., pin_memory=True)``: torch's pinned allocator (``cudaHostAlloc`` behind a
caching allocator) rounds every request up to a power of two, so a 40 GiB pool would pin 64 GiB.
Instead we map exactly ``nbytes`` of anonymous memory (``mmap``: page-aligned, zero-filled by the
kernel, so every pool starts finite and no other allocation shares its OS pages) and page-lock it in
place with ``cudaHostRegister(Portable | Mapped)``. ``cudaHostGetDevicePointer`` then gives the
address at which GPU kernels reach it; with unified virtual addressing it equals the host address.

``cuda_view`` wraps that device address in a CUDA tensor with no copy, through an object exposing
``__cuda_array_interface__`` (the same trick as vLLM's UVA offload). torch keeps a reference to
that object, and the object keeps the buffer alive, so the memory stays registered for as long as
any such view exists -- unless ``close()`` is called explicitly, after which views must not be used.

Without CUDA (``register=False``) the same allocation serves as an ordinary CPU buffer.
"""

from __future__ import annotations

import mmap
import sys
import weakref

import torch

# cudaHostRegister flags (driver_types.h): usable from every context, mapped into the GPU's
# address space.
CUDA_HOST_REGISTER_PORTABLE = 0x01
CUDA_HOST_REGISTER_MAPPED = 0x02
_CUDA_SUCCESS = 0
_CUDA_ERROR_CUDART_UNLOADING = 4  # returned at interpreter exit once the runtime is torn down

_CAI_TYPESTR = {1: "|u1", 2: "<i2", 4: "<i4", 8: "<i8"}  # element size -> raw integer typestr
_RAW_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def available_host_bytes() -> int | None:
    """The host memory available for new allocations (``MemAvailable`` of /proc/meminfo, in
    bytes), None where the system does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _host_unregister(host_ptr: int, memory: torch.Tensor) -> None:
    """Finalizer: undo cudaHostRegister. ``memory`` is passed only to outlive the registration."""
    del memory
    code = int(torch.cuda.cudart().cudaHostUnregister(host_ptr))
    if code not in (_CUDA_SUCCESS, _CUDA_ERROR_CUDART_UNLOADING):
        raise RuntimeError(f"cudaHostUnregister(0x{host_ptr:x}) failed with CUDA error {code}")


class _CudaArrayInterface:
    """A zero-copy CUDA array description of part of a ``PinnedHostBuffer`` (CAI version 3).

    torch's ``as_tensor`` keeps this object alive as long as the tensor it builds, and this
    object keeps ``owner`` (the buffer) alive.
    """

    def __init__(self, owner: "PinnedHostBuffer", device_ptr: int, numel: int, itemsize: int) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (numel,),
            "typestr": _CAI_TYPESTR[itemsize],
            "data": (device_ptr, False),
            "version": 3,
            "strides": None,
            "stream": None,  # no synchronisation: the memory is not produced on any stream
        }


class PinnedHostBuffer:
    """``nbytes`` of page-aligned, zero-filled host memory; page-locked and GPU-mapped if asked.

    Attributes:
        nbytes:     exact size of the allocation.
        tensor:     uint8 CPU tensor ``(nbytes,)`` over the memory.
        host_ptr:   its host address.
        device:     the CUDA device it is registered with, or None when not registered.
        device_ptr: the address GPU kernels use (``cudaHostGetDevicePointer``), or None.
    """

    def __init__(self, nbytes: int, device: torch.device | None = None) -> None:
        """Map ``nbytes`` of host memory; if ``device`` is a CUDA device, register and map it there."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
        if nbytes > sys.maxsize:
            raise MemoryError(f"cannot map {nbytes} bytes: more than an allocation can address ({sys.maxsize} bytes)")
        self.nbytes = nbytes
        try:
            self._mmap = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError as exc:
            raise MemoryError(f"cannot map {nbytes} bytes ({nbytes / 2**30:.3g} GiB) of host memory: {exc}") from exc
        self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)  # (nbytes,)
        self.host_ptr = self.tensor.data_ptr()
        self.device: torch.device | None = None
        self.device_ptr: int | None = None
        self._finalizer: weakref.finalize | None = None
        if device is not None:
            if device.type != "cuda":
                raise ValueError(f"can only register host memory with a CUDA device, not {device}")
            index = torch.cuda.current_device() if device.index is None else device.index
            self._register(torch.device("cuda", index))

    def _register(self, device: torch.device) -> None:
        from cuda.bindings import runtime as rt  # cuda-bindings comes with nvidia-cutlass-dsl

        with torch.cuda.device(device):
            flags = CUDA_HOST_REGISTER_PORTABLE | CUDA_HOST_REGISTER_MAPPED
            code = int(torch.cuda.cudart().cudaHostRegister(self.host_ptr, self.nbytes, flags))
            if code != _CUDA_SUCCESS:
                raise RuntimeError(
                    f"cudaHostRegister of {self.nbytes} bytes at 0x{self.host_ptr:x} failed with CUDA "
                    f"error {code} (is the locked-memory limit, `ulimit -l`, large enough?)"
                )
            self._finalizer = weakref.finalize(self, _host_unregister, self.host_ptr, self.tensor)
            # Bind the same (primary) context in the cuda-bindings runtime, then ask for the
            # device address of the registered range.
            (err,) = rt.cudaSetDevice(device.index)
            if err == rt.cudaError_t.cudaSuccess:
                err, device_ptr = rt.cudaHostGetDevicePointer(self.host_ptr, 0)
            if err != rt.cudaError_t.cudaSuccess:
                self.close()
                raise RuntimeError(f"cudaHostGetDevicePointer(0x{self.host_ptr:x}) on {device} failed: {err!r}")
        self.device = device
        self.device_ptr = int(device_ptr)

    @property
    def registered(self) -> bool:
        """True while the memory is page-locked and mapped for the GPU."""
        return self._finalizer is not None and self._finalizer.alive

    @property
    def uva(self) -> bool:
        """True when the GPU reaches the memory at its host address (unified virtual addressing)."""
        return self.registered and self.device_ptr == self.host_ptr

    def cuda_view(self, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D CUDA tensor of ``dtype`` aliasing the whole buffer, built without a copy."""
        if not self.registered:
            raise RuntimeError("cuda_view needs a buffer registered with a CUDA device")
        itemsize = dtype.itemsize
        if itemsize not in _CAI_TYPESTR or self.nbytes % itemsize:
            raise ValueError(f"cannot view {self.nbytes} bytes as {dtype}")
        cai = _CudaArrayInterface(self, self.device_ptr, self.nbytes // itemsize, itemsize)
        raw = torch.as_tensor(cai, device=self.device)  # (nbytes // itemsize,) integer
        if raw.data_ptr() != self.device_ptr or raw.device != self.device:
            raise RuntimeError("torch.as_tensor copied the pinned buffer instead of aliasing it")
        if raw.dtype != _RAW_DTYPE[itemsize]:
            raise RuntimeError(f"__cuda_array_interface__ gave {raw.dtype}, expected {_RAW_DTYPE[itemsize]}")
        return raw.view(dtype)

    def close(self) -> None:
        """Unregister now (idempotent). CUDA views of the buffer must not be used afterwards."""
        if self._finalizer is not None:
            self._finalizer()

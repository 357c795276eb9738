"""Pinned host buffers and their zero-copy CUDA views (UVA), for the baselines and ceilings.

A thin shaped view over the cache's own ``directkv_cute._pinned.PinnedHostBuffer``: exact-size
host memory page-locked with ``cudaHostRegister`` (as the cache's host pool is), so no
power-of-two rounding and nothing kept in torch's pinned cache, plus the CUDA tensor aliasing it
(a GPU kernel given that view reads host memory over the link: zero-copy).
"""

from __future__ import annotations

import math

import torch

from directkv_cute._pinned import PinnedHostBuffer


class PinnedBuffer:
    """Exact-size page-locked host memory with a zero-copy CUDA view.

    ``cpu``: the host tensor (shape, dtype as asked); ``cuda``: the UVA alias, or None when
    ``device`` is "cpu" (CPU runs use ordinary memory). Call ``close()`` once no kernel uses
    the memory any more (after a synchronize): it unregisters the pages.
    """

    def __init__(self, shape, dtype: torch.dtype, device: str):
        self.shape = tuple(shape)
        self.dtype = dtype
        self.nbytes = math.prod(self.shape) * dtype.itemsize
        self.cuda = None
        self._buf = None
        if not self.nbytes:
            self.cpu = torch.empty(self.shape, dtype=dtype)
            return
        self._buf = PinnedHostBuffer(self.nbytes, torch.device("cuda") if device == "cuda" else None)
        self.cpu = self._buf.tensor.view(dtype).view(self.shape)
        if self._buf.registered:
            self.cuda = self._buf.cuda_view(dtype).view(self.shape)

    @property
    def device_view(self) -> torch.Tensor:
        """The tensor a GPU kernel should read: the UVA alias on CUDA, the host tensor on CPU."""
        return self.cuda if self.cuda is not None else self.cpu

    def close(self) -> None:
        """Unregister the pages and drop the views (the caller has synchronized)."""
        self.cuda = None
        if self._buf is not None:
            self._buf.close()

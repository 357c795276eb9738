"""DirectKV inside vLLM: an attention backend whose KV blocks live in pinned host memory.

vLLM loads ``register`` through the ``vllm.general_plugins`` entry point ``directkv`` in every
process it starts. ``register`` makes ``DirectKVBackend`` vLLM's ``CUSTOM`` attention backend
(``vllm.v1.attention.backends.registry.register_backend``) and routes that backend's KV
allocation to pinned host memory (``memory.install``). It selects nothing: a server picks the
backend with ``--attention-backend CUSTOM`` and sizes the host KV with ``--kv-cache-memory-bytes``
(docs/SERVING.md).

``step`` holds the host-side decisions without vLLM (tested on any machine); ``backend`` and
``memory`` import vLLM, so import them only where vLLM is installed.
"""

from __future__ import annotations

ENTRY_POINT = "directkv"  # the plugin's name for VLLM_PLUGINS
BACKEND_PATH = "directkv_cute.vllm.backend.DirectKVBackend"


def plugin_installed() -> bool:
    """Whether vLLM will find ``register``: the package is installed (``pip install``, editable or
    not) with its ``vllm.general_plugins`` entry point. A source tree on ``PYTHONPATH`` has none,
    and then ``--attention-backend CUSTOM`` finds no backend."""
    from importlib.metadata import entry_points

    return any(ep.value == "directkv_cute.vllm:register"
               for ep in entry_points(group="vllm.general_plugins", name=ENTRY_POINT))


def register() -> None:
    """Register the backend as vLLM's CUSTOM attention backend and install the pinned KV
    allocation (idempotent)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from directkv_cute.vllm.memory import install

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    install()

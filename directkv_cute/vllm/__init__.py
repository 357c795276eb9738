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

from directkv_cute.vllm.names import BACKEND_PATH, ENTRY_POINT


def plugin_installed() -> bool:
    """Whether vLLM will find ``register``: the package is installed (``pip install``, editable or
    not) with its ``vllm.general_plugins`` entry point. A source tree on ``PYTHONPATH`` has none,
    and then ``--attention-backend CUSTOM`` finds no backend."""
    from importlib.metadata import entry_points

    return any(ep.value == "directkv_cute.vllm:register"
               for ep in entry_points(group="vllm.general_plugins", name=ENTRY_POINT))


def register() -> None:
    """Register the backend as vLLM's CUSTOM attention backend, install the pinned KV allocation
    and the host-size check of vLLM's config, and log where vLLM logs (idempotent)."""
    # vLLM is an optional dependency: imported only when vLLM loads the plugin
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    # loads torch and hooks vLLM's allocation: only once vLLM loads the plugin
    from directkv_cute.vllm.memory import install, install_host_check

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    install()
    install_host_check()
    log_like_vllm()


def log_like_vllm() -> None:
    """The package's log records go to vLLM's handlers at vLLM's level (vLLM configures only its
    own ``vllm`` logger, so the backend's INFO lines would otherwise be dropped); nothing changes
    where the package's logger has handlers already or vLLM's has none."""
    import logging

    ours, theirs = logging.getLogger("directkv_cute"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.getEffectiveLevel())

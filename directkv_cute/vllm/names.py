"""The plugin's names, shared by ``register`` and the modules it installs (no vLLM import)."""

ENTRY_POINT = "directkv"  # the plugin's name for VLLM_PLUGINS
BACKEND_PATH = "directkv_cute.vllm.backend.DirectKVBackend"  # what CUSTOM resolves to once registered

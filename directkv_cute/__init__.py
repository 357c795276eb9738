"""directkv-cute: zero-copy attention over a paged KV cache in pinned host memory."""

from directkv_cute.config import ConfigError, DecodeConfig, default_decode_config

__version__ = "0.1.0"

__all__ = ["ConfigError", "DecodeConfig", "default_decode_config", "__version__"]

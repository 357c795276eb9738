"""The package's version (``directkv_cute.__version__``), a module of its own so that the tools
that record it (a tuned profile's metadata) read it without the package's public API."""

__version__ = "0.2.0"

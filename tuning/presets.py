"""Model presets for the tuner: each preset's attention geometry, and its shape buckets.

The presets, their names and other spellings are ``directkv_cute.presets``' (the one list, shared
with ``directkv-generate``); each preset here takes its geometry (num_attention_heads,
num_key_value_heads, head_dim, hidden_size, num_hidden_layers) from that preset's transformers
config fields and names the public config it was read from.
Shape buckets are the Cartesian product batch x context x q_len the tuner measures and the
profile keys its entries by; the lookup maps other shapes to the nearest bucket.
'all' is every preset of a real model (``directkv_cute.presets.TEST_PRESETS``, the tiny test
shape, is tuned only when named).
"""

from __future__ import annotations

from dataclasses import dataclass

from directkv_cute import presets as _models

from .space import TuneShape, normalize_dtype

DEFAULT_BATCHES = (1, 4, 16, 64)
DEFAULT_CONTEXTS = (4096, 16384, 32768, 131072)
DEFAULT_Q_LENS = (1,)
DEFAULT_PAGE_SIZE = 64
DEFAULT_DTYPE = "bf16"

# Shape buckets of kernels whose calls are not decode steps, used where a run gives no bucket
# lists of its own (--batches / --contexts / --q-lens): the Q-tiled kernel runs compute-bound
# chunks (long prefills, large chunked-prefill steps), so its buckets are one sequence's chunk of
# 512..8192 query tokens at the end of an 8k..128k context (the multi_token profile's buckets).
KERNEL_BUCKETS: dict[str, dict[str, tuple[int, ...]]] = {
    "q_tiled": {"batches": (1,), "contexts": (8192, 32768, 131072), "q_lens": (512, 2048, 8192)},
}


def kernel_buckets(kernel: str | None) -> dict[str, tuple[int, ...]]:
    """The bucket lists (batches, contexts, q_lens) ``kernel`` is tuned on by default; empty for
    the decode kernels (the presets' own lists)."""
    return dict(KERNEL_BUCKETS.get(kernel or "", {}))


@dataclass(frozen=True)
class ModelPreset:
    name: str
    source: str  # the public config the numbers come from
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    num_layers: int
    batches: tuple[int, ...] = DEFAULT_BATCHES
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS
    q_lens: tuple[int, ...] = DEFAULT_Q_LENS
    page_size: int = DEFAULT_PAGE_SIZE
    dtype: str = DEFAULT_DTYPE

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    def shapes(self, *, batches=None, contexts=None, q_lens=None, page_size=None, dtype=None,
               kernel: str | None = None) -> list[TuneShape]:
        """The preset's shape buckets (optionally with other bucket lists / page size / dtype);
        ``kernel``: that kernel's default bucket lists (``KERNEL_BUCKETS``) where none are given."""
        kb = kernel_buckets(kernel)
        batches, contexts, q_lens = (batches or kb.get("batches"), contexts or kb.get("contexts"),
                                     q_lens or kb.get("q_lens"))
        out = []
        for q_len in q_lens or self.q_lens:
            for batch in batches or self.batches:
                for context in contexts or self.contexts:
                    out.append(
                        TuneShape(
                            num_q_heads=self.num_q_heads,
                            num_kv_heads=self.num_kv_heads,
                            head_dim=self.head_dim,
                            batch=int(batch),
                            context=int(context),
                            q_len=int(q_len),
                            page_size=int(page_size or self.page_size),
                            dtype=normalize_dtype(dtype or self.dtype),
                        )
                    )
        return out

    def kv_bytes_per_token(self, elem_bytes: int = 2) -> int:
        """K and V bytes of one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem_bytes


def _from_model(name: str) -> ModelPreset:
    """The tuner's preset of ``directkv_cute.presets``' preset ``name`` (its config's fields)."""
    _cls, kw = _models.PRESETS[name]
    return ModelPreset(name, _models.preset_source(name), num_q_heads=kw["num_attention_heads"],
                       num_kv_heads=kw["num_key_value_heads"],
                       head_dim=kw.get("head_dim") or kw["hidden_size"] // kw["num_attention_heads"],
                       hidden_size=kw["hidden_size"], num_layers=kw["num_hidden_layers"])


PRESETS: dict[str, ModelPreset] = {name: _from_model(name) for name in _models.preset_names()}


def get_preset(name: str) -> ModelPreset:
    """A preset by name, case- and punctuation-insensitive (``Llama-3-8B`` == ``llama3-8b``;
    ``directkv_cute.presets.canonical_name``)."""
    key = _models.canonical_name(name)
    if key is None:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(PRESETS)} (or 'all')")
    return PRESETS[key]


def resolve_presets(names) -> list[ModelPreset]:
    """Presets for a list of names; 'all' means every preset of a real model (not the test
    shapes of ``directkv_cute.presets.TEST_PRESETS``)."""
    every = [p for name, p in PRESETS.items() if name not in _models.TEST_PRESETS]
    out = []
    for n in names:
        for p in (every if n.lower() == "all" else [get_preset(n)]):
            if p not in out:
                out.append(p)
    return out


def unique_shapes(shapes) -> list[TuneShape]:
    """Shapes in first-seen order, without repeats (Llama-3-70B and Qwen2.5-72B share theirs)."""
    seen, out = set(), []
    for s in shapes:
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


__all__ = ["DEFAULT_BATCHES", "DEFAULT_CONTEXTS", "DEFAULT_Q_LENS", "KERNEL_BUCKETS", "ModelPreset", "PRESETS",
           "get_preset", "kernel_buckets", "resolve_presets", "unique_shapes"]

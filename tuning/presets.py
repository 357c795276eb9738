"""Model presets: attention geometry from the models' public configs, and their shape buckets.

Each preset lists the Hugging Face config it was read from (num_attention_heads,
num_key_value_heads, head_dim or hidden_size / heads, hidden_size, num_hidden_layers).
Shape buckets are the Cartesian product batch x context x q_len the tuner measures and the
profile keys its entries by; the lookup maps other shapes to the nearest bucket.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset(
            "llama3-8b", "meta-llama/Meta-Llama-3-8B config.json",
            num_q_heads=32, num_kv_heads=8, head_dim=128, hidden_size=4096, num_layers=32,
        ),
        ModelPreset(
            "llama3-70b", "meta-llama/Meta-Llama-3-70B config.json",
            num_q_heads=64, num_kv_heads=8, head_dim=128, hidden_size=8192, num_layers=80,
        ),
        ModelPreset(
            "qwen2.5-72b", "Qwen/Qwen2.5-72B config.json",
            num_q_heads=64, num_kv_heads=8, head_dim=128, hidden_size=8192, num_layers=80,
        ),
        ModelPreset(
            "qwen2.5-7b", "Qwen/Qwen2.5-7B config.json",
            num_q_heads=28, num_kv_heads=4, head_dim=128, hidden_size=3584, num_layers=28,
        ),
        ModelPreset(
            "mistral-large", "mistralai/Mistral-Large-Instruct-2407 config.json",
            num_q_heads=96, num_kv_heads=8, head_dim=128, hidden_size=12288, num_layers=88,
        ),
    )
}


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower().replace("meta-", ""))


_ALIASES = {_norm(k): k for k in PRESETS}
_ALIASES.update({
    _norm("Llama-3-8B"): "llama3-8b",
    _norm("Meta-Llama-3-8B"): "llama3-8b",
    _norm("Llama-3-70B"): "llama3-70b",
    _norm("Meta-Llama-3-70B"): "llama3-70b",
    _norm("Qwen2.5-72B"): "qwen2.5-72b",
    _norm("Qwen2.5-72B-Instruct"): "qwen2.5-72b",
    _norm("Qwen2.5-7B"): "qwen2.5-7b",
    _norm("Qwen2.5-7B-Instruct"): "qwen2.5-7b",
    _norm("Mistral-Large-Instruct-2407"): "mistral-large",
    _norm("Mistral-Large-2407"): "mistral-large",
})


def get_preset(name: str) -> ModelPreset:
    """A preset by name, case- and punctuation-insensitive (``Llama-3-8B`` == ``llama3-8b``)."""
    key = _ALIASES.get(_norm(name))
    if key is None:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(PRESETS)} (or 'all')")
    return PRESETS[key]


def resolve_presets(names) -> list[ModelPreset]:
    """Presets for a list of names; 'all' means every preset."""
    out = []
    for n in names:
        for p in (PRESETS.values() if n.lower() == "all" else [get_preset(n)]):
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

"""Model presets: the shapes of real decoders as transformers configs, built straight on the target
device with cheap, deterministic weights (for ``directkv-generate --preset`` and the end-to-end
bench). Nothing here downloads anything.

This module owns the presets: their names, the public config each shape was read from
(``preset_source``), the other spellings they answer to (``canonical_name``: case and
punctuation are ignored, so ``Meta-Llama-3-8B`` and ``Qwen2.5-7B-Instruct`` name ``llama3-8b`` and
``qwen2.5-7b``). ``directkv-tune`` (``directkv_cute.tuning.presets``) takes its presets' attention
geometry and names from here, so both command lines accept the same names. ``tiny`` is no real
model: a small Llama shape for CPU runs and tests (``TEST_PRESETS``).

    from directkv_cute.presets import build_random_model
    model = build_random_model("llama3-8b", torch.bfloat16, "cuda", seed=0)

``build_random_model`` constructs the model on the meta device (no memory), materialises it with
``to_empty`` on the target device (a 70B model is 131 GiB of bf16: it is never allocated on the
CPU first) and initialises every tensor in place there: Linear / Embedding weights (every weight
of two or more dimensions) ~ N(0, 0.02) from a generator seeded with ``seed`` on that device,
norm weights (the other weights) = 1, biases = 0. ``to_empty`` leaves non-persistent buffers as
garbage, so the rotary embeddings' ``inv_freq`` / ``original_inv_freq`` (and their scaling) are
recomputed by constructing the same rotary class from the model's config on the CPU; any other
buffer is refused rather than left uninitialised. The same seed, dtype and device give the same
weights; CPU and GPU draws differ.
"""

from __future__ import annotations

import copy
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where a model is built: the names and shapes need none of it
    import torch

__all__ = ["PRESETS", "SOURCES", "TEST_PRESETS", "build_random_model", "canonical_name", "preset_config",
           "preset_names", "preset_source", "weight_bytes"]

_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# name -> (config class name, kwargs). Special tokens are None: random weights have no EOS, so
# generation never stops early.
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3-8b": ("LlamaConfig", dict(
        num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        intermediate_size=14336, vocab_size=128256, rope_parameters=_LLAMA3_ROPE, max_position_embeddings=131072,
        rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "llama3-70b": ("LlamaConfig", dict(
        num_hidden_layers=80, hidden_size=8192, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
        intermediate_size=28672, vocab_size=128256, rope_parameters=_LLAMA3_ROPE, max_position_embeddings=131072,
        rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "qwen2.5-7b": ("Qwen2Config", dict(
        num_hidden_layers=28, hidden_size=3584, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
        intermediate_size=18944, vocab_size=152064, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        max_position_embeddings=131072, rms_norm_eps=1e-6, use_sliding_window=False, sliding_window=None,
        tie_word_embeddings=False)),  # Qwen2 attention always has q/k/v biases
    "qwen2.5-72b": ("Qwen2Config", dict(
        num_hidden_layers=80, hidden_size=8192, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
        intermediate_size=29568, vocab_size=152064, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        max_position_embeddings=131072, rms_norm_eps=1e-5, use_sliding_window=False, sliding_window=None,
        tie_word_embeddings=False)),
    "mistral-large": ("MistralConfig", dict(
        num_hidden_layers=88, hidden_size=12288, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
        intermediate_size=28672, vocab_size=32768, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        max_position_embeddings=131072, rms_norm_eps=1e-5, sliding_window=None, tie_word_embeddings=False)),
    "tiny": ("LlamaConfig", dict(
        num_hidden_layers=2, hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        intermediate_size=512, vocab_size=1024, rope_parameters=_LLAMA3_ROPE, max_position_embeddings=131072,
        rms_norm_eps=1e-5, tie_word_embeddings=False)),
}
_NO_SPECIAL_TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)

# The public config each preset's shape was read from (num_attention_heads, num_key_value_heads,
# head_dim, hidden_size, num_hidden_layers, intermediate_size, vocab_size).
SOURCES: dict[str, str] = {
    "llama3-8b": "meta-llama/Meta-Llama-3-8B config.json",
    "llama3-70b": "meta-llama/Meta-Llama-3-70B config.json",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B config.json",
    "qwen2.5-72b": "Qwen/Qwen2.5-72B config.json",
    "mistral-large": "mistralai/Mistral-Large-Instruct-2407 config.json",
    "tiny": "none: a small Llama shape for CPU runs and tests",
}
# Presets that are no real model's shape: directkv-tune's 'all' leaves them out (named, they tune).
TEST_PRESETS = ("tiny",)

# Other spellings of the names (the model's own name on the Hub, its instruct variant), matched as
# ``_norm`` leaves them: lower case, without punctuation and a leading "meta-".
_SPELLINGS = {
    "llama3-8b": ("Llama-3-8B", "Meta-Llama-3-8B", "Llama-3-8B-Instruct"),
    "llama3-70b": ("Llama-3-70B", "Meta-Llama-3-70B", "Llama-3-70B-Instruct"),
    "qwen2.5-7b": ("Qwen2.5-7B", "Qwen2.5-7B-Instruct"),
    "qwen2.5-72b": ("Qwen2.5-72B", "Qwen2.5-72B-Instruct"),
    "mistral-large": ("Mistral-Large-2407", "Mistral-Large-Instruct-2407"),
}


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", str(name).lower().replace("meta-", ""))


_ALIASES = {_norm(k): k for k in PRESETS}
_ALIASES.update({_norm(alias): name for name, aliases in _SPELLINGS.items() for alias in aliases})
assert set(SOURCES) == set(PRESETS) and set(_ALIASES.values()) == set(PRESETS)


def preset_names() -> list[str]:
    """Every preset's name, in the order the command lines list them."""
    return list(PRESETS)


def canonical_name(name: str) -> str | None:
    """The preset ``name`` names (any of its spellings, case and punctuation ignored), or None."""
    return _ALIASES.get(_norm(name)) if isinstance(name, str) else None


def preset_source(name: str) -> str:
    """The public config preset ``name``'s shape was read from."""
    return SOURCES[_known(name)]


def _known(name: str) -> str:
    key = canonical_name(name)
    if key is None:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return key


def preset_config(name: str, **overrides):
    """The transformers config of preset ``name`` (any of its spellings; ``overrides`` replace its
    fields, e.g. fewer layers for a test). ``ValueError`` naming the presets for an unknown name."""
    name = _known(name)
    import transformers

    cls_name, kwargs = PRESETS[name]
    kwargs = copy.deepcopy(kwargs) | _NO_SPECIAL_TOKENS | overrides
    return getattr(transformers, cls_name)(**kwargs)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def _dtype_kwarg() -> str:
    """transformers >= 4.56 names the model dtype ``dtype`` (``torch_dtype`` before)."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def _reinit_rotary(module: torch.nn.Module, device: torch.device) -> None:
    """Recompute a rotary embedding's non-persistent buffers (garbage after ``to_empty``) by
    building the same class from its config on the CPU."""
    import torch

    with torch.device("cpu"):
        fresh = type(module)(module.config)
    for name, buf in fresh.named_buffers(recurse=False):
        setattr(module, name, buf.to(device))  # replaces the registered buffer, keeps it non-persistent
    for attr in ("attention_scaling", "max_seq_len_cached", "original_max_seq_len"):
        if hasattr(fresh, attr):
            setattr(module, attr, getattr(fresh, attr))


def init_random_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Initialise a materialised (``to_empty``) model in place on its device: weights with two or
    more dimensions ~ N(0, 0.02), other weights (norms) 1, biases 0, rotary buffers recomputed.
    Tied parameters are initialised once."""
    import torch

    with torch.no_grad():
        _init_random_weights(model, seed)


def _init_random_weights(model, seed: int) -> None:
    import torch

    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(int(seed))
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=True):
        if id(p) in seen:
            continue
        seen.add(id(p))
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "bias":
            p.zero_()
        elif p.dim() >= 2:
            p.normal_(0.0, 0.02, generator=gen)
        else:
            p.fill_(1.0)
    rotary = set()
    for mod_name, mod in model.named_modules():
        if "RotaryEmbedding" in type(mod).__name__ and hasattr(mod, "inv_freq"):
            _reinit_rotary(mod, device)
            rotary.add(mod_name)
    for name, _ in model.named_buffers():
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        if owner not in rotary:
            raise NotImplementedError(f"build_random_model cannot initialise buffer {name!r} of "
                                      f"{type(model).__name__} (only rotary embedding buffers are known)")


def build_random_model(preset, dtype: torch.dtype | None = None, device: str | torch.device = "cuda",
                       seed: int = 0, attn_implementation: str = "sdpa", **overrides):
    """A causal LM of preset ``preset`` (a name, or a transformers config) with random weights,
    built directly on ``device`` in ``dtype`` (default bfloat16): meta device -> ``to_empty`` ->
    in-place init (see the module docstring). Returns it in eval mode with ``attn_implementation``
    set ("directkv" needs ``import directkv_cute.hf``, which registers it)."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if dtype is None else dtype

    if attn_implementation == "directkv":
        # transformers (optional) and torch: the preset names and shapes import without either
        import directkv_cute.hf  # noqa: F401 - registers the attention implementation

    config = preset_config(preset, **overrides) if isinstance(preset, str) else copy.deepcopy(preset)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation,
                                                 **{_dtype_kwarg(): dtype})
    model = model.to(dtype=dtype) if any(p.dtype != dtype for p in model.parameters()) else model
    model.to_empty(device=device)
    init_random_weights(model, seed)
    model.eval()
    model.requires_grad_(False)
    return model

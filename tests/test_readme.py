"""The README's snippets run as written (on a CPU the op runs the reference; lines marked
``(GPU only)`` need the kernels)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def _block(heading: str) -> str:
    text = README.read_text()
    section = text[text.index(heading):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_use_the_op_directly_runs():
    code = _block("## Use the op directly")
    if not torch.cuda.is_available():
        code = "\n".join(line for line in code.splitlines() if "(GPU only)" not in line)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    out, cache = scope["out"], scope["cache"]
    assert out.shape == (513, 32, 128) and torch.isfinite(out.float()).all()
    assert cache.seq_len(scope["a"]) == 1000 and cache.seq_len(scope["b"]) == 700

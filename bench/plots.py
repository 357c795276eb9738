"""PNG plots of a results document (matplotlib, when it is installed)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Iterable, Mapping

from bench.common import pyplot as _pyplot
from bench.common import save_figure

DECODE_METHODS = ("ours", "zero_copy", "swap", "host_read", "hbm")
PREFILL_METHODS = ("ours", "zero_copy", "swap", "hbm", "floor")
_STYLE = {"ours": "o-", "zero_copy": "s--", "swap": "^--", "host_read": "k:", "hbm": "d-.", "floor": "k:"}


def _measured(records: Iterable[Mapping], bench: str) -> list[Mapping]:
    return [r for r in records if r["bench"] == bench and r["ms"] is not None]


def _grid(plt, n: int, width: float = 4.2, height: float = 3.4):
    cols = min(4, max(1, n))
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat


def plot_decode(doc: Mapping, prefix: str | Path) -> list[Path]:
    """<prefix>-gbps.png: effective GB/s vs context per method (one panel per batch and head
    count; ours at hbm_fraction 0); <prefix>-hybrid.png: ours' time vs HBM fraction with the
    ideal max(host/link, HBM/HBM-bandwidth) dashed. Returns the files written."""
    plt = _pyplot()
    recs = _measured(doc["records"], "decode")
    if plt is None or not recs:
        return []
    written = [_decode_gbps(plt, recs, doc, Path(f"{prefix}-gbps.png"))]
    hybrid = [r for r in recs if r["method"] == "ours"]
    if len({r["hbm_fraction"] for r in hybrid}) > 1:
        written.append(_decode_hybrid(plt, hybrid, doc, Path(f"{prefix}-hybrid.png")))
    return written


def _decode_gbps(plt, recs, doc, path: Path) -> Path:
    panels = sorted({(r["batch"], r["hq"], r["hkv"]) for r in recs})
    fig, axes = _grid(plt, len(panels))
    host_ceiling = doc["ceilings"]["host_read_gbps"]
    for ax, (b, hq, hkv) in zip(axes, panels):
        for method in DECODE_METHODS:
            pts = sorted((r["context"], r["gbps"]) for r in recs
                         if (r["batch"], r["hq"], r["hkv"]) == (b, hq, hkv) and r["method"] == method
                         and (method != "ours" or r["hbm_fraction"] == 0))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], _STYLE[method], label=method, ms=4)
        ax.axhline(host_ceiling, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set(yscale="log", title=f"decode B={b} Hq/Hkv={hq}/{hkv}", xlabel="context (tokens)",
               ylabel="effective GB/s of KV")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    return save_figure(plt, fig, path, f"{doc['header']['gpu']} {doc['header']['date']} "
                       f"(gray: host read ceiling {host_ceiling:.1f} GB/s)")


def _decode_hybrid(plt, recs, doc, path: Path) -> Path:
    by_shape = defaultdict(list)
    for r in recs:
        by_shape[(r["batch"], r["context"], r["hq"], r["hkv"])].append(r)
    panels = sorted({k[0] for k in by_shape})
    fig, axes = _grid(plt, len(panels))
    ceil = doc["ceilings"]
    for ax, b in zip(axes, panels):
        for (bb, ctx, hq, hkv), rs in sorted(by_shape.items()):
            if bb != b:
                continue
            rs = sorted(rs, key=lambda r: r["hbm_fraction"])
            x = [r["hbm_fraction"] for r in rs]
            line, = ax.plot(x, [r["ms"] for r in rs], "o-", ms=4, label=f"ctx {ctx} {hq}/{hkv}")
            ideal = [1e3 * max(r["host_bytes"] / (ceil["host_read_gbps"] * 1e9),
                               r["hbm_bytes"] / (ceil["hbm_read_gbps"] * 1e9)) for r in rs]
            ax.plot(x, ideal, "--", color=line.get_color(), lw=0.8)
        ax.set(yscale="log", title=f"ours, decode B={b}", xlabel="fraction of pages in HBM", ylabel="ms")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    return save_figure(plt, fig, path, f"{doc['header']['gpu']} {doc['header']['date']} "
                       "(dashed: max(host/link, HBM/HBM bw))")


def plot_prefill(doc: Mapping, prefix: str | Path) -> list[Path]:
    """<prefix>.png: time vs q_len per method, one panel per context (log-log)."""
    plt = _pyplot()
    recs = [r for r in _measured(doc["records"], "prefill") if r["hbm_fraction"] == 0 or r["method"] == "hbm"]
    if plt is None or not recs:
        return []
    panels = sorted({(r["context"], r["batch"], r["hq"], r["hkv"]) for r in recs})
    fig, axes = _grid(plt, len(panels))
    for ax, key in zip(axes, panels):
        for method in PREFILL_METHODS:
            pts = sorted((r["q_len"], r["ms"]) for r in recs
                         if (r["context"], r["batch"], r["hq"], r["hkv"]) == key and r["method"] == method)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], _STYLE[method], label=method, ms=4)
        ctx, b, hq, hkv = key
        ax.set_xscale("log", base=2)
        ax.set(yscale="log", title=f"prefill ctx={ctx} B={b} {hq}/{hkv}", xlabel="q_len",
               ylabel="ms")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    return [save_figure(plt, fig, f"{prefix}.png", f"{doc['header']['gpu']} {doc['header']['date']} "
                        "(floor: host bytes once / host ceiling)")]


class PlotError(RuntimeError):
    """A results document cannot be plotted (matplotlib missing, or no measured records)."""


def plot_results(doc: Mapping, prefix: str | Path) -> list[Path]:
    """The PNG plots of every bench in a results document (a merged ``all`` run has both):
    <prefix>-decode-gbps.png, <prefix>-decode-hybrid.png and <prefix>-prefill.png. For runs made
    where matplotlib is not installed, from their JSON afterwards."""
    if _pyplot() is None:
        raise PlotError("matplotlib is not installed (pip install 'directkv-cute[bench]')")
    files: list[Path] = []
    for bench, plot in (("decode", plot_decode), ("prefill", plot_prefill)):
        if _measured(doc["records"], bench):
            files += plot(doc, f"{prefix}-{bench}")
    if not files:
        raise PlotError("the document has no measured decode or prefill records")
    return files

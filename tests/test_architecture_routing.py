"""The routing table of docs/ARCHITECTURE.md is the planner's: every row's representative shape,
planned for the H200's facts and machine model, takes that row's route (``AttentionPlan.route``),
staged or in place as the row says, or is refused where the row says so; and every row of the
table has a representative here."""

from __future__ import annotations

import dataclasses
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from directkv_cute.config import DecodeConfig, QTiledConfig
from directkv_cute.machine import H200, DeviceInfo
from directkv_cute.planner import CallShape, DefaultConfigs, plan_attention

DOC = Path(__file__).resolve().parent.parent / "docs" / "ARCHITECTURE.md"
FACTS = DeviceInfo("NVIDIA H200", 132, 140 * 2**30, copies_ahead=True)
E4M3 = torch.float8_e4m3fn


def routing_rows() -> dict[str, tuple[str, str]]:
    """{row name: (route cell, KV read cell)} of every table under ``## Routing``."""
    text = DOC.read_text()
    section = text[text.index("## Routing"):]
    section = section[:section.index("\n## ", 1)] if "\n## " in section[1:] else section
    rows, header = {}, None
    for line in section.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
            continue
        if set(line) <= set("|-: ") or "route" not in header:
            continue
        name = re.fullmatch(r"`([\w-]+)`", cells[0])
        if name:
            rows[name.group(1)] = (cells[header.index("route")], cells[header.index("KV read")])
    return rows


def shape(lens, q_lens, tier="host", hq=32, hkv=8, page=64, fp8=False, marked=False, cascade=False):
    return CallShape.example(lens, q_lens, num_q_heads=hq, num_kv_heads=hkv, page_size=page, tier=tier,
                             page_dtype=E4M3 if fp8 else None, back_to_back=marked).replace(cascade=cascade)


def hybrid(lens, q_lens):
    """Every fourth page of each sequence in HBM."""
    s = shape(lens, q_lens)
    t = s.host_table.copy()
    t[:, ::4] = -t[:, ::4] - 1
    return s.replace(host_table=t)


def forks(batch, own):
    """``batch`` sequences forked from one 32k prompt, ``own`` tokens each of their own, decoding."""
    prompt = 512
    table = np.zeros((batch, prompt + own // 64 + 1), dtype=np.int32)
    table[:, :prompt] = np.arange(prompt)
    for b in range(batch):
        table[b, prompt:] = prompt + b * (own // 64 + 1) + np.arange(own // 64 + 1)
    return CallShape(table, (32768 + own + 1,) * batch, (1,) * batch, 32, 8, 128, 64, torch.bfloat16,
                     torch.bfloat16, 32, 1, table.shape[1], cascade=True)


CAPTURING = dataclasses.replace(FACTS, capturing=True)
# row -> (shape, explicit config, device facts)
REPRESENTATIVES = {
    "in-place-unplanned": (shape([32768], [8192]).replace(host_table=None), None, FACTS),
    "decode-all-hbm": (shape([32768] * 32, [1] * 32, tier="hbm"), None, FACTS),
    "decode-hybrid": (hybrid([32768], [1]), None, FACTS),
    "decode-host-short": (shape([4096], [1]), None, FACTS),
    "decode-host-long": (shape([32768], [1]), None, FACTS),
    "decode-host-kept": (shape([32768], [1]), None, dataclasses.replace(FACTS, staging_cap=2**20)),
    "chunk-all-hbm": (shape([32768], [2048], tier="hbm"), None, FACTS),
    "chunk-all-hbm-narrow": (shape([32768], [64], tier="hbm"), None, FACTS),
    "chunk-in-place": (shape([8192], [64]), None, FACTS),
    "chunk-one-wave": (shape([8192], [512]), None, FACTS),
    "chunk-link-bound": (shape([32768], [2048]), None, FACTS),
    "chunk-compute-bound": (shape([32768], [8192]), None, FACTS),
    "chunk-pipelined": (shape([8192], [2048], tier="window", marked=True), None, FACTS),
    "chunk-window": (shape([32768], [2048], tier="window"), None, FACTS),
    "chunk-wide-group": (shape([8192], [64], hq=72, hkv=1), None, FACTS),
    "workspace-cap": (shape([32768], [64], tier="hbm"), None, dataclasses.replace(FACTS, workspace_cap=1.0)),
    "explicit-decode-config": (shape([32768], [1]), DecodeConfig(), FACTS),
    "explicit-q-tiled": (shape([8192], [64]), QTiledConfig(), FACTS),
    "fp8-decode-in-place": (shape([4096], [1], fp8=True), None, FACTS),
    "fp8-decode-staged": (shape([32768], [4], fp8=True), None, FACTS),
    "fp8-decode-two-piece": (shape([32768], [1], fp8=True), None, FACTS),
    "fp8-chunk-refused": (shape([8192], [2048], fp8=True), None, CAPTURING),
    "fp8-chunk-by-head": (shape([8192], [2048], fp8=True), None, FACTS),
    "fp8-chunk-whole": (shape([8192], [64], fp8=True), None, FACTS),
    "shared-none": (shape([32768], [2048], cascade=True), None, FACTS),
    "shared-staged-batch": (forks(16, 8192), None, FACTS),
    "shared-cascade": (forks(64, 0), None, FACTS),
    "cpu-reference": (shape([32768], [2048]), None, DeviceInfo.for_cpu()),
}


def test_every_documented_row_has_a_representative():
    rows = routing_rows()
    assert len(rows) >= 25, sorted(rows)
    assert set(rows) == set(REPRESENTATIVES)


@pytest.mark.parametrize("row", sorted(REPRESENTATIVES))
def test_the_documented_route_is_the_planners(row):
    route_cell, read_cell = routing_rows()[row]
    s, config, facts = REPRESENTATIVES[row]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if route_cell == "refused":
            with pytest.raises(ValueError):
                plan_attention(s, facts, H200, DefaultConfigs(), config)
            return
        plan = plan_attention(s, facts, H200, DefaultConfigs(), config)
    routes = re.findall(r"`(\w+)`", route_cell)
    if route_cell == "the rows above":  # nothing shared: the plain plan
        assert plan.route not in ("cascade", "cascade_staged")
    else:
        assert plan.route in routes, (row, plan.explain())
    inner = getattr(plan.detail, "inner", None)  # fp8_dequantized, cascade_staged: the plan they run
    staged = plan.staging is not None or (inner is not None and inner.staging is not None)
    if read_cell.startswith("staged") and "else" not in read_cell:
        assert staged, (row, plan.explain())
    if read_cell.startswith("in place"):
        assert not staged, (row, plan.explain())

"""The kernel spec registry (``directkv_cute.kernels.specs``): one spec per compiled kernel, the
one statement of its files, legality, code-generating fields, compile and launch; the op's
dispatch, jit's keys, the tuner's spaces and ``bench check`` read it."""

from __future__ import annotations

import dataclasses
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from directkv_cute.config import DecodeConfig, QTiledConfig, default_decode_config, default_multi_token_config
from directkv_cute.kernels import jit, sources, specs
from directkv_cute.kv_proj import KVProjConfig
from directkv_cute.tuning.space import TuneShape, get_space
from pkg_copy import HOST_ONLY, package_imports

CONFIGURED = [s for s in specs.SPECS if s.config is not None]


def test_one_spec_per_compiled_kernel():
    assert [s.name for s in specs.SPECS] == ["decode", "decode_fp8", "multi_token", "q_tiled", "kv_proj", "dequant",
                                          "combine"]
    assert specs.KERNELS == {s.name: s for s in specs.SPECS} and specs.get("q_tiled") is specs.KERNELS["q_tiled"]
    with pytest.raises(KeyError, match="no kernel 'prefill'"):
        specs.get("prefill")
    assert specs.tuned() == sources.tuned_kernels() == ("decode", "decode_fp8", "multi_token", "q_tiled")
    assert specs.get("decode").config_class is specs.get("multi_token").config_class is DecodeConfig
    assert specs.get("q_tiled").config_class is QTiledConfig and specs.get("combine").config_class is None


def test_the_registry_imports_without_torch_or_cutlass():
    code = ("import sys; from directkv_cute.kernels import specs, sources; "
            "assert specs.KERNELS and sources.CODE_FILES; "
            "print(sorted(m for m in ('torch', 'cutlass') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_references_resolve():
    for s in specs.SPECS:
        assert callable(s.compile_fn) and callable(s.key_fn) and callable(s.launch_fn), s.name
        assert s.compile_fn.__module__ == "directkv_cute.kernels.jit"
    assert specs.get("multi_token").compile_fn is jit.compile_multi_token
    assert specs.get("decode").key_fn is specs.get("multi_token").key_fn is jit.decode_key
    assert specs.resolve("directkv_cute.config.DecodeConfig.problems") is DecodeConfig.problems
    with pytest.raises(AttributeError):
        specs.resolve("directkv_cute.kernels.jit.no_such_function")


# ---- files -------------------------------------------------------------------------------------


def test_code_files_are_the_specs_files():
    """sources.CODE_FILES / LAUNCHES are built from the specs (one statement of each)."""
    assert sources.CODE_FILES == {s.name: s.files for s in specs.SPECS}
    assert sources.LAUNCHES == {s.name: s.launches for s in specs.SPECS if s.launches}
    for s in specs.SPECS:
        assert set(s.launches) <= set(specs.KERNELS)


@pytest.mark.parametrize("spec", specs.SPECS, ids=lambda s: s.name)
def test_spec_files_exist_and_are_closed_under_their_package_imports(spec):
    every = {f for s in specs.SPECS for f in s.files}
    assert len(set(spec.files)) == len(spec.files)
    for rel in spec.files:
        assert (sources.PACKAGE_DIR / rel).is_file(), rel
        imported = package_imports(sources.PACKAGE_DIR / rel)
        allowed = set(spec.files) | (every | HOST_ONLY if rel == "kernels/jit.py" else set())
        assert imported <= allowed, f"{spec.name}: {rel} imports {sorted(imported - allowed)}"
    # the device module its compile function builds is among its files
    device = {"decode": "kernels/decode.py", "decode_fp8": "kernels/decode_fp8.py", "multi_token": "kernels/multi_token.py", "q_tiled": "kernels/q_tiled.py",
              "kv_proj": "kernels/kv_proj.py", "dequant": "kernels/dequant.py",
                  "combine": "kernels/combine.py"}[spec.name]
    assert device in spec.files and "kernels/jit.py" in spec.files


# ---- legality ----------------------------------------------------------------------------------


def _random_configs(cls, n, seed=0):
    rng = random.Random(seed)
    choices = {
        "tile_n": (16, 32, 64, 128, 256), "stages": (1, 2, 3, 4, 6, 7, 12, 13), "num_splits": (-1, 0, 4),
        "ctas_per_sm": (0, 1, 2, 9), "carveout": (50, 80, 100, 101), "consumer_wgs": (0, 1, 2, 3),
        "chunk_tiles": (0, 1, 3, 6), "max_inflight": (0, 1, 2), "link_credits": (0, 8, -1), "edge_tiles": (0, 1, 2),
        "q_regs": (0, 1, 2), "q_cluster": (0, 2, 3), "stagger": (0, 2, 4),
        "splits": (-1, 0, 2), "pingpong": (0, 1, 2), "tile_m": (32, 64, 128), "cluster": (0, 1, 2, 4),
    }
    names = [f.name for f in dataclasses.fields(cls)]
    return [cls(**{k: rng.choice(choices[k]) for k in names}) for _ in range(n)]


@pytest.mark.parametrize("spec", CONFIGURED, ids=lambda s: s.name)
def test_spec_legality_is_its_config_classs(spec):
    """Without a shape a spec's legality is its config's ``problems()`` (stated there only); the
    shape rules only add to it."""
    cls = spec.config_class
    seen_legal = 0
    for cfg in _random_configs(cls, 400):
        for head_dim, page, eb in ((128, 64, 2), (64, 16, 2), (96, None, 2), (128, 128, 4)):
            want = cfg.problems(head_dim, page, eb)
            assert spec.problems(cfg, head_dim, page, eb) == want
            assert spec.is_legal(cfg, head_dim, page, eb) == cfg.is_legal(head_dim, page, eb)
            with_shape = spec.problems(cfg, head_dim, page, eb, group=4, q_len=2)
            assert with_shape[:len(want)] == want
            assert with_shape[len(want):] == spec.shape_problems(cfg, 4, 2)
            seen_legal += not want
    assert seen_legal  # the sample has legal configs too


def test_streaming_shape_rules_are_the_ops_old_rule():
    """decode accepts a config exactly when every query row of a KV head fits one CTA and it has
    no multi-token-only option (the streaming rule the planner keeps)."""
    old = lambda cfg, g, q: not cfg.multi_token_only and g <= cfg.rows and q <= cfg.rows // g  # noqa: E731
    decode = specs.get("decode")
    for cfg in _random_configs(DecodeConfig, 200, seed=1):
        if cfg.consumer_wgs < 1:
            continue
        for g in (1, 4, 8, 64, 65, 128, 129):
            for q in (1, 2, 16, 32, 33, 128):
                assert decode.accepts(cfg, g, q) == old(cfg, g, q), (cfg, g, q)
                assert specs.config_kernel(cfg, g, q) == ("decode" if old(cfg, g, q) else "multi_token")


@pytest.mark.parametrize("kernel, cfg, group, q_len, message", [
    ("decode", DecodeConfig(q_regs=1, consumer_wgs=2, stages=3), 4, 1, "q_regs: options of the multi-token kernel only"),
    ("decode", DecodeConfig(), 65, 1, "GQA group 65 must be in 1..64"),
    ("decode", DecodeConfig(consumer_wgs=2), 4, 33, "group 4 x q_len 33 rows exceed the config's 128 rows"),
    ("multi_token", DecodeConfig(consumer_wgs=2), 65, 1, "the multi-token kernel holds GQA groups up to 64, got 65"),
    ("multi_token", DecodeConfig(), 0, 1, "GQA group 0 must be in 1..64"),
    ("q_tiled", QTiledConfig(), 129, 1, "GQA group 129 must be in 1..128"),
])
def test_the_compiler_raises_the_specs_first_shape_problem(kernel, cfg, group, q_len, message):
    spec = specs.get(kernel)
    assert spec.shape_problems(cfg, group, q_len)[0] == message
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)") + "$"):
        if kernel == "q_tiled":
            jit.compile_q_tiled(cfg, torch.bfloat16, 128, 64, group, False)
        else:
            jit.compile_decode(cfg, torch.bfloat16, 128, 64, group, q_len, multi_token=kernel == "multi_token")


# ---- code generation ---------------------------------------------------------------------------


@pytest.mark.parametrize("spec", CONFIGURED, ids=lambda s: s.name)
def test_every_config_field_is_stated_once(spec):
    names = [f.name for f in dataclasses.fields(spec.config_class)]
    launch = [f for f, _ in spec.launch_fields]
    resolved = [f for f, _ in spec.resolved_fields]
    stated = [*spec.codegen_fields, *launch, *resolved]
    assert sorted(stated) == sorted(names) and len(stated) == len(set(stated))


def _key(spec, cfg, head_dim=128):
    if spec.name == "kv_proj":
        return jit.kv_proj_key(cfg, torch.bfloat16, 4096, 8, head_dim, 64, True, True, True, False)
    if spec.name == "q_tiled":
        return jit.q_tiled_key(cfg, torch.bfloat16, head_dim, 64, 4, True, True)
    if spec.name == "decode_fp8":
        return jit.decode_fp8_key(cfg, torch.bfloat16, torch.float8_e4m3fn, head_dim, 64, 4, True)
    return jit.decode_key(cfg, torch.bfloat16, head_dim, 64, 4, True, multi_token=spec.name == "multi_token")


def _other(value, field):
    return {"tile_n": 128 if value != 128 else 64, "tile_m": 64 if value != 64 else 128, "consumer_wgs": 2 if value != 2 else 1,
            "carveout": 90 if value != 90 else 80}.get(field, value + 1)


@pytest.mark.parametrize("spec", CONFIGURED, ids=lambda s: s.name)
def test_codegen_fields_are_exactly_those_that_change_the_compile_key(spec):
    base = {"decode": default_decode_config(128, 8, 64), "decode_fp8": default_decode_config(128, 8, 64),
            "multi_token": default_multi_token_config(128),
            "q_tiled": QTiledConfig(), "kv_proj": KVProjConfig()}[spec.name]
    resolved = dict(spec.resolved_fields)
    for f in dataclasses.fields(base):
        cfg = dataclasses.replace(base, **{f.name: _other(getattr(base, f.name), f.name)})
        changed = _key(spec, cfg) != _key(spec, base)
        if f.name in resolved:
            want = resolved[f.name](cfg, 128) != resolved[f.name](base, 128)
        else:
            want = f.name in spec.codegen_fields
        assert changed == want, f"{spec.name}: {f.name}"


def test_the_occupancy_is_what_ctas_per_sm_puts_in_the_multi_token_key():
    spec = specs.get("multi_token")
    one_wg = DecodeConfig(tile_n=64, stages=2, consumer_wgs=1, carveout=100, chunk_tiles=1)
    assert one_wg.multi_token_occupancy(128) == 2
    keys = {c: _key(spec, dataclasses.replace(one_wg, ctas_per_sm=c)) for c in (1, 2, 3)}
    assert keys[2] == keys[3] != keys[1]  # 2 and 3 both resolve to two CTAs per SM
    two_wg = default_multi_token_config(128)
    assert _key(spec, dataclasses.replace(two_wg, ctas_per_sm=2)) == _key(spec, two_wg)  # resolves to 1 either way


def test_the_keys_are_the_configs_as_their_spec_states():
    cfg = DecodeConfig(num_splits=5, ctas_per_sm=3, chunk_tiles=2, q_regs=1)
    key = jit.decode_key(cfg, torch.bfloat16, 128, 64, 4, False)
    assert key[8:] == specs.get("decode").key_values(cfg, 128) == dataclasses.astuple(
        dataclasses.replace(cfg, num_splits=0, ctas_per_sm=1, chunk_tiles=0, q_regs=0))
    q = QTiledConfig(tile_n=64, stages=4, pingpong=0, cluster=1)
    assert jit.q_tiled_key(q, torch.bfloat16, 128, 64, 4, True)[8:] == specs.get("q_tiled").key_values(q, 128) \
        == (64, 4, 100, 0, 1)  # every field as it is: the Q-tiled config holds code-generating fields only
    assert jit.combine_key(128, torch.bfloat16)[0] == "combine"


# ---- readers -----------------------------------------------------------------------------------


def _patched(monkeypatch, name, **changes):
    spec = dataclasses.replace(specs.get(name), **changes)
    monkeypatch.setitem(specs.KERNELS, name, spec)
    return spec


def test_the_planners_dispatch_reads_the_registry(monkeypatch):
    from directkv_cute.machine import H200, DeviceInfo
    from directkv_cute.planner import CallShape, DefaultConfigs, plan_attention

    def kernel(config, q_len=1):
        shape = CallShape.example([4096], [q_len], num_q_heads=4, num_kv_heads=1, tier="hbm")
        return plan_attention(shape, DeviceInfo("H", 132, 2**37), H200, DefaultConfigs(), config).kernel

    cfg = DecodeConfig()
    assert kernel(cfg) == "decode" and kernel(None, 32) == "decode" and kernel(None, 33) == "multi_token"
    assert specs.op_kernel(4, 32) == "decode" and specs.op_kernel(4, 33) == "multi_token"
    # the streaming kernel refusing DecodeConfig() (4 stages; the defaults have more) and holding 64 rows
    _patched(monkeypatch, "decode", shape_rules=lambda c, g, q: ["refused"] if c.stages == 4 else [], max_rows=64)
    assert kernel(cfg) == "multi_token" and kernel(None, 16) == "decode" and kernel(None, 17) == "multi_token"
    assert specs.op_kernel(4, 16) == "decode" and specs.op_kernel(4, 17) == "multi_token"


def test_jit_keys_read_the_registry(monkeypatch):
    cfg = default_decode_config(128, 8, 64)
    base = jit.decode_key(cfg, torch.bfloat16, 128, 64, 8, True)
    spec = specs.get("decode")
    _patched(monkeypatch, "decode", codegen_fields=tuple(f for f in spec.codegen_fields if f != "stages"),
             launch_fields=(*spec.launch_fields, ("stages", 2)))
    moved = jit.decode_key(dataclasses.replace(cfg, stages=3), torch.bfloat16, 128, 64, 8, True)
    assert moved == jit.decode_key(cfg, torch.bfloat16, 128, 64, 8, True) != base


def test_the_tuners_spaces_read_the_registry(monkeypatch):
    for name in ("decode", "multi_token"):
        space = get_space(name)
        assert space.kernel == space.source_kernel == name and space.config_cls is specs.get(name).config_class
    shape = TuneShape(32, 8, 128, batch=1, context=4096, q_len=1)
    cfg = get_space("decode").default_for(shape)
    assert get_space("decode").problems(cfg, shape) == []
    monkeypatch.setattr(DecodeConfig, "problems", lambda self, *a, **k: ["a config rule"])
    assert get_space("decode").problems(cfg, shape) == ["a config rule"]
    assert get_space("multi_token").problems(cfg, shape)[:1] == ["a config rule"]


def test_bench_check_reads_the_registry(monkeypatch):
    from bench import check
    from directkv_cute.tuning import profiles as P

    prof = P.Profile(metadata={"gpu_name": "X", "tune_version": P.TUNE_VERSION})
    rec = {"config": DecodeConfig(consumer_wgs=2, stages=3).to_dict(), "p50_us": 1.0, "trials": 1,
           "kernel_hash": "a" * 64}
    prof.set(("decode", "bf16", 128, 4, 64), (1, 4096, 32), rec)
    prof.set(("multi_token", "bf16", 128, 4, 64), (1, 4096, 512), rec)
    assert check.profile_legality_problems(prof) == []
    assert [t.kernel for t in check.profile_targets([(Path("p.yaml"), prof)])] == ["decode", "multi_token"]
    _patched(monkeypatch, "multi_token", shape_rules=lambda c, g, q: [f"no group {g}"])
    assert check.profile_legality_problems(prof) == ["('multi_token', 'bf16', 128, 4, 64) (1, 4096, 512): no group 4"]
    assert check.resolve_compiler() == (jit.compile_decode, jit.compile_combine, jit.decode_key)
    assert check.resolve_q_tiled() is jit.compile_q_tiled

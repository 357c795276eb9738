"""Every kernel variant compiles for sm_90a without a GPU (CUTE_DSL_ARCH=sm_90a, set in conftest),
the generated code has what the kernels' designs need, and the compile cache (memory and disk)
returns kernels without recompiling.

The matrices (default configs, the decode search space, multi-token variants, tile x page) run
a representative part by default; the rest is marked ``full`` and runs with ``--full`` (a step of
``.ci/run``). Every kernel compiled here keeps its PTX (``fn.__ptx__``), so the PTX tests read the
code of the kernels the compile tests built instead of compiling each again in a subprocess."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from directkv_cute.config import (
    SUPPORTED_PAGE_SIZES,
    ConfigError,
    DecodeConfig,
    default_decode_config,
    default_multi_token_config,
)
from directkv_cute.kernels import jit

pytestmark = pytest.mark.compile
full = pytest.mark.full


@pytest.fixture(scope="module", autouse=True)
def _keep_ptx(tmp_path_factory):
    """``cute.compile`` keeps the PTX of every kernel compiled in this module (``--keep-ptx``, the
    dump in a temporary folder): the same text CuTe DSL's CUTE_DSL_KEEP=ptx dump writes."""
    import cutlass.cute as cute

    dump = tmp_path_factory.mktemp("ptx")
    real = cute.compile

    def compile_keeping_ptx(*args, **kwargs):
        assert "options" not in kwargs, "jit passes compile options now: merge them here"
        return real(*args, options=f"--keep-ptx --dump-dir={dump}", **kwargs)

    mp = pytest.MonkeyPatch()
    mp.setattr(cute, "compile", compile_keeping_ptx)
    yield
    mp.undo()


@pytest.fixture(autouse=True)
def _isolated_disk_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DIRECTKV_CACHE_DIR", str(tmp_path / "kc"))
    yield


def _ptx_of(fn, rebuild) -> str:
    """The PTX of compiled ``fn``; ``rebuild()`` compiles it afresh when ``fn`` came from a cache
    filled before this module kept PTX."""
    ptx = getattr(fn, "__ptx__", None)
    if not ptx:
        ptx = rebuild().__ptx__
    assert ptx and ptx.count(".entry") == 1
    return ptx


def _cover(configs: list) -> list:
    """A few of ``configs`` in which the smallest and the largest value (among ``configs``) of
    every field appear."""
    names = [f.name for f in dataclasses.fields(configs[0])]
    missing = {(n, pick(getattr(c, n) for c in configs)) for n in names for pick in (min, max)}
    picked = []
    while missing:
        best = max(configs, key=lambda c: len(missing & set(dataclasses.asdict(c).items())))
        picked.append(best)
        missing -= set(dataclasses.asdict(best).items())
    return picked


# bench check compiles the bf16 defaults of every head dim, row count and page size (and the
# float16 ones at page 64): the representative part here is the other dtype, head dim and page.
REPRESENTATIVE_DEFAULTS = {(torch.float16, 64, 16)}


def _default_params():
    return [pytest.param(dtype, head_dim, page, id=f"{str(dtype)[6:]}-d{head_dim}-page{page}",
                         marks=() if (dtype, head_dim, page) in REPRESENTATIVE_DEFAULTS else full)
            for page in SUPPORTED_PAGE_SIZES for head_dim in (64, 128) for dtype in (torch.bfloat16, torch.float16)]


@pytest.mark.parametrize("dtype,head_dim,page_size", _default_params())
def test_default_configs_compile(dtype, head_dim, page_size):
    for group, q_len in ((1, 1), (4, 1), (8, 1), (8, 8)):
        cfg = default_decode_config(head_dim, group * q_len, page_size)
        for split_out in (True, False):
            fn = jit.compile_decode(cfg, dtype, head_dim, page_size, group, q_len, split_out)
            assert callable(fn)
    assert callable(jit.compile_multi_token(default_multi_token_config(head_dim), dtype, head_dim, page_size, 4))
    assert callable(jit.compile_combine(head_dim, dtype))


def _decode_space_configs() -> list:
    """One config per compile key among the legal configs of the tuner's decode space."""
    from directkv_cute.tuning.space import TuneShape, get_space

    by_key = {}
    for cfg in get_space("decode").legal_configs(TuneShape(32, 8, 128, batch=1, context=32768, page_size=64)):
        by_key.setdefault(jit.decode_key(cfg, torch.bfloat16, 128, 64, 4, True), cfg)
    return list(by_key.values())


def test_search_space_configs_compile_a_cover():
    """Configs of the tuner's decode space with the smallest and largest value of every field
    compile (every code-generation-distinct one: test_search_space_configs_compile, --full)."""
    configs = _decode_space_configs()
    assert len(configs) >= 10
    picked = _cover(configs)
    assert len(picked) < len(configs) / 4
    for cfg in picked:
        assert callable(jit.compile_decode(cfg, torch.bfloat16, 128, 64, 4, 1, True))


@full
def test_search_space_configs_compile():
    """Every code-generation-distinct legal config of the tuner's decode space compiles."""
    configs = _decode_space_configs()
    assert len(configs) >= 10
    for cfg in configs:
        assert callable(jit.compile_decode(cfg, torch.bfloat16, 128, 64, 4, 1, True))


def test_memory_cache_hits_without_recompiling(monkeypatch):
    cfg = DecodeConfig(tile_n=64, stages=3)
    fn = jit.compile_decode(cfg, torch.bfloat16, 128, 32, 8, 1, True)
    monkeypatch.setattr(jit, "_compile_decode", lambda *a, **k: pytest.fail("recompiled"))
    assert jit.compile_decode(cfg, torch.bfloat16, 128, 32, 8, 1, True) is fn
    # num_splits / ctas_per_sm change only the launch, so they share the compiled kernel
    assert jit.compile_decode(DecodeConfig(tile_n=64, stages=3, num_splits=5), torch.bfloat16, 128, 32, 8) is fn


def test_cache_key_covers_codegen_fields():
    base = DecodeConfig()
    k0 = jit.decode_key(base, torch.bfloat16, 128, 64, 4, True)
    variants = [
        jit.decode_key(DecodeConfig(tile_n=32), torch.bfloat16, 128, 64, 4, True),
        jit.decode_key(DecodeConfig(stages=3), torch.bfloat16, 128, 64, 4, True),
        jit.decode_key(DecodeConfig(consumer_wgs=2), torch.bfloat16, 128, 64, 4, True),
        jit.decode_key(DecodeConfig(carveout=100), torch.bfloat16, 128, 64, 4, True),
        jit.decode_key(base, torch.float16, 128, 64, 4, True),
        jit.decode_key(base, torch.bfloat16, 64, 64, 4, True),
        jit.decode_key(base, torch.bfloat16, 128, 16, 4, True),
        jit.decode_key(base, torch.bfloat16, 128, 64, 8, True),
        jit.decode_key(base, torch.bfloat16, 128, 64, 4, False),
        jit.decode_key(base, torch.bfloat16, 128, 64, 4, True, multi_token=True),
    ]
    assert len({k0, *variants}) == len(variants) + 1
    # the multi-token kernel's chunk and occupancy change its code; the streaming kernel ignores them
    walk = DecodeConfig(tile_n=64, stages=3, consumer_wgs=1, carveout=100, ctas_per_sm=1)
    multi_token = {jit.decode_key(c, torch.bfloat16, 128, 64, 4, True, multi_token=True)
                   for c in (walk, DecodeConfig(**{**walk.to_dict(), "chunk_tiles": 1}),
                             DecodeConfig(**{**walk.to_dict(), "ctas_per_sm": 2}))}
    assert len(multi_token) == 3
    assert jit.decode_key(DecodeConfig(chunk_tiles=2), torch.bfloat16, 128, 64, 4, True) == k0
    # the producer's in-flight limit changes both kernels' code
    assert jit.decode_key(DecodeConfig(max_inflight=1), torch.bfloat16, 128, 64, 4, True) != k0
    assert jit.decode_key(dataclasses.replace(walk, max_inflight=1), torch.bfloat16, 128, 64, 4, True,
                          multi_token=True) not in multi_token
    # edge chunks, staggered chunks and Q in registers change the multi-token kernel only
    for field in ({"edge_tiles": 1, "chunk_tiles": 2}, {"stagger": 2, "chunk_tiles": 2}, {"q_regs": 1},
                  {"q_cluster": 2}):
        on = dataclasses.replace(walk, **field)
        off = dataclasses.replace(on, **{k: 0 for k in field if k != "chunk_tiles"})
        assert jit.decode_key(on, torch.bfloat16, 128, 64, 4, True, multi_token=True) != jit.decode_key(
            off, torch.bfloat16, 128, 64, 4, True, multi_token=True)
    assert jit.decode_key(DecodeConfig(chunk_tiles=2, edge_tiles=1), torch.bfloat16, 128, 64, 4, True) == k0
    assert jit.decode_key(DecodeConfig(chunk_tiles=2, stagger=2), torch.bfloat16, 128, 64, 4, True) == k0
    assert len({jit.decode_key(dataclasses.replace(walk, stages=7, chunk_tiles=4, stagger=g), torch.bfloat16, 128,
                               64, 4, True, multi_token=True) for g in (0, 2, 3, 4)}) == 4
    # link admission control changes both kernels' code, and each credit count is its own kernel
    credited = dataclasses.replace(walk, max_inflight=1, link_credits=8)
    assert jit.decode_key(credited, torch.bfloat16, 128, 64, 4, True, multi_token=True) != jit.decode_key(
        dataclasses.replace(credited, link_credits=0), torch.bfloat16, 128, 64, 4, True, multi_token=True)
    assert jit.decode_key(credited, torch.bfloat16, 128, 64, 4, True, multi_token=True) != jit.decode_key(
        dataclasses.replace(credited, link_credits=16), torch.bfloat16, 128, 64, 4, True, multi_token=True)


def _full(cfg: DecodeConfig):
    return pytest.param(cfg, marks=full)


# The representative part: two CTAs per SM, wide tiles with link admission and edge chunks, the
# clusters the PTX tests read too (compiled once for both), staggered chunks in a cluster.
@pytest.mark.parametrize(
    "cfg",
    [
        _full(DecodeConfig(tile_n=64, stages=6, consumer_wgs=2, carveout=100, ctas_per_sm=1, chunk_tiles=5)),
        _full(DecodeConfig(tile_n=128, stages=3, consumer_wgs=2, carveout=100, ctas_per_sm=1, chunk_tiles=2)),
        DecodeConfig(tile_n=64, stages=3, consumer_wgs=1, carveout=100, ctas_per_sm=2),  # two CTAs per SM
        _full(DecodeConfig(tile_n=32, stages=8, consumer_wgs=3, carveout=100, ctas_per_sm=1, chunk_tiles=3)),
        _full(DecodeConfig(tile_n=32, stages=12, consumer_wgs=2, carveout=100, ctas_per_sm=1, chunk_tiles=6,
                           max_inflight=1)),
        DecodeConfig(tile_n=128, stages=3, consumer_wgs=2, carveout=100, ctas_per_sm=1, chunk_tiles=2, max_inflight=1,
                     link_credits=8, edge_tiles=1),
        # Q in registers: the freed 32 KB holds a seventh 64-token stage; wide tiles too
        _full(DecodeConfig(tile_n=64, stages=7, consumer_wgs=2, carveout=100, ctas_per_sm=1, chunk_tiles=5,
                           max_inflight=1, link_credits=16, q_regs=1)),
        _full(DecodeConfig(tile_n=128, stages=3, consumer_wgs=2, carveout=100, ctas_per_sm=1, chunk_tiles=2, q_regs=1)),
        # clusters of CTAs sharing each tile by TMA multicast
        DecodeConfig(tile_n=64, stages=7, consumer_wgs=2, carveout=100, ctas_per_sm=1, chunk_tiles=4, max_inflight=1,
                     q_regs=1, q_cluster=2),
        _full(DecodeConfig(tile_n=128, stages=3, consumer_wgs=2, carveout=100, ctas_per_sm=1, chunk_tiles=2,
                           q_cluster=4)),
        DecodeConfig(tile_n=64, stages=7, consumer_wgs=2, carveout=100, ctas_per_sm=1, chunk_tiles=4, max_inflight=1,
                     q_regs=1, q_cluster=4),  # four CTAs: the page pieces are halved into four boxes
        # clusters under link admission (rank 0 admits each tile and signals its peers)
        DecodeConfig(tile_n=64, stages=7, consumer_wgs=2, carveout=100, ctas_per_sm=1, chunk_tiles=4, max_inflight=1,
                     q_regs=1, q_cluster=2, link_credits=16),
        _full(DecodeConfig(tile_n=128, stages=3, consumer_wgs=2, carveout=100, ctas_per_sm=1, chunk_tiles=2,
                           max_inflight=1, q_cluster=4, link_credits=8)),
        # staggered chunk boundaries: in a cluster, with Q in SMEM, with link admission
        DecodeConfig(tile_n=64, stages=7, consumer_wgs=2, carveout=100, ctas_per_sm=1, chunk_tiles=4, max_inflight=1,
                     q_regs=1, q_cluster=2, stagger=4),
        _full(DecodeConfig(tile_n=64, stages=6, consumer_wgs=2, carveout=100, ctas_per_sm=1, chunk_tiles=3, stagger=2)),
        _full(DecodeConfig(tile_n=64, stages=7, consumer_wgs=2, carveout=100, ctas_per_sm=1, chunk_tiles=4,
                           max_inflight=1, link_credits=16, q_regs=1, stagger=3)),
    ],
)
def test_multi_token_variants_compile(cfg):
    """The multi-token kernel: walking chunks, wide tiles, two CTAs per SM, three warpgroups, a
    throttled producer, device-wide link admission with edge chunks, staggered chunks."""
    assert callable(jit.compile_multi_token(cfg, torch.bfloat16, 128, 64, 4))


@pytest.mark.parametrize(
    "cfg,kwargs,exc",
    [
        (DecodeConfig(tile_n=128, stages=6), dict(head_dim=128, page_size=64), ConfigError),  # SMEM
        (DecodeConfig(tile_n=48), dict(head_dim=128, page_size=64), ConfigError),
        (DecodeConfig(), dict(head_dim=96, page_size=64), ConfigError),
        (DecodeConfig(), dict(head_dim=128, page_size=64, max_q_len=17, group=4), ValueError),
        (DecodeConfig(), dict(head_dim=128, page_size=64, group=65), ValueError),
        (DecodeConfig(q_regs=1), dict(head_dim=128, page_size=64), ValueError),  # decode keeps Q in SMEM
        (DecodeConfig(q_cluster=2, ctas_per_sm=1), dict(head_dim=128, page_size=64), ValueError),  # no clusters
    ],
)
def test_illegal_requests_fail_before_compiling(cfg, kwargs, exc, monkeypatch):
    monkeypatch.setattr(jit, "_compile_decode", lambda *a, **k: pytest.fail("compiled an illegal request"))
    kwargs = {"group": 4, "max_q_len": 1, **kwargs}
    with pytest.raises(exc):
        jit.compile_decode(cfg, torch.bfloat16, kwargs["head_dim"], kwargs["page_size"], kwargs["group"],
                           kwargs["max_q_len"])


def test_dtype_is_checked():
    with pytest.raises(TypeError):
        jit.compile_decode(DecodeConfig(), torch.float32, 128, 64, 4)


@pytest.mark.parametrize("tile_n,page_size", [
    # the representative part: a tile within one page, one page, several pages
    pytest.param(t, p, marks=() if (t, p) in {(32, 128), (64, 64), (128, 16)} else full)
    for t, p in itertools.product([32, 64, 128], SUPPORTED_PAGE_SIZES)])
def test_tile_page_combinations_compile(tile_n, page_size):
    cfg = DecodeConfig(tile_n=tile_n, stages=2, carveout=100)
    jit.compile_decode(cfg, torch.bfloat16, 128, page_size, 8, 1, True)


def test_multi_token_group_limit_fails_before_compiling(monkeypatch):
    """Each consumer warpgroup of the multi-token kernel holds whole GQA groups in its 64 rows."""
    monkeypatch.setattr(jit, "_compile_decode", lambda *a, **k: pytest.fail("compiled an illegal request"))
    cfg = DecodeConfig(tile_n=64, stages=3, consumer_wgs=2, carveout=100, ctas_per_sm=1)
    with pytest.raises(ValueError, match="up to 64"):
        jit.compile_multi_token(cfg, torch.bfloat16, 128, 64, 96)


def _multi_token_ptx(**fields) -> str:
    """PTX of the multi-token kernel: the bf16, d 128, GQA 4 default with ``fields`` replaced."""
    cfg = dataclasses.replace(default_multi_token_config(128), **fields)
    return _ptx_of(jit.compile_multi_token(cfg, torch.bfloat16, 128, 64, 4),
                   lambda: jit._compile_decode(cfg, torch.bfloat16, 128, 64, 4, True, True))


def _combine_ptx() -> str:
    return _ptx_of(jit.compile_combine(128, torch.bfloat16), lambda: jit._compile_combine(128, torch.bfloat16))


def test_multi_token_kernel_ptx():
    """The multi-token kernel's generated code with Q in SMEM: TMA loads, WGMMA, the split
    partials written and reloaded with 8-byte vector accesses (scalar ones double the L2
    transactions per pass), the next block's Q rows and partial prefetched into L2, and a pass's
    loads issued together."""
    ptx = _multi_token_ptx(q_regs=0, stages=6)
    for needle in ("wgmma.mma_async", "cp.async.bulk.tensor", "st.global.v2.b32", "ld.global.v2.b32",
                   "prefetch.global.L2"):
        assert needle in ptx, needle
    assert ptx.count("st.global.b32") <= 4  # only the LSE stores stay scalar
    # A pass issues its Q gather (16-byte loads) and its partial reload (8-byte loads) before the Q
    # rows go to SMEM, so both are in flight together: one L2 round trip per pass, not two.
    lines = ptx.splitlines()
    at = lambda needle: [i for i, line in enumerate(lines) if needle in line]  # noqa: E731
    assert at("ld.global.v4.b32") and at("st.shared.v4.b32")
    assert max(at("ld.global.v4.b32") + at("ld.global.v2.b32")) < min(at("st.shared.v4.b32"))


def test_combine_kernel_ptx():
    """The combine kernel reads each split's partial row with 16-byte vector loads (a warp per row),
    a group of 8 splits at a time with every load of the group issued before the first weight is
    computed: one memory round trip per group."""
    from directkv_cute.kernels.combine import SPLIT_GROUP

    ptx = _combine_ptx()
    lines = ptx.splitlines()
    at = lambda needle: [i for i, line in enumerate(lines) if needle in line]  # noqa: E731
    loads, exps = at("ld.global.v4.b32"), at("ex2.approx")
    assert len(loads) == SPLIT_GROUP == 8
    assert len(at("ld.global.b32")) == SPLIT_GROUP  # the group's LSEs
    assert max(loads + at("ld.global.b32")) < min(exps)


@pytest.mark.parametrize("kv_dtype,dtype,head_dim,page_size", [
    (torch.float8_e4m3fn, torch.bfloat16, 128, 64), (torch.float8_e5m2, torch.float16, 64, 16),
])
def test_dequant_kernel_ptx(kv_dtype, dtype, head_dim, page_size):
    """The FP8 dequantizing kernel: one 16-byte load of FP8 values and one scale per thread, the
    values converted in pairs, two 16-byte stores of the 16-bit result; nothing scalar beyond the
    scale."""
    ptx = _ptx_of(jit.compile_dequant(kv_dtype, dtype, head_dim, page_size),
                  lambda: jit._compile_dequant(kv_dtype, dtype, head_dim, page_size))
    fmt = "e4m3x2" if kv_dtype == torch.float8_e4m3fn else "e5m2x2"
    assert ptx.count("ld.global.v4.b32") == 1 and ptx.count("ld.global.b32") == 1
    assert ptx.count("st.global.v4.b32") == 2 and "st.global.b" not in ptx.replace("st.global.v4.b32", "")
    assert ptx.count(f"cvt.rn.f16x2.{fmt}") == 8
    assert ptx.count("cvt.rn.bf16x2.f32" if dtype == torch.bfloat16 else "cvt.rn.f16x2.f32") == 8


def test_dequant_refuses_other_dtypes_before_compiling():
    with pytest.raises(TypeError, match="kv_dtype"):
        jit.compile_dequant(torch.bfloat16, torch.bfloat16, 128, 64)
    with pytest.raises(TypeError, match="dtype must be"):
        jit.compile_dequant(torch.float8_e4m3fn, torch.float32, 128, 64)


def test_throttled_producer_ptx():
    """With max_inflight the producer waits on a tile's full barrier before issuing a later one:
    one more mbarrier wait loop in the producer than without."""
    plain = _multi_token_ptx(max_inflight=0, link_credits=0)
    limited = _multi_token_ptx(max_inflight=1, link_credits=0)
    waits = lambda ptx: ptx.count("mbarrier.try_wait")  # noqa: E731
    assert waits(limited) > waits(plain)


def test_link_admission_ptx():
    """With link_credits the producer takes a ticket with an atomic add on the device-wide
    counter, polls the landed counter with sleeps, and reports each landed tile with a reduction;
    without it none of these are emitted. The producer warp walks its tiles with all lanes: one
    lane takes the ticket and reads the counter, a shuffle hands both to the others, and one
    atomic add per ticket remains."""
    plain = _multi_token_ptx(max_inflight=1, link_credits=0)
    credited = _multi_token_ptx(max_inflight=1, link_credits=8)
    for needle in ("atom.global.add", "ld.relaxed.gpu.global", "nanosleep", "red.relaxed.gpu.global.add"):
        assert needle not in plain, needle
        assert needle in credited, needle
    assert credited.count("atom.global.add") == 1
    assert credited.count("shfl.sync.idx") > plain.count("shfl.sync.idx")


def test_q_in_registers_ptx():
    """With q_regs the multi-token kernel has no Q tile in SMEM: no 16-byte SMEM stores, no
    per-warpgroup named barriers, and its Q K^T WGMMA takes A as four registers (the RS form)
    where the SMEM variant passes two descriptors."""
    smem = _multi_token_ptx(q_regs=0, stages=6)
    regs = _multi_token_ptx(q_regs=1, stages=7)
    qk = lambda ptx: [ln for ln in ptx.splitlines() if "wgmma.mma_async.sync.aligned.m64n64k16" in ln]  # noqa: E731
    assert qk(smem) and qk(regs)
    assert all("}, {%r" not in ln for ln in qk(smem))
    assert all("}, {%r" in ln for ln in qk(regs))
    assert "st.shared.v4.b32" in smem and "st.shared.v4.b32" not in regs
    assert smem.count("bar.sync") > regs.count("bar.sync")


def test_cluster_multicast_ptx():
    """With q_cluster the producer's TMA copies are multicast to the cluster (each box issued by
    one CTA), the consumers release a stage to every CTA of it, and the CTAs meet at a cluster
    barrier before they exit; without it none of that is emitted. Four CTAs over a tile of one
    64-token page piece (two boxes, K and V) halve the pieces: four boxes. The producer is the
    whole warp (the pipeline and each copy elect their own lane: no elect.sync nested in an
    elected lane, where the first cluster kernel hung)."""
    plain = _multi_token_ptx(q_cluster=0, link_credits=0)
    cluster = _multi_token_ptx(q_cluster=2, link_credits=0)
    four = _multi_token_ptx(q_cluster=4, link_credits=0)
    tma = lambda ptx: [ln for ln in ptx.splitlines() if "cp.async.bulk.tensor" in ln]  # noqa: E731
    assert tma(plain) and not any("multicast::cluster" in ln for ln in tma(plain))
    assert tma(cluster) and all("multicast::cluster" in ln for ln in tma(cluster))
    assert len(tma(cluster)) == len(tma(plain))  # whole boxes, shared out: not 1/C slices of each
    # the same bytes in twice the boxes of half the rows
    assert all("multicast::cluster" in ln for ln in tma(four)) and len(tma(four)) == len(tma(plain))
    import cutlass
    from directkv_cute.kernels.multi_token import MultiTokenAttention

    boxes = lambda c: MultiTokenAttention(cutlass.BFloat16, 128, 64, 4, c, True)  # noqa: E731
    base = DecodeConfig(tile_n=64, stages=7, consumer_wgs=2, carveout=100, ctas_per_sm=1, chunk_tiles=4, q_regs=1)
    assert [(boxes(dataclasses.replace(base, q_cluster=c)).copy_rows, boxes(dataclasses.replace(base, q_cluster=c)).copies)
            for c in (0, 2, 4)] == [(64, 1), (64, 1), (32, 2)]
    # Producer: the whole warp walks the tiles, the arrive and each copy elect their own lane, so
    # both kernels reach the first TMA copy through the same elect.syncs (none nested in another).
    head = lambda ptx: ptx[: ptx.index("cp.async.bulk.tensor")]  # noqa: E731
    assert head(plain).count("elect.sync") == head(cluster).count("elect.sync")
    assert "barrier.cluster" not in plain and "barrier.cluster.wait" in cluster
    assert "mapa" not in plain and "mapa" in cluster  # remote arrives on the peers' empty barriers


def test_cluster_link_admission_ptx():
    """Clusters under link admission: one ticket (atomic add) per tile, taken by rank 0, which then
    arrives on its peers' admit barrier in their SMEM (one remote arrive per peer, from one lane);
    the peers wait on their own admit barrier. Without link credits a cluster kernel has none of
    that."""
    plain = _multi_token_ptx(q_cluster=2, link_credits=0)
    two = _multi_token_ptx(q_cluster=2, link_credits=16)
    four = _multi_token_ptx(q_cluster=4, link_credits=16)
    remote = lambda ptx: ptx.count("mbarrier.arrive.shared::cluster")  # noqa: E731
    tickets = lambda ptx: ptx.count("atom.global.add")  # noqa: E731
    assert tickets(plain) == 0 and tickets(two) == 1 and tickets(four) == 1
    # the consumers' stage release to the peers is there in all three; the admit signal adds one
    # arrive per peer
    assert remote(two) == remote(plain) + 1 and remote(four) == remote(plain) + 3
    waits = lambda ptx: ptx.count("mbarrier.try_wait.parity")  # noqa: E731
    assert waits(two) > waits(plain)  # the peers' admit wait (and the last ticketed tile's landing)


# The disk cache tests come last: they empty the memory cache, which the tests above share.
def test_disk_cache_survives_a_new_process_cache(monkeypatch, tmp_path):
    cfg = DecodeConfig(tile_n=32, stages=5)
    jit.compile_decode(cfg, torch.float16, 64, 16, 2, 1, False)
    objs = list((tmp_path / "kc").rglob("*.o"))
    assert objs, "nothing written to the disk cache"
    jit.clear_memory_cache()
    monkeypatch.setattr(jit, "_compile_decode", lambda *a, **k: pytest.fail("recompiled despite the disk cache"))
    assert callable(jit.compile_decode(cfg, torch.float16, 64, 16, 2, 1, False))


def test_disk_cache_can_be_disabled(monkeypatch, tmp_path):
    monkeypatch.setenv("DIRECTKV_DISK_CACHE", "0")
    jit.clear_memory_cache()
    jit.compile_decode(DecodeConfig(tile_n=64, stages=2), torch.bfloat16, 64, 64, 1, 1, True)
    assert not list((tmp_path / "kc").rglob("*.o"))

"""YAML profiles: schema round trip, rejection of bad files, atomic merge, per-kernel source
hashes and stale entries, the schema-1 migration (CPU only)."""

import os
import warnings
from pathlib import Path

import pytest
import yaml

from directkv_cute.config import DecodeConfig
from directkv_cute.kernels import sources
from directkv_cute.tuning import profiles as P
from pkg_copy import HOST_ONLY, edit, package_copy, package_imports as _package_imports

GPU = "NVIDIA H200"
KH = "a" * 64
KH2 = "b" * 64
CLASS = ("decode", "bf16", 128, 8, 64)


def env(gpu=GPU):
    return {"gpu_name": gpu, "compute_capability": "9.0", "sm_count": 132, "smem_optin_bytes": 232448,
            "host_link_gbps": 54.3, "hbm_gbps": 4400.0}


def rec(tile_n=64, stages=4, p50=100.0, default=120.0, trials=10):
    return {"config": DecodeConfig(tile_n=tile_n, stages=stages).to_dict(), "p50_us": p50, "default_p50_us": default,
            "trials": trials}


def make(buckets, *, gpu=GPU, kh=KH, objective="gpu"):
    prof = P.Profile(metadata=P.make_metadata(env(gpu), objective=objective))
    for bk, r in buckets.items():
        prof.set(CLASS, bk, {"kernel_hash": kh, **r})
    return prof


def good_doc():
    return make({(1, 4096, 1): rec()}).to_doc()


def write_doc(path, doc):
    path.write_text(P.dump_yaml(doc))  # no anchors for shared dicts: the loader refuses them
    return path


def test_names():
    assert P.sanitize_gpu_name("NVIDIA H200") == "NVIDIA_H200"
    assert P.profile_filename("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3.yaml"
    assert P.sanitize_gpu_name("  NVIDIA  GH200/480GB ") == "NVIDIA_GH200_480GB"


def test_round_trip_keeps_ints_and_fields(tmp_path):
    prof = make({(1, 4096, 1): rec(), (16, 131072, 1): rec(tile_n=128, stages=2, p50=5000.5, default=None)})
    path = tmp_path / P.profile_filename(GPU)
    written = P.save_profile(prof, path)
    text = path.read_text()
    assert "tile_n: 64" in text and "batch: 16" in text and "context: 131072" in text
    assert "64.0" not in text
    back = P.load_profile(path)
    assert back.entries == written.entries
    assert back.metadata["gpu_name"] == GPU and {r["kernel_hash"] for _, _, r in back.records()} == {KH}
    assert "kernel_hash" not in back.metadata
    r = back.get(CLASS, (16, 131072, 1))
    assert r["config"] == DecodeConfig(tile_n=128, stages=2).to_dict()
    assert all(type(v) is int for v in r["config"].values())
    assert r["default_p50_us"] is None and r["trials"] == 10
    for ck, bk, _ in back.records():
        assert all(type(x) is int for x in ck[2:] + bk)
    md = back.metadata
    assert back.schema_version == P.SCHEMA_VERSION == 3 and back.migrated_from is None
    for k in ("tune_version", "sm_count", "smem_optin_bytes"):
        assert type(md[k]) is int
    assert md["compute_capability"] == "9.0" and md["objective"] == "gpu"
    assert set(md["versions"]) >= {"cutlass_dsl", "torch", "cuda", "optuna"}
    assert md["created"] and md["updated"]
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


@pytest.mark.parametrize(
    "text, match",
    [
        ("schema_version: 1\nmetadata: {gpu_name: [unclosed\n", "corrupt YAML"),
        ("", "empty file"),
        ("- just\n- a list\n", "not a profile"),
        ("schema_version: 4\nmetadata: {}\nentries: []\n", "unknown schema_version 4"),
        ("schema_version: '1'\nmetadata: {}\n", "schema_version missing or not an integer"),
    ],
)
def test_rejects_unreadable_files(tmp_path, text, match):
    path = tmp_path / "NVIDIA_H200.yaml"
    path.write_text(text)
    with pytest.raises(P.ProfileError, match=match):
        P.load_profile(path)


def test_rejects_binary_garbage(tmp_path):
    path = tmp_path / "NVIDIA_H200.yaml"
    path.write_bytes(b"\xff\xfe\x00garbage\x80")
    with pytest.raises(P.ProfileError):
        P.load_profile(path)


def _mutate(doc, fn):
    fn(doc)
    return doc


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: d["entries"][0]["buckets"][0]["config"].__setitem__("tile_n", "64"), r"config\.tile_n: must be an integer"),
        (lambda d: d["entries"][0]["buckets"][0]["config"].__setitem__("stages", 4.0), r"config\.stages: must be an integer"),
        (lambda d: d["entries"][0]["buckets"][0]["config"].__setitem__("warps", 4), "unknown DecodeConfig fields"),
        (lambda d: d["entries"][0]["buckets"][0].__setitem__("p50_us", "fast"), r"p50_us: must be a finite number"),
        (lambda d: d["entries"][0]["buckets"][0].__setitem__("p50_us", -1.0), r"p50_us: must be > 0"),
        (lambda d: d["entries"][0]["buckets"][0].__setitem__("batch", 1.5), r"batch: must be an integer"),
        (lambda d: d["entries"][0]["buckets"][0].__setitem__("trials", True), r"trials: must be an integer"),
        (lambda d: d["entries"][0]["buckets"][0].pop("config"), r"config: missing or not a mapping"),
        (lambda d: d["entries"][0].__setitem__("head_dim", "128"), r"head_dim: must be an integer"),
        (lambda d: d["entries"][0].__setitem__("dtype", "fp8"), r"unsupported dtype"),
        (lambda d: d["entries"][0].__setitem__("buckets", {"a": 1}), r"buckets: missing or not a list"),
        (lambda d: d["metadata"].__setitem__("sm_count", "132"), r"metadata\.sm_count: must be an integer"),
        (lambda d: d["metadata"].pop("gpu_name"), r"metadata: missing 'gpu_name'"),
        (lambda d: d["entries"][0]["buckets"][0].__setitem__("kernel_hash", "abc"),
         r"buckets\[0\]\.kernel_hash: must be a sha256 hex digest"),
        (lambda d: d["entries"][0]["buckets"][0].pop("kernel_hash"), r"buckets\[0\]: missing 'kernel_hash'"),
        (lambda d: d.__setitem__("entires", []), r"unknown keys \['entires'\]"),
        (lambda d: d["entries"].append(dict(d["entries"][0])), r"duplicate entry"),
        (lambda d: d["entries"][0]["buckets"].append(dict(d["entries"][0]["buckets"][0])), r"duplicate bucket"),
    ],
)
def test_rejects_wrong_types_and_shapes(tmp_path, mutate, match):
    path = write_doc(tmp_path / "NVIDIA_H200.yaml", _mutate(good_doc(), mutate))
    with pytest.raises(P.ProfileError, match=match) as ei:
        P.load_profile(path)
    assert str(path) in str(ei.value)


def test_accepts_hand_edited_scalars(tmp_path):
    doc = good_doc()
    doc["metadata"]["versions"]["cuda"] = 13.0  # unquoted in a hand-edited file
    doc["metadata"]["compute_capability"] = 9.0
    path = write_doc(tmp_path / "NVIDIA_H200.yaml", doc)
    raw = path.read_text().replace(f"created: '{doc['metadata']['created']}'", "created: 2026-11-30T10:00:00Z")
    assert "created: 2026-11-30T10:00:00Z" in raw and "cuda: 13.0" in raw
    path.write_text(raw)
    prof = P.load_profile(path)
    assert prof.metadata["versions"]["cuda"] == "13.0" and prof.metadata["compute_capability"] == "9.0"
    assert isinstance(prof.metadata["created"], str) and prof.metadata["created"].startswith("2026-11-30")


def test_foreign_gpu(tmp_path):
    path = tmp_path / "NVIDIA_H200.yaml"
    P.save_profile(make({(1, 4096, 1): rec()}), path)
    with pytest.raises(P.ProfileError, match="gpu_name"):
        P.load_profile(path, gpu_name="NVIDIA H100 80GB HBM3", strict=True)
    with pytest.warns(P.ProfileWarning, match="gpu_name"):
        P.load_profile(path, gpu_name="NVIDIA H100 80GB HBM3")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert P.load_profile(path, gpu_name=GPU, strict=True).compat_problems(gpu_name=GPU) == []


def test_stale_entries_are_listed_per_kernel(tmp_path):
    """A bucket whose kernel_hash is not its kernel's current hash is stale; staleness is per
    bucket and per kernel, and loading such a file neither warns nor fails."""
    path = tmp_path / "NVIDIA_H200.yaml"
    prof = make({(1, 4096, 1): rec(), (4, 4096, 1): rec()}, kh=P.current_kernel_hash("decode"))
    prof.set(CLASS, (16, 4096, 1), {"kernel_hash": KH2, **rec()})
    prof.set(("multi_token", "bf16", 128, 8, 64), (1, 4096, 512),
             {"kernel_hash": P.current_kernel_hash("multi_token"), **rec()})
    prof.set(("future-kernel", "bf16", 128, 8, 64), (1, 4096, 1), {"kernel_hash": KH2, **rec()})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        P.save_profile(prof, path)
        back = P.load_profile(path, gpu_name=GPU, strict=True)
    stale = back.stale()
    assert [(ck, bk) for ck, bk, _ in stale] == [(CLASS, (16, 4096, 1))]
    assert KH2[:12] in stale[0][2] and P.current_kernel_hash("decode")[:12] in stale[0][2]


def test_atomic_merge_new_run_wins_per_bucket(tmp_path):
    path = tmp_path / "NVIDIA_H200.yaml"
    first = P.save_profile(make({(1, 4096, 1): rec(p50=100.0), (4, 4096, 1): rec(p50=200.0)}), path)
    created = first.metadata["created"]
    P.save_profile(make({(4, 4096, 1): rec(stages=3, p50=150.0), (16, 4096, 1): rec(p50=300.0)}), path)
    merged = P.load_profile(path)
    assert merged.get(CLASS, (1, 4096, 1))["p50_us"] == 100.0  # kept from disk
    assert merged.get(CLASS, (4, 4096, 1))["p50_us"] == 150.0  # new run wins
    assert merged.get(CLASS, (4, 4096, 1))["config"]["stages"] == 3
    assert merged.get(CLASS, (16, 4096, 1))["p50_us"] == 300.0
    assert len(merged) == 3
    assert merged.metadata["created"] == created
    assert sorted(os.listdir(tmp_path)) == [".NVIDIA_H200.yaml.lock", "NVIDIA_H200.yaml"]


def test_merge_keeps_each_buckets_kernel_hash(tmp_path):
    path = tmp_path / "NVIDIA_H200.yaml"
    P.save_profile(make({(1, 4096, 1): rec(), (4, 4096, 1): rec()}, kh=KH), path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        P.save_profile(make({(4, 4096, 1): rec(stages=3)}, kh=KH2), path)
    prof = P.load_profile(path)
    assert prof.get(CLASS, (1, 4096, 1))["kernel_hash"] == KH
    newer = prof.get(CLASS, (4, 4096, 1))
    assert newer["kernel_hash"] == KH2 and newer["config"]["stages"] == 3


def test_merge_drops_buckets_of_another_tune_version(tmp_path):
    path = tmp_path / "NVIDIA_H200.yaml"
    old = make({(1, 4096, 1): rec()})
    old.metadata["tune_version"] = P.TUNE_VERSION + 1
    P.save_profile(old, path)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        P.save_profile(make({(4, 4096, 1): rec()}), path)
    assert any("dropping 1 bucket" in str(x.message) and "tune_version" in str(x.message) for x in w)
    assert list(P.load_profile(path).entries[CLASS]) == [(4, 4096, 1)]


def test_merge_refuses_foreign_or_corrupt_file(tmp_path):
    path = tmp_path / "NVIDIA_H200.yaml"
    P.save_profile(make({(1, 4096, 1): rec()}, gpu="NVIDIA H100"), path)
    before = path.read_text()
    with pytest.raises(P.ProfileError, match="refusing to overwrite"):
        P.save_profile(make({(1, 4096, 1): rec()}), path)
    assert path.read_text() == before
    path.write_text("schema_version: 1\nmetadata: [oops")
    with pytest.raises(P.ProfileError, match="corrupt"):
        P.save_profile(make({(1, 4096, 1): rec()}), path)
    assert path.read_text() == "schema_version: 1\nmetadata: [oops"


def test_failed_write_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "NVIDIA_H200.yaml"
    P.save_profile(make({(1, 4096, 1): rec()}), path)
    before = path.read_text()

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(P.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        P.save_profile(make({(4, 4096, 1): rec()}), path)
    assert path.read_text() == before
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_unknown_kernel_entries_are_kept(tmp_path):
    doc = good_doc()
    doc["entries"].append({"kernel": "future-kernel", "dtype": "bf16", "head_dim": 128, "group": 8, "page_size": 64,
                           "buckets": [{"batch": 1, "context": 4096, "q_len": 128, "config": {"tile_m": 128},
                                        "p50_us": 10.0, "default_p50_us": None, "trials": 3, "kernel_hash": KH}]})
    path = write_doc(tmp_path / "NVIDIA_H200.yaml", doc)
    prof = P.load_profile(path)
    assert prof.get(("future-kernel", "bf16", 128, 8, 64), (1, 4096, 128))["config"] == {"tile_m": 128}


def test_q_tiled_entries_holding_staging_keys(tmp_path):
    """Tuned q_tiled entries once held the staging keys, all 0 (the planner's choice): they load
    as the code-generating config, silently; a key that asks for staging is refused, named."""
    from directkv_cute.config import QTiledConfig

    old = {"tile_n": 64, "stages": 4, "carveout": 100, "piece_pages": 0, "splits": 0, "order": 0, "pingpong": 1,
           "cluster": 2}

    def doc_with(config):
        doc = good_doc()
        doc["entries"].append({"kernel": "q_tiled", "dtype": "bf16", "head_dim": 128, "group": 4, "page_size": 64,
                               "buckets": [{"batch": 1, "context": 8192, "q_len": 512, "config": config,
                                            "p50_us": 10.0, "default_p50_us": 12.0, "trials": 3, "kernel_hash": KH}]})
        return write_doc(tmp_path / "NVIDIA_H200.yaml", doc)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prof = P.load_profile(doc_with(old))
    rec = prof.get(("q_tiled", "bf16", 128, 4, 64), (1, 8192, 512))
    assert QTiledConfig.from_dict(rec["config"]) == QTiledConfig(tile_n=64, stages=4)
    with pytest.raises(P.ProfileError, match=r"buckets\[0\]\.config: .*no staging fields.*'order': 2"):
        P.load_profile(doc_with({**old, "order": 2}))


# ---- schema 1 ----------------------------------------------------------------------------------


def v1_doc(kh=KH):
    doc = good_doc()
    doc["schema_version"] = 1
    doc["metadata"]["kernel_hash"] = kh
    for b in doc["entries"][0]["buckets"]:
        b.pop("kernel_hash")
    return doc


def test_schema_1_file_is_migrated_with_every_entry_stale(tmp_path):
    path = write_doc(tmp_path / "NVIDIA_H200.yaml", v1_doc())
    prof = P.load_profile(path)
    assert prof.schema_version == 3 and prof.migrated_from == 1 and "kernel_hash" not in prof.metadata
    assert prof.get(CLASS, (1, 4096, 1))["kernel_hash"] == KH
    assert [(ck, bk) for ck, bk, _ in prof.stale()] == [(CLASS, (1, 4096, 1))]
    P.save_profile(make({(4, 4096, 1): rec()}, kh=P.current_kernel_hash("decode")), path)
    doc = yaml.safe_load(path.read_text())
    assert doc["schema_version"] == 3 and "kernel_hash" not in doc["metadata"]
    assert {b["kernel_hash"] for b in doc["entries"][0]["buckets"]} == {KH, P.current_kernel_hash("decode")}


def test_schema_2_file_reads_its_prefill_entries_as_multi_token(tmp_path):
    """Schema 2 named the multi-token kernel "prefill": such a file still loads, its entries read
    as multi_token (stale: their hashes were taken under the old name); the next save writes
    schema 3 with the new name."""
    prof = make({(1, 4096, 1): rec()}, kh=P.current_kernel_hash("decode"))
    mt = DecodeConfig(tile_n=64, stages=3, consumer_wgs=2, carveout=90, ctas_per_sm=1, chunk_tiles=2)
    prof.set(("multi_token", "bf16", 128, 8, 64), (1, 4096, 512), {**rec(), "config": mt.to_dict(), "kernel_hash": KH})
    doc = prof.to_doc()
    doc["schema_version"] = 2
    for e in doc["entries"]:
        if e["kernel"] == "multi_token":
            e["kernel"] = "prefill"
    path = write_doc(tmp_path / "NVIDIA_H200.yaml", doc)
    assert "kernel: prefill" in path.read_text()
    back = P.load_profile(path)
    assert back.schema_version == 3 and back.migrated_from == 2
    assert {ck[0] for ck in back.entries} == {"decode", "multi_token"}
    assert back.get(("multi_token", "bf16", 128, 8, 64), (1, 4096, 512))["config"] == mt.to_dict()
    assert [ck[0] for ck, _bk, _why in back.stale()] == ["multi_token"]  # KH: tuned under another name
    P.save_profile(make({(4, 4096, 1): rec()}, kh=P.current_kernel_hash("decode")), path)
    text = path.read_text()
    assert yaml.safe_load(text)["schema_version"] == 3 and "kernel: multi_token" in text and "prefill" not in text


def test_schema_1_file_without_its_hash_is_invalid(tmp_path):
    path = write_doc(tmp_path / "NVIDIA_H200.yaml", v1_doc(kh="abc"))
    with pytest.raises(P.ProfileError, match=r"metadata\.kernel_hash: must be a sha256 hex digest \(schema 1\)"):
        P.load_profile(path)


def test_shipped_profiles_use_per_kernel_hashes():
    paths = P.list_profiles(P.bundled_profile_dir())
    assert paths
    for path in paths:
        assert yaml.safe_load(path.read_text())["schema_version"] == P.SCHEMA_VERSION
        prof = P.load_profile(path)
        assert prof.migrated_from is None and (len(prof) or prof.machine)  # tuned entries, or the rates alone
        for ck, _bk, r in prof.records():
            assert len(r["kernel_hash"]) == 64 and ck[0] in sources.tuned_kernels()


# ---- per-kernel source hashes --------------------------------------------------------------------


def hashes(root):
    return {k: sources.kernel_hash(k, root) for k in sources.tuned_kernels()}


def test_kernel_hash_is_the_current_hash_of_the_installation():
    assert hashes(None) == {k: P.current_kernel_hash(k) for k in sources.tuned_kernels()}
    assert all(len(h) == 64 for h in hashes(None).values())
    assert P.current_kernel_hash("decode") != P.current_kernel_hash("multi_token")  # each kernel its own key
    assert hashes(sources.PACKAGE_DIR) == hashes(None)


def test_a_code_generating_config_rule_changes_the_kernel_hashes(tmp_path):
    root = package_copy(tmp_path)
    before = hashes(root)
    assert before == hashes(None)
    edit(root / "config.py", "MULTI_TOKEN_CHUNK4_ROWS = 8192", "MULTI_TOKEN_CHUNK4_ROWS = 4096")
    after = hashes(root)
    assert after["decode"] != before["decode"] and after["multi_token"] != before["multi_token"]
    assert after["q_tiled"] != before["q_tiled"]  # config.py holds its rules too


@pytest.mark.parametrize("rel, changes", [
    ("kernels/decode.py", {"decode", "decode_fp8"}),  # the FP8 kernel is a subclass of it
    ("kernels/decode_fp8.py", {"decode_fp8"}),
    ("fp8.py", {"decode_fp8"}),
    ("kernels/multi_token.py", {"multi_token"}),
    ("kernels/q_tiled.py", {"q_tiled"}),
    ("kernels/helpers.py", {"decode", "decode_fp8", "multi_token", "q_tiled"}),
    ("kernels/paged.py", {"decode", "decode_fp8", "multi_token", "q_tiled"}),
    ("kernels/producer.py", {"decode", "decode_fp8", "multi_token", "q_tiled"}),
    ("kernels/qio.py", {"decode", "decode_fp8", "multi_token", "q_tiled"}),
    ("kernels/walk.py", {"decode", "decode_fp8", "multi_token", "q_tiled"}),
    ("kernels/masks.py", {"decode", "decode_fp8", "multi_token", "q_tiled"}),
    ("kernels/softmax.py", {"decode", "decode_fp8", "multi_token", "q_tiled"}),
    ("kernels/jit.py", {"decode", "decode_fp8", "multi_token", "q_tiled"}),
    # the split kernels' launches run the combine after their partials (the Q-tiled kernel folds its
    # KV splits itself)
    ("kernels/combine.py", {"decode", "decode_fp8", "multi_token"}),
    ("kernels/launch.py", set()),  # host-side launch glue: no code generation
    ("kernels/disk_cache.py", set()),
    ("kernels/specs.py", set()),  # adding a kernel's spec voids no profile
    ("ops.py", set()),
    ("kernels/new_kernel.py", set()),  # adding a kernel file voids no profile
])
def test_kernel_hash_covers_exactly_its_files(tmp_path, rel, changes):
    root = package_copy(tmp_path)
    before = hashes(root)
    (root / rel).write_text(((root / rel).read_text() if (root / rel).exists() else "") + "\n# edited\n")
    after = hashes(root)
    assert {k for k in before if after[k] != before[k]} == changes


def test_a_kernel_of_its_own_file_keeps_the_other_kernels_hash(tmp_path, monkeypatch):
    root = package_copy(tmp_path)
    (root / "kernels" / "new_multi_token.py").write_text("x = 1\n")
    monkeypatch.setitem(sources.CODE_FILES, "multi_token", ("kernels/new_multi_token.py", "kernels/helpers.py", "config.py"))
    before = hashes(root)
    edit(root / "kernels" / "new_multi_token.py", "x = 1", "x = 2")
    after = hashes(root)
    assert after["multi_token"] != before["multi_token"] and after["decode"] == before["decode"]
    edit(root / "kernels" / "decode.py", "from __future__", "# edited\nfrom __future__")
    assert hashes(root)["multi_token"] == after["multi_token"] and hashes(root)["decode"] != after["decode"]


def test_code_files_are_closed_under_their_package_imports():
    """What a kernel's files import from the package at trace time is in its file list (config.py
    rules included); jit.py also imports the kernel modules it compiles and its cache plumbing."""
    every = {f for files in sources.CODE_FILES.values() for f in files}
    for kernel, files in sources.CODE_FILES.items():
        for rel in files:
            imported = _package_imports(sources.PACKAGE_DIR / rel)
            allowed = set(files) | (every | HOST_ONLY if rel == "kernels/jit.py" else set())
            assert imported <= allowed, f"{kernel}: {rel} imports {sorted(imported - allowed)}"
    assert "config.py" in sources.launch_files("decode") and "config.py" in sources.launch_files("multi_token")


def test_profile_dirs_env_first(tmp_path, monkeypatch):
    monkeypatch.setenv(P.PROFILE_DIR_ENV, str(tmp_path))
    dirs = P.profile_dirs()
    assert dirs[0] == tmp_path and dirs[-1] == P.bundled_profile_dir()
    assert (P.bundled_profile_dir() / "__init__.py").exists()
    found, expected = P.find_profile("Some GPU")
    assert found is None and expected == tmp_path / "Some_GPU.yaml"
    (tmp_path / "Some_GPU.yaml").write_text("x")
    assert P.find_profile("Some GPU")[0] == tmp_path / "Some_GPU.yaml"


def test_numbers_past_int64_or_a_float_are_named_not_converted():
    """A document (not only a YAML file) holding integers no float or int64 holds: a ProfileError
    naming each key, never an OverflowError, and never printing thousands of digits."""
    prof = P.Profile(metadata=P.make_metadata(
        {"gpu_name": "X", "compute_capability": "9.0", "sm_count": 132, "smem_optin_bytes": 232448}, objective="gpu"))
    prof.set(("decode", "bf16", 128, 8, 64), (1, 4096, 1),
             {"config": {"tile_n": 64, "stages": 2}, "p50_us": 1.0, "default_p50_us": None, "trials": 1,
              "kernel_hash": "a" * 64})
    doc = prof.to_doc()
    bucket = doc["entries"][0]["buckets"][0]
    bucket["p50_us"] = 10**5000
    bucket["config"]["stages"] = -(10**400)
    doc["metadata"]["smem_optin_bytes"] = 2**64
    with pytest.raises(P.ProfileError) as ei:
        P.Profile.from_doc(doc, "doc.yaml")
    text = str(ei.value)
    assert text.startswith("doc.yaml: invalid profile:")
    assert "buckets[0].p50_us: must be a finite number, got an integer of thousands of digits" in text
    assert "buckets[0].config.stages: must be an integer of at most 9223372036854775807, got an integer of 401 digits" in text
    assert "metadata.smem_optin_bytes: must be an integer of at most" in text and len(text) < 1000
    doc["metadata"]["smem_optin_bytes"] = 2**63 - 1  # the largest int64 is a number a profile may hold
    bucket["p50_us"], bucket["config"]["stages"] = 2**63 - 1, 2
    assert len(P.Profile.from_doc(doc, "doc.yaml")) == 1

"""YAML profiles: schema round trip, rejection of bad files, atomic merge (CPU only)."""

import os
import warnings

import pytest
import yaml

from directkv_cute.config import DecodeConfig
from directkv_cute.tuning import profiles as P

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
    prof = P.Profile(metadata=P.make_metadata(env(gpu), kernel_hash=kh, objective=objective))
    for bk, r in buckets.items():
        prof.set(CLASS, bk, r)
    return prof


def good_doc():
    return make({(1, 4096, 1): rec()}).to_doc()


def write_doc(path, doc):
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
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
    assert back.metadata["gpu_name"] == GPU and back.kernel_hash == KH
    r = back.get(CLASS, (16, 131072, 1))
    assert r["config"] == DecodeConfig(tile_n=128, stages=2).to_dict()
    assert all(type(v) is int for v in r["config"].values())
    assert r["default_p50_us"] is None and r["trials"] == 10
    for ck, bk, _ in back.records():
        assert all(type(x) is int for x in ck[2:] + bk)
    md = back.metadata
    assert back.schema_version == P.SCHEMA_VERSION
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
        ("schema_version: 2\nmetadata: {}\nentries: []\n", "unknown schema_version 2"),
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
        (lambda d: d["metadata"].__setitem__("kernel_hash", "abc"), r"sha256 hex digest"),
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


def test_foreign_gpu_and_stale_kernel_hash(tmp_path):
    path = tmp_path / "NVIDIA_H200.yaml"
    P.save_profile(make({(1, 4096, 1): rec()}), path)
    with pytest.raises(P.ProfileError, match="gpu_name"):
        P.load_profile(path, gpu_name="NVIDIA H100 80GB HBM3", strict=True)
    with pytest.raises(P.ProfileError, match="kernel_hash"):
        P.load_profile(path, gpu_name=GPU, kernel_hash=KH2, strict=True)
    with pytest.warns(P.ProfileWarning, match="kernel sources"):
        prof = P.load_profile(path, gpu_name=GPU, kernel_hash=KH2)
    assert prof.compat_problems(gpu_name=GPU, kernel_hash=KH) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        P.load_profile(path, gpu_name=GPU, kernel_hash=KH)


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


def test_merge_drops_stale_buckets(tmp_path):
    path = tmp_path / "NVIDIA_H200.yaml"
    P.save_profile(make({(1, 4096, 1): rec()}, kh=KH), path)
    with pytest.warns(P.ProfileWarning, match="stale"):
        P.save_profile(make({(4, 4096, 1): rec()}, kh=KH2), path)
    prof = P.load_profile(path)
    assert prof.kernel_hash == KH2 and list(prof.entries[CLASS]) == [(4, 4096, 1)]


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
                                        "p50_us": 10.0, "default_p50_us": None, "trials": 3}]})
    path = write_doc(tmp_path / "NVIDIA_H200.yaml", doc)
    prof = P.load_profile(path)
    assert prof.get(("future-kernel", "bf16", 128, 8, 64), (1, 4096, 128))["config"] == {"tile_m": 128}


def test_kernel_source_hash(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 2\n")
    (tmp_path / "notes.txt").write_text("ignored")
    h1 = P.kernel_source_hash.__wrapped__(str(tmp_path))
    (tmp_path / "notes.txt").write_text("changed")
    assert P.kernel_source_hash.__wrapped__(str(tmp_path)) == h1
    (tmp_path / "b.py").write_text("y = 3\n")
    h2 = P.kernel_source_hash.__wrapped__(str(tmp_path))
    assert h2 != h1 and len(h2) == 64
    assert len(P.current_kernel_hash()) == 64


def test_profile_dirs_env_first(tmp_path, monkeypatch):
    monkeypatch.setenv(P.PROFILE_DIR_ENV, str(tmp_path))
    dirs = P.profile_dirs()
    assert dirs[0] == tmp_path and dirs[-1] == P.bundled_profile_dir()
    assert (P.bundled_profile_dir() / "__init__.py").exists()
    found, expected = P.find_profile("Some GPU")
    assert found is None and expected == tmp_path / "Some_GPU.yaml"
    (tmp_path / "Some_GPU.yaml").write_text("x")
    assert P.find_profile("Some GPU")[0] == tmp_path / "Some_GPU.yaml"

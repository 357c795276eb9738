"""``directkv-tune machine``: rates composed from (fake) timings, written into the GPU's profile,
and the refusals (no CUDA, a bad --output) before anything is measured."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from directkv_cute.machine import H200, MachineModel
from directkv_cute.plan import causal_flops
from directkv_cute.tuning import cli, lookup
from directkv_cute.tuning import machine as mm
from directkv_cute.tuning import profiles as P

ROOT = Path(__file__).resolve().parents[1]
GPU = "NVIDIA H200"
LINK_MS_8K = 2 * 8192 * 8 * 128 * 2 / (50.0 * 1e6)  # 8k keys of K and V at 50 GB/s


class FakeProbes:
    """Hand-picked timings; records the model the staged call was planned under."""

    def __init__(self, gpu_name=GPU, flagged_ms=1.028, staged=(0.85, 0.80)):
        self.gpu_name = gpu_name
        self.env = {"gpu_name": gpu_name, "compute_capability": "9.0", "sm_count": 132, "smem_optin_bytes": 232448}
        self.flagged_ms, self.staged = flagged_ms, staged
        self.staged_under = None

    def bandwidths(self):
        return {"host_read_gbps": 50.0, "memcpy_h2d_gbps": 55.0, "hbm_read_gbps": mm.H200_HBM_READ_GBPS / 2}

    def d2d(self):
        return 512_000_000, 0.4

    def copy_calls(self):
        return {"one_ms": 0.6, "many_ms": 0.9, "flagged_ms": self.flagged_ms, "many_calls": 128}

    def chunk_ms(self, keys, queries):
        return {(32768, 2048): 4.0, (8192, 64): LINK_MS_8K + 0.03, (8192, 512): LINK_MS_8K + 0.09}[keys, queries]

    def q_tiled_ms(self, keys, queries):
        assert (keys, queries) == (32768, 2048)
        return 1.5

    def staged_ms(self, machine, keys, queries):
        self.staged_under = machine
        return self.staged


@pytest.fixture
def profile_dir(tmp_path, monkeypatch):
    d = tmp_path / "profiles"
    monkeypatch.setenv(P.PROFILE_DIR_ENV, str(d))
    lookup.clear_cache()
    yield d
    lookup.clear_cache()


def test_rates_from_fake_timings_equal_a_hand_computation():
    fake = FakeProbes()
    got = mm.measure_machine(fake, GPU)
    m = got.model
    flops = 4 * 32 * 128 * (2048 * (32768 - 2048) + 2048 * 2049 / 2)
    slope = (0.09 - 0.03) / (512 - 64)
    want = {"link_gbps": 50.0, "memcpy_gbps": 55.0, "d2d_gbps": 1280.0, "copy_call_ms": 0.3 / 127,
            "flag_ms": 0.128 / 128, "chunked_tflops": flops / 4.0e9, "q_tiled_tflops": flops / 1.5e9,
            "chunk_tail_ms_per_token": slope, "chunk_tail_ms": 0.03 - 64 * slope,
            "q_tiled_read_gbps": H200.q_tiled_read_gbps / 2, "partial_gbps": H200.partial_gbps / 2,
            "fold_gbps": H200.fold_gbps / 2, "stage_overhead_ms": 0.05}
    assert flops == causal_flops([32768], [2048], 32, 128)
    assert m.to_dict() == pytest.approx(want, rel=1e-9)
    # the staged call is planned under every measured rate, with no overhead of its own
    assert fake.staged_under.stage_overhead_ms == 0.0
    assert fake.staged_under.q_tiled_tflops == pytest.approx(want["q_tiled_tflops"])
    for k in mm.SCALED:
        assert got.how[k].startswith(mm.SCALED_HOW)
    assert all(got.how[k].startswith("measured") for k in MachineModel.fields() if k not in mm.SCALED)
    assert [r[0] for r in mm.table_rows(got)] == list(MachineModel.fields())


def test_a_difference_below_the_timing_resolution_is_floored_and_said():
    got = mm.measure_machine(FakeProbes(flagged_ms=0.89, staged=(0.80, 0.85)), GPU)
    assert got.model.flag_ms == mm.FLOORS["flag_ms"] and "floored" in got.how["flag_ms"]
    assert got.model.stage_overhead_ms == mm.FLOORS["stage_overhead_ms"] and "floored" in got.how["stage_overhead_ms"]


def test_a_timing_that_makes_no_rate_is_refused():
    fake = FakeProbes()
    fake.q_tiled_ms = lambda keys, queries: 0.0
    with pytest.raises(mm.MeasureError, match="Q-tiled kernel: timed 0.0 ms"):
        mm.measure_machine(fake, GPU)


def _run(monkeypatch, capsys, argv, fake=None):
    if fake is not None:
        monkeypatch.setattr(mm, "gpu_probes", lambda: fake)
    rc = cli.main(["machine", *argv])
    return rc, capsys.readouterr()


def test_the_profile_gets_a_machine_section_the_lookup_returns(profile_dir, monkeypatch, capsys):
    rc, io = _run(monkeypatch, capsys, ["--output", str(profile_dir)], FakeProbes())
    assert rc == 0, io.err
    path = profile_dir / "NVIDIA_H200.yaml"
    prof = P.load_profile(path)
    want = mm.rounded(mm.measure_machine(FakeProbes(), GPU).model)
    assert MachineModel.from_dict(GPU, prof.machine).to_dict() == want
    assert set(prof.metadata["machine_sources"]) == set(MachineModel.fields())
    assert lookup.machine_model(GPU).to_dict() == want
    for k in ("link_gbps", "fold_gbps", "stage_overhead_ms"):
        assert k in io.out
    assert "scaled from H200 by HBM bandwidth" in io.out and f"profile: {path}" in io.out


def test_existing_entries_survive_and_a_later_tune_keeps_the_machine_model(profile_dir, monkeypatch, capsys):
    profile_dir.mkdir()
    shutil.copy(ROOT / "profiles" / "NVIDIA_H200.yaml", profile_dir)
    path = profile_dir / "NVIDIA_H200.yaml"
    before = P.load_profile(path)
    assert len(before) > 0
    rc, io = _run(monkeypatch, capsys, ["--output", str(profile_dir)], FakeProbes())
    assert rc == 0, io.err
    after = P.load_profile(path)
    assert list(after.records()) == list(before.records())
    assert after.machine != before.machine and after.metadata["created"] == before.metadata["created"]
    # a tuning run's save (no machine model of its own) keeps the measured one and how it was obtained
    md = P.make_metadata({**FakeProbes().env, "host_link_gbps": 55.0, "hbm_gbps": 4000.0}, objective="gpu")
    P.save_profile(P.Profile(metadata=md, path=path), path)
    again = P.load_profile(path)
    assert again.machine == after.machine
    assert again.metadata["machine_sources"] == after.metadata["machine_sources"]


def test_dry_run_prints_the_section_and_writes_nothing(profile_dir, monkeypatch, capsys):
    rc, io = _run(monkeypatch, capsys, ["--print", "--output", str(profile_dir)], FakeProbes())
    assert rc == 0 and "machine:" in io.out and "not written" in io.out
    assert not profile_dir.exists()


def test_without_cuda_one_line_exit_2(tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc, io = _run(monkeypatch, capsys, ["--output", str(tmp_path / "out")])
    assert rc == 2
    assert io.err.count("\n") == 1 and "needs a CUDA GPU" in io.err
    assert not (tmp_path / "out").exists()


def _never():
    raise AssertionError("measured before the output folder was checked")


@pytest.mark.parametrize("where", ["file", "under_file"])
def test_a_bad_output_is_refused_before_measuring(tmp_path, monkeypatch, capsys, where):
    f = tmp_path / "a-file"
    f.write_text("not a folder\n")
    out = f if where == "file" else f / "sub"
    monkeypatch.setattr(mm, "gpu_probes", _never)
    rc, io = _run(monkeypatch, capsys, ["--output", str(out)])
    assert rc == 2 and io.err.count("\n") == 1 and "is not a folder" in io.err
    assert f.read_text() == "not a folder\n" and sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_a_profile_for_another_gpu_is_refused_before_measuring(tmp_path, monkeypatch, capsys):
    shutil.copy(ROOT / "profiles" / "NVIDIA_H200.yaml", tmp_path / "Other_GPU.yaml")
    text = (tmp_path / "Other_GPU.yaml").read_text()
    fake = FakeProbes(gpu_name="Other GPU")
    fake.bandwidths = _never
    rc, io = _run(monkeypatch, capsys, ["--output", str(tmp_path)], fake)
    assert rc == 2 and io.err.count("\n") == 1 and "holds a profile for 'NVIDIA H200'" in io.err
    assert (tmp_path / "Other_GPU.yaml").read_text() == text


MACHINE = "machine: " + str(H200.to_dict()).replace("'", "")
METADATA = ("tune_version: 1, gpu_name: G, compute_capability: '9.0', sm_count: 1, smem_optin_bytes: 1, "
            "host_link_gbps: 50.0, hbm_gbps: 4000.0, created: '2026-01-01T00:00:00Z', updated: '2026-01-01T00:00:00Z'")


@pytest.mark.parametrize("sources,msg", [
    ("[measured]", "metadata.machine_sources: must be a mapping of rate names to strings, got list"),
    ("{link_gbps: measured, warp_speed: high}", "metadata.machine_sources: unknown rates [\"'warp_speed'\"]"),
    ("{link_gbps: 3}", "metadata.machine_sources.link_gbps: must be a non-empty string"),
    ("{link_gbps: ''}", "metadata.machine_sources.link_gbps: must be a non-empty string"),
    ("{link_gbps: " + "x" * 5000 + "}", "at most 200 characters, got str 'xxxx"),
])
def test_a_hostile_machine_sources_is_refused_with_a_clear_message(sources, msg):
    text = f"schema_version: 3\nmetadata: {{{METADATA}, machine_sources: {sources}}}\n{MACHINE}\nentries: []\n"
    with pytest.raises(P.ProfileError) as e:
        P.parse_profile(text, "p.yaml")
    assert msg in str(e.value) and len(str(e.value)) < 1000 and str(e.value).count("\n") == 1


def test_a_profile_with_machine_sources_reads_back():
    text = (f"schema_version: 3\nmetadata: {{{METADATA}, machine_sources: {{fold_gbps: scaled from H200 by HBM "
            f"bandwidth}}}}\n{MACHINE}\nentries: []\n")
    prof = P.parse_profile(text, "p.yaml")
    assert prof.metadata["machine_sources"] == {"fold_gbps": "scaled from H200 by HBM bandwidth"}
    assert P.parse_profile(prof.to_yaml()).metadata == prof.metadata


# Sane ranges for any GPU the kernels run on (Hopper): wide, to catch a unit slip, not to grade.
SANE = {"link_gbps": (5, 500), "memcpy_gbps": (5, 500), "d2d_gbps": (100, 20000), "chunked_tflops": (10, 3000),
        "q_tiled_tflops": (10, 3000), "q_tiled_read_gbps": (100, 50000), "partial_gbps": (100, 100000),
        "fold_gbps": (100, 50000), "stage_overhead_ms": (1e-4, 5), "copy_call_ms": (1e-5, 1), "flag_ms": (1e-5, 1),
        "chunk_tail_ms": (1e-4, 5), "chunk_tail_ms_per_token": (1e-7, 1e-2)}


@pytest.mark.gpu
def test_the_command_measures_this_gpu(tmp_path, monkeypatch, capsys):
    import time

    monkeypatch.setenv(P.PROFILE_DIR_ENV, str(tmp_path))
    lookup.clear_cache()
    t0 = time.perf_counter()
    rc = cli.main(["machine", "--output", str(tmp_path)])
    io = capsys.readouterr()
    assert rc == 0, io.err
    print(io.out, f"{time.perf_counter() - t0:.1f} s")
    (path,) = tmp_path.glob("*.yaml")
    prof = P.load_profile(path)
    m = MachineModel.from_dict(prof.gpu_name, prof.machine)
    for k, (lo, hi) in SANE.items():
        assert lo <= getattr(m, k) <= hi, (k, getattr(m, k))
    assert lookup.machine_model(prof.gpu_name) == m
    lookup.clear_cache()

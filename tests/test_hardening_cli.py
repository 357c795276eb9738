"""Hardening of the command lines and of the profile's machine model: what a user can get wrong
is one line on stderr and exit status 2 (never a traceback), refused before anything is written.

* a profile's ``machine:`` section: every rate finite and in its stated range, no unknown keys,
  checked by one function (``directkv_cute.machine.machine_problems``) wherever a profile is
  read: the loader, ``directkv-tune check`` / ``show``, and the planner's ``lookup.machine_for``;
* ``python -m bench regress`` / ``refresh`` with a missing file, a file that is not JSON, or
  JSON that is not a results document;
* ``python -m bench e2e``: no time budget unless one is asked for;
* ``directkv-generate --hbm-budget`` on a CPU (no HBM there);
* one list of model presets for ``directkv-generate`` and ``directkv-tune``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest

from directkv_cute import machine as M
from directkv_cute.machine import H200, MachineModel
from directkv_cute.tuning import cli
from directkv_cute.tuning import lookup as L
from directkv_cute.tuning import profiles as P

ROOT = Path(__file__).resolve().parents[1]
GPU = "Hardening Test GPU"  # no bundled profile has this name


@pytest.fixture(autouse=True)
def isolated(isolated_profiles):
    """Every profile folder under tmp_path (``conftest.isolated_profiles``), no machine warning given yet."""
    L._WARNED.clear()
    yield
    L.clear_cache()


def _profile(machine: dict | None = None, gpu: str = GPU) -> P.Profile:
    md = P.make_metadata({"gpu_name": gpu, "compute_capability": "9.0", "sm_count": 132,
                          "smem_optin_bytes": 232448}, objective="gpu")
    return P.Profile(metadata=md, machine=dict(H200.to_dict() if machine is None else machine))


def _with_machine_line(tmp_path, key: str, value: str, gpu: str = GPU) -> Path:
    """A valid profile in the env folder whose ``machine:`` has ``key: value`` (a YAML scalar) set
    or added, written as text (the writer refuses what the loader refuses)."""
    path = tmp_path / "env" / P.profile_filename(gpu)
    doc = _profile(gpu=gpu).to_doc()
    rates = {k: repr(v) for k, v in doc.pop("machine").items()}
    rates[key] = value
    path.write_text(P.dump_yaml(doc) + "machine:\n" + "".join(f"  {k}: {v}\n" for k, v in rates.items()))
    return path


def _run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# ---- 1. the machine model ----------------------------------------------------------------------

BAD_RATES = [
    ("link_gbps", ".nan", "machine.link_gbps", "finite"),
    ("memcpy_gbps", ".inf", "machine.memcpy_gbps", "finite"),
    ("d2d_gbps", "-.inf", "machine.d2d_gbps", "finite"),
    ("link_gbps", "-1", "machine.link_gbps", "positive"),
    ("link_gbps", "0", "machine.link_gbps", "positive"),
    ("link_gbps", "200000.0", "machine.link_gbps", "at most 100000 GB/s"),
    ("q_tiled_tflops", "20000", "machine.q_tiled_tflops", "at most 10000 TFLOP/s"),
    ("copy_call_ms", "-0.5", "machine.copy_call_ms", "at least 0 ms"),
    ("chunk_tail_ms", "1.0e+5", "machine.chunk_tail_ms", "at most 10000 ms"),
    ("fold_gbps", "9" * 400, "machine.fold_gbps", "an integer of 400 digits"),
    ("flag_ms", "fast", "machine.flag_ms", "must be a number"),
    ("flag_ms", "true", "machine.flag_ms", "must be a number"),
    ("flag_ms", "[1, 2]", "machine.flag_ms", "must be a number"),
    ("warp_speed_gbps", "1.0", "machine", "unknown key 'warp_speed_gbps'"),
    ("1", "2.0\n  bogus_gbps: 1.0", "machine", "unknown key 1"),  # keys of mixed types (int and str)
    ("null", "2.0", "machine", "unknown key None"),
]


@pytest.mark.parametrize("key, value, where, says", BAD_RATES)
def test_a_bad_machine_rate_is_refused_naming_the_file_and_the_field(tmp_path, key, value, where, says):
    path = _with_machine_line(tmp_path, key, value)
    with pytest.raises(P.ProfileError) as ei:
        P.load_profile(path)
    msg = str(ei.value)
    assert str(path) in msg and f"{where}: " in msg and says in msg and len(msg) < 1000, msg


def test_the_machine_ranges_cover_every_rate_and_accept_the_shipped_models():
    assert set(M.RATE_RANGES) == set(MachineModel.fields())
    for k, (lo, hi, unit) in M.RATE_RANGES.items():
        assert unit in ("GB/s", "ms", "TFLOP/s") and math.isfinite(hi) and lo in (0.0, None), k
    assert M.machine_problems(H200.to_dict()) == []
    assert MachineModel.from_dict("G", H200.to_dict()) == dataclasses.replace(H200, name="G")
    zero = {**H200.to_dict(), "stage_overhead_ms": 0, "flag_ms": 0.0}  # ms may be 0: no cost
    assert M.machine_problems(zero) == []
    bundled = P.load_profile(ROOT / "profiles" / "NVIDIA_H200.yaml")
    assert M.machine_problems(bundled.machine) == []
    for bad in ({**H200.to_dict(), "link_gbps": float("nan")}, {**H200.to_dict(), 3: 1.0}, ["link_gbps"], None):
        with pytest.raises(ValueError, match="machine"):
            MachineModel.from_dict("G", bad)


def test_the_writer_refuses_a_bad_machine_model_before_writing(tmp_path):
    prof = _profile({**H200.to_dict(), "link_gbps": float("nan")})
    path = tmp_path / "out" / P.profile_filename(GPU)
    with pytest.raises(P.ProfileError, match="machine.link_gbps"):
        P.save_profile(prof, path)
    assert not path.exists()


@pytest.mark.parametrize("key, value, where, says", [BAD_RATES[0], BAD_RATES[5], BAD_RATES[9], BAD_RATES[14]],
                         ids=["nan", "too-large", "huge-int", "mixed-keys"])
def test_check_reports_a_bad_machine_section_in_one_line_exit_2(tmp_path, capsys, key, value, where, says):
    path = _with_machine_line(tmp_path, key, value)
    rc, out, err = _run(capsys, "check", "--dir", str(path.parent))
    assert rc == 2, (out, err)
    assert err.count("\n") == 1 and str(path) in err and f"{where}: " in err and says in err, err
    assert "Traceback" not in out + err and "OK " not in out


@pytest.mark.parametrize("key, value, where, says", [BAD_RATES[0], BAD_RATES[9], BAD_RATES[14]],
                         ids=["nan", "huge-int", "mixed-keys"])
def test_show_reports_a_bad_machine_section_in_one_line(tmp_path, capsys, key, value, where, says):
    path = _with_machine_line(tmp_path, key, value)
    rc, out, err = _run(capsys, "show", str(path))
    assert rc == 2 and out == "" and err.count("\n") == 1 and f"{where}: " in err and says in err, err
    for fmt in ("table", "json"):
        rc, out, err = _run(capsys, "show", "--dir", str(path.parent), "--format", fmt)
        assert rc == 1 and err.count("\n") == 1 and f"{where}: " in err and "Traceback" not in err, err


def test_check_still_passes_a_good_machine_section(tmp_path, capsys):
    path = tmp_path / "env" / P.profile_filename(GPU)
    P.save_profile(_profile(), path)
    rc, out, err = _run(capsys, "check", "--dir", str(path.parent))
    assert rc == 0 and f"OK      {path}" in out and err == "", (out, err)


@pytest.mark.parametrize("key, value, where, says", [BAD_RATES[0], BAD_RATES[1], BAD_RATES[5], BAD_RATES[14]],
                         ids=["nan", "inf", "too-large", "mixed-keys"])
def test_the_planner_refuses_a_bad_machine_section_naming_the_file_and_the_field(tmp_path, key, value, where,
                                                                                 says):
    """machine_for (the planner's machine model) raises rather than plan with the rates, and
    rather than falling back to the conservative default in silence."""
    path = _with_machine_line(tmp_path, key, value)
    with pytest.raises(M.MachineModelError) as ei:
        L.machine_for(GPU)
    msg = str(ei.value)
    assert str(path) in msg and f"{where}: " in msg and says in msg and "\n" not in msg, msg
    # the same again (cached), and once the file is fixed, its rates
    with pytest.raises(M.MachineModelError):
        L.machine_for(GPU)
    P.save_profile(_profile(), path, merge=False)
    L.clear_cache()
    assert L.machine_for(GPU) == dataclasses.replace(H200, name=GPU)


def test_a_bad_machine_section_in_a_later_folder_is_refused_too(tmp_path):
    """A higher folder's good profile wins; a bad one there is refused even where a later folder
    has a good model (the planner never swaps in other rates behind the user's back)."""
    good = tmp_path / "xdg" / "directkv_cute" / "profiles" / P.profile_filename(GPU)
    P.save_profile(_profile(), good)
    L.clear_cache()
    assert L.machine_for(GPU) == dataclasses.replace(H200, name=GPU)
    bad = _with_machine_line(tmp_path, "link_gbps", ".nan")
    L.clear_cache()
    with pytest.raises(M.MachineModelError, match=re.escape(str(bad))):
        L.machine_for(GPU)


def test_a_profile_without_a_machine_section_still_gets_the_conservative_default(tmp_path):
    path = tmp_path / "env" / P.profile_filename(GPU)
    P.save_profile(dataclasses.replace(_profile(), machine=None), path)
    with pytest.warns(P.ProfileWarning, match="no machine model"):
        m = L.machine_for(GPU)
    assert m.memcpy_gbps == M.CONSERVATIVE.memcpy_gbps


# ---- 2. bench regress / refresh with a bad --results --------------------------------------------


def _bench(capsys, *argv):
    from bench.__main__ import main

    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _valid_results() -> dict:
    """A passing results document with one measured shape (as tests/test_bench_regress.py makes)."""
    from bench.common import GB, Ceilings, Shape, add_check, make_record, new_results

    ceil = Ceilings(host_read_gbps=50.0, hbm_read_gbps=4000.0, memcpy_h2d_gbps=54.0)
    header = {"gpu": "NVIDIA H200", "gpu_key": "NVIDIA_H200", "date": "2026-11-29", "versions": {}}
    doc = new_results("all", header, ceil, args={"preset": "quick", "benches": ["decode"]})
    s = Shape("decode", 1, 32768, 1, 32, 8, 128, "bfloat16")
    ideal = s.kv_bytes / (ceil.host_read_gbps * GB) * 1e3
    doc["records"].append(make_record(s, "zero_copy", ideal * 1.1, ceil, host_bytes=s.kv_bytes).to_dict())
    doc["records"].append(make_record(s, "ours", ideal * 1.02, ceil, host_bytes=s.kv_bytes).to_dict())
    add_check(doc, s, "ours", True, rel_err=1e-3, against="fp32 anchor")
    return doc


def _bad_results(tmp_path) -> dict:
    (tmp_path / "text.json").write_text("not json {")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "other.json").write_text(json.dumps({"hello": "world"}))
    (tmp_path / "header.json").write_text(json.dumps({"schema": 1, "header": 3, "ceilings": {}, "records": [],
                                                     "checks": [], "passed": True, "bench": "all", "args": {}}))
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00")
    (tmp_path / "folder.json").mkdir()
    return {"missing": (tmp_path / "missing.json", "no such file"), "text": (tmp_path / "text.json", "not JSON"),
            "list": (tmp_path / "list.json", "not a results document"),
            "other": (tmp_path / "other.json", "not a results document"),
            "header": (tmp_path / "header.json", "not a results document"),
            "binary": (tmp_path / "binary.json", "not JSON"),
            "folder": (tmp_path / "folder.json", "a folder")}


@pytest.mark.parametrize("case", ["missing", "text", "list", "other", "header", "binary", "folder"])
@pytest.mark.parametrize("command", ["regress", "refresh"])
def test_bench_regress_and_refresh_refuse_a_bad_results_file_in_one_line(tmp_path, capsys, command, case):
    path, says = _bad_results(tmp_path)[case]
    bdir = tmp_path / "baselines"
    rc, out, err = _bench(capsys, command, "--results", str(path), "--baseline-dir", str(bdir))
    assert rc == 2 and out == "" and err.count("\n") == 1, (rc, out, err)
    assert str(path) in err and says in err and "Traceback" not in err, err
    assert not bdir.exists()  # nothing written


def test_bench_refresh_refuses_a_bad_second_results_file_before_writing(tmp_path, capsys):
    from bench.common import write_json

    good = write_json(tmp_path / "good.json", _valid_results())
    bdir = tmp_path / "baselines"
    rc, out, err = _bench(capsys, "refresh", "--results", str(good), "--results", str(tmp_path / "nope.json"),
                          "--baseline-dir", str(bdir))
    assert rc == 2 and err.count("\n") == 1 and "nope.json" in err and not bdir.exists()


def test_bench_regress_refuses_a_bad_baseline_file_in_one_line(tmp_path, capsys):
    from bench.common import write_json

    good = write_json(tmp_path / "good.json", _valid_results())
    bad = tmp_path / "base.json"
    bad.write_text("{}")
    rc, out, err = _bench(capsys, "regress", "--results", str(good), "--baseline", str(bad))
    assert rc == 2 and out == "" and err.count("\n") == 1 and str(bad) in err and "not a results document" in err


# ---- 3. bench e2e: no time budget by default ----------------------------------------------------


def test_bench_e2e_has_no_time_budget_unless_asked():
    from bench.__main__ import build_parser

    ns = build_parser().parse_args(["e2e", "--device", "cpu"])
    assert ns.time_budget_s is None
    assert build_parser().parse_args(["e2e", "--time-budget-s", "30"]).time_budget_s == 30.0
    import bench.e2e as e2e

    for text in (e2e.__doc__, (ROOT / "bench" / "README.md").read_text()):
        assert "10-minute" not in text and "540" not in text and "device call" not in text
    readme = (ROOT / "bench" / "README.md").read_text()
    e2e_part = readme[readme.index("## End to end"):]
    e2e_part = e2e_part[:e2e_part.index("\n## ", 5)] if "\n## " in e2e_part[5:] else e2e_part
    assert "--contexts" in e2e_part and "--methods" in e2e_part


# ---- 4. directkv-generate --hbm-budget on a CPU -------------------------------------------------


@pytest.mark.parametrize("budget", ["8GiB", "1", "512MiB"])
def test_generate_refuses_an_hbm_budget_on_a_cpu_before_allocating(tmp_path, capsys, monkeypatch, budget):
    pytest.importorskip("transformers")
    import directkv_cute.hf as dkhf
    import directkv_cute.presets as presets
    from directkv_cute import generate as gen

    def boom(*args, **kwargs):
        raise AssertionError("allocated before refusing")

    monkeypatch.setattr(presets, "build_random_model", boom)
    monkeypatch.setattr(presets, "preset_config", boom)  # refused before the config is even read
    monkeypatch.setattr(dkhf, "DirectKVCache", boom)
    with pytest.raises(SystemExit) as ei:
        gen.main(["--preset", "tiny", "--device", "cpu", "--no-progress", "--hbm-budget", budget,
                  "--json", str(tmp_path / "out" / "run.json")])
    assert ei.value.code == 2
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err.count("\n") == 1 and cap.err.startswith("directkv-generate: error: ")
    assert f"--hbm-budget {budget}" in cap.err and "no HBM" in cap.err, cap.err
    assert not (tmp_path / "out").exists()


def test_generate_takes_a_zero_hbm_budget_on_a_cpu():
    pytest.importorskip("transformers")
    from directkv_cute import generate as gen

    p = gen.build_parser()
    for budget in ("0", "0GiB"):
        ns = p.parse_args(["--preset", "tiny", "--device", "cpu", "--hbm-budget", budget])
        assert gen.check_args(p, ns).hbm_budget == 0


# ---- 5. one list of presets ---------------------------------------------------------------------


def _generate_help_presets(capsys) -> list[str]:
    from directkv_cute import generate as gen

    with pytest.raises(SystemExit):
        gen.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    listed = re.search(r"--preset NAME a model of real shapes with random weights: (.*?) \(", text)
    assert listed, text
    return [n.strip() for n in listed.group(1).split(",")]


def _tune_presets(capsys) -> list[str]:
    rc, out, _ = _run(capsys, "presets")
    assert rc == 0
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == ["preset"])
    assert set(lines[start + 1].replace(" ", "")) == {"-"}  # the table's rule
    names = []
    for line in lines[start + 2:]:
        if not line.strip() or line.startswith("--"):  # the notes under the table
            break
        names.append(line.split()[0])
    return names


def test_both_clis_list_the_same_presets(capsys):
    from directkv_cute import presets as model_presets
    from directkv_cute.tuning import presets as tune_presets

    names = model_presets.preset_names()
    assert _generate_help_presets(capsys) == names
    assert _tune_presets(capsys) == names
    assert list(tune_presets.PRESETS) == names
    assert {"llama3-8b", "llama3-70b", "qwen2.5-7b", "qwen2.5-72b", "mistral-large", "tiny"} == set(names)


def test_the_tuner_takes_its_shapes_from_the_model_presets():
    from directkv_cute import presets as model_presets
    from directkv_cute.tuning import presets as tune_presets

    for name, (_cls, kw) in model_presets.PRESETS.items():
        p = tune_presets.get_preset(name)
        assert (p.num_q_heads, p.num_kv_heads, p.head_dim, p.hidden_size, p.num_layers) == (
            kw["num_attention_heads"], kw["num_key_value_heads"], kw["head_dim"], kw["hidden_size"],
            kw["num_hidden_layers"]), name
        assert p.source == model_presets.preset_source(name)
    # 'all' is every real model's shape; the tiny test model is tuned only when named
    assert [p.name for p in tune_presets.resolve_presets(["all"])] == [
        n for n in model_presets.preset_names() if n != "tiny"]
    assert [p.name for p in tune_presets.resolve_presets(["tiny"])] == ["tiny"]


ALIASES = [("Meta-Llama-3-8B", "llama3-8b"), pytest.param("Llama-3-70B", "llama3-70b", marks=pytest.mark.full),
           ("QWEN2.5-72B", "qwen2.5-72b"),
           pytest.param("Qwen2.5-7B-Instruct", "qwen2.5-7b", marks=pytest.mark.full),
           ("Mistral-Large-Instruct-2407", "mistral-large"),
           pytest.param("mistral-large-2407", "mistral-large", marks=pytest.mark.full),
           pytest.param("llama3-8b", "llama3-8b", marks=pytest.mark.full),
           pytest.param("TINY", "tiny", marks=pytest.mark.full)]


@pytest.mark.parametrize("alias, name", ALIASES)
def test_both_clis_take_the_same_spellings(capsys, alias, name):
    pytest.importorskip("transformers")
    from directkv_cute import generate as gen
    from directkv_cute import presets as model_presets
    from directkv_cute.tuning import presets as tune_presets

    assert model_presets.canonical_name(alias) == name
    assert tune_presets.get_preset(alias).name == name
    p = gen.build_parser()
    ns = p.parse_args(["--preset", alias, "--device", "cpu"])
    gen.check_args(p, ns)
    assert ns.preset == name
    assert model_presets.preset_config(alias).num_hidden_layers == \
        model_presets.PRESETS[name][1]["num_hidden_layers"]
    rc, out, err = _run(capsys, "run", "--preset", alias, "--dry-run")
    assert rc == 0 and err == "", err


@pytest.mark.parametrize("name", ["qwen2.5-72b", "mistral-large"])
def test_the_new_generate_presets_are_models_directkv_runs(name):
    pytest.importorskip("transformers")
    from directkv_cute.hf import model_spec
    from directkv_cute.presets import preset_config
    from directkv_cute.tuning.presets import get_preset

    spec, p = model_spec(preset_config(name)), get_preset(name)
    assert (spec.num_layers, spec.num_q_heads, spec.num_kv_heads, spec.head_dim) == (
        p.num_layers, p.num_q_heads, p.num_kv_heads, p.head_dim)


def test_an_unknown_preset_is_one_line_in_both_clis(capsys):
    pytest.importorskip("transformers")
    from directkv_cute import generate as gen
    from directkv_cute.presets import preset_names

    with pytest.raises(SystemExit) as ei:
        gen.main(["--preset", "gpt-5", "--device", "cpu"])
    err = capsys.readouterr().err
    assert ei.value.code == 2 and err.count("\n") == 1 and all(n in err for n in preset_names())
    rc, out, err = _run(capsys, "run", "--preset", "gpt-5", "--dry-run")
    assert rc == 2 and err.count("\n") == 1 and all(n in err for n in preset_names()), err

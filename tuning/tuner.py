"""The search loop: one Optuna study per shape bucket, a re-benchmark of the best few, a profile.

Per bucket (kernel x TuneShape):

1. The static filter enumerates the legal configs of the space for the shape. If there are
   at most ``exhaustive_threshold`` of them the study runs ``BruteForceSampler`` over the whole
   space (every legal config is measured, time budget permitting); otherwise a seeded
   multivariate ``TPESampler``. Parameters are suggested as ordinal indices into each choice
   list (``tile_n_i`` ...), so TPE can exploit their order.
2. The heuristic default, the existing profile's config for the bucket and the space's
   portfolio (``KernelSpace.portfolio``: configs that measured well before) are enqueued first.
3. Each trial: illegal points are pruned before anything runs (reasons in the trial's user
   attrs); a config already measured in the study is answered from the study (never re-run);
   a config that runs the same launch as a measured one (same resolved split count etc., see
   ``KernelSpace.launch_key``) reuses that measurement; a config that failed before is pruned
   again. New configs go to ``measure(config, shape)``: failures (ok False or an exception)
   are recorded in the trial (``error`` user attr) and the trial is pruned, so TPE ranks them
   last and nobody measures them again; a ``fatal`` failure stops the run (resume later).
4. The study lives in the given storage (``JournalStorage(JournalFileBackend(path))`` for a
   journal file), keyed by a study name that holds the bucket, the objective, the kernel
   sources hash and the space hash. Resuming loads the study and continues to ``n_trials``
   distinct measured configs in total; a trial left RUNNING by a dead process is recorded as
   a crash and its config is never measured again.
5. The top ``top_k`` configs within ``rebench_within`` x the best, plus the default, are
   measured again with ``rebench_factor`` x the repetitions; the fastest median wins, the
   default winning ties within ``tie_tolerance`` (a profile only changes what it must).
6. The result is merged into ``<output_dir>/<GPU>.yaml`` right away (atomic), so an
   interrupted run keeps the buckets it finished.
"""

from __future__ import annotations

import inspect
import logging
import math
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from directkv_cute.env import EnvironmentVariableError

from .lookup import clear_cache
from .objectives import GpuObjective, HardwareModel, ModelledObjective
from .profiles import Profile, ProfileError, current_kernel_hash, load_profile, make_metadata, output_problem, \
    profile_filename, sanitize_gpu_name, save_profile
from .space import TuneShape, get_space

log = logging.getLogger("directkv_cute.tuning")


class TunerAbort(RuntimeError):
    """The objective reported a fatal failure (the run can be resumed in a fresh process)."""


# The largest bucket the tuner takes: beyond these no GPU runs the launch (and a cost model's
# work, which grows with the CTAs of a launch, would have no bound).
MAX_BATCH = 1 << 16  # sequences in one call
MAX_CONTEXT = 1 << 24  # tokens of one sequence (16M, above every model's context window)
MAX_PAGES = 2**31 - 1  # pages of one call: the op's page ids are int32 (as the cache's)
MAX_SEEDS = 2**32  # seeds are 0 .. 2**32 - 1 (the samplers' random generators take no more)


def shape_problem(shape: TuneShape) -> str | None:
    """Why the tuner does not take bucket ``shape`` (None: it does)."""
    pages = shape.batch * -(-shape.context // shape.page_size)
    if shape.batch > MAX_BATCH:
        return f"{shape.describe()}: batch {shape.batch} is over the tuner's {MAX_BATCH}"
    if shape.context > MAX_CONTEXT:
        return f"{shape.describe()}: context {shape.context} is over the tuner's {MAX_CONTEXT} tokens"
    if shape.q_len > MAX_CONTEXT:
        return f"{shape.describe()}: q_len {shape.q_len} is over the tuner's {MAX_CONTEXT} tokens"
    if pages > MAX_PAGES:
        return f"{shape.describe()}: {pages} pages of {shape.page_size} tokens, over the op's {MAX_PAGES}"
    return None


@dataclass
class TuneOptions:
    n_trials: int = 40  # distinct configs measured per bucket, resumed trials included
    time_budget_s: float | None = None  # wall-clock budget of the whole run
    seed: int = 0
    exhaustive_threshold: int = 128  # legal configs <= this: BruteForceSampler over the space
    n_startup_trials: int = 10  # TPE random start
    top_k: int = 3
    rebench_within: float = 1.5
    rebench_factor: int = 3
    tie_tolerance: float = 0.01
    patience: int = 80  # trials in a row that measure nothing new: converged
    max_consecutive_failures: int = 25
    dedupe_equivalent: bool = True
    progress: bool = True


@dataclass
class BucketResult:
    kernel: str
    shape: TuneShape
    study_name: str
    mode: str = ""
    status: str = "pending"  # tuned | default | failed | skipped | cached
    config: object = None
    p50_us: float | None = None
    p20_us: float | None = None
    p80_us: float | None = None
    default_config: object = None
    default_p50_us: float | None = None
    trials: int = 0  # distinct configs measured (failures included)
    failures: int = 0
    legal: int = 0
    runner_up: list = field(default_factory=list)
    err: str = ""

    @property
    def speedup(self) -> float | None:
        if self.p50_us and self.default_p50_us:
            return self.default_p50_us / self.p50_us
        return None

    def record(self, space_hash: str, seed: int) -> dict:
        rec = {
            "config": self.config.to_dict(),
            "p50_us": round(float(self.p50_us), 3),
            "default_p50_us": None if self.default_p50_us is None else round(float(self.default_p50_us), 3),
            "trials": int(self.trials),
        }
        if self.p20_us is not None:
            rec["p20_us"] = round(float(self.p20_us), 3)
        if self.p80_us is not None:
            rec["p80_us"] = round(float(self.p80_us), 3)
        rec.update(failures=int(self.failures), mode=self.mode, seed=int(seed), space_hash=space_hash[:16])
        if self.runner_up:
            rec["runner_up"] = [{"config": c.to_dict(), "p50_us": round(float(t), 3)} for c, t in self.runner_up]
        return rec

    def summary(self) -> dict:
        """A JSON-able digest, stored in the study so that a finished bucket is not re-measured."""
        return {
            "status": self.status, "mode": self.mode, "trials": self.trials, "failures": self.failures,
            "legal": self.legal, "err": self.err,
            "config": None if self.config is None else self.config.to_dict(),
            "p50_us": self.p50_us, "p20_us": self.p20_us, "p80_us": self.p80_us,
            "default_config": None if self.default_config is None else self.default_config.to_dict(),
            "default_p50_us": self.default_p50_us,
            "runner_up": [[c.to_dict(), t] for c, t in self.runner_up],
        }


def _accepts_reps(fn) -> bool:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    return "reps" in sig.parameters or any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())


def open_storage(storage):
    """None -> in-memory; a path (str / Path) -> JournalStorage(JournalFileBackend(path)); else as is."""
    import optuna

    if storage is None:
        return optuna.storages.InMemoryStorage()
    if isinstance(storage, (str, Path)):
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        p = Path(storage)
        p.parent.mkdir(parents=True, exist_ok=True)
        return JournalStorage(JournalFileBackend(str(p)))
    return storage


class Tuner:
    """Tunes one kernel over a list of shape buckets with a pluggable ``measure`` callable."""

    def __init__(self, kernel: str, measure, *, storage=None, options: TuneOptions | None = None,
                 output_dir=None, environment: dict | None = None, kernel_hash: str | None = None,
                 objective_name: str | None = None):
        import optuna

        self.optuna = optuna
        self.kernel = kernel
        self.space = get_space(kernel)
        self.measure = measure
        self._measure_reps = _accepts_reps(measure)
        self.storage = open_storage(storage)
        self.opt = options or TuneOptions()
        self.output_dir = Path(output_dir) if output_dir is not None else None
        env = environment or (measure.environment() if hasattr(measure, "environment") else {})
        self.env = {
            "gpu_name": "unknown GPU", "compute_capability": "", "sm_count": 132, "smem_optin_bytes": 232448,
            "host_link_gbps": None, "hbm_gbps": None, **env,
        }
        self.num_sms = int(self.env["sm_count"])
        self.kernel_hash = kernel_hash or current_kernel_hash(self.space.source_kernel or kernel)
        self.objective_name = objective_name or getattr(measure, "name", "custom")
        self.space_hash = self.space.space_hash()
        self._old_profile = self._load_old_profile()
        self.results: list[BucketResult] = []
        self.written: Path | None = None  # the profile this tuner wrote, once it has

    # ---- helpers ---------------------------------------------------------------------------------
    @property
    def profile_path(self) -> Path | None:
        if self.output_dir is None:
            return None
        return self.output_dir / profile_filename(self.env["gpu_name"])

    def _load_old_profile(self) -> Profile | None:
        p = self.profile_path
        if p is None or not p.exists():
            return None
        try:
            return load_profile(p)
        except ProfileError as e:
            log.warning("ignoring the existing profile for seeding: %s", e)
            return None

    def study_name(self, shape: TuneShape) -> str:
        return (
            f"{self.kernel}|{sanitize_gpu_name(self.env['gpu_name'])}|{shape.dtype}|d{shape.head_dim}|g{shape.group}"
            f"|p{shape.page_size}|b{shape.batch}|c{shape.context}|q{shape.q_len}|{self.objective_name}"
            f"|k{self.kernel_hash[:12]}|s{self.space_hash[:12]}"
        )

    def seed_configs(self, shape: TuneShape) -> list:
        """The configs a bucket's search starts with, in order: the heuristic default, the existing
        profile's entry for the bucket, the space's portfolio (illegal ones included: the search
        skips them)."""
        seeds = [self.space.default_for(shape)]
        if self._old_profile is not None:
            rec = self._old_profile.get((self.kernel, *shape.class_key), shape.bucket)
            if rec is not None:
                try:
                    seeds.append(self.space.config_from_dict(rec["config"]))
                except Exception:
                    pass
        return seeds + self.space.portfolio(shape)

    def precompile_plan(self, shapes) -> list[tuple]:
        """(config, shape) of each distinct kernel the search of ``shapes`` measures first: every
        legal config of a bucket searched exhaustively, else its first ``n_trials`` distinct legal
        seeds (what a short run measures); one per config and compile class (kernel, dtype,
        head_dim, GQA group, page size)."""
        space, opt = self.space, self.opt
        seen, out = set(), []
        for shape in shapes:
            legal = space.legality(shape).legal
            if len(legal) <= opt.exhaustive_threshold:
                picks = legal
            else:
                picks, keys = [], set()
                for cfg in self.seed_configs(shape):
                    key = space.config_key(cfg)
                    if key not in keys and space.in_space(cfg) and not space.problems(cfg, shape):
                        keys.add(key)
                        picks.append(cfg)
                picks = picks[:opt.n_trials]
            for cfg in picks:
                key = (shape.class_key, space.config_key(cfg))
                if key not in seen:
                    seen.add(key)
                    out.append((cfg, shape))
        return out

    def precompile(self, shapes, jobs: int) -> tuple[int, list[str]]:
        """Compile ``precompile_plan(shapes)`` before measuring, in ``jobs`` worker processes (spawned:
        each imports the compiler afresh) or, with ``jobs`` 1, here: the compiled-kernel disk cache
        (``directkv_cute.kernels.jit``) then serves the measurements, which otherwise compile one
        kernel at a time. Returns (kernels, failures); a failure is only reported (the trial of that
        config fails and is recorded as usual)."""
        plan = self.precompile_plan(shapes)
        tasks = [(self.kernel, cfg.to_dict(), shape.to_dict()) for cfg, shape in plan]
        if jobs <= 1:
            errors = [_compile_one(*t) for t in tasks]
        else:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            with ProcessPoolExecutor(max_workers=min(jobs, max(1, len(tasks))),
                                     mp_context=multiprocessing.get_context("spawn")) as pool:
                errors = list(pool.map(_compile_one, *zip(*tasks))) if tasks else []
        fails = [f"{TuneShape(**t[2]).describe()} {t[1]}: {e}" for t, e in zip(tasks, errors) if e]
        return len(tasks), fails

    def _params_of(self, cfg) -> dict | None:
        pt = self.space.point(cfg)
        try:
            return {f"{p.name}_i": p.index(pt[p.name]) for p in self.space.params}
        except ValueError:
            return None  # not in this space

    def _safe_measure(self, cfg, shape, reps=None) -> dict:
        try:
            if reps and self._measure_reps:
                res = self.measure(cfg, shape, reps=reps)
            else:
                res = self.measure(cfg, shape)
        except (KeyboardInterrupt, EnvironmentVariableError):  # not the config's failure
            raise
        except Exception as e:  # a failing config must not end the study
            return {"ok": False, "err": f"{type(e).__name__}: {e}"}
        if not isinstance(res, dict):
            return {"ok": False, "err": f"objective returned {type(res).__name__}, not a dict"}
        if res.get("ok"):
            p50 = res.get("p50_us")
            if not isinstance(p50, (int, float)) or not math.isfinite(p50) or p50 <= 0:
                return {"ok": False, "err": f"objective returned a bad p50_us {p50!r}"}
        else:
            res.setdefault("err", "failed (no message)")
        return res

    # ---- one bucket -----------------------------------------------------------------------------
    def tune_bucket(self, shape: TuneShape, *, time_budget_s: float | None = None, pbar=None) -> BucketResult:
        """Search one bucket (resuming its study if the storage has it) and re-benchmark the best."""
        optuna = self.optuna
        verbosity = optuna.logging.get_verbosity()
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        try:
            return self._tune_bucket(shape, time_budget_s, pbar)
        finally:
            optuna.logging.set_verbosity(verbosity)

    def _tune_bucket(self, shape: TuneShape, time_budget_s, pbar) -> BucketResult:
        optuna = self.optuna
        from optuna.trial import TrialState

        space, opt = self.space, self.opt
        name = self.study_name(shape)
        res = BucketResult(self.kernel, shape, name)
        report = space.legality(shape)
        res.legal = report.legal_count
        default = space.default_for(shape)
        res.default_config = default
        if not report.legal:
            res.status, res.err = "failed", "no legal config in the space for this shape"
            return res
        mode = "exhaustive" if report.legal_count <= opt.exhaustive_threshold else "tpe"
        if mode == "exhaustive":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                sampler = optuna.samplers.BruteForceSampler(seed=opt.seed, avoid_premature_stop=True)
        else:
            sampler = optuna.samplers.TPESampler(
                seed=opt.seed, multivariate=True, constant_liar=False,
                n_startup_trials=opt.n_startup_trials,
            )
        study = optuna.create_study(study_name=name, storage=self.storage, sampler=sampler, direction="minimize",
                                    load_if_exists=True)
        res.mode = mode
        target = report.legal_count if mode == "exhaustive" else min(opt.n_trials, report.legal_count)
        launch_classes = {space.launch_key(c, shape, self.num_sms) for c in report.legal}
        if opt.dedupe_equivalent:
            target = min(target, len(launch_classes))

        prev = study.user_attrs.get("result")
        if prev and prev.get("target", -1) >= target and prev.get("status") in ("tuned", "default", "failed"):
            return self._from_summary(res, prev)
        if not study.user_attrs.get("shape"):
            study.set_user_attr("shape", shape.to_dict())
            study.set_user_attr("kernel", self.kernel)
            study.set_user_attr("space_hash", self.space_hash)
            study.set_user_attr("mode", mode)

        # ---- what the study already knows (resume) --------------------------------------------
        measured: dict[str, tuple] = {}  # config key -> (p50, cfg, trial number, result attrs)
        failed: dict[str, str] = {}
        by_launch: dict = {}  # launch key -> config key
        for t in study.get_trials(deepcopy=False):
            cd = t.user_attrs.get("config")
            if not cd:
                continue
            try:
                cfg = space.config_from_dict(cd)
            except Exception:
                continue
            key, kind = space.config_key(cfg), t.user_attrs.get("kind")
            if t.state == TrialState.COMPLETE and kind == "measured":
                measured[key] = (t.value, cfg, t.number, t.user_attrs)
                by_launch.setdefault(space.launch_key(cfg, shape, self.num_sms), key)
            elif kind == "failed":
                failed[key] = t.user_attrs.get("error", "failed")
                by_launch.setdefault(space.launch_key(cfg, shape, self.num_sms), key)
            elif t.state == TrialState.RUNNING and kind in (None, "running"):
                failed[key] = "crashed: the process died while measuring this config"
                study.set_user_attr(f"crashed_{t.number}", cd)
                try:
                    study.tell(t.number, state=TrialState.FAIL)
                except Exception as e:  # pragma: no cover - storage specific
                    log.warning("could not close crashed trial %d: %s", t.number, e)
                by_launch.setdefault(space.launch_key(cfg, shape, self.num_sms), key)
        evaluated0 = len(measured) + len(failed)

        # ---- seeds: heuristic default, the existing profile's entry, then the space's portfolio ------
        seeds = self.seed_configs(shape)
        queued = set()
        for cfg in seeds:
            params, key = self._params_of(cfg), space.config_key(cfg)
            if params is None or space.problems(cfg, shape) or key in measured:
                continue
            # skip_if_exists: a portfolio config that is also the default or the old entry (already
            # waiting in the queue) is enqueued once
            study.enqueue_trial(params, user_attrs={"seed_config": True}, skip_if_exists=True)
            queued.add(key)
        if len(queued) > target - evaluated0 > 0:
            # Seeds count against the trials: the later ones (the portfolio's tail) go unmeasured.
            log.warning("%s: %d seed configs (default, old entry, portfolio) but %d trials left; the last %d "
                        "seeds will not be measured (raise --trials to reach them)", shape.describe(), len(queued),
                        target - evaluated0, len(queued) - (target - evaluated0))

        state = {"new": 0, "idle": 0, "fails_in_row": 0, "fatal": None}

        def objective(trial):
            idx = {p.name: trial.suggest_int(f"{p.name}_i", 0, len(p.choices) - 1) for p in space.params}
            cfg = space.make_config({p.name: p.choices[idx[p.name]] for p in space.params}, shape)
            key = space.config_key(cfg)
            trial.set_user_attr("config", cfg.to_dict())
            problems = space.problems(cfg, shape)
            if problems:
                trial.set_user_attr("kind", "illegal")
                trial.set_user_attr("problems", problems)
                raise optuna.TrialPruned("illegal: " + "; ".join(problems))
            if key in failed:
                trial.set_user_attr("kind", "failed_before")
                raise optuna.TrialPruned("failed before: " + failed[key])
            if key in measured:
                trial.set_user_attr("kind", "duplicate")
                trial.set_user_attr("duplicate_of", measured[key][2])
                return measured[key][0]
            lk = space.launch_key(cfg, shape, self.num_sms)
            if opt.dedupe_equivalent and lk in by_launch:
                other = by_launch[lk]
                trial.set_user_attr("equivalent_to", other)
                if other in failed:
                    trial.set_user_attr("kind", "failed_before")
                    raise optuna.TrialPruned("same launch as a failed config: " + failed[other])
                trial.set_user_attr("kind", "equivalent")
                return measured[other][0]
            trial.set_user_attr("kind", "running")
            out = self._safe_measure(cfg, shape)
            state["new"] += 1
            by_launch.setdefault(lk, key)
            if not out.get("ok"):
                err = str(out.get("err"))[:2000]
                failed[key] = err
                trial.set_user_attr("kind", "failed")
                trial.set_user_attr("error", err)
                state["fails_in_row"] += 1
                if out.get("fatal"):
                    state["fatal"] = err
                raise optuna.TrialPruned("failed: " + err)
            state["fails_in_row"] = 0
            p50 = float(out["p50_us"])
            attrs = {k: out[k] for k in ("p20_us", "p80_us", "reps") if out.get(k) is not None}
            for k, v in attrs.items():
                trial.set_user_attr(k, v)
            trial.set_user_attr("kind", "measured")
            measured[key] = (p50, cfg, trial.number, attrs)
            return p50

        deadline = None if time_budget_s is None else time.monotonic() + time_budget_s

        def callback(study_, frozen):
            kind = frozen.user_attrs.get("kind")
            if kind in ("measured", "failed"):
                state["idle"] = 0
                if pbar is not None:
                    pbar.update(1)
                    if measured:
                        pbar.set_postfix_str(f"best {min(v[0] for v in measured.values()):.1f} us")
            else:
                state["idle"] += 1
            n_eval = len(measured) + len(failed)
            if (
                n_eval >= target
                or state["fatal"]
                or (mode == "tpe" and state["idle"] >= opt.patience)
                or state["fails_in_row"] >= opt.max_consecutive_failures
                or (opt.dedupe_equivalent and len(by_launch) >= len(launch_classes))
                or (deadline is not None and time.monotonic() >= deadline)
            ):
                study_.stop()

        if evaluated0 < target:
            if mode == "exhaustive":
                max_asks = space.cardinality() + len(seeds) + 10
            else:
                max_asks = 20 * target + opt.patience + 100
            study.optimize(objective, n_trials=max_asks, timeout=time_budget_s, callbacks=[callback],
                           gc_after_trial=False, catch=())

        res.trials = len(measured) + len(failed)
        res.failures = len(failed)
        if state["fatal"]:
            raise TunerAbort(f"{shape.describe()}: {state['fatal']}")
        if not measured:
            res.status = "failed"
            first = next(iter(failed.values()), "nothing measured (time budget?)")
            res.err = f"no config ran ({len(failed)} failed): {first}"
            if state["fails_in_row"] >= opt.max_consecutive_failures:
                study.set_user_attr("result", {**res.summary(), "target": target})
            return res

        self._rebench(res, shape, measured, failed, default)
        complete = (
            res.trials >= target
            or len(by_launch) >= len(launch_classes)
            or (mode == "tpe" and state["idle"] >= opt.patience)
        )
        if complete:
            study.set_user_attr("result", {**res.summary(), "target": target})
        return res

    def _rebench(self, res, shape, measured, failed, default):
        space, opt = self.space, self.opt
        ranked = sorted(measured.values(), key=lambda v: v[0])
        best = ranked[0][0]
        cands, seen = [], set()
        for p50, cfg, _n, _a in ranked:
            lk = space.launch_key(cfg, shape, self.num_sms)
            if p50 > opt.rebench_within * best or len(cands) >= opt.top_k:
                break
            if lk not in seen:
                seen.add(lk)
                cands.append(cfg)
        dkey = space.config_key(default)
        default_ok = dkey not in failed and not space.problems(default, shape)
        if default_ok and all(space.config_key(c) != dkey for c in cands):
            cands.append(default)
        timed = []
        for cfg in cands:
            k = space.config_key(cfg)
            base = (measured[k][3].get("reps") if k in measured else None) or getattr(self.measure, "reps", None) or 10
            out = self._safe_measure(cfg, shape, reps=int(base) * opt.rebench_factor)
            if out.get("ok"):
                timed.append((float(out["p50_us"]), cfg, out))
            elif out.get("fatal"):
                raise TunerAbort(f"{shape.describe()}: {out.get('err')}")
        if not timed:  # re-benchmark failed for all: fall back to the search's numbers
            timed = [(p50, cfg, attrs) for p50, cfg, _n, attrs in ranked[:1]]
        timed.sort(key=lambda x: x[0])
        win_t, win_cfg, win_out = timed[0]
        d = next((x for x in timed if space.config_key(x[1]) == dkey), None)
        if d is not None:
            res.default_p50_us = d[0]
            if d[0] <= win_t * (1 + opt.tie_tolerance):
                win_t, win_cfg, win_out = d
        elif dkey in measured:
            res.default_p50_us = measured[dkey][0]
        res.config = self._preferred(win_cfg, shape)
        res.p50_us = win_t
        res.p20_us = win_out.get("p20_us")
        res.p80_us = win_out.get("p80_us")
        res.status = "default" if space.config_key(win_cfg) == dkey else "tuned"
        res.runner_up = [(c, t) for t, c, _o in timed if c is not win_cfg][:2]

    def _preferred(self, cfg, shape):
        """Among configs running the same launch, prefer the automatic split count (it carries
        over to other shapes when the lookup borrows this entry), then the default's ctas_per_sm."""
        if getattr(cfg, "num_splits", 0) == 0 or not hasattr(cfg, "ctas_per_sm"):
            return cfg
        import dataclasses

        lk = self.space.launch_key(cfg, shape, self.num_sms)
        choices = next((p.choices for p in self.space.params if p.name == "ctas_per_sm"), ())
        default_cps = self.space.default_for(shape).ctas_per_sm
        for cps in sorted(choices, key=lambda c: (c != default_cps, c)):
            alt = dataclasses.replace(cfg, num_splits=0, ctas_per_sm=cps)
            if self.space.launch_key(alt, shape, self.num_sms) == lk and not self.space.problems(alt, shape):
                return alt
        return cfg

    def _from_summary(self, res: BucketResult, s: dict) -> BucketResult:
        sp = self.space
        res.status = "cached" if s["status"] != "failed" else "failed"
        res.mode, res.trials, res.failures, res.legal, res.err = s["mode"], s["trials"], s["failures"], s["legal"], s["err"]
        res.config = sp.config_from_dict(s["config"]) if s.get("config") else None
        res.p50_us, res.p20_us, res.p80_us = s.get("p50_us"), s.get("p20_us"), s.get("p80_us")
        if s.get("default_config"):
            res.default_config = sp.config_from_dict(s["default_config"])
        res.default_p50_us = s.get("default_p50_us")
        res.runner_up = [(sp.config_from_dict(c), t) for c, t in s.get("runner_up", [])]
        return res

    # ---- many buckets ---------------------------------------------------------------------------
    def _write(self, results) -> None:
        path = self.profile_path
        good = [r for r in results if r.config is not None and r.p50_us]
        if path is None or not good:
            return
        md = make_metadata(self.env, objective=self.objective_name)
        prof = Profile(metadata=md, path=path)
        for r in good:
            rec = {**r.record(self.space_hash, self.opt.seed), "kernel_hash": self.kernel_hash}
            prof.set((self.kernel, *r.shape.class_key), r.shape.bucket, rec)
        save_profile(prof, path)
        self.written = path
        try:  # a lookup in this process must see the new file
            clear_cache()
        except Exception:  # pragma: no cover
            pass

    def tune(self, shapes) -> list[BucketResult]:
        """Tune every shape in turn (time budget shared out), writing the profile after each. A
        bucket over the tuner's limits (:func:`shape_problem`) or a bad seed raises ValueError, an
        output folder that cannot take the profile ProfileError, before anything is measured."""
        from tqdm import tqdm

        shapes = list(shapes)
        for shape in shapes:
            problem = shape_problem(shape)
            if problem:
                raise ValueError(problem)
        if not 0 <= self.opt.seed < MAX_SEEDS:
            raise ValueError(f"seed {self.opt.seed}: seeds are 0 .. {MAX_SEEDS - 1}")
        if self.output_dir is not None:
            problem = output_problem(self.output_dir, self.env["gpu_name"])
            if problem:
                raise ProfileError(problem)
        opt = self.opt
        t_end = None if opt.time_budget_s is None else time.monotonic() + opt.time_budget_s
        results = []
        total = sum(min(opt.n_trials, 10**9) for _ in shapes)
        with tqdm(total=total, disable=not opt.progress, unit="trial", file=sys.stderr, dynamic_ncols=True,
                  mininterval=0.5) as pbar:
            for i, shape in enumerate(shapes):
                pbar.set_description(f"b{shape.batch} c{shape.context} q{shape.q_len} g{shape.group}")
                budget = None
                if t_end is not None:
                    left = t_end - time.monotonic()
                    if left <= 0:
                        r = BucketResult(self.kernel, shape, self.study_name(shape), status="skipped",
                                         err="time budget used up", default_config=self.space.default_for(shape))
                        results.append(r)
                        continue
                    budget = 0.85 * left / (len(shapes) - i)
                r = self.tune_bucket(shape, time_budget_s=budget, pbar=pbar)
                results.append(r)
                self._write([r])
        self.results = results
        return results


def _compile_one(kernel: str, cfg: dict, shape: dict) -> str | None:
    """Compile one config for one shape (``Tuner.precompile``'s worker); the error, or None."""
    space = get_space(kernel)
    try:
        space.compile_for(space.config_from_dict(cfg), TuneShape(**shape))
    except Exception as e:  # a config that does not compile fails its trial later
        text = str(e).strip()
        return f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}"
    return None


def tune(kernel: str, shapes, measure, *, storage=None, output_dir=None, **options) -> list[BucketResult]:
    """Functional front end: ``tune("decode", shapes, ModelledObjective(), n_trials=30)``."""
    return Tuner(kernel, measure, storage=storage, output_dir=output_dir, options=TuneOptions(**options)).tune(shapes)


def format_results(results, *, kernel: str = "decode") -> str:
    """Plain-text table: tuned vs default per bucket."""
    head = ["group", "batch", "context", "q_len", "status", "trials", "tuned us", "default us", "speedup", "config"]
    rows = []
    for r in results:
        c = r.config
        cs = "-" if c is None else _short_config(c)
        rows.append([
            str(r.shape.group), str(r.shape.batch), str(r.shape.context), str(r.shape.q_len),
            r.status + (f" ({r.err})" if r.err and r.status in ("failed", "skipped") else ""),
            str(r.trials), _fmt(r.p50_us), _fmt(r.default_p50_us),
            "-" if r.speedup is None else f"{r.speedup:.2f}x", cs,
        ])
    return plain_table(head, rows)


def _fmt(v):
    return "-" if v is None else f"{v:.1f}"


def _short_config(c) -> str:
    d = c.to_dict()
    names = {"tile_n": "t", "stages": "s", "num_splits": "n", "ctas_per_sm": "c", "carveout": "a", "consumer_wgs": "w",
             "chunk_tiles": "k", "max_inflight": "f",
             "link_credits": "L", "edge_tiles": "e", "q_regs": "q",
             "q_cluster": "m", "stagger": "g",
             "pingpong": "pg", "cluster": "cl"}
    return " ".join(f"{names.get(k, k)}{v}" for k, v in d.items())


def plain_table(head, rows) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)] if rows else [len(h) for h in head]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*row) for row in rows]
    return "\n".join(line.rstrip() for line in lines)


__all__ = ["BucketResult", "GpuObjective", "HardwareModel", "ModelledObjective", "TuneOptions", "Tuner",
           "TunerAbort", "format_results", "open_storage", "plain_table", "shape_problem", "tune"]

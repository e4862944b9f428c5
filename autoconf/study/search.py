"""search: an Optuna study over the configuration space, ranked by the cost model.

The space is split in two:

- the *outer* choices (tp, pp, dp, micro-batch size, schedule with its chunks and layered flag)
  are what the study samples: each Optuna trial is one outer point;
- the *inner* memory savers (ZeRO stage, recomputation, sequence parallelism, the framework's
  knobs) are searched exhaustively inside a trial (24 cheap estimates or more); the trial records
  the fastest that fits in its user attributes (optuna-dashboard shows them) and its memory
  excess as the constraint (negative: fits).

When the outer space is no bigger than the trial budget every point is evaluated (brute force).
Otherwise a constrained TPE sampler explores it for the budget (seeded with every point already
in the study) and then every remaining point is evaluated by branch and bound: a configuration
whose least possible work (``schedule_time.pipeline_floor`` plus the optimizer step,
``cost.bounds.lower_bound``; a true lower bound for every schedule) is already slower than the
``top``-th fastest found is skipped without simulating its schedule. The result is the model's
exhaustive ``top`` fastest configurations (the runners-up included, so ``--verify K`` checks the
real K best), at a fraction of the cost (``--sample-only`` stops after the sampler).

Trials are sampled in memory (about 2 ms each) and, with a storage (``sqlite:///file.db``; the
library keeps nothing by default, the CLI keeps a file), written in batches, so an interrupted
search keeps what it finished and a rerun with the same inputs resumes: the default study name
carries a fingerprint of them (model, cluster, profile content, calibration, framework, batch,
devices, space options), and points already in the study are not evaluated again. An outcome the
bound decided holds for the ``top`` it was taken for (stored with it) and smaller ones; a rerun
asking for more evaluates those points again."""

from __future__ import annotations

import dataclasses
import time

from autoconf.cost.system import System
from autoconf.errors import UserError
from autoconf.procs import deferred_signals
from autoconf.space.config import ParallelConfig
from autoconf.space.enumeration import MAX_VIRTUAL, cp_choices
from autoconf.specs.recipes import framework_spec
from autoconf.study.choices import compression_savings, count_space, dp_hierarchical, precision_choices
from autoconf.study.evaluator import Evaluator, _bound_s, _Repair
from autoconf.study.options import SearchOptions
from autoconf.study.placer import Placer
from autoconf.study.result import SearchResult, _pipeline_label
from autoconf.study.storage import (
    _difference,
    _digest,
    _discard_new_database,
    _schema_lock,
    check_storage,
    check_study_name,
    cost_model_digest,
    default_study_name,
    storage_failure,
    study_lock,
)

PARAMS = ("tp", "pp", "dp", "micro_batch_size", "pipeline", "cp")


def _write(study) -> None:
    """Write a ``_Study``'s pending trials, then its attributes where they changed; one trial at a
    time, each whole (an interrupt lands between two), each popped once written."""
    while study.pending:
        with deferred_signals():
            study.persistent.add_trial(study.pending[0])
            study.pending.pop(0)
            study.written += 1
    state = study._attrs()
    if state != study._attrs_written:
        with deferred_signals():
            for name, value in zip(("swept_nofit", "swept_dominated", "top_times"), state):
                study.persistent.set_user_attr(name, value)
            study._attrs_written = state


class _Study:
    """The persistent Optuna study and this run's bookkeeping: what is known per outer point,
    trials waiting to be written (in batches: SQLite costs ~10 ms a trial), the in-memory study
    TPE samples from."""

    def __init__(self, storage, name, signature, points, evaluate, seed, budget):
        import optuna
        from optuna.distributions import CategoricalDistribution

        self.optuna = optuna
        self.evaluate = evaluate
        self.top = evaluate.top
        self.dists = {
            "tp": CategoricalDistribution(sorted({p[2] for p in points})),
            "pp": CategoricalDistribution(sorted({p[1] for p in points})),
            "dp": CategoricalDistribution(sorted({p[0] for p in points})),
            "micro_batch_size": CategoricalDistribution(sorted({p[3] for p in points})),
            "pipeline": CategoricalDistribution(sorted({_pipeline_label(p[4], p[5], p[6]) for p in points})),
            "cp": CategoricalDistribution(sorted({p[7] for p in points})),
        }
        self.sample_dists = {k: v for k, v in self.dists.items() if k != "dp"}  # dp = world / (pp x tp)
        self.key_of = {(p[2], p[1], p[0], p[3], _pipeline_label(p[4], p[5], p[6]), p[7]): p for p in points}
        self.results: dict = {}
        """outer key -> (best fitting estimate or None, least-memory estimate or None)"""
        self.fits: dict = {}
        """outer key -> the fitting estimates of this run that can be among the top, fastest first"""
        self.earlier: dict = {}
        """outer key -> finished trial of an earlier run (resumed) whose outcome holds for this search"""
        self.pending: list = []
        self.stored = 0
        self.written = 0
        """Trials this run wrote to the storage."""
        self.swept_skipped = 0
        self.skipped_keys: set = set()
        """Outer points the sweep decided without storing a trial, in this run and earlier ones, so a
        resumed sweep does not decide them again. Kept as study attributes (indices into the space):
        ``swept_nofit`` (nothing fits: holds for any search) and ``swept_dominated`` ([index,
        bound] pairs: holds while the ``top``-th best is no slower than the bound)."""
        self.nofit_keys: set = set()
        self.dominated_keys: dict = {}
        self.top_times: list = []
        """[step time, index, config digest] of the fastest configurations the study has seen (the
        ``top_times`` attribute): what a resumed search knows of its ``top``-th best at the start."""
        self._attrs_written = None
        self.last_flush = time.perf_counter()
        self.resumed = False
        """Whether the study existed before this run (made by an earlier search with the same inputs)."""
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.where, self.failure = (storage, name), None
        """(storage, study name); why the storage stopped taking trials (None while it takes them)"""
        self.persistent = self._open(storage, name, signature) if storage else None
        self.seed, self.budget = seed, budget
        self.memory = None
        self.earlier_sampled = sum(1 for t in self.earlier.values() if t.user_attrs.get("phase", "sampled") == "sampled")
        """Sampled trials of earlier runs (trials stored before the phase was recorded count as sampled)."""

    def _memory_study(self):
        """The in-memory study TPE samples from, seeded with every earlier trial (built only when
        this run samples)."""
        optuna = self.optuna
        self.memory = optuna.create_study(
            direction="minimize",
            sampler=optuna.samplers.TPESampler(seed=self.seed, multivariate=True,
                                               n_startup_trials=min(40, max(10, self.budget // 5))))
        for t in self.earlier.values():
            params = {k: t.params[k] for k in self.sample_dists}
            if t.state == optuna.trial.TrialState.PRUNED:
                self.memory.add_trial(optuna.trial.create_trial(params=params, distributions=self.sample_dists,
                                                                state=optuna.trial.TrialState.PRUNED))
            else:
                self.memory.add_trial(optuna.trial.create_trial(
                    params=params, distributions=self.sample_dists, value=t.value,
                    constraints={"memory_excess_bytes": t.user_attrs.get("memory_excess_bytes", 0.0)}))

    def _open(self, storage, name, signature: dict):
        """Open (or create) the study; refuse one made for another search. ``signature`` holds
        everything the stored values depend on: model, cluster, profile, calibration, batch,
        devices and the space's bounds."""
        try:
            with _schema_lock(storage):
                study = self.optuna.create_study(storage=storage, study_name=name, direction="minimize",
                                                 load_if_exists=True)
            return self._load(study, storage, name, signature)
        except UserError:
            raise
        except (ValueError, TypeError, AttributeError, KeyError, IndexError) as e:  # JSON errors are ValueErrors
            why = (str(e).splitlines() or [""])[0][:120]
            raise UserError(f"study {name!r} in {storage} is unreadable ({type(e).__name__}: {why}); "
                            "pass another --study-name or --storage") from None
        except Exception as e:  # a bad URL, an unwritable file, a full disk: one line, nothing left behind
            _discard_new_database(storage)
            raise UserError(f"--storage {storage!r}: cannot open the study ({storage_failure(e)})") from None

    def _load(self, study, storage, name, signature: dict):
        """What the study's stored trials and attributes tell this search (``_open``)."""
        optuna = self.optuna
        stored = study.user_attrs.get("signature")
        if stored is not None and not isinstance(stored, dict):
            raise TypeError(f"its signature is a {type(stored).__name__}, not a mapping")
        if stored is not None and stored != signature:
            raise UserError(f"study {name!r} in {storage} was made for another search (different "
                            f"{_difference(stored, signature)}); pass another --study-name, or none to "
                            "get the study of these inputs")
        self.resumed = stored is not None
        if stored is None:
            study.set_user_attr("signature", signature)
        index = list(self.key_of)
        where = {k: i for i, k in enumerate(index)}
        done = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
        found: dict = {}
        for t in study.get_trials(deepcopy=False, states=done):
            if t.user_attrs.get("verified"):  # a measured run, recorded by --verify
                continue
            k = tuple(t.params.get(p) for p in PARAMS)
            if k in self.key_of:
                found.setdefault(k, []).append(t)

        # what the earlier runs know of this search's top-th best: configurations that exist
        # (the fastest ones they kept, and each stored point's best), each counted once
        known: dict = {}
        for row in study.user_attrs.get("top_times", []):
            if (isinstance(row, list) and len(row) == 3 and isinstance(row[1], int) and 0 <= row[1] < len(index)
                    and isinstance(row[0], (int, float)) and isinstance(row[2], str)):
                known[row[2]] = (float(row[0]), index[row[1]])
        for k, ts in found.items():
            for t in ts:
                if t.user_attrs.get("fits") and t.value is not None and isinstance(t.user_attrs.get("config"), dict):
                    known.setdefault(_digest(t.user_attrs["config"]), (t.value, k))
        self.top_times = sorted([t, where[k], d] for d, (t, k) in known.items())[:max(self.top, 1)]
        kth = sorted(t for t, _ in known.values())[self.top - 1] if len(known) >= self.top else float("inf")

        # a stored outcome holds if what its bound skipped is slower than that top-th best; the
        # others (decided against a tighter bound: a search for fewer) are evaluated again
        for k, ts in found.items():
            ok = [t for t in ts if _bound_s(t) >= kth]
            if ok:
                self.earlier[k] = max(ok, key=lambda t: (t.state == optuna.trial.TrialState.COMPLETE, _bound_s(t)))
        by_point: dict = {}
        for d, (t, k) in known.items():
            by_point.setdefault(self.key_of[k], []).append((t, d))
        for point, entries in by_point.items():  # what earlier runs found bounds this one
            self.evaluate.offer(point, entries)

        def keys(indices):
            return {index[i] for i in indices if isinstance(i, int) and 0 <= i < len(index)}

        self.nofit_keys = keys(study.user_attrs.get("swept_nofit", []))
        for pair in study.user_attrs.get("swept_dominated", []):
            if (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], int) and 0 <= pair[0] < len(index)
                    and isinstance(pair[1], (int, float))):
                k = index[pair[0]]
                self.dominated_keys[k] = max(self.dominated_keys.get(k, 0.0), float(pair[1]))
        # (a study from before the bound was recorded kept them as "swept_skipped": decided again)
        self.skipped_keys = self.nofit_keys | {k for k, b in self.dominated_keys.items() if b >= kth}
        self._attrs_written = self._attrs()
        return study

    def _attrs(self) -> tuple:
        where = {k: i for i, k in enumerate(self.key_of)}
        known = {d: (t, i) for t, i, d in self.top_times}
        for t, point, d in self.evaluate.kept():
            known[d] = (t, where[self._key(point)])
        self.top_times = sorted([t, i, d] for d, (t, i) in known.items())[:max(self.top, len(self.top_times))]
        return (sorted(where[k] for k in self.nofit_keys),
                sorted([where[k], b] for k, b in self.dominated_keys.items()), self.top_times)

    @staticmethod
    def _key(point) -> tuple:
        return (point[2], point[1], point[0], point[3], _pipeline_label(point[4], point[5], point[6]), point[7])

    def record(self, k, fits, least, phase: str):
        """Keep the outcome of an outer point and queue its trial; None when it was dominated.
        ``phase`` (sampled, swept, brute force) is stored: a resumed search counts the sampled
        trials already in the study against its budget. Where the bound decided anything, it is
        stored (``bound_s``): the outcome holds for a search whose ``top``-th best is no slower."""
        optuna = self.optuna
        best = fits[0] if fits else None
        self.results[k] = (best, least)
        self.fits[k] = fits
        self.stored += 1
        b = self.evaluate.bound_used
        bounded = {"bound_s": b} if b is not None else {}
        if best is None and least is None:  # every choice was dominated by the incumbent
            self.pending.append(optuna.trial.create_trial(
                params=dict(zip(PARAMS, k)), distributions=self.dists, state=optuna.trial.TrialState.PRUNED,
                user_attrs={"fits": None, "dominated_by_s": self.evaluate.incumbent, "phase": phase, **bounded}))
            return None
        e = best or least
        attrs = {"phase": phase, "config": e.config.to_dict(), "fits": bool(best), "step_time_s": e.step_time_s,
                 "memory_excess_bytes": e.memory_excess_bytes,
                 "peak_memory_gib": round(e.peak_memory_bytes / 2**30, 3), "mfu": round(e.mfu, 4),
                 "breakdown_s": e.breakdown_s, **bounded}
        ft = optuna.trial.create_trial(params=dict(zip(PARAMS, k)), distributions=self.dists,
                                       value=min(e.step_time_s, 1e30), user_attrs=attrs,
                                       constraints={"memory_excess_bytes": e.memory_excess_bytes})
        self.pending.append(ft)
        return ft

    def flush(self, every_s: float = 0.0) -> None:
        """Write pending trials to the storage (at most every ``every_s`` seconds)."""
        if time.perf_counter() - self.last_flush < every_s:
            return
        if self.persistent is not None:
            try:
                _write(self)
            except Exception as e:  # a full disk, a storage gone: stop writing, the search goes on in memory
                self.failure = (f"--storage {self.where[0]!r}: cannot write to study {self.where[1]!r} "
                                f"({storage_failure(e)}); the {self.written} trials of this run written before "
                                "stay in it, the rest of the search ran in memory")
                self.persistent = None
        self.pending.clear()
        self.last_flush = time.perf_counter()

    def brute_force(self, todo, progress) -> None:
        for i, k in enumerate(todo, 1):
            self.record(k, *self.evaluate(self.key_of[k]), "brute force")
            if progress:
                progress(i, len(todo))
            self.flush(every_s=5)

    def _tell_known(self, trial, k) -> bool:
        """Answer a sampled point already known (earlier run or this one); False if it is new."""
        pruned = self.optuna.trial.TrialState.PRUNED
        if k in self.earlier:
            t = self.earlier[k]
            if t.value is None:
                self.memory.tell(trial, state=pruned)
            else:
                trial.set_constraint("memory_excess_bytes", t.user_attrs.get("memory_excess_bytes", 0.0))
                self.memory.tell(trial, t.value)
            return True
        if k in self.results:
            e = self.results[k][0] or self.results[k][1]
            if e is None:
                self.memory.tell(trial, state=pruned)
            else:
                trial.set_constraint("memory_excess_bytes", e.memory_excess_bytes)
                self.memory.tell(trial, e.step_time_s)
            return True
        return False

    def sample(self, target: int, repair, progress, stall: float = float("inf")) -> int:
        """Constrained TPE over (tp, pp, micro-batch size, pipeline, cp), each sample repaired to a
        valid point; returns the number of new points evaluated. ``stall``: stop once that many
        samples in a row were points already known, or after twice ``target`` samples (TPE has
        settled; an exhaustive search's sweep decides the rest, and each sample costs more as the
        study grows); without it, after five times ``target``."""
        run = asks = repeats = 0
        if target > 0 and self.memory is None:
            self._memory_study()
        while run < target and asks < (2 if stall < float("inf") else 5) * target and repeats < stall:
            asks += 1
            trial = self.memory.ask(self.sample_dists)
            k = repair(trial.params)
            if self._tell_known(trial, k):
                repeats += 1
                continue
            repeats = 0
            ft = self.record(k, *self.evaluate(self.key_of[k]), "sampled")
            if ft is None:
                self.memory.tell(trial, state=self.optuna.trial.TrialState.PRUNED)
            else:
                trial.set_constraint("memory_excess_bytes", ft.constraints["memory_excess_bytes"])
                self.memory.tell(trial, ft.value)
            run += 1
            if progress:
                progress(run, target)
            self.flush(every_s=5)
        return run

    def sweep(self, todo, done: int, progress) -> int:
        """Every remaining point under the bound of the top-th best found: exact, and fast once
        the incumbent is good (dominated points skip the schedule simulation). Only points that
        fit are stored; dominated and out-of-memory ones are counted."""
        rest = [k for k in todo if k not in self.results]
        n_total = done + len(rest)
        for i, k in enumerate(rest):
            fits, least = self.evaluate(self.key_of[k])
            if fits:
                self.record(k, fits, least, "swept")
            else:
                self.results[k] = (None, least)
                self.swept_skipped += 1
                self.skipped_keys.add(k)
                if self.evaluate.bound_used is not None:
                    self.dominated_keys[k] = self.evaluate.bound_used
                else:
                    self.nofit_keys.add(k)
            if progress and i % 50 == 0:
                progress(done + i + 1, n_total)
            self.flush(every_s=5)
        if progress:
            progress(n_total, n_total)
        return len(rest)


def search(model, cluster=None, global_batch: int = 0, options: SearchOptions | None = None, *, progress=None,
           phase=None, **overrides) -> SearchResult:
    """Search the space for the ``options.top`` fastest configurations that fit (exactly the
    model's fastest, unless ``exhaustive=False``). ``options``: a :class:`SearchOptions` (each
    field documented there); keyword ``overrides`` replace its fields. Where the storage fails
    mid-search (a full disk) the search finishes in memory and raises a UserError whose
    ``result`` is the whole result. ``progress(done, total)`` is called as trials finish, and
    ``phase(name)`` as each phase starts ("brute force", "sampling", "sweep", "earlier trials",
    "placement")."""
    o = dataclasses.replace(options or SearchOptions(), **overrides)
    gpus, top, trials, storage, study_name = o.gpus, o.top, o.trials, o.storage, o.study_name
    profile, calibration, max_micro_batch, seed, exhaustive = o.profile, o.calibration, o.max_micro_batch, o.seed, \
        o.exhaustive
    framework, place, max_cp, precision, fp8_recipe = o.framework, o.place, o.max_cp, o.precision, o.fp8_recipe
    moe_imbalance, allow_compression, moe_dispatcher = o.moe_imbalance, o.allow_compression, o.moe_dispatcher
    pp_compression_rank, dp_compression_rank = o.pp_compression_rank, o.dp_compression_rank
    t0 = time.perf_counter()
    storage = check_storage(storage)
    check_study_name(study_name)
    if top < 1:
        raise UserError(f"--top {top}: must be a positive number of configurations")
    ctx = System(model, cluster, profile, calibration, framework=framework, moe_imbalance=moe_imbalance,
                 moe_dispatcher=moe_dispatcher)
    world = gpus or ctx.num_devices
    if world > ctx.num_devices:
        raise UserError(f"--gpus {world}: the cluster has only {ctx.num_devices} devices")
    if global_batch <= 0:
        raise UserError(f"--global-batch {global_batch}: must be a positive number of sequences")
    cps = cp_choices(model, world, max_cp) if ctx.framework.cp_comm else (1,)
    precisions = precision_choices(ctx, precision, fp8_recipe)
    points, total, valid, rejected, valid_per_point = count_space(
        model, world, global_batch, max_micro_batch, ctx.framework,
        lambda dp, pp, tp: dp_hierarchical(ctx, dp, pp, tp), cps, precisions, o.max_virtual)
    if not points or not valid:
        raise UserError(f"no valid configuration: global batch {global_batch} on {world} devices; "
                        f"rejected: {', '.join(f'{k} ({v})' for k, v in rejected.items())}")
    placer = None
    if place and ctx.framework.name == "reference":
        # only the reference trainer plays any rank on any device and builds any layer split; the
        # other frameworks take rank = launch order, which the emitted files do not reorder yet
        placer = Placer(ctx, world)
    compression = None
    if allow_compression:
        for name, r in (("--pp-compression-rank", pp_compression_rank), ("--dp-compression-rank", dp_compression_rank)):
            if isinstance(r, bool) or not isinstance(r, int) or r < 1:
                raise UserError(f"{name} {r!r}: must be a positive integer")
        if not ctx.framework.compression:
            raise UserError(f"--allow-compression: framework {ctx.framework.name} cannot run compressed traffic "
                            "(no low-rank pipeline gradients, no PowerSGD on its gradient buffers); "
                            "valid: --framework reference")
        compression = (pp_compression_rank, dp_compression_rank)
    evaluate = Evaluator(ctx, global_batch, valid_per_point, placer, top=top, precisions=precisions,
                          compression=compression)
    budget = trials if trials is not None else 400
    signature = {"model": model.to_dict(), "global_batch": global_batch, "devices": world,
                 "framework": framework_spec(ctx.framework), "cost_model": cost_model_digest(),
                 "max_micro_batch": max_micro_batch,
                 **{k: _digest(v.to_dict()) if v is not None else None
                    for k, v in (("cluster", cluster), ("profile", profile), ("calibration", calibration))}}
    # (each absent at its default, so earlier studies keep their names; placed: the stored step
    # times are those of the placed configurations)
    signature.update({k: v for k, v, default in (
        ("placement", "searched" if place else None, None), ("cp", list(cps), [1]),
        ("precisions", [list(p) for p in precisions], [["bf16", "tensorwise"]]),
        ("moe_imbalance", moe_imbalance, 1.0), ("moe_dispatcher", moe_dispatcher, "alltoall"),
        ("max_virtual", o.max_virtual, MAX_VIRTUAL), ("compression", list(compression) if compression else None, None))
        if v != default})
    name = study_name or default_study_name(model, world, global_batch,
                                            cluster.name if cluster is not None else "profile",
                                            framework_spec(ctx.framework), signature)

    def enter(what):
        if phase is not None:
            phase(what)

    with study_lock(storage, name):
        study = _Study(storage, name, signature, points, evaluate, seed, budget)
        todo = [k for k in study.key_of if k not in study.earlier and k not in study.skipped_keys]
        brute = len(todo) <= budget
        sampler_name = ("brute force" if brute else
                        "TPE, then every point by branch and bound" if exhaustive else "TPE (constrained, multivariate)")
        try:
            if brute:
                enter("brute force")
                study.brute_force(todo, progress)
                run = len(todo)
            else:
                # exhaustive: the sweep decides the answer, so sampled trials already in the study
                # count against the budget (a resumed search finishes the same search)
                target = budget - study.earlier_sampled if exhaustive else budget
                enter("sampling")
                run = study.sample(min(max(target, 0), len(todo)), _Repair(study.key_of), progress,
                                   stall=20 if exhaustive else float("inf"))
                if exhaustive:
                    enter("sweep")
                    run += study.sweep(todo, run, progress)
            study.flush()
        except BaseException as e:  # interrupted (or failed): every finished evaluation goes to the study
            if study.persistent is not None and not isinstance(e, UserError):
                with deferred_signals():
                    study.flush()
                e.autoconf_kept = (f"{study.written} trials of this run and {len(study.earlier)} earlier ones are "
                                   f"kept in study {name!r} in {storage}; rerun the same command to resume")
            raise

    # rank: this run's results plus the earlier runs' best points (only each point's best was
    # stored: the `top` best earlier points are evaluated again for their runners-up; a
    # configuration among the `top` fastest lies in one of them)
    fitting = [e for fits in study.fits.values() for e in fits]
    earlier_fit = sorted(((k, t) for k, t in study.earlier.items()
                          if t.user_attrs.get("fits") and "config" in t.user_attrs and t.value is not None),
                         key=lambda kt: kt[1].value)
    if earlier_fit:
        enter("earlier trials")
    for i, (k, _) in enumerate(earlier_fit[:top], 1):
        fitting.extend(evaluate.reevaluate(study.key_of[k]))
        if progress:
            progress(i, min(top, len(earlier_fit)))
    fitting.sort(key=lambda e: e.step_time_s)
    placement, t_place = (), time.perf_counter()
    if placer is not None and fitting:
        enter("placement")
        fitting, placement = _improve_placements(placer, fitting[:top], progress=progress)
    t_place = time.perf_counter() - t_place
    rejected = dict(rejected)
    for k2, v2 in evaluate.rejected.items():
        rejected[k2] = rejected.get(k2, 0) + v2
    slower = evaluate.dominated + evaluate.pruned
    if slower:
        rejected[f"slower than the {_nth_best(top)} found (bound, not simulated)"] = slower
    notes = []
    if not brute and not exhaustive:
        notes.append(f"sampled {run} of {len(points)} outer points ({len(todo)} not yet in the study); "
                     f"raise --trials to cover more, or rerun to continue the study")
    if study.swept_skipped:
        notes.append(f"{study.swept_skipped} outer points were dominated by the {_nth_best(top)} found or did "
                     "not fit (not stored in the study)")
    if place and placer is None:
        notes.append(f"placement not searched: {ctx.framework.name} runs rank r on the r-th launched process, "
                     "and the launch files keep that order (autoconf's reference trainer places any rank on any "
                     "device)")
    if compression is not None:
        notes.append("lossy communication allowed (--allow-compression): compressed gradients change the "
                     "numerics of training (low-rank pipeline gradients, PowerSGD with error feedback); "
                     "check the loss before a long run")
        notes.extend(compression_savings(fitting[:top], ctx))
    result = SearchResult(top=tuple(fitting[:top]), rejected=rejected, space_size=total, valid=valid,
                          outer_points=len(points), trials_run=study.stored,
                          trials_total=len(study.earlier) + study.stored, estimates=evaluate.estimates,
                          sampler=sampler_name, study_name=name, storage=storage,
                          elapsed_s=time.perf_counter() - t0,
                          smallest_memory=evaluate.smallest if not fitting else None, notes=tuple(notes),
                          placement=placement, placement_s=t_place if placement else 0.0,
                          evaluated=tuple(evaluate.points) + tuple(
                              (ParallelConfig.from_dict(t.user_attrs["config"]), t.user_attrs["step_time_s"],
                               t.user_attrs["peak_memory_gib"] * 2**30, t.user_attrs["fits"])
                              for t in study.earlier.values()
                              if {"config", "step_time_s", "peak_memory_gib", "fits"} <= t.user_attrs.keys()),
                          resumed=study.resumed, earlier_trials=len(study.earlier))
    if study.failure is not None:  # the storage failed mid-search: the whole result rides on the error
        raise _with_result(UserError(study.failure), result)
    return result


def _with_result(e: UserError, result: SearchResult) -> UserError:
    """``e`` carrying the in-memory ``result`` (``e.result``, its storage None: the study holds only
    part of it) so that a caller prints it before the error."""
    e.result = dataclasses.replace(result, storage=None)
    return e


def _nth_best(n: int) -> str:
    """"best" for 1, else "2nd best", "5th best", "21st best"."""
    if n == 1:
        return "best"
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix} best"


def _improve_placements(placer, top: list, max_evaluations: int = 200, budget_s: float = 20.0, progress=None):
    """The local search (``study.placer.Placer.improve``) on each of the best configurations, ranked
    again; with what placement gained for each. ``budget_s`` bounds the whole (each configuration
    gets an equal share of what is left)."""
    t0 = time.perf_counter()
    out = []
    for i, e in enumerate(top):
        if progress:
            progress(i, len(top))
        share = (budget_s - (time.perf_counter() - t0)) / (len(top) - i)
        better, evals = placer.improve(e.config, max_evaluations=max_evaluations,
                                       deadline=time.perf_counter() + max(share, 0.0))
        out.append((better, placer.outcome(better, e.step_time_s, evals)))
    if progress:
        progress(len(top), len(top))
    out.sort(key=lambda pair: pair[0].step_time_s)
    return [e for e, _ in out], tuple(o for _, o in out)

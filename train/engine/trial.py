"""One Optuna trial seen from inside its job: reports at each evaluation, the pruning verdict
agreed by every rank, and the trial's end told to the study.

The sweeper (train/launch/study.py, hydra_plugins/train_launcher/optuna_sweeper.py) hands a job
`trainer.trial=<number>` and `trainer.study=<storage>::<study name>`. Only rank 0 opens the
study (one reader of the shared storage per job, not one per rank); it reports the objective at
each evaluation, asks the study's pruner, and shares the verdict with one collective, so that
all ranks leave the loop together. A requeued job does not report an epoch twice: the steps the
trial holds already are skipped. A thread on rank 0 writes a heartbeat into the trial, so that
a sweep resumed after its job died can tell a dead trial from a slow one.

Light at import (no torch): the sweep's driver (train/launch/study.py) uses its pruners and
storage; the collectives are imported where a rank calls them.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from train.config.groups import TrainConfig

log = logging.getLogger("train")

SEPARATOR = "::"
"""Between the storage URL and the study name in trainer.study."""
PRUNER_ATTR = "pruner"
"""The study's user attribute holding the pruner's spec ({name: kwargs}), set by the sweeper."""
HEARTBEAT_ATTR = "heartbeat"
HEARTBEAT_S_ATTR = "heartbeat_s"


def build_pruner(spec: dict[str, Any] | None) -> Any:
    """Optuna's pruner for a spec {"name": ..., **kwargs}; NopPruner for None. ValueError for
    an unknown name (the sweeper checks it before anything starts)."""
    import optuna

    if not spec:
        return optuna.pruners.NopPruner()
    kinds = {"median": optuna.pruners.MedianPruner,
             "percentile": optuna.pruners.PercentilePruner,
             "successive_halving": optuna.pruners.SuccessiveHalvingPruner,
             "asha": optuna.pruners.SuccessiveHalvingPruner,
             "hyperband": optuna.pruners.HyperbandPruner,
             "threshold": optuna.pruners.ThresholdPruner,
             "none": optuna.pruners.NopPruner}
    kwargs = {k: v for k, v in spec.items() if k != "name"}
    name = str(spec.get("name"))
    if name not in kinds:
        raise ValueError(f"unknown pruner {name!r}: one of {', '.join(sorted(kinds))}")
    return kinds[name](**kwargs)


def storage_of(url: str) -> Any:
    """Optuna storage for a URL: a path (or journal:<path>) is a journal file, which needs no
    server and is safe on a shared filesystem; anything else is Optuna's own URL (sqlite://)."""
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    if "://" in url:
        return url
    path = url.removeprefix("journal:")
    return JournalStorage(JournalFileBackend(path))


def load_study(study: str) -> Any:
    """The study of trainer.study, with the pruner the sweeper chose."""
    import optuna

    url, _, name = study.rpartition(SEPARATOR)
    storage = storage_of(url)
    plain = optuna.load_study(study_name=name, storage=storage)
    return optuna.load_study(study_name=name, storage=storage,
                             pruner=build_pruner(plain.user_attrs.get(PRUNER_ATTR)))


def objective_value(name: str, train: Any, val: Any) -> float | None:
    """trainer.objective at this evaluation: a val/ or train/ metric; None otherwise."""
    split, _, key = name.partition("/")
    source = {"val": val, "train": train}.get(split)
    value = None if source is None else source.values.get(key)
    return None if value is None else float(value)


class TrialReporter:
    """Every rank has one; only rank 0's talks to the study."""

    def __init__(self, cfg: TrainConfig, rank: int) -> None:
        self.number = int(cfg.trainer.trial or 0)
        self.objective = cfg.trainer.objective
        self.rank = rank
        self.pruned_at: int | None = None
        self.stop_reason: str | None = None
        self._trial: Any = None
        self._beat: threading.Event | None = None
        if rank == 0:
            study = load_study(str(cfg.trainer.study))
            storage = study._storage  # noqa: SLF001 - Optuna's Trial is built from it
            trial_id = storage.get_trial_id_from_study_id_trial_number(
                study._study_id, self.number)  # noqa: SLF001
            import optuna

            self._trial = optuna.trial.Trial(study, trial_id)
            self._start_heartbeat(float(study.user_attrs.get(HEARTBEAT_S_ATTR, 30)))

    def check_params(self, config: dict[str, Any]) -> None:
        """Collective: every rank's values of the trial's parameters equal the trial's own (a
        rank sampling on its own would train another trial: lightning-hydra-template#639)."""
        from train.distributed import process_group as distributed

        params = self._trial.params if self.rank == 0 else None
        [params] = distributed.gather_to_all(params)[:1]
        mine = {k: _lookup(config, k) for k in params}
        every = distributed.gather_to_all(mine)
        for rank, seen in enumerate(every):
            wrong = {k: v for k, v in seen.items() if not _same(v, params[k])}
            if wrong:
                raise RuntimeError(f"trial {self.number}: rank {rank} has {wrong}, the trial "
                                   f"{ {k: params[k] for k in wrong} }")
        log.info("trial %d: the same parameters on all %d rank(s): %s", self.number,
                 len(every), params)

    def should_stop(self, epochs_done: int, train: Any, val: Any, last: bool = False) -> bool:
        """Collective, at each evaluation but the last: report (rank 0) and the pruner's
        verdict, the same on every rank. `epochs_done` (1-based) is the step reported. The last
        evaluation is reported too (the curve the pruners compare later trials against, and
        Hyperband's `max_resource="auto"`, end there) but asks nothing: no collective."""
        from train.distributed import process_group as distributed

        prune = False
        if self.rank == 0:
            try:
                prune = self._report(epochs_done, objective_value(self.objective, train, val),
                                     ask=not last)
            except Exception as e:  # noqa: BLE001 - the peers wait in the collective below
                log.warning("trial %d: could not report epoch %d to the study (%s); "
                            "training on", self.number, epochs_done, e)
        if last or not distributed.any_rank(prune):
            return False
        self.pruned_at = epochs_done
        self.stop_reason = f"pruned by the sweep's pruner after epoch {epochs_done}"
        if self.rank == 0:
            self._trial.set_user_attr("pruned_at", epochs_done)
        return True

    def _report(self, step: int, value: float | None, ask: bool = True) -> bool:
        if value is None:
            return False
        if step in self._trial.storage.get_trial(self._trial._trial_id).intermediate_values:
            # A requeued job runs the epoch again: the trial keeps its first report.
            log.info("trial %d: step %d was reported before this start; not again",
                     self.number, step)
        else:
            self._trial.report(value, step)
        return ask and bool(self._trial.should_prune())

    def tell(self, final: dict[str, float]) -> None:
        """Rank 0, at the end of a job that trained: the trial's end (PRUNED, or COMPLETE with
        the objective). Never raises: the sweeper tells it from summary.json otherwise."""
        if self.rank != 0:
            return
        self._stop_heartbeat()
        import optuna

        try:
            study = self._trial.study
            if self.pruned_at is not None:
                study.tell(self.number, state=optuna.trial.TrialState.PRUNED)
            elif self.objective in final:
                study.tell(self.number, final[self.objective])
        except Exception as e:  # noqa: BLE001 - e.g. told already (a requeued job's rerun)
            log.warning("trial %d: could not tell the study its end: %s", self.number, e)

    def _start_heartbeat(self, every_s: float) -> None:
        self._beat = threading.Event()
        self._trial.set_user_attr(HEARTBEAT_ATTR, time.time())

        def beat() -> None:
            while self._beat is not None and not self._beat.wait(every_s):
                try:
                    self._trial.set_user_attr(HEARTBEAT_ATTR, time.time())
                except Exception as e:  # noqa: BLE001 - a missed beat is no failed job
                    log.warning("trial %d: heartbeat not written: %s", self.number, e)

        threading.Thread(target=beat, name="trial-heartbeat", daemon=True).start()

    def _stop_heartbeat(self) -> None:
        if self._beat is not None:
            self._beat.set()
            self._beat = None

    def close(self) -> None:
        self._stop_heartbeat()


def _lookup(config: dict[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, int | float) and isinstance(b, int | float):
        return abs(float(a) - float(b)) <= 1e-12 * max(1.0, abs(float(b)))
    return str(a) == str(b)

"""What both launchers do before the first job starts: pre-flight every job of the sweep, then
append the experiment and parent run ids to each job's overrides.

The ids reach jobs this one way, as explicit overrides (`tracking.experiment_id=...`,
`tracking.parent_run_id=...`): no environment variables (sites may submit with
--export=NONE), no module state.
"""

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

from omegaconf import open_dict

from train.errors import TrainError


def refuse(message: object) -> NoReturn:
    """One clear message and exit code 2: nothing has started or been submitted."""
    print(f"\nerror: {message}\n", file=sys.stderr)
    raise SystemExit(2)


@contextmanager
def nothing_left_behind(launcher: Any) -> Iterator[None]:
    """A command that ends inside (a refusal, a dry run: SystemExit) leaves no
    `multirun/<date>/<time>/` behind: Hydra's sweeper made it for multirun.yaml alone before
    calling the launcher."""
    try:
        yield
    except SystemExit:
        forget_sweep_dir(str(launcher.config.hydra.sweep.dir))
        raise


def forget_sweep_dir(sweep_dir: str) -> None:
    """The sweep directory, removed only while empty but for multirun.yaml, and its parents
    only below the working directory (never a directory that holds anything else)."""
    leaf, cwd = Path(sweep_dir).absolute(), Path.cwd()
    if not leaf.is_dir() or {p.name for p in leaf.iterdir()} - {"multirun.yaml"}:
        return
    (leaf / "multirun.yaml").unlink(missing_ok=True)
    for directory in [leaf, *leaf.parents]:
        if directory != leaf and cwd not in directory.parents:
            break
        try:
            directory.rmdir()
        except OSError:
            break


def job_configs(launcher: Any, job_overrides: Sequence[Sequence[str]]) -> list[Any]:
    """Each job's composed config as TrainConfig, as the job itself will see it."""
    from train.config import schema

    assert launcher.hydra_context is not None and launcher.config is not None
    typed = []
    for overrides in job_overrides:
        cfg = launcher.hydra_context.config_loader.load_sweep_config(launcher.config,
                                                                     list(overrides))
        with open_dict(cfg):
            del cfg["hydra"]
        try:  # e.g. model=custom without model._target_
            typed.append(schema.to_typed(schema.to_container(cfg)))
        except TrainError as e:
            refuse(e)
    return typed


def preflight_jobs(configs: Sequence[Any], on_slurm: bool = False,
                   dry_run: bool = False) -> str | None:
    """train/launch/preflight.py for all of them; the experiment id (None without tracking or in a
    dry run). A refusal ends the command here."""
    from train.launch.preflight import preflight

    try:
        return preflight(configs, on_slurm=on_slurm, dry_run=dry_run,
                         prepare_tracking=not dry_run)
    except TrainError as e:
        refuse(e)


def with_ids(launcher: Any, job_overrides: Sequence[Sequence[str]],
             experiment_id: str | None) -> tuple[list[list[str]], str | None]:
    """Each job's overrides with the ids appended, and the sweep's parent run id (None for one
    job, or without tracking). The sweep callback creates the parent at its first request."""
    from train.config.groups import handed_overrides
    from train.tracking.sweep import find_callback

    if experiment_id is None:
        return [list(o) for o in job_overrides], None
    callback = find_callback(launcher.hydra_context)
    parent = callback.parent_for_jobs(experiment_id) if callback is not None else None
    handed = handed_overrides(experiment_id, parent)
    return [[*o, *handed] for o in job_overrides], parent


def job_place(launcher: Any, overrides: Sequence[str], num: int, job_id: str) -> Any:
    """Where job `num` writes, resolved as the job itself resolves it (Hydra's sweep directory
    and subdirectory, with its number and id), and the command that runs it there again
    (train/launch/follow.py JobPlace); None where it cannot be resolved."""
    from train.config.groups import typed_by_user
    from train.launch.follow import JobPlace

    assert launcher.hydra_context is not None and launcher.config is not None
    try:
        cfg = launcher.hydra_context.config_loader.load_sweep_config(launcher.config,
                                                                     list(overrides))
        with open_dict(cfg.hydra.job) as job:
            job.id, job.num = job_id, num
        sweep, subdir = str(cfg.hydra.sweep.dir), str(cfg.hydra.sweep.subdir)
    except Exception:  # noqa: BLE001 - the caller then does without (the rank's log, a rerun)
        return None
    return JobPlace(Path(sweep) / subdir,
                    " ".join(["python -m train", *typed_by_user(overrides)]),
                    [f"hydra.sweep.dir={sweep}", f"hydra.sweep.subdir={subdir}"])


def finished_jobs(launcher: Any, job_overrides: Sequence[Sequence[str]], configs: Sequence[Any],
                  initial_job_idx: int, job_ids: Sequence[str] | None = None) -> dict[int, Any]:
    """The jobs of a sweep run again in its directory (`python -m train sweep resume`) that
    finished there already, by index, with their objective: not started again (each would only
    start, read its summary.json and end); none of a new sweep (nothing is looked at). `job_ids`:
    the ids the jobs will have where known before they start (a local job's is its number)."""
    from train.tracking.sweep import find_callback

    callback = find_callback(launcher.hydra_context)
    if len(job_overrides) < 2 or callback is None or not callback.continued:
        return {}
    done = {}
    for i, (overrides, cfg) in enumerate(zip(job_overrides, configs, strict=True)):
        # A subdirectory named by a Slurm job's id resolves elsewhere: started again.
        place = job_place(launcher, overrides, initial_job_idx + i,
                          job_ids[i] if job_ids else "")
        if place is None or not (place.out / "summary.json").is_file():
            continue
        from train.engine.job import finished_already  # (torch: only for a job that has one)

        if (summary := finished_already(cfg, place.out)) is not None:
            done[i] = (summary.get("metrics") or {}).get(cfg.trainer.objective)
    if done:
        print(f"{len(done)} of the sweep's {len(job_overrides)} jobs finished already in their "
              "directories, not started again: #"
              + ", #".join(str(initial_job_idx + i) for i in done), flush=True)
    return done


def resume_hint(launcher: Any) -> str | None:
    """The one command that continues a sweep whose jobs did not all finish (its sweep.json:
    a sweep with tracking), or None."""
    from train.tracking.sweep import SWEEP_FILE

    sweep_dir = Path(str(launcher.config.hydra.sweep.dir))
    if not (sweep_dir / SWEEP_FILE).is_file():
        return None
    return ("to run the jobs that did not finish again, each into its own run (the finished "
            f"ones stay): python -m train sweep resume {sweep_dir}")


def report_failed_jobs(results: Sequence[Any], job_overrides: Sequence[Sequence[str]],
                       initial_job_idx: int, hint: str | None = None) -> None:
    """A local sweep whose jobs failed or were stopped (Ctrl-C, `kill`) ends here, with a line
    per such job - its cause, the job named by its number and the user's overrides - and what
    it kept and how to resume it, then the exit code of the first, instead of Hydra's "Error
    executing job" report and its traceback (in the job's train.log). An error that is not
    the service's own is left to Hydra's report."""
    from hydra.core.utils import JobStatus

    from train.errors import LaunchError, StoppedBySignal

    failed = [(initial_job_idx + i, overrides, r._return_value)
              for i, (r, overrides) in enumerate(zip(results, job_overrides, strict=True))
              if r.status == JobStatus.FAILED]
    if not failed or not all(isinstance(e, TrainError) for _, _, e in failed):
        return
    stopped = next((e for _, _, e in failed if isinstance(e, StoppedBySignal)), None)
    unstarted = [n for n, _, e in failed if stopped is not None and isinstance(e, LaunchError)]
    lines = []
    for n, overrides, e in failed:
        if n not in unstarted:
            head, *kept = _job_lines(e)
            lines += [f"job #{n} ({' '.join(overrides)}): {head}", *kept]
    if unstarted:
        lines.append(f"jobs #{', #'.join(map(str, unstarted))} not started: the sweep was "
                     f"stopped by {stopped.signal_name}")  # type: ignore[union-attr]
    if hint is not None:
        lines.append(hint)
    print("\n" + "\n".join(lines) + "\n", file=sys.stderr, flush=True)
    raise SystemExit((stopped or failed[0][2]).exit_code)


def _job_lines(error: TrainError) -> list[str]:
    """A job's terminal block for the sweep's end: its cause line, and what was kept and how to
    resume it (the launcher's train/launch/outcomes.py Failure, which the error carries); the
    user's frames stay in the job's train.log."""
    lines = [line for line in error.terminal_line().splitlines() if line.strip()]
    failure = getattr(error, "failure", None)
    if failure is not None:
        return [lines[0], *("  " + line for line in failure.after)]
    if len(lines) > 1:  # a traceback without the block: its exception's line
        return [f"{lines[0]} {lines[-1].strip()}"]
    return lines

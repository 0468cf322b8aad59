"""The Hydra application: compose the config; in a rank started by torchrun, srun or submitit,
train; otherwise pre-flight, then start this machine's ranks.

Under `-m` (sweeps) and `+cluster=slurm` the project's launchers (hydra_plugins/train_launcher)
pre-flight every job before the first starts and hand each job the experiment and sweep parent
run ids as overrides; a single run is pre-flighted here.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from train.config import groups as config_lib
from train.config import keys
from train.config.groups import TrainConfig
from train.config.keys import override_hint
from train.config.schema import register_schema, to_container, to_typed
from train.distributed import env as distenv
from train.distributed import process_end
from train.errors import ConfigError, LaunchError, StoppedBySignal, TrainError
from train.launch import joblock, rundir

register_schema()
# hydra.run.dir's and hydra.sweep.dir's defaults: one directory per launch, cached as ${now:}
# is (see rundir.py).
OmegaConf.register_new_resolver("launch_dir", rundir.launch_dir, use_cache=True, replace=True)

# An absolute path: under `python -m train` Hydra would read a relative one as a module name.
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


_sweep_stopped_by: str | None = None
"""A job of this process's local sweep was stopped by this signal (Ctrl-C, `kill`): the jobs
after it are not started, rather than one more Ctrl-C per job."""


def job(cfg: DictConfig) -> float | None:
    """Run one job; returns its objective (trainer.objective) for Hydra's sweepers."""
    global _sweep_stopped_by
    _keep_hydras_short_errors()
    hydra_cfg = HydraConfig.get()
    try:
        if _sweep_stopped_by is not None:
            raise LaunchError(f"not started: the sweep was stopped by {_sweep_stopped_by}")
        # What the user typed (also inside a Slurm job, where argv is submitit's).
        overrides = config_lib.typed_by_user(hydra_cfg.overrides.task)
        rerun_of = cfg.get("tracking", {}).get("rerun_of")  # python -m train rerun <run_id>
        used = cfg.get("eval", {})  # python -m train eval|predict <run_id>
        verb = (["rerun", rerun_of] if rerun_of else
                [used.get("purpose"), used.get("run_id")] if used.get("run_id") else [])
        command = " ".join(["python -m train", *verb, *overrides])
        return run(cfg, hydra_cfg.runtime.output_dir, command,
                   preflighted=launched_by_us(hydra_cfg))
    except TrainError as e:
        if hydra_cfg.mode == RunMode.MULTIRUN:
            if isinstance(e, StoppedBySignal):
                _sweep_stopped_by = e.signal_name
            raise  # Hydra marks this job FAILED; the other jobs of the sweep go on
        # A single job: the message alone, no stack of Hydra frames around it.
        if distenv.external_world_size() is None:  # torchrun's ranks share the directory
            rundir.discard_unused(Path(hydra_cfg.runtime.output_dir))
        print(f"\n{e.terminal_line()}\n", file=sys.stderr)
        raise SystemExit(e.exit_code) from None


_hydra_main = hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="train")(job)
_FULL_ERROR = "HYDRA_FULL_ERROR"
_full_error_is_ours = False


def main() -> None:
    """`python -m train`: Hydra's main, with a mistake in the command line (an unknown key, a
    value of the wrong type, a missing config option, bad override syntax) told in one line
    with exit code 2 instead of Hydra's report. HYDRA_FULL_ERROR=1 still shows the trace."""
    global _full_error_is_ours
    if (group := help_group(sys.argv[1:])) is not None:
        print(keys.group_help(group))
        return
    if _FULL_ERROR in os.environ:
        _hydra_main()
        return
    # Hydra raises instead of printing its report (and exiting 1) only with this set.
    os.environ[_FULL_ERROR], _full_error_is_ours = "1", True
    try:
        _hydra_main()
    except (HydraException, OmegaConfBaseException) as e:
        rundir.discard_unused()
        print(f"\nerror: {one_line(e)}\n", file=sys.stderr)
        raise SystemExit(2) from None
    finally:
        _keep_hydras_short_errors()


def unknown_help_topic(argv: list[str]) -> str | None:
    """The one line for `--help <word>` where the word is no config group (Hydra would take it
    for an override and say it misses its '='); None otherwise."""
    for flag, word in zip(argv, argv[1:], strict=False):
        if flag in ("--help", "-h") and not word.startswith("-") and "=" not in word and \
                word not in keys.groups():
            return (f"error: --help {word}: no config group {word}; the groups are "
                    f"{', '.join(keys.groups())} (`python -m train --help` shows them all).")
    return None


def help_group(argv: list[str]) -> str | None:
    """`python -m train --help trainer`: the group whose keys and docs to show (Hydra's own
    --help shows the groups' options and the composed config)."""
    for flag, group in zip(argv, argv[1:], strict=False):
        if flag in ("--help", "-h") and group in keys.groups():
            return group
    return None


def _keep_hydras_short_errors() -> None:
    """Composition is over once a job runs: its own errors, its ranks and the jobs it submits
    keep Hydra's usual short report."""
    global _full_error_is_ours
    if _full_error_is_ours:
        os.environ.pop(_FULL_ERROR, None)
        _full_error_is_ours = False


_NOISE = ("full_key:", "reference_type=", "object_type=", "See https://", "Config search path",
          "provider=", "To append to your config")  # `+key` cannot add what no dataclass has


def one_line(error: BaseException) -> str:
    """A Hydra or OmegaConf error and its causes as one line (options listed inline)."""
    texts: list[str] = []
    current: BaseException | None = error
    while current is not None:
        parts: list[str] = []
        for raw in str(current).splitlines():
            line = raw.strip()
            if not line or line.startswith(_NOISE):
                continue
            if raw.startswith("\t") and parts:  # an option under "Available options in ..."
                parts[-1] += (" " if parts[-1].endswith(":") else ", ") + line
            else:
                parts.append(line)
        texts.append(" ".join(parts))
        current = current.__cause__
    hint = override_hint(_chain_text(error))
    return _with_hint(": ".join(t.rstrip(".") for t in texts if t), hint)


def _with_hint(line: str, hint: str | None) -> str:
    return line + (f"; {hint} " if hint else ". ") + "`python -m train --help` lists every setting."


def _chain_text(error: BaseException) -> str:
    """The error and its causes, unfiltered (the hint reads Hydra's "To append" line)."""
    texts, current = [], error
    while current is not None:
        texts.append(str(current))
        current = current.__cause__
    return "\n".join(texts)


def _typed(cfg: DictConfig) -> tuple[dict, TrainConfig]:
    """The composed config as a plain dict and typed; a key no dataclass has (`+trainer.foo=1`)
    or a value of the wrong type is a ConfigError."""
    try:
        config = to_container(cfg)
        return config, to_typed(config)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", "") or "config"
        line = one_line(e)
        if hint := override_hint(f"{key}: {e}"):  # `+trainer.epoch=1`: no such key to add
            line = _with_hint(line.partition(". `python -m train --help`")[0], hint)
        raise ConfigError(f"{key}: {line}") from None


def launched_by_us(hydra_cfg: DictConfig) -> bool:
    """A job of a multirun started by one of this project's launchers, which pre-flighted it
    together with the rest of its sweep."""
    launcher = str(hydra_cfg.launcher.get("_target_", ""))
    return (hydra_cfg.mode == RunMode.MULTIRUN
            and launcher.startswith("hydra_plugins.train_launcher."))


def run(cfg: DictConfig, output_dir: str, command: str,
        preflighted: bool = False) -> float | None:
    """Run the job this process was asked for; returns the objective for Hydra sweepers.
    `preflighted`: the launcher checked this job already."""
    config, typed = _typed(cfg)
    from train.launch.preflight import preflight

    if typed.cluster is not None and typed.cluster.ranks == "per_node":
        return objective(typed, _run_node_task(typed, config, output_dir, command))
    external = distenv.external_world_size()
    if external is not None:
        # torchrun / srun / submitit started every rank: each validates, then trains.
        _check_without_preflight(typed, external)
        from train.engine.job import run_rank

        # The job's first rank holds its directory for all of its ranks (they share it).
        with joblock.held(Path(output_dir), holds=distenv.external_rank() == 0):
            return objective(typed, run_rank(config, output_dir, command))
    from train.launch.local import reads_shards_itself, run_in_process, start_local_ranks
    from train.launch.rank_server import rank_context

    with joblock.held(Path(output_dir)):  # before anything is checked, created or started
        nproc = typed.distributed.nproc_per_node
        own_processes = nproc > 1 or reads_shards_itself(config["data"])
        if own_processes:
            # The ranks' fork server imports torch (~3 s) while the pre-flight runs; it
            # starts no rank, and ends with this process if the pre-flight refuses the job.
            rank_context(config["data"])
        if not preflighted:
            preflight([typed], output_dir=output_dir)
        if not own_processes:
            return objective(typed, run_in_process(config, output_dir, command))
        return objective(typed, start_local_ranks(config, output_dir, command, nproc))


def _check_without_preflight(typed: TrainConfig, world_size: int) -> None:
    """What a process started by Slurm or torchrun checks itself, as no pre-flight ran for it:
    the config on the job's world size, and options only CUDA can serve."""
    from train.distributed import devices
    from train.launch.preflight import validate

    validate(typed, world_size)
    if problem := devices.refuse_without_cuda(typed.distributed) or \
            devices.refuse_memory_snapshot(typed.trainer.memory_snapshot,
                                           typed.distributed.device):
        raise ConfigError(problem)


def _run_node_task(typed: TrainConfig, config: dict, output_dir: str,
                   command: str) -> dict[str, float]:
    """The one Slurm task of a node (cluster.ranks=per_node): start and supervise this node's
    ranks with the local launcher, as torchrun would; a failing rank makes this task exit
    non-zero, and srun's --kill-on-bad-exit then ends the other nodes' tasks."""
    from train.config.cluster import ranks_per_node
    from train.launch.local import start_local_ranks

    assert typed.cluster is not None
    per_node = ranks_per_node(typed.cluster)
    node = distenv.slurm_node_task(per_node)
    _check_without_preflight(typed, node.world_size)  # as every rank of a per-task job does
    # The first node's task holds the job's directory for every rank (they share it).
    with joblock.held(Path(output_dir), holds=node.node_rank == 0):
        try:
            final = start_local_ranks(config, output_dir, command, per_node, node)
        finally:  # as each of its ranks (StopSignals): a late time-limit USR2 ends nothing
            from train.distributed.stopping import ignore_time_limit_warning

            ignore_time_limit_warning()
    process_end.end_quickly_under_submitit()  # as a rank's task: no teardown after its result
    return final


def objective(cfg: TrainConfig, final: dict[str, float]) -> float | None:
    return final.get(cfg.trainer.objective)

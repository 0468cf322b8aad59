"""Where this process sits in the job: the ONE module that reads the launch environment.

No torch here (the launcher imports it before any rank starts). It understands three
launchers and refuses a half-set environment:

- torchrun, or this package's local launcher: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
  MASTER_ADDR, MASTER_PORT are all set;
- a Slurm job step (`srun`, or submitit, which runs its tasks through srun): submitit's
  JobEnvironment reads SLURM_* and TorchDistributedEnvironment derives MASTER_ADDR (first node);
  MASTER_PORT is seeded by the job id (`job_master_port`); both are exported torchrun-style;
- nothing: a plain `python -m train`, which the local launcher turns into N ranks;
- a Slurm job step with one task per node (`cluster.ranks=per_node`): that task is a local
  launcher for its node's ranks (`slurm_node_task`), which then see torchrun-style variables.
"""

from __future__ import annotations

import os
import random
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from train.errors import DistEnvError as DistEnvError  # re-exported

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT")


MASTER_PORTS = (20000, 32767)
"""Where a Slurm job's MASTER_PORT is drawn, seeded by its job id so that every task derives the
same one: below Linux's default ephemeral range (32768-60999), from which the kernel hands out
ports to outgoing connections. submitit draws from 20000-60000, where any connection on the
master node may hold the port: a sweep's array task failed with EADDRINUSE."""


LAUNCHER_VAR = "TRAIN_LAUNCHER"
"""Set by the local launcher for its ranks (`local` for a plain `python -m train`, `slurm per
node` / `submitit per node` for a Slurm node's task): the run's `launcher` tag then says what
started them; torchrun-style variables without it are a user's torchrun."""
LOCAL = "local"
STORE_PORT_FILE_VAR = "TRAIN_STORE_PORT_FILE"
"""Set by the local launcher for the ranks of a job on this machine alone: the file in which
rank 0 leaves the port its store bound (the OS's choice, as it bound it) for the other ranks,
instead of a port found free before they started, which another process may take meanwhile
(train/distributed/process_group.py)."""
FORK_SERVER_VAR = "TRAIN_FORK_SERVER_OF"
"""The launcher's pid, in the environment its rank fork server starts with alone
(train/launch/fork_server.py): the server ends with that process."""


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str
    """local (`python -m train` on this machine), torchrun (the user's), slurm (srun), submitit,
    or `slurm per node` / `submitit per node` (cluster.ranks=per_node)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def on_one_node(cls, rank: int, world_size: int) -> DistEnv:
        """Rank `rank` of `world_size` ranks on this machine, as the local launcher starts
        them (for code that builds a rank's share without a process group, e.g. tests)."""
        return cls(rank, rank, world_size, world_size, "127.0.0.1", 0, LOCAL)


def torchrun_env(rank: int, local_rank: int, world_size: int, local_world_size: int,
                 master_addr: str, master_port: int) -> dict[str, str]:
    """The variables torchrun sets for one rank (used by the local launcher)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(local_world_size), "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port)}


@dataclass(frozen=True)
class NodeRanks:
    """One node's share of a job, as the local launcher starts it: `per_node` ranks, global
    rank = node_rank x per_node + local rank."""

    node_rank: int
    nodes: int
    per_node: int
    master_addr: str
    master_port: int
    launcher: str = LOCAL
    store_port_file: str = ""
    """Where rank 0 leaves its store's port for the others (STORE_PORT_FILE_VAR); "" = they
    all take master_port."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node

    def rank(self, local_rank: int) -> int:
        return self.node_rank * self.per_node + local_rank

    def env(self, local_rank: int) -> dict[str, str]:
        """The variables of one of this node's ranks."""
        env = torchrun_env(self.rank(local_rank), local_rank, self.world_size, self.per_node,
                           self.master_addr, self.master_port)
        port_file = {STORE_PORT_FILE_VAR: self.store_port_file} if self.store_port_file else {}
        return {**env, LAUNCHER_VAR: self.launcher, **port_file}

    def remove_store_port_file(self) -> None:
        """Once the ranks have ended (every one that got as far has read it)."""
        if self.store_port_file:
            Path(self.store_port_file).unlink(missing_ok=True)


def this_machine(nproc: int, output_dir: str | None = None) -> NodeRanks:
    """A job of `nproc` ranks on this machine alone (a plain `python -m train`); with its
    `output_dir`, the ranks meet at the port rank 0's store binds, left in a file there named
    for this launch (STORE_PORT_FILE_VAR)."""
    port_file = ("" if output_dir is None else
                 str(Path(output_dir) / f".store-port-{os.getpid()}-{time.time_ns()}"))
    return NodeRanks(0, 1, nproc, "127.0.0.1", free_port(), store_port_file=port_file)


def slurm_node_task(per_node: int, environ: Mapping[str, str] = os.environ) -> NodeRanks:
    """Inside the one Slurm task of a node (cluster.ranks=per_node): this node's place in the
    job. The master is the first node and the port is seeded by the job id, as submitit does
    for one task per rank. Refuses a step that is not one task per node, and torchrun-style
    variables already set (a half-set environment: this task sets them for its ranks)."""
    present = [v for v in TORCHRUN_VARS if v in environ]
    if present:
        raise DistEnvError(
            f"cluster.ranks=per_node: {', '.join(present)} set in the node's task, which sets "
            "them for the ranks it starts. Unset them (cluster.setup, the container's "
            "environment), or use cluster.ranks=per_task.")
    if not in_slurm_step(environ):
        raise DistEnvError("cluster.ranks=per_node runs only inside a Slurm job step "
                           "(`python -m train +cluster=slurm cluster.ranks=per_node`).")
    tasks = int(environ.get("SLURM_STEP_NUM_TASKS", environ.get("SLURM_NTASKS", "0")))
    nodes = int(environ.get("SLURM_STEP_NUM_NODES", environ.get("SLURM_JOB_NUM_NODES", "0")))
    if tasks != nodes:
        raise DistEnvError(
            f"cluster.ranks=per_node needs one Slurm task per node, but this step has {tasks} "
            f"task(s) on {nodes} node(s): submit with `+cluster=slurm cluster.ranks=per_node`, "
            "which asks for one (or use cluster.ranks=per_task).")
    os.environ.setdefault("SUBMITIT_EXECUTOR", "slurm")
    from submitit.helpers import TorchDistributedEnvironment

    job = TorchDistributedEnvironment()  # reads SLURM_*; exports nothing
    launcher = "submitit per node" if "SUBMITIT_FOLDER" in environ else "slurm per node"
    return NodeRanks(node_rank=job.rank, nodes=nodes, per_node=per_node,
                     master_addr=job.master_addr, master_port=job_master_port(environ),
                     launcher=launcher)


def job_master_port(environ: Mapping[str, str] = os.environ) -> int:
    """The Slurm job's MASTER_PORT, the same in each of its tasks (MASTER_PORTS)."""
    return random.Random(environ["SLURM_JOB_ID"]).randint(*MASTER_PORTS)


def in_slurm_step(environ: Mapping[str, str] = os.environ) -> bool:
    """True inside an `srun` step; False in the batch script itself or on a login node."""
    return "SLURM_STEP_ID" in environ and "SLURM_PROCID" in environ and "SLURM_JOB_ID" in environ


def external_world_size(environ: Mapping[str, str] = os.environ) -> int | None:
    """World size when torchrun or Slurm started one process per rank; None otherwise."""
    if "WORLD_SIZE" in environ:
        return int(environ["WORLD_SIZE"])
    if in_slurm_step(environ):
        return int(environ.get("SLURM_STEP_NUM_TASKS", environ.get("SLURM_NTASKS", "1")))
    return None


def external_rank(environ: Mapping[str, str] = os.environ) -> int | None:
    """This process's rank when torchrun or Slurm started one process per rank; None
    otherwise (before detect() has exported anything)."""
    if "RANK" in environ:
        return int(environ["RANK"])
    if in_slurm_step(environ):
        return int(environ["SLURM_PROCID"])
    return None


def detect() -> DistEnv:
    """Read this rank's place in the job from the environment, exporting torchrun-style vars."""
    present = [v for v in TORCHRUN_VARS if v in os.environ]
    if not present and in_slurm_step():
        _export_from_slurm()
        launcher = "submitit" if "SUBMITIT_FOLDER" in os.environ else "slurm"
        present = list(TORCHRUN_VARS)
    else:
        launcher = os.environ.get(LAUNCHER_VAR, "torchrun")
    missing = [v for v in TORCHRUN_VARS if v not in os.environ]
    if missing:
        raise DistEnvError(
            f"Half-set distributed environment: {', '.join(present)} set but "
            f"{', '.join(missing)} missing. Launch with torchrun, srun, or plain `python -m train`"
            " (which starts distributed.nproc_per_node ranks itself), or unset these variables.")
    env = DistEnv(rank=int(os.environ["RANK"]), local_rank=int(os.environ["LOCAL_RANK"]),
                  world_size=int(os.environ["WORLD_SIZE"]),
                  local_world_size=int(os.environ["LOCAL_WORLD_SIZE"]),
                  master_addr=os.environ["MASTER_ADDR"], master_port=int(os.environ["MASTER_PORT"]),
                  launcher=launcher)
    if not (0 <= env.rank < env.world_size and 0 <= env.local_rank < env.local_world_size):
        raise DistEnvError(f"Inconsistent distributed environment: {env}.")
    return env


def _export_from_slurm() -> None:
    # submitit's JobEnvironment knows how to read SLURM_* (node lists, local ids) and its
    # TorchDistributedEnvironment derives the master address (its port is replaced); a plain
    # `srun python -m train` gets the same treatment by naming the slurm plugin.
    os.environ.setdefault("SUBMITIT_EXECUTOR", "slurm")
    from submitit.helpers import TorchDistributedEnvironment

    # Keep every GPU visible: we pick cuda:<local_rank> ourselves.
    TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    os.environ["MASTER_PORT"] = str(job_master_port())  # instead of submitit's: MASTER_PORTS


def free_port() -> int:
    """A port no one listens on now; the OS picks from its ephemeral range."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

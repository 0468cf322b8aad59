"""Sharded checkpoints (distributed.strategy=fsdp): a directory `step-<N>.dcp` that every rank
writes its own shard of with `torch.distributed.checkpoint` - no rank gathers the model.

Whole or absent, as a single-file checkpoint: the ranks write into `step-<N>.dcp.tmp`; once all
have (a barrier), rank 0 adds `meta.pt` (epoch, step, the data position, every rank's RNG state
and running sums, the schedule, the MLflow run: the same fields as a single-file checkpoint
but the tensors) and renames the directory. A directory without `meta.pt` or DCP's `.metadata`
is not a checkpoint (`load_meta`), and a `.tmp` one is a crash's leftover, removed at the next
save.

With distributed.fsdp.async_checkpoint the shards are written in the background (`begin`
with `background`); the checkpoint is completed (`finish`: meta.pt, the rename) before the next
one starts and before the job ends (train/engine/checkpoint.py Checkpointer.finish).

DCP reshards on load: the checkpoint loads at any world size, and into a DDP job as well
(`load`: the state dict of the model and optimiser as this job holds them is the template).
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from train.engine import fsdp

META = "meta.pt"
SUFFIX = ".dcp"


def path_for(folder: Path, step: int) -> Path:
    return folder / f"step-{step:09d}{SUFFIX}"


@dataclass
class Unfinished:
    """A sharded checkpoint whose shards are being written (`begin`); `finish` completes it."""

    final: Path
    meta: dict[str, Any] | None
    """Rank 0's fields (meta.pt); None on the other ranks."""
    writing: Future | None = None
    """This rank's shards still being written in the background (trainer.async_checkpoint);
    None once they are on disk."""

    @property
    def tmp(self) -> Path:
        return self.final.with_name(self.final.name + ".tmp")


def save(folder: Path, step: int, module: nn.Module, optimizer: torch.optim.Optimizer,
         meta: dict[str, Any] | None, expendable: list[Path] | None = None) -> Path:
    """Collective: every rank writes its shards; rank 0 (the one passing `meta`) completes
    the checkpoint. Returns its final path."""
    return finish(begin(folder, step, module, optimizer, meta, expendable))


def begin(folder: Path, step: int, module: nn.Module, optimizer: torch.optim.Optimizer,
          meta: dict[str, Any] | None, expendable: list[Path] | None = None,
          background: bool = False, ema: dict[str, Any] | None = None) -> Unfinished:
    """Collective: every rank writes its shards into `step-<N>.dcp.tmp`, or with `background`
    starts to (`dcp.async_save`: the state is copied to host memory, then written by a thread
    while training goes on, its collectives on a group of their own). Room is made first
    (`room`): `expendable`, rank 0's older checkpoints but the newest, go if that is what it
    takes; DiskFull on every rank if even that is not enough, before anyone writes. `ema`:
    trainer.ema's average (train/engine/ema.py), sharded as the model is."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    unfinished = Unfinished(path_for(folder, step), meta)
    if meta is not None:
        folder.mkdir(parents=True, exist_ok=True)
        clear_leftovers(folder)
    dist.barrier()  # the folder is clean before anyone writes
    fsdp.share_rank0_buffers(module)  # one model in the checkpoint, as DDP's
    model_sd, optim_sd = get_state_dict(module, optimizer)
    state = {"model": model_sd, "optim": optim_sd, **({} if ema is None else {"ema": ema})}
    room(folder, unfinished.final, local_bytes(state), expendable if meta is not None else None)
    if background:
        unfinished.writing = dcp.async_save(state, checkpoint_id=unfinished.tmp,
                                            process_group=_background_group())
    else:
        dcp.save(state, checkpoint_id=unfinished.tmp)
    return unfinished


def finish(unfinished: Unfinished) -> Path:
    """Collective: once every rank's shards are on disk, rank 0 adds meta.pt and renames the
    directory into place (whole or absent). Returns the final path."""
    import torch.distributed as dist

    if unfinished.writing is not None:
        unfinished.writing.result()
        unfinished.writing = None
    dist.barrier()  # every shard is on disk
    final, tmp = unfinished.final, unfinished.tmp
    if unfinished.meta is not None:
        with open(tmp / META, "wb") as f:
            torch.save(unfinished.meta, f)
            f.flush()
            os.fsync(f.fileno())
        shutil.rmtree(final, ignore_errors=True)  # the same step again (a resumed job)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
    return final


_GROUPS: dict[int, Any] = {}


def _background_group() -> Any:
    """A gloo group of every rank for background saves (made by all ranks at their first),
    so that their collectives never interleave with training's on the default group."""
    import torch.distributed as dist

    world = id(dist.group.WORLD)  # a new default group (in-process tests) gets its own
    if world not in _GROUPS:
        _GROUPS.clear()
        _GROUPS[world] = dist.new_group(backend="gloo")
    return _GROUPS[world]


def local_bytes(state: Any) -> int:
    """The bytes of this rank's part of a state dict's tensors (a DTensor's local shard)."""
    if isinstance(state, dict):
        return sum(local_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(local_bytes(v) for v in state)
    if isinstance(state, torch.Tensor):
        to_local = getattr(state, "to_local", None)
        mine = to_local() if callable(to_local) else state
        return mine.numel() * mine.element_size()
    return 0


def room(folder: Path, final: Path, mine: int, expendable: list[Path] | None) -> None:
    """Collective, before a sharded save: every rank's `mine` bytes summed; rank 0 (the one
    with `expendable`) makes room for them or finds there is none, and every rank learns its
    verdict: all raise DiskFull together rather than some waiting in dcp.save for the others.
    (The ranks' shards are taken to share rank 0's filesystem, as the checkpoint does.)"""
    from train.distributed import process_group as distributed
    from train.engine import safewrite

    needed = sum(distributed.gather_to_all(mine))
    problem = None
    if expendable is not None:
        try:
            safewrite.make_room(folder, needed, expendable, f"checkpoint {final}")
        except safewrite.DiskFull as e:
            problem = str(e)
    verdict = distributed.gather_to_all(problem)[0]
    if verdict is not None:
        raise safewrite.DiskFull(verdict)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_checkpoint_dir(path: Path) -> bool:
    return path.is_dir() and path.name.endswith(SUFFIX)


def load_meta(path: Path) -> dict[str, Any]:
    """The checkpoint's fields but the tensors; ValueError if the directory is not whole."""
    if not (path / ".metadata").is_file() or not (path / META).is_file():
        raise ValueError("not a whole sharded checkpoint (no .metadata or meta.pt)")
    state = torch.load(path / META, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or "step" not in state:
        raise ValueError("not a checkpoint of this tool")
    return state


def load(path: Path, module: nn.Module, optimizer: torch.optim.Optimizer,
         ema: dict[str, Any] | None = None) -> None:
    """Collective: the checkpoint's model and optimiser state into this job's (sharded or
    not), resharded for this world size; `ema`: its trainer.ema average into these tensors."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(module, optimizer)
    state = {"model": model_sd, "optim": optim_sd, **({} if ema is None else {"ema": ema})}
    dcp.load(state, checkpoint_id=path)  # in place, the average's tensors too
    set_state_dict(module, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


def load_model(path: Path, module: nn.Module) -> None:
    """Collective: the checkpoint's model weights alone into `module` (sharded or not),
    resharded for this world size (`python -m train eval`): trainer.ema's average where the
    checkpoint holds one (what the run validated), else the trained weights."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    key = "ema" if load_meta(path).get("ema_in_shards") else "model"
    state = {key: get_model_state_dict(module)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(module, state[key])


def remove(path: Path) -> None:
    """A checkpoint of either kind (keep-K, making room)."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def clear_leftovers(folder: Path) -> None:
    """Remove what a crash mid-save left, `step-*.tmp` of either kind (a single-file save's
    file, a sharded save's directory: an FSDP job resumed as DDP finds the latter): space
    nobody uses, and a name the next save may need."""
    for stale in folder.glob("step-*.tmp"):
        remove(stale)


def size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    return path.stat().st_size

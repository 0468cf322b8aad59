"""What was written before train/ was split into wings still loads (train/_moved.py).

A pickle names a class by its module path. Exceptions sent back from Slurm jobs through
submitit and models that older runs logged pickled name the old paths; checkpoints and unsent
files name no class of the project at all, which the last two tests show.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch

from train.distributed.stopping import Preempted
from train.engine import checkpoint_folder
from train.engine.monitor import Best
from train.errors import ConfigError, JobStoppedError, StoppedBySignal
from train.tracking import records, unsent


def old_pickle(module: str, name: str, *args: str) -> bytes:
    """A protocol-0 pickle of `module.name(*args)` (or of the class itself without args), as
    the code before the move wrote it."""
    call = "(" + "".join(f"V{a}\n" for a in args) + "tR" if args else ""
    return f"c{module}\n{name}\n{call}.".encode()


def test_a_stop_pickled_by_the_old_code_loads_as_the_same_class() -> None:
    stopped = pickle.loads(old_pickle("train.launch", "JobStoppedError", "SIGTERM", "/o"))
    assert type(stopped) is JobStoppedError
    assert (stopped.signal_name, stopped.output_dir, stopped.exit_code) == ("SIGTERM", "/o", 143)
    preempted = pickle.loads(old_pickle("train.stopping", "Preempted", "SIGUSR2"))
    assert type(preempted) is Preempted and isinstance(preempted, StoppedBySignal)
    assert preempted.signal_name == "SIGUSR2"


def test_old_module_paths_name_the_same_objects() -> None:
    import train.stopping  # type: ignore[import-not-found]  # an old path

    import train.distributed.stopping

    assert train.stopping is train.distributed.stopping
    assert pickle.loads(old_pickle("train.config", "ConfigError")) is ConfigError
    from train.models.build import _BasicBlock

    assert pickle.loads(old_pickle("train.models", "_BasicBlock")) is _BasicBlock


def test_a_wing_that_took_an_old_name_still_imports_its_own_modules() -> None:
    # `from train.models import build` must give the module, not the old module's `build`.
    from train.data import build as data_build
    from train.models import build

    assert build.__name__ == "train.models.build"
    assert data_build.__name__ == "train.data.build"


def test_stops_pickle_with_their_signal_name() -> None:
    for error in (Preempted("SIGUSR2"), JobStoppedError("SIGHUP", "/out")):
        again = pickle.loads(pickle.dumps(error))
        assert (type(again), again.signal_name, str(again)) == \
            (type(error), error.signal_name, str(error))


def test_a_checkpoint_cannot_name_a_class_of_the_project(tmp_path: Path) -> None:
    """Checkpoints load weights_only: one holding any project object is refused, so none that
    loads can be broken by a module's move."""
    folder = tmp_path / "checkpoints"
    plain = {"step": 1, "model": {"w": torch.ones(2)}, "monitor": {"best": 0.5}}
    checkpoint_folder.save(folder, plain, keep=2)
    [path] = checkpoint_folder.candidates(folder)
    loaded = checkpoint_folder.load_newest([path])
    assert loaded is not None and loaded.state["monitor"] == {"best": 0.5}
    with_class = {**plain, "step": 2, "monitor": Best(0, 1, "val/loss", "min", 0.5)}
    torch.save(with_class, folder / "step-000000002.pt")
    assert checkpoint_folder.load_newest([folder / "step-000000002.pt"]) is None


def test_an_unsent_file_names_no_class(tmp_path: Path) -> None:
    path = tmp_path / unsent.UNSENT_FILE
    rows = records.Batch(metrics=[("train/loss", 1.0, 0, 1)], params=[("a", "1")])
    header = {"run_id": None, "tracking_uri": "sqlite:///gone.db", "status": "FAILED"}
    unsent.save(path, header, rows,
                [records.Text(text="x", artifact_file="config.yaml"),
                 records.DatasetInput(name="d", digest="ab", num_rows=1,
                                      features_shape=[1], features_dtype="uint8")])
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line.get("record") for line in lines[1:3]] == ["text", "dataset"]
    assert "train." not in path.read_text()  # record kinds by name, no module path
    loaded_header, loaded_rows, waiting = unsent.load(path)
    assert (loaded_header, loaded_rows.metrics, len(waiting)) == (header, rows.metrics, 2)

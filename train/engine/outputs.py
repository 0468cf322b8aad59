"""The job's files beside its outputs and in its run, written by rank 0 alone: best.pt at each
new best evaluation (trainer.save_best), and at the end model.pt, the confusion matrices and
summary.json. Every rank holds a `JobOutputs`; on the others each method does nothing, so the
job script (train/engine/job.py) never asks which rank it is on.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from train.config.groups import TrainConfig
from train.data.build import DataBundle
from train.distributed.env import DistEnv
from train.engine import checkpoint
from train.engine import monitor as monitor_lib
from train.engine.state import TrainState
from train.report.figures import per_class_accuracy, render_confusion
from train.report.metrics import Reduced
from train.report.runlog import RunLogger

log = logging.getLogger("train")


class JobOutputs:
    def __init__(self, cfg: TrainConfig, env: DistEnv, out: Path, logger: RunLogger) -> None:
        self.cfg, self.out, self.logger = cfg, out, logger
        self.writes = env.is_main
        """Rank 0 is the one writer; the other ranks' outputs are no-ops."""
        self.checkpoints = checkpoint.directory(out)

    def best_writer(self, state: TrainState) -> monitor_lib.OnBest | None:
        """The monitor's reaction to a new best evaluation: best.pt (trainer.save_best) and the
        run's best/<monitor> metric and best_epoch tag; None on the ranks that write nothing."""
        if not self.writes:
            return None

        def on_best(best: monitor_lib.Best) -> None:
            path = None
            if self.cfg.trainer.save_best:
                path = checkpoint.save_best(
                    self.checkpoints, state.module.state_dict(),
                    {"epoch": best.epoch, "step": best.step, "monitor": best.monitor,
                     "mode": best.mode, "value": best.value})
            self.logger.training.best(best.epoch, best.monitor, best.value, path)
        return on_best

    def check_room(self, state: TrainState) -> None:
        """Before training, on the one writer: room for a checkpoint, or DiskFull now rather
        than after an epoch's work."""
        if self.writes:
            checkpoint.check_room_for_one(self.checkpoints, state)

    def write_final(self, state: TrainState, bundle: DataBundle, final_val: Reduced | None,
                    peaks: list[float], tested: Reduced | None = None) -> None:
        """model.pt, confusion_matrix.svg (and the test split's), summary.json; the same in the
        run."""
        if not self.writes:
            return
        files: dict[str, Path] = {}
        table = None
        names = bundle.class_names
        if final_val is not None and final_val.confusion is not None:
            files[""] = render_confusion(final_val.confusion, names,
                                         self.out / "confusion_matrix.svg")
            table = per_class_accuracy(final_val.confusion, names)
        if tested is not None and tested.confusion is not None:
            svg = render_confusion(tested.confusion, names,
                                   self.out / "test_confusion_matrix.svg")
            self.logger.test_outputs(svg, per_class_accuracy(tested.confusion, names))
        files["weights"] = checkpoint.save_weights(state.module.state_dict(),
                                                   self.out / "model.pt", self.checkpoints)
        example = next(iter(bundle.val))[0][:4].cpu().numpy()  # batch > 1: any size loads back
        self.logger.log_outputs(files, table, state.module, example)
        (self.out / "summary.json").write_text(json.dumps(self.logger.summary(peaks), indent=2))

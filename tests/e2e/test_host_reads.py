"""No host sync outside logging steps at two ranks (tests/unit/test_host_reads.py has one rank,
in process): each rank of a real `python -m train` job counts its reads of tensor values by
optimiser step (tests/host_reads.py, started by the job's loss), through DDP's and FSDP's
Python parts, the ranks' shared step times and the straggler check of every logging step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import TINY_GPT, USER_PATH, run_train
from tests.host_reads import FOLDER_VAR, outside_logging

LOG_EVERY = 4
STEPS = 9
COUNTED = ("trainer.loss._target_=host_reads.CountedCrossEntropy",)
JOBS = {
    "ddp, a cnn, fp16's loss scaler": ("model=cnn", "trainer.precision=fp16-mixed"),
    "fsdp, the gpt, bf16, clipped": (
        *TINY_GPT, "data.batch_size=16", "distributed.strategy=fsdp",
        "trainer.precision=bf16-mixed", "optim.grad_clip=1.0"),
}


@pytest.mark.parametrize("job", JOBS)
def test_no_rank_reads_a_tensor_on_the_host_outside_logging_steps(
        job: str, small_tokens: Path, tmp_path: Path) -> None:
    folder = tmp_path / "reads"
    folder.mkdir()
    tokens = (f"data.root={small_tokens}",) if "model=gpt" in JOBS[job] else ()
    done = run_train(*JOBS[job], *tokens, *COUNTED, "distributed.nproc_per_node=2",
                     "data.num_workers=0", "trainer.epochs=1", f"trainer.max_steps={STEPS}",
                     f"trainer.log_every_n_steps={LOG_EVERY}", "trainer.checkpoint_every=0",
                     "tracking.enabled=false", f"hydra.run.dir={tmp_path / 'job'}",
                     env={FOLDER_VAR: str(folder), "PYTHONPATH": USER_PATH})
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        seen = json.loads((folder / f"rank-{rank}.json").read_text())
        assert max(row[0] for row in seen) >= STEPS - 1, seen  # written after step 9
        assert outside_logging(seen, STEPS, LOG_EVERY) == [], (rank, seen)
        # Each logging step reads its interval's loss: the count sees what a GPU waits for.
        assert {4, 8} <= {s for s, _, where, _ in seen if where.startswith("metrics.py")}

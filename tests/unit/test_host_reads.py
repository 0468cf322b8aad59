"""No host sync in a training step that does not log (CONTRIBUTING.md's standard; the floor of
`make bench-gpu` and of the step-time breakdown), and none per validation batch, checked where
no GPU is.

On a GPU, reading a tensor's value on the host - `.item()`, `float()`, `bool()`, `.tolist()`,
`.numpy()`, `.cpu()`, a boolean mask's `nonzero` - waits for every kernel queued before it, and
the device idles while the host queues the next ones. On a CPU such a read costs nothing, so it
is counted instead: each job below trains in this process under a TorchDispatchMode that notes
every such read by the optimiser step it falls in and the line of the project that asked for
it. The optimisers take the fused kernels a GPU gets (train/engine/optim.py `fused_kernels`):
the CPU's unfused Adam reads each parameter's step count. Reads of the samples on the host, in
the DataLoader's fetch, are not syncs, and are left out.

What this cannot see, and the GPU tests and `make bench-gpu` count with
`torch.cuda.set_sync_debug_mode` instead: copies to the host by `.to()` (on a CPU the job's
device is the host), torch's C++ (DDP's reducer, the collectives), the CUDA-only branches (the
device clock, in-memory data on the GPU), and jobs that read their shards in their own
processes (data=arrow: transformers' text models read their padding mask at every forward,
`padding_mask.all()` in its `sdpa_mask`, as they do for every transformers user). Two ranks,
DDP and FSDP: tests/e2e/test_host_reads.py."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from tests.conftest import SMALL_TEXT, TINY_GPT, composed
from tests.host_reads import HostReads, fused_as_on_gpu, outside_logging
from train.app import run
from train.data import tokenize
from train.engine import optim

LOG_EVERY = 4
STEPS = 9
"""Steps 4 and 8 log; 1-3 and 5-7 must read nothing."""


@pytest.fixture
def host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[HostReads]:
    reads = HostReads()
    monkeypatch.setattr(optim, "fused_kernels", fused_as_on_gpu())
    for name, method in reads.counting_methods().items():
        monkeypatch.setattr(torch.Tensor, name, method)
    hook = register_optimizer_step_post_hook(reads.stepped)
    try:
        yield reads
    finally:
        hook.remove()


@pytest.fixture(scope="module")
def byte_tokens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SMALL_TEXT as `train prepare-text` writes it, written in this process."""
    out = tmp_path_factory.mktemp("bytes") / "tokens"
    tokenize.prepare([SMALL_TEXT], out, tokenize.ByteTokenizer(), val_fraction=0.05)
    return out


TOKENS = "data.root=<byte_tokens>"
JOBS = {
    "gpt, bf16, clipped, EMA, accumulated": (
        *TINY_GPT, TOKENS, "data.batch_size=8", "optim.grad_clip=1.0",
        "trainer.precision=bf16-mixed", "trainer.ema.enabled=true",
        "trainer.accumulate_grad_batches=2"),
    "transformers' GPT-2": (
        "data=tokens", TOKENS, "task=language_model", "model=hf", "+model.config.n_layer=1",
        "+model.config.n_head=2", "+model.config.n_embd=32", "data.seq_len=32", "optim=adamw",
        "task.sample_tokens=0", "data.batch_size=8"),
    "cnn, fp16's loss scaler, channels_last, clipped": (
        "model=cnn", "data=synthetic", "data.num_samples=120", "data.image_size=8",
        "data.batch_size=8", "trainer.channels_last=true", "trainer.precision=fp16-mixed",
        "optim.grad_clip=1.0"),
    "segmentation": (
        "task=segmentation", "data=custom", "data.train._target_=userpkg.tasks.Shapes",
        "+data.train.length=96", "model=custom", "model._target_=userpkg.tasks.TinySegmenter",
        "data.batch_size=8"),
    "regression": (
        "task=regression", "data=custom", "data.train._target_=userpkg.tasks.Diabetes",
        "+data.train.stop=96", "model=custom", "model._target_=userpkg.tasks.Regressor",
        "data.batch_size=8"),
}


@pytest.mark.parametrize("job", JOBS)
def test_a_step_that_does_not_log_reads_no_tensor_on_the_host(
        job: str, host_reads: HostReads, byte_tokens: Path, tmp_path: Path,
        no_launcher_env: None, user_path: None) -> None:
    overrides = [o.replace("<byte_tokens>", str(byte_tokens)) for o in JOBS[job]]
    cfg = composed(*overrides, "trainer.epochs=1", f"trainer.max_steps={STEPS}",
                   f"trainer.log_every_n_steps={LOG_EVERY}", "data.num_workers=0",
                   "trainer.checkpoint_every=0", "tracking.enabled=false")
    with host_reads:
        run(cfg, str(tmp_path / "job"), "test")
    assert host_reads.steps == STEPS
    assert outside_logging(host_reads.rows(), STEPS, LOG_EVERY) == []
    # The logging steps read the interval's loss: the count sees what a GPU would wait for.
    logged = {(s, where) for s, _, where in host_reads.seen}
    assert {(s, "metrics.py") for s in (4, 8)} <= {(s, w.split(":")[0]) for s, w in logged}


def test_validation_reads_its_sums_once_however_many_batches_it_has(
        host_reads: HostReads, tmp_path: Path, no_launcher_env: None) -> None:
    """After the last step (validation, the epoch's metrics, the checkpoint): the same reads for
    9 validation batches as for 36 - none per batch."""
    after: list[Counter[tuple[str, str]]] = []
    for samples in (160, 520):  # 72 training samples (9 steps) and 9 or 36 batches to validate
        host_reads.seen.clear()
        host_reads.steps = 0
        cfg = composed("model=cnn", "data=synthetic", f"data.num_samples={samples}",
                       f"data.val_fraction={1 - 72 / samples}", "data.image_size=8",
                       "data.batch_size=8", "trainer.epochs=1", "data.num_workers=0",
                       f"trainer.log_every_n_steps={LOG_EVERY}", "tracking.enabled=false")
        with host_reads:
            run(cfg, str(tmp_path / f"job-{samples}"), "test")
        assert host_reads.steps == STEPS
        after.append(Counter({(what, where): n for (s, what, where), n in host_reads.seen.items()
                              if s == STEPS}))
    few, many = after
    assert few and few == many

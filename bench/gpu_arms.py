"""The arms of `python -m bench.gpu`: what each trains, at which size, and its command.

Three workloads, each trained by the service and by its peers with the same seed, batch,
dtype, compile setting and optimiser (the settings below are handed to both):

  gpt     GPT-2 small (12 layers, 12 heads, 768 wide, vocab 50304, 1024 tokens), bf16 autocast,
          SDPA, fused AdamW, torch.compile, on a token file the bench writes:
          model=gpt task=language_model data=tokens; plain = nanoGPT's loop
  resnet  ResNet-50 at 224 px, bf16, channels_last, synthetic data held on the GPU:
          model=torchvision data=synthetic; plain = torchvision's reference loop; Lightning
  input   ResNet-18 at 64 px from uint8 images in host memory, augmented on the CPU in
          DataLoader workers, pinned: data=custom; plain = the same Dataset and DataLoader;
          the service's on-device data path (data=synthetic, augmented on the GPU) as the
          upper bound

Sizes: `full` fits about 8 minutes on one H100/H200 (compiling GPT-2 three times is most of
it), `quick` about 3 (fewer steps, nothing compiled), `smoke` a minute on a CPU (tiny models:
every arm and figure, for the test that keeps the bench from rotting).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.gpu_meter import Plan

REPO = Path(__file__).resolve().parent.parent

# Steps: (warm-up, steps per timed window, windows, logging interval).
STEPS = {"full": {"gpt": (15, 20, 5, 10), "resnet": (10, 10, 5, 10), "input": (10, 20, 5, 10)},
         "quick": {"gpt": (5, 10, 3, 10), "resnet": (5, 10, 3, 10), "input": (5, 10, 3, 10)},
         "smoke": {"gpt": (2, 2, 2, 2), "resnet": (2, 2, 2, 2), "input": (2, 2, 2, 2)}}

SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "full": {
        "gpt": {"n_layer": 12, "n_head": 12, "n_embd": 768, "seq_len": 1024, "batch_size": 16},
        "resnet": {"model": "resnet50", "image_size": 224, "batch_size": 128, "classes": 1000},
        "input": {"model": "resnet18", "image_size": 64, "batch_size": 256, "classes": 100,
                  "workers": 8},
    },
    "smoke": {
        "gpt": {"n_layer": 1, "n_head": 2, "n_embd": 32, "seq_len": 32, "batch_size": 4},
        "resnet": {"model": "resnet50", "image_size": 32, "batch_size": 8, "classes": 10},
        "input": {"model": "resnet18", "image_size": 16, "batch_size": 8, "classes": 10,
                  "workers": 1},
    },
}
SIZES["quick"] = SIZES["full"]

OPTIMISERS = {"gpt": {"lr": 6e-4, "weight_decay": 0.1},
              "resnet": {"momentum": 0.9, "weight_decay": 1e-4},
              "input": {"momentum": 0.9, "weight_decay": 1e-4}}
"""AdamW as nanoGPT trains GPT-2; SGD as torchvision's reference script, its lr 0.1 for a batch
of 256 scaled to the batch (`settings`)."""


@dataclass(frozen=True)
class Arm:
    name: str
    workload: str
    runner: str
    """service (python -m train under the meter), plain (bench/gpu_peers.py) or lightning."""
    options: tuple[str, ...] = ()
    """The service's overrides beyond its workload's."""
    needs: str | None = None
    """A package the arm imports, without which it is skipped with the reason."""


ARMS = (
    Arm("gpt/plain", "gpt", "plain"),
    Arm("gpt/service", "gpt", "service"),
    Arm("resnet/plain", "resnet", "plain"),
    Arm("resnet/service", "resnet", "service"),
    Arm("input/plain", "input", "plain"),
    Arm("input/service", "input", "service"),
    Arm("gpt/service-fsdp", "gpt", "service", ("distributed.strategy=fsdp",)),
    Arm("resnet/lightning", "resnet", "lightning", needs="lightning"),
    Arm("input/service-on-device", "input", "service"),
    Arm("gpt/service-mlflow", "gpt", "service", ("tracking.enabled=true",), needs="mlflow"),
)
"""In the order they run: each workload's service and plain peer first, so that a run cut
short still holds the main ratios."""


def last_step(size: str, workload: str) -> int:
    """bench/gpu_meter.py's Plan.last: the warm-up, the timed windows and one step more."""
    warmup, window, windows, _ = STEPS[size][workload]
    return warmup + window * windows + 1


def settings(size: str, workload: str, device: str, tokens: Path | None) -> dict[str, Any]:
    """What the service's arm and its peers share: sizes, optimiser, dtype, compile, data."""
    s: dict[str, Any] = {"workload": workload, "seed": 0, "dtype": "bf16",
                         **SIZES[size][workload], **OPTIMISERS[workload]}
    if workload != "gpt":
        s["lr"] = 0.1 * s["batch_size"] / 256
    s["compile"] = workload == "gpt" and size == "full" and device == "cuda"
    s["channels_last"] = workload != "gpt"
    # One epoch holds every step (the service validates only after it): whole batches for
    # the last step, and the service's validation share (data=synthetic: 10 %) on top.
    s["num_samples"] = math.ceil(last_step(size, workload) * s["batch_size"] / 0.9) + \
        s["batch_size"]
    if workload == "gpt":
        s["data"] = str(tokens)
    return s


def tokens_needed(size: str) -> tuple[int, int]:
    """Training and validation tokens of the gpt workload's file: a window per sample of every
    step (the service reads each window once), and a few windows to validate."""
    s = SIZES[size]["gpt"]
    windows = last_step(size, "gpt") * s["batch_size"] + s["batch_size"]
    return windows * s["seq_len"] + 1, 4 * s["seq_len"] + 1


def service_overrides(arm: Arm, plan: Plan, out: Path) -> list[str]:
    """`python -m train`'s arguments for a service arm: the workload, the shared settings, a
    run of exactly the measured steps on one rank, and the meter's loss."""
    s = plan.settings
    common = [f"data.batch_size={s['batch_size']}", "optim.schedule=constant",
              "optim.warmup_epochs=0", f"optim.lr={s['lr']}",
              f"optim.weight_decay={s['weight_decay']}",
              "trainer.precision=" + ("bf16-mixed" if s["dtype"] == "bf16" else "fp32"),
              f"trainer.compile={str(s['compile']).lower()}", "trainer.epochs=1",
              f"trainer.max_steps={plan.last}", f"trainer.seed={s['seed']}",
              f"trainer.log_every_n_steps={plan.log_every}", "trainer.checkpoint_every=0",
              "trainer.loss._target_=bench.gpu_meter.NotedCrossEntropy",
              "distributed.nproc_per_node=1", f"distributed.device={plan.device}",
              "tracking.enabled=false", "tracking.log_model=false", f"hydra.run.dir={out}"]
    if arm.workload == "gpt":
        work = ["model=gpt", f"model.n_layer={s['n_layer']}", f"model.n_head={s['n_head']}",
                f"model.n_embd={s['n_embd']}", "task=language_model", "data=tokens",
                f"data.root={s['data']}", f"data.seq_len={s['seq_len']}", "optim=adamw",
                "task.sample_tokens=0"]
    else:
        work = ["model=torchvision", f"model.name={s['model']}", "optim=sgd",
                f"optim.momentum={s['momentum']}", "optim.nesterov=false",
                f"trainer.channels_last={str(s['channels_last']).lower()}"]
        work += _image_data(arm, s)
    return [*work, *common, *arm.options]


def _image_data(arm: Arm, s: dict[str, Any]) -> list[str]:
    if arm.workload == "resnet" or arm.name.endswith("on-device"):
        return ["data=synthetic", f"data.image_size={s['image_size']}",
                f"data.num_samples={s['num_samples']}", f"data.num_classes={s['classes']}",
                f"data.augment={str(arm.workload == 'input').lower()}"]
    images = "bench.gpu_data.HostImages"
    return ["data=custom", f"data.train._target_={images}", f"+data.train.size={s['num_samples']}",
            f"+data.train.side={s['image_size']}", f"+data.train.classes={s['classes']}",
            f"data.val._target_={images}", f"+data.val.size={4 * s['batch_size']}",
            f"+data.val.side={s['image_size']}", f"+data.val.classes={s['classes']}",
            "+data.val.augment=false", f"data.num_workers={s['workers']}"]


def command(arm: Arm, plan_path: Path, overrides: list[str]) -> list[str]:
    if arm.runner == "service":
        return [sys.executable, "-m", "bench.gpu_meter", str(plan_path), "--", *overrides]
    module = "bench.gpu_peers" if arm.runner == "plain" else "bench.gpu_lightning"
    return [sys.executable, "-m", module, str(plan_path)]

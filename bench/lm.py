"""`make bench`'s language-model rows: the service's model=gpt task=language_model against a
nanoGPT-style plain DDP loop, and the service's memory on a token file 4x larger.

The corpus is the Python documentation's topic texts (pydoc_data/topics.py, in every CPython),
tokenized by `train.data.tokenize.prepare` (bytes). Both variants train the same GPT class
(train/models/gpt.py) with the same sizes, ranks, global batch in tokens, AdamW learning rate
and weight decay, and the same number of optimiser steps per timed span:

  a  plain    bench/plain_lm.py under torchrun (nanoGPT's loop: random memmap windows, the
              loss's mean, `loss.item()` every step), spans of --steps steps
  b  service  python -m train data=tokens model=gpt task=language_model ..., whose epoch over
              the bench's train.bin is --steps steps (windows = steps x batch)

Pairs run --repeats times, interleaved (a b a b ...); tokens/s are medians of every span but the
first. Then `c`: the service on a train.bin 4 times larger (the same text 4 times), stopped
after as many steps (trainer.max_steps), for peak RSS per rank against b's.

    python -m bench.lm                   # ~5 minutes on a quiet 2-core CPU
    python -m bench.lm --repeats 5 --workers 1
    python -m bench.lm --model hf --out .bench/lm-hf.json   # model=hf's GPT-2 (transformers)
                                         # against a loop over the same GPT2LMHeadModel
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.report import machine_info, run_variant
from bench.run import steady_rate

REPO = Path(__file__).resolve().parent.parent
NAMES = {"a": "plain", "b": "service", "c": "service 4x data"}
VAL_TOKENS = 8192


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--nproc", type=int, default=2, help="gloo ranks on this machine's CPU")
    p.add_argument("--repeats", type=int, default=3, help="pairs; medians are shown")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16, help="global windows per step")
    p.add_argument("--steps", type=int, default=60, help="optimiser steps per epoch / span")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--workers", type=int, default=0,
                   help="the service's DataLoader workers per rank (nanoGPT reads in the rank)")
    p.add_argument("--model", choices=["gpt", "hf"], default="gpt",
                   help="gpt: model=gpt against the same GPT class; hf: model=hf's random "
                        "GPT-2 (transformers) against a loop over the same GPT2LMHeadModel")
    p.add_argument("--timeout", type=float, default=600, help="seconds per command")
    p.add_argument("--out", type=Path, default=REPO / ".bench" / "lm.json")
    return p.parse_args()


def write_corpus(folder: Path, args: argparse.Namespace, copies: int) -> Path:
    """train.bin of exactly --steps x --batch-size windows (times `copies`) and a val.bin of
    VAL_TOKENS, from the topic texts, through the service's own preparation."""
    import pydoc_data.topics

    from train.data import tokenize

    text = Path(pydoc_data.topics.__file__).read_bytes()
    train_tokens = args.steps * args.batch_size * args.seq_len + 1
    if len(text) < train_tokens + VAL_TOKENS:
        raise SystemExit(f"the corpus has {len(text)} bytes; lower --steps or --batch-size")
    train, val = text[:train_tokens] * copies, text[train_tokens:train_tokens + VAL_TOKENS]
    source = folder / "corpus.txt"
    source.write_bytes(train + val)
    out = folder / f"tokens-{copies}x"
    tokenize.prepare([source], out, tokenize.ByteTokenizer(),
                     val_fraction=len(val) / (len(train) + len(val)))
    return out


def plain_command(data: Path, args: argparse.Namespace, out: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={args.nproc}", str(REPO / "bench" / "plain_lm.py"),
            "--data", str(data), "--seq-len", str(args.seq_len),
            "--batch-size", str(args.batch_size), "--steps", str(args.steps),
            "--epochs", str(args.epochs), "--n-layer", str(args.n_layer),
            "--n-embd", str(args.n_embd), "--model", args.model, "--out", str(out / "plain.json")]


def service_command(data: Path, args: argparse.Namespace, out: Path,
                    max_steps: int | None = None) -> list[str]:
    model = ([f"model.n_layer={args.n_layer}", f"model.n_embd={args.n_embd}"]
             if args.model == "gpt" else
             ["model=hf", f"+model.config.n_layer={args.n_layer}", "+model.config.n_head=4",
              f"+model.config.n_embd={args.n_embd}", f"+model.config.n_positions={args.seq_len}"])
    cmd = [sys.executable, "-m", "train", "data=tokens", f"data.root={data}",
           *(["model=gpt"] if args.model == "gpt" else []), *model,
           "task=language_model", f"data.seq_len={args.seq_len}",
           f"data.batch_size={args.batch_size}", f"data.num_workers={args.workers}", "optim=adamw",
           "optim.schedule=constant", "optim.warmup_epochs=0", f"trainer.epochs={args.epochs}",
           "task.sample_tokens=0", f"distributed.nproc_per_node={args.nproc}",
           "distributed.device=cpu", "tracking.enabled=false", f"hydra.run.dir={out}"]
    return cmd + ([f"trainer.max_steps={max_steps}"] if max_steps else [])


def run_one(variant: str, repeat: int, data: Path, args: argparse.Namespace,
            tmp: Path) -> dict[str, Any]:
    out = tmp / f"{variant}-{repeat}"
    out.mkdir(parents=True)
    env = dict(os.environ)
    env.pop("MLFLOW_TRACKING_URI", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(REPO), env.get("PYTHONPATH"))))
    cmd = (plain_command(data, args, out) if variant == "a" else
           service_command(data, args, out, args.steps * args.epochs if variant == "c" else None))
    started, wall, result = run_variant(cmd, env, out, args.timeout, NAMES[variant],
                                        variant == "a")
    rates = [e["samples_per_sec"] * args.seq_len
             for e in result["epochs" if variant == "a" else "by_epoch"]]
    return {"variant": variant, "repeat": repeat, "tokens_per_sec": steady_rate(rates),
            "by_epoch": [round(v) for v in rates],
            "first_step_s": round(result["first_step_at"] - started, 2),
            "peak_rss_mb": [round(v) for v in result["peak_rss_mb"]], "wall_s": round(wall, 1),
            "command": [str(c).replace(str(tmp), "$TMP") for c in cmd[1:]]}


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for v, name in NAMES.items():
        rs = [r for r in runs if r["variant"] == v]
        if not rs:
            continue
        tps = [r["tokens_per_sec"] for r in rs]
        row[name] = {"tokens_per_sec": round(statistics.median(tps)), "min": round(min(tps)),
                     "max": round(max(tps)),
                     "first_step_s": round(statistics.median(r["first_step_s"] for r in rs), 2),
                     "peak_rss_mb": [statistics.median(x) for x in
                                     zip(*(r["peak_rss_mb"] for r in rs), strict=True)]}
    row["ratio"] = round(row["service"]["tokens_per_sec"] / row["plain"]["tokens_per_sec"], 3)
    pairs = zip([r for r in runs if r["variant"] == "a"], [r for r in runs if r["variant"] == "b"],
                strict=True)
    row["ratio_per_pair"] = [round(b["tokens_per_sec"] / a["tokens_per_sec"], 3) for a, b in pairs]
    if "service 4x data" in row:
        row["rss_4x_over_1x"] = [round(big / small, 4) for big, small in zip(
            row["service 4x data"]["peak_rss_mb"], row["service"]["peak_rss_mb"], strict=True)]
    return row


def main() -> None:
    args = parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="train-bench-lm-"))
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "timeout")}
    print(f"bench.lm: {settings}\n          runs under {tmp}", flush=True)
    load_before = os.getloadavg()
    runs: list[dict[str, Any]] = []
    try:
        data = {1: write_corpus(tmp, args, 1), 4: write_corpus(tmp, args, 4)}
        plan = [(v, r) for r in range(args.repeats) for v in "ab"] + [("c", 0)]
        for variant, repeat in plan:
            r = run_one(variant, repeat, data[4 if variant == "c" else 1], args, tmp)
            runs.append(r)
            print(f"  {NAMES[variant]:<16} #{repeat + 1}: {r['tokens_per_sec']:8.0f} tokens/s "
                  f"(spans {r['by_epoch']})  first step {r['first_step_s']:5.1f} s  peak RSS "
                  f"{r['peak_rss_mb']} MB  load {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    summary = summarise(runs)
    print(json.dumps(summary, indent=1))
    results = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
               "machine": machine_info("cpu"),
               "load_average_1_5_15": {"before": load_before, "after": os.getloadavg()},
               "settings": settings, "summary": summary, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"service/plain = {summary['ratio']} (medians; pairs {summary['ratio_per_pair']}); "
          f"peak RSS 4x/1x per rank {summary.get('rss_4x_over_1x')}; results in {args.out}")


if __name__ == "__main__":
    main()

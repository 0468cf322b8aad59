"""`python -m train predict <run_id> [overrides]`: a finished run's model run over a data set's
split - every sample's outputs once, in the data set's order, merged from the ranks into one
Parquet file (segmentation masks as PNGs beside it) - or a language model's continuations of
`predict.prompts`, as JSON lines. The same checks and launching as `python -m train eval`
(train/launch/evaluate.py); the job is train/engine/predict.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

from train.config.evaluate import PredictConfig
from train.errors import ConfigError
from train.launch.evaluate import given_value, start

USAGE = """usage: python -m train predict RUN_ID [hydra flags] [key=value ...]

Writes the finished run's outputs for every sample of a data set's split, in its order, as one
Parquet file (with the run, weights and data it came from), at any world size, locally or on
Slurm; or a language model's continuations of predict.prompts:
  predict.out=<file>               where (default: predictions.parquet in the job's directory)
  predict.overwrite=true           replace an existing predict.out
  predict.weights=last|best|<path>|runs:/<run_id>/<path>
                                   which weights (default: last; as eval's)
  predict.split=test|val           which split (default: test)
  predict.prompts='[...]' predict.max_new_tokens=N predict.temperature=T   language models
  data=<option> data.<key>=...     another data set of the same shape
Reads MLFLOW_TRACKING_URI, else the embedded store. docs/evaluation.md"""


PARQUET_SUFFIXES = (".parquet", ".pq")
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
"""What predict.out may be named: a name that says another format (p.csv) would hide Parquet."""


def checked_out(overrides: list[str]) -> list[str]:
    """The overrides with predict.out made absolute (the job may run elsewhere: a Slurm node,
    another directory); an existing one refused unless predict.overwrite=true."""
    given = given_value(overrides, "predict.out")
    settings = PredictConfig(split=given_value(overrides, "predict.split") or "test")
    if problem := settings.problem():
        raise ConfigError(problem)
    if given is None:
        return overrides
    out = Path(given).expanduser().resolve()
    overwrite = (given_value(overrides, "predict.overwrite") or "").lower() == "true"
    if out.exists() and not overwrite:
        raise ConfigError(f"predict.out={given} exists: give another path, or "
                          "predict.overwrite=true to replace it.")
    if out.is_dir():
        raise ConfigError(f"predict.out={given} is a directory: give a file's path, e.g. "
                          f"predict.out={Path(given) / 'predictions.parquet'}.")
    prompts = given_value(overrides, "predict.prompts") is not None
    what, kind, suffixes = (("continuations", "JSON lines", JSONL_SUFFIXES) if prompts else
                            ("predictions", "Parquet", PARQUET_SUFFIXES))
    if out.suffix.lower() not in suffixes:
        raise ConfigError(f"predict.out={given}: the {what} are written as {kind}; name the "
                          f"file so, e.g. predict.out={Path(given).with_suffix(suffixes[0])}.")
    return [o for o in overrides if o.lstrip("+").split("=", 1)[0] != "predict.out"] + \
        [f"predict.out='{out}'"]


def main(argv: list[str]) -> int:
    """`predict RUN_ID [overrides]` (argv without `python -m train predict`); the exit code."""
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not argv else sys.stdout)
        return 2 if not argv else 0
    return start("predict", argv[0], checked_out(argv[1:]))

"""The Hydra application: compose the config, then hand it to the launcher."""

from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from train.config import register_schema

register_schema()

# An absolute path: under `python -m train` Hydra would read a relative one as a module name.
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="train")
def main(cfg: DictConfig) -> float | None:
    from train.launch import run

    return run(cfg, HydraConfig.get().runtime.output_dir)

"""data.tokenize=map on the real local 2-node Slurm cluster (issue 44): a text set tokenized
once per node - never once per rank - before 4 ranks train on it. Without a cluster: the same
on one machine in tests/e2e/test_hf.py, the cache itself in tests/unit/test_pretokenize.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cluster.conftest import slurm_job
from tests.conftest import SENTENCES, runs_in

pytest.importorskip("transformers", reason="model=hf needs the hf extra (make setup has it)")


def test_texts_are_tokenized_once_per_node_for_two_nodes_of_two_ranks(
        cluster: None, store: dict[str, str], sentences: Path, bpe_tokens: Path,
        tmp_path: Path) -> None:
    cache = tmp_path / "tokenized"
    result = slurm_job(tmp_path, "cluster.nodes=2", "cluster.tasks_per_node=2", "data=arrow",
                       f"data.root={sentences}", f"data.tokenizer={bpe_tokens}",
                       "data.max_length=16", "data.tokenize=map", f"data.tokenized_to={cache}",
                       "model=hf", "model.auto_class=sequence_classification",
                       "model.config.model_type=bert", "+model.config.hidden_size=16",
                       "+model.config.num_hidden_layers=1", "+model.config.num_attention_heads=2",
                       "+model.config.intermediate_size=32", "trainer.epochs=1",
                       "data.batch_size=32", "data.num_workers=0", "tracking.log_model=false",
                       env=store)
    assert result.returncode == 0, result.stdout + result.stderr
    [run] = runs_in(store["MLFLOW_TRACKING_URI"])
    assert run.info.status == "FINISHED" and run.data.tags["world_size"] == "4"
    assert run.data.tags["rank_hostnames"] == "node1,node1,node2,node2"
    assert run.data.metrics["val/samples"] == SENTENCES - SENTENCES * 4 // 5
    # One tokenizing pass per node at most (the second node may find the first's cache), each
    # on another node: 4 ranks, 1 or 2 passes, never 4.
    passes = (cache / "tokenize.log").read_text().splitlines()
    hosts = [p.split(" host=")[1].split()[0] for p in passes]
    assert 1 <= len(passes) <= 2 and len(set(hosts)) == len(hosts), passes
    assert set(hosts) <= {"node1", "node2"}
    assert all(f"rows={SENTENCES}" in p for p in passes)
    assert len(list(cache.glob("set-*/dataset_dict.json"))) == 1  # one cache, whole
    assert not list(cache.glob(".*.tmp"))  # no working copy left behind

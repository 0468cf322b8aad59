"""Measure the tracking server settings: `python -m bench.tracking_server`.

Starts `python -m train server` with gunicorn and with uvicorn (MLflow's default) on free
ports, and reports time to ready, per-request latency of synchronous log_metric calls on a
kept-alive connection, one log_batch of 1000 values, and the RSS of the server's process tree.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

from train.distributed.env import free_port


def measure(server: str, calls: int = 200) -> dict[str, float]:
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "train.server", "--port", str(port), "--server", server,
             "--backend-store-uri", f"sqlite:///{tmp}/db.sqlite",
             "--artifacts-destination", f"{tmp}/artifacts",
             "--no-auth"],  # the HTTP server's own cost: a throwaway loopback store
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            while True:
                try:
                    urllib.request.urlopen(url + "/health", timeout=1)
                    break
                except OSError:
                    time.sleep(0.2)
            ready = time.perf_counter() - started
            client = MlflowClient(tracking_uri=url)
            run_id = client.create_run(client.create_experiment("bench")).info.run_id
            client.log_metric(run_id, "warm", 0.0)
            t0 = time.perf_counter()
            for i in range(calls):
                client.log_metric(run_id, "m", float(i), step=i)
            per_request = (time.perf_counter() - t0) / calls
            now = int(time.time() * 1000)
            t0 = time.perf_counter()
            client.log_batch(run_id, metrics=[Metric("b", float(i), now, i) for i in range(1000)])
            batch = time.perf_counter() - t0
            tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
            rss = sum(p.memory_info().rss for p in tree if p.is_running()) / 2**20
        finally:
            for p in psutil.Process(proc.pid).children(recursive=True):
                p.kill()
            proc.kill()
            proc.wait()
    return {"ready_s": round(ready, 1), "log_metric_ms": round(per_request * 1000, 2),
            "log_batch_1000_s": round(batch, 3), "rss_mb": round(rss), "processes": len(tree)}


if __name__ == "__main__":
    results = {server: measure(server) for server in ("gunicorn", "uvicorn")}
    print(json.dumps(results, indent=2))
    Path(".bench").mkdir(exist_ok=True)
    Path(".bench/tracking_server.json").write_text(json.dumps(results, indent=2))

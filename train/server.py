"""`python -m train.server`: an MLflow tracking server set up for clusters (`make mlflow-server`).

Settings chosen by measurement on a 2-core machine (docs/viewing-runs.md,
`python -m bench.tracking_server`): gunicorn answers a request on a kept-alive connection in
milliseconds where MLflow's default uvicorn server took ~45 ms, so a job logging every step
through uvicorn would wait on it; two workers and no job-execution workers keep the footprint
under a gigabyte instead of ~3 GB. Artifacts are proxied through the server, so compute nodes
need no shared filesystem. Bound to 127.0.0.1 unless told otherwise (reach it through an SSH
tunnel, or bind a cluster-internal address with --host).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

from train.tracking import EMBEDDED_STORE_DIR


def command(args: argparse.Namespace) -> list[str]:
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", args.host, "--port",
           str(args.port), "--backend-store-uri", args.backend_store_uri,
           "--serve-artifacts", "--artifacts-destination", args.artifacts_destination,
           "--workers", str(args.workers)]
    if args.server == "gunicorn":
        cmd += ["--gunicorn-opts", "--keep-alive 60 --timeout 120"]
    if args.host not in ("127.0.0.1", "localhost"):
        # MLflow rejects Host headers it does not know (403): allow this node's names.
        names = {args.host, socket.gethostname(), socket.getfqdn(), "localhost", "127.0.0.1"}
        cmd += ["--allowed-hosts", ",".join(f"{n},{n}:{args.port}" for n in sorted(names))]
    return cmd


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m train.server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5001)
    parser.add_argument("--backend-store-uri",
                        default=f"sqlite:///{EMBEDDED_STORE_DIR / 'server.db'}",
                        help="SQLite by default; any SQLAlchemy URI, e.g. postgresql://...")
    parser.add_argument("--artifacts-destination",
                        default=str(EMBEDDED_STORE_DIR / "server-artifacts"))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--server", choices=("gunicorn", "uvicorn"), default="gunicorn")
    args = parser.parse_args(argv)
    if args.backend_store_uri.startswith("sqlite:///"):
        Path(args.backend_store_uri.removeprefix("sqlite:///")).parent.mkdir(
            parents=True, exist_ok=True)
    url = f"http://{args.host if args.host != '0.0.0.0' else socket.gethostname()}:{args.port}"
    print(f"MLflow tracking server on {url}  (store {args.backend_store_uri})\n"
          f"  jobs:   export MLFLOW_TRACKING_URI={url}\n"
          f"  laptop: ssh -N -L {args.port}:127.0.0.1:{args.port} <login-node>, then open "
          f"http://127.0.0.1:{args.port}", flush=True)
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    os.execvpe(sys.executable, command(args), env)


if __name__ == "__main__":
    main()

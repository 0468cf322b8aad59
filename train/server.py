"""`python -m train.server`: an MLflow tracking server set up for clusters (`make mlflow-server`).

It builds one `mlflow server` command and execs it; mlflow itself is never imported here, so
`--help` is instant. The settings were chosen by measurement on a 2-core machine
(README.md, "Viewing runs"; `python -m bench.tracking_server` measures them):

- gunicorn instead of MLflow's default uvicorn: a request on a kept-alive connection took
  ~60 ms through uvicorn and a few ms through gunicorn;
- 2 workers and MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false (no job-execution workers; training
  does not use them): ~0.75 GB in 4 processes instead of ~3 GB in 15;
- artifacts proxied through the server (--serve-artifacts, --artifacts-destination), so compute
  nodes upload and the UI downloads over HTTP and no shared filesystem is needed;
- bound to 127.0.0.1 unless --host says otherwise. Bound to another address, MLflow's Host-header
  check (DNS-rebinding protection) would refuse `http://<node name>:<port>`, which is what cluster
  nodes use: this node's names and addresses are added to --allowed-hosts (next to MLflow's
  defaults: localhost and private IP ranges), and `http://<node name>:<port>` to the CORS origins
  so the UI opened at that address may POST (its searches are POSTs).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import socket
import sys

from train.tracking.store import EMBEDDED_STORE_DIR, sqlite_path

LOOPBACK = ("127.0.0.1", "localhost", "::1")
# MLflow's own default allow-list (mlflow/server/security_utils.py): giving --allowed-hosts
# replaces it, so it is repeated here.
DEFAULT_ALLOWED = ["localhost", "127.0.0.1", "[::1]", "0.0.0.0", "localhost:*", "127.0.0.1:*",
                   "[[]::1]:*", "0.0.0.0:*", "192.168.*", "10.*",
                   *[f"172.{i}.*" for i in range(16, 32)], "fc00:*", "fd00:*"]
# Sync workers close the connection after each response (no keep-alive to go stale); a generous
# timeout so a worker receiving a large model upload over a slow link is not killed at 30 s.
GUNICORN_OPTS = "--timeout 300 --graceful-timeout 10"


def node_names() -> list[str]:
    """The names and addresses other nodes may use for this one."""
    names = {socket.gethostname(), socket.getfqdn(), socket.gethostname().split(".")[0]}
    for name in list(names):
        with contextlib.suppress(OSError):  # a name that does not resolve here
            names.update(str(info[4][0]) for info in socket.getaddrinfo(name, None))
    # IPv6 addresses are left out: they would need [brackets] in a Host header; use names.
    return sorted(n for n in names if n and n not in LOOPBACK and ":" not in n)


def public_url(host: str, port: int) -> str:
    """The URL to put in MLFLOW_TRACKING_URI (the node's name when bound to all interfaces)."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def build(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The `mlflow server` command line and the environment it needs."""
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", args.host, "--port", str(args.port),
           "--backend-store-uri", args.backend_store_uri,
           "--serve-artifacts", "--artifacts-destination", args.artifacts_destination,
           "--workers", str(args.workers)]
    if args.server == "gunicorn":
        cmd += ["--gunicorn-opts", GUNICORN_OPTS]
    # The job-execution workers (huey consumers) serve MLflow's GenAI jobs, not training runs.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    extra_hosts = [h for h in (args.allowed_hosts or "").split(",") if h]
    if args.host not in LOOPBACK or extra_hosts:
        names = [*node_names(), *extra_hosts]
        if args.host not in ("0.0.0.0", "::", *LOOPBACK):
            names.append(args.host)
        hosts = DEFAULT_ALLOWED + [p for n in names for p in (n, f"{n}:*")]
        origins = [f"http://{n}:{args.port}" for n in names]
        # Through the environment: `mlflow server` refuses --allowed-hosts and
        # --cors-allowed-origins next to --gunicorn-opts, but its Flask app (what gunicorn
        # serves) reads these variables in every worker.
        env["MLFLOW_SERVER_ALLOWED_HOSTS"] = ",".join(dict.fromkeys(hosts))
        env["MLFLOW_SERVER_CORS_ALLOWED_ORIGINS"] = ",".join(dict.fromkeys(origins))
    return cmd, env


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m train.server", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1",
                        help="interface to bind (default 127.0.0.1: reach it through an SSH "
                             "tunnel); 0.0.0.0 for the cluster's nodes")
    parser.add_argument("--port", type=int, default=5001)
    store = EMBEDDED_STORE_DIR
    parser.add_argument("--backend-store-uri", default=f"sqlite:///{store / 'server.db'}",
                        help="runs, params and metrics: SQLite by default, or any SQLAlchemy URI, "
                             "e.g. postgresql://user:password@dbhost:5432/mlflow")
    parser.add_argument("--artifacts-destination", default=str(store / "server-artifacts"),
                        help="where the server keeps the artifacts it receives (a directory, "
                             "or s3://..., gs://...)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--allowed-hosts", default="",
                        help="more Host headers to accept, comma-separated (e.g. a DNS alias: "
                             "mlflow.cluster.example.org)")
    parser.add_argument("--server", choices=("gunicorn", "uvicorn"), default="gunicorn",
                        help="HTTP server (uvicorn is MLflow's default, kept for comparison)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if (db := sqlite_path(args.backend_store_uri)) is not None:
        db.parent.mkdir(parents=True, exist_ok=True)
    url = public_url(args.host, args.port)
    # From a laptop: forward a local port to this server through the login node.
    target = "127.0.0.1" if args.host in LOOPBACK else url.split("//")[1].rsplit(":", 1)[0]
    cmd, env = build(args)
    print(f"MLflow tracking server: {url}\n"
          f"  store:     {args.backend_store_uri}\n"
          f"  artifacts: {args.artifacts_destination} (proxied: jobs upload through the server)\n"
          f"  jobs:      export MLFLOW_TRACKING_URI={url}\n"
          f"  laptop:    ssh -N -L {args.port}:{target}:{args.port} <login-node>\n"
          f"             then open http://127.0.0.1:{args.port}\n"
          f"  command:   {shlex.join(cmd)}", flush=True)
    if "MLFLOW_SERVER_ALLOWED_HOSTS" in env:
        print(f"  Host headers accepted: {env['MLFLOW_SERVER_ALLOWED_HOSTS']}", flush=True)
    os.execvpe(cmd[0], cmd, env)


if __name__ == "__main__":
    main()

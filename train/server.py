"""`python -m train server`: an MLflow tracking server set up for clusters (`make mlflow-server`).

It builds one `mlflow server` command and execs it; mlflow itself is never imported here, so
`--help` is instant. The settings were chosen by measurement on a 2-core machine
(docs/tracking.md, "Viewing runs"; `python -m bench.tracking_server` measures them):

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
  so the UI opened at that address may POST (its searches are POSTs);
- logins on (MLflow's basic-auth app, train/security/server_auth.py) unless --no-auth: every user of
  the node reaches even 127.0.0.1; HTTPS with --certfile/--keyfile;
- files private (umask 077: store, artifacts and secrets 0600/0700); the backend store URI,
  which may hold a database password, reaches `mlflow server` through its environment (argv
  is public: `ps`).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import shlex
import socket
import sys
from pathlib import Path

from train.security import server_auth
from train.security.redact import redact, split_userinfo
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


def public_url(host: str, port: int, tls: bool = False) -> str:
    """The URL to put in MLFLOW_TRACKING_URI (the node's name when bound to all interfaces)."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return f"http{'s' if tls else ''}://{f'[{host}]' if ':' in host else host}:{port}"


def check_port_free(host: str, port: int) -> None:
    """Refuse a port something already listens on, before anything is created."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gunicorn binds
        try:
            probe.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise SystemExit(f"error: port {port} on {host} is in use (another server?): "
                                 "stop it or choose another with --port.") from None
            raise SystemExit(f"error: cannot listen on {host}:{port}: {e.strerror}.") from None


def build(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The `mlflow server` command line and the environment it needs (no secret on argv)."""
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", args.host, "--port", str(args.port),
           "--serve-artifacts", "--artifacts-destination", args.artifacts_destination,
           "--workers", str(args.workers)]
    if args.server == "gunicorn":
        tls = (f" --certfile {shlex.quote(args.certfile)} --keyfile {shlex.quote(args.keyfile)}"
               if args.certfile else "")
        cmd += ["--gunicorn-opts", GUNICORN_OPTS + tls]
    elif args.certfile:
        cmd += ["--uvicorn-opts", f"--ssl-certfile {shlex.quote(args.certfile)} "
                                  f"--ssl-keyfile {shlex.quote(args.keyfile)}"]
    if not args.no_auth:
        cmd += ["--app-name", "basic-auth"]
    # The job-execution workers (huey consumers) serve MLflow's GenAI jobs, not training runs.
    # The store URI goes through the environment: a database password on argv is public (`ps`).
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
           "MLFLOW_BACKEND_STORE_URI": args.backend_store_uri}
    extra_hosts = [h for h in (args.allowed_hosts or "").split(",") if h]
    if args.host not in LOOPBACK or extra_hosts:
        names = [*node_names(), *extra_hosts]
        if args.host not in ("0.0.0.0", "::", *LOOPBACK):
            names.append(args.host)
        hosts = DEFAULT_ALLOWED + [p for n in names for p in (n, f"{n}:*")]
        scheme = "https" if args.certfile else "http"
        origins = [f"{scheme}://{n}:{args.port}" for n in names]
        # Through the environment: `mlflow server` refuses --allowed-hosts and
        # --cors-allowed-origins next to --gunicorn-opts, but its Flask app (what gunicorn
        # serves) reads these variables in every worker.
        env["MLFLOW_SERVER_ALLOWED_HOSTS"] = ",".join(dict.fromkeys(hosts))
        env["MLFLOW_SERVER_CORS_ALLOWED_ORIGINS"] = ",".join(dict.fromkeys(origins))
    return cmd, env


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m train server", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1",
                        help="interface to bind (default 127.0.0.1: reach it through an SSH "
                             "tunnel); 0.0.0.0 for the cluster's nodes")
    parser.add_argument("--port", type=int, default=5001)
    store = EMBEDDED_STORE_DIR
    parser.add_argument("--backend-store-uri", default=None,
                        help="runs, params and metrics (default: $MLFLOW_BACKEND_STORE_URI, else "
                             f"sqlite:///{store / 'server.db'}); or any SQLAlchemy URI, e.g. "
                             "postgresql://mlflow@dbhost:5432/mlflow with the password in "
                             "~/.pgpass or PGPASSWORD, never here (`ps` shows argv to everyone)")
    parser.add_argument("--artifacts-destination", default=str(store / "server-artifacts"),
                        help="where the server keeps the artifacts it receives (a directory, "
                             "or s3://..., gs://...)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--allowed-hosts", default="",
                        help="more Host headers to accept, comma-separated (e.g. a DNS alias: "
                             "mlflow.cluster.example.org)")
    parser.add_argument("--server", choices=("gunicorn", "uvicorn"), default="gunicorn",
                        help="HTTP server (uvicorn is MLflow's default, kept for comparison)")
    parser.add_argument("--no-auth", action="store_true",
                        help="serve WITHOUT logins: everyone who reaches the port (every user of "
                             "this node, even on 127.0.0.1) reads, changes and deletes every "
                             "run. Only for a machine nobody else uses.")
    parser.add_argument("--auth-dir", default=None,
                        help="the login database and the generated admin password "
                             f"({server_auth.SECRETS_FILE}, 0600); default: the SQLite store's "
                             f"directory, else {store}")
    parser.add_argument("--certfile", help="serve HTTPS with this certificate (PEM)")
    parser.add_argument("--keyfile", help="the certificate's private key (PEM)")
    parser.add_argument("--env-file", default=None,
                        help="write the `export` lines a job needs (URL, login, certificate) "
                             "to this file, 0600, atomically (slurm/mlflow-server.sbatch)")
    parser.add_argument("--group-readable", action="store_true",
                        help="files the group may read (umask 027), for a team that shares a "
                             "store on purpose; default: the owner's alone (umask 077)")
    args = parser.parse_args(argv)
    if bool(args.certfile) != bool(args.keyfile):
        parser.error("--certfile and --keyfile go together")
    if args.backend_store_uri is None:
        args.backend_store_uri = (os.environ.get("MLFLOW_BACKEND_STORE_URI")
                                  or f"sqlite:///{store / 'server.db'}")
    elif split_userinfo(args.backend_store_uri)[2] is not None:
        parser.error("--backend-store-uri holds a password, which every user sees in `ps`: put "
                     "it in ~/.pgpass (or PGPASSWORD), or the whole URI in "
                     "MLFLOW_BACKEND_STORE_URI")
    return args


def auth_dir(args: argparse.Namespace) -> Path:
    if args.auth_dir:
        return Path(args.auth_dir)
    db = sqlite_path(args.backend_store_uri)
    return db.parent if db is not None else EMBEDDED_STORE_DIR


def job_env(args: argparse.Namespace, url: str, auth: dict[str, str]) -> dict[str, str]:
    """What a job needs to log here: the URL, the login, the certificate to trust."""
    values = {"MLFLOW_TRACKING_URI": url}
    if auth:
        values.update(MLFLOW_TRACKING_USERNAME=auth["MLFLOW_AUTH_ADMIN_USERNAME"],
                      MLFLOW_TRACKING_PASSWORD=auth["MLFLOW_AUTH_ADMIN_PASSWORD"])
    if args.certfile:
        values["MLFLOW_TRACKING_SERVER_CERT_PATH"] = str(Path(args.certfile).resolve())
    return values


def banner(args: argparse.Namespace, url: str, cmd: list[str], authed: bool) -> str:
    # From a laptop: forward a local port to this server through the login node.
    target = "127.0.0.1" if args.host in LOOPBACK else url.split("//")[1].rsplit(":", 1)[0]
    login = (f"user admin, password in {server_auth.secrets_path(auth_dir(args))} (0600): "
             "`source` it, or copy it to ~/.mlflow/credentials" if authed else
             "NONE (--no-auth): anyone who reaches the port reads, changes, deletes every run")
    return (f"MLflow tracking server: {url}\n"
            f"  store:     {redact(args.backend_store_uri)}\n"
            f"  artifacts: {redact(args.artifacts_destination)} (proxied: jobs upload through "
            "the server)\n"
            f"  login:     {login}\n"
            f"  jobs:      export MLFLOW_TRACKING_URI={url}\n"
            f"  laptop:    ssh -N -L {args.port}:{target}:{args.port} <login-node>\n"
            f"             then open {url.split(':')[0]}://127.0.0.1:{args.port}\n"
            f"  command:   {shlex.join(cmd)}")


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    # Before anything is created: the store, artifacts and secrets are the owner's alone.
    os.umask(0o027 if args.group_readable else 0o077)
    check_port_free(args.host, args.port)
    if (db := sqlite_path(args.backend_store_uri)) is not None:
        db.parent.mkdir(parents=True, exist_ok=True)
    url = public_url(args.host, args.port, tls=bool(args.certfile))
    cmd, env = build(args)
    auth: dict[str, str] = {}
    if not args.no_auth:
        try:
            auth = server_auth.prepare(auth_dir(args))
        except (server_auth.AuthSetupError, OSError) as e:
            raise SystemExit(f"error: {e}") from None
        env.update(auth)
    if args.env_file:
        server_auth.write_private(Path(args.env_file),
                                  server_auth.env_lines(job_env(args, url, auth)))
    print(banner(args, url, cmd, bool(auth)), flush=True)
    if args.no_auth:
        print(f"WARNING: authentication is OFF (--no-auth): every user who reaches {url} can "
              "read, change and delete every run and artifact.", file=sys.stderr, flush=True)
    if "MLFLOW_SERVER_ALLOWED_HOSTS" in env:
        print(f"  Host headers accepted: {env['MLFLOW_SERVER_ALLOWED_HOSTS']}", flush=True)
    os.execvpe(cmd[0], cmd, env)


if __name__ == "__main__":
    main()

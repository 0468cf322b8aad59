"""Where runs are recorded: the tracking URI, the embedded store, and whether it can be used.

No mlflow import here (it costs ~1.6 s): the pre-flight checks the store with these functions
before any rank starts; train/tracking/client.py does the MLflow work.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from pathlib import Path

from train.config.groups import TrackingConfig
from train.security import server_auth
from train.security.redact import redact, split_userinfo
from train.tracking.auth import login_request, ssl_context  # HTTPS verified as MLflow's client does
from train.tracking.errors import TrackingError

REPO_ROOT = Path(__file__).resolve().parents[2]
EMBEDDED_STORE_DIR = REPO_ROOT / "mlruns"
"""The embedded store: mlruns/mlflow.db (runs, params, metrics) and mlruns/artifacts/."""


def embedded_uri() -> str:
    return f"sqlite:///{EMBEDDED_STORE_DIR / 'mlflow.db'}"


def sqlite_path(uri: str) -> Path | None:
    """The database file of an SQLite store URI (sqlite:////abs/path.db); None for others."""
    return Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None


def resolve_uri(cfg: TrackingConfig) -> str:
    """tracking.uri (MLFLOW_TRACKING_URI when set), else the embedded store."""
    return cfg.uri or embedded_uri()


def artifact_location(uri: str) -> str | None:
    """Where a new experiment keeps its artifacts: for an SQLite store, `artifacts/` beside the
    database (MLflow's default would be ./mlruns of whatever directory the job ran in); for a
    server or another database, where the server says."""
    db = sqlite_path(uri)
    return None if db is None else (db.parent / "artifacts").as_uri()


def is_local_path_uri(uri: str) -> bool:
    """A store that lives in this machine's filesystem (compute nodes must share it)."""
    return uri.startswith(("sqlite:", "file:", "/")) or "://" not in uri


def check_reachable(uri: str, timeout_s: float = 5.0) -> None:
    """Refuse an unusable tracking URI before any rank starts."""
    if uri.startswith(("http://", "https://")):

        health, uri = split_userinfo(uri)[0].rstrip("/") + "/health", redact(uri)
        try:
            with urllib.request.urlopen(health, timeout=timeout_s, context=ssl_context()) as r:
                if r.status == 200:
                    return
                problem = f"it answered HTTP {r.status}"
        except (urllib.error.URLError, OSError) as e:
            problem = f"it cannot be reached ({getattr(e, 'reason', e)})"
        raise TrackingError(
            f"MLflow tracking server {uri} is not usable: {problem}. Start it (`make "
            "mlflow-server`), fix MLFLOW_TRACKING_URI / tracking.uri, or run with "
            "tracking.enabled=false.")
    if (db := sqlite_path(uri)) is not None:
        directory = db.parent
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TrackingError(f"Cannot create the MLflow store directory {directory}: {e}.") \
                from None
        if not os.access(directory, os.W_OK):
            raise TrackingError(f"The MLflow store directory {directory} is not writable.")


def check_server_api(uri: str, experiment: str, timeout_s: float = 10.0) -> None:
    """A server that answers /health must also answer MLflow's API: another web service on
    that port answers 404 to it, and a server with authentication 401/403 without the right
    credentials (MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD)."""
    import urllib.parse

    # The login (URI, environment or ~/.mlflow/credentials) and the TLS verification that
    # MLflow's client would use, as the login check sends them.

    query = urllib.parse.urlencode({"experiment_name": experiment})
    request, _ = login_request(uri, f"/api/2.0/mlflow/experiments/get-by-name?{query}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s, context=ssl_context()):
            return
    except urllib.error.HTTPError as e:
        body = e.read(2000).decode(errors="replace")
        if e.code == 404 and "RESOURCE_DOES_NOT_EXIST" in body:
            return  # an MLflow server without that experiment yet
        if e.code in (401, 403):
            problem = (f"it refused the request (HTTP {e.code}): set MLFLOW_TRACKING_USERNAME "
                       "and MLFLOW_TRACKING_PASSWORD to an account of that server")
        elif e.code == 404:
            problem = "it answers /health but not MLflow's API (HTTP 404): not an MLflow server"
        elif e.code >= 500 or e.code == 429:
            return  # busy or failing for now: the job retries such answers
        else:
            problem = f"MLflow's API answered HTTP {e.code}: {body[:200]}"
    except (urllib.error.URLError, OSError):
        return  # check_reachable has just reached it; a blip now is the job's to retry
    raise TrackingError(f"MLflow tracking server {uri} is not usable: {problem}. Fix "
                        "MLFLOW_TRACKING_URI / tracking.uri, or run with tracking.enabled=false.")


def is_new_sqlite(uri: str) -> bool:
    """An SQLite store whose database does not exist yet: it must be created and migrated once,
    by one process (several doing it at once corrupt it)."""
    db = sqlite_path(uri)
    return db is not None and (not db.exists() or db.stat().st_size == 0)


def how_to_view(uri: str, experiment_id: str | None, run_id: str) -> str:
    """The command or URL that shows a run in the MLflow UI, and where its login is (the file
    that holds the password, never the password)."""
    page = f"#/experiments/{experiment_id}/runs/{run_id}"
    if uri.startswith(("http://", "https://")):
        return f"{uri.rstrip('/')}/{page}"
    if uri == embedded_uri():
        return f"`make ui`, then http://127.0.0.1:5000/{page}{_login(EMBEDDED_STORE_DIR)}"
    if (db := sqlite_path(uri)) is not None and db.name == "mlflow.db":
        return (f"`make ui UI_STORE={db.parent}`, then http://127.0.0.1:5000/{page}"
                f"{_login(db.parent)}")
    return (f"`python -m train server --port 5000 --backend-store-uri {uri}`, then "
            f"http://127.0.0.1:5000/{page}{_login(db.parent if db else EMBEDDED_STORE_DIR)}")


def _login(auth_dir: Path) -> str:
    """The UI's login (train/server.py's default auth dir for the store): where the generated
    password is kept."""
    secrets = server_auth.secrets_path(auth_dir)
    return (f" (login: user {server_auth.ADMIN}, password MLFLOW_TRACKING_PASSWORD in "
            f"{secrets}, written by the server's first start)")

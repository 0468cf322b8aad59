"""The tracking server's logins: MLflow's own basic-auth app, closed to anyone without one.

`prepare(auth_dir)` returns the environment `mlflow server --app-name basic-auth` needs:
- an auth config (`basic_auth.ini`) with `default_permission = NO_PERMISSIONS` (MLflow ships
  READ: every user would read every run) and absolute paths (MLflow's are relative to the
  server's working directory); the user database `basic_auth.db` beside it;
- the admin password and the Flask secret key: taken from MLFLOW_AUTH_ADMIN_PASSWORD /
  MLFLOW_FLASK_SERVER_SECRET_KEY when set, else generated on the first start and kept in
  `server-auth.env` (0600; `source` it to give a job the admin login). They reach the server
  through its environment, never its command line (`ps` shows every user's argv).
- `auth_cache_ttl_seconds = 60`: each login is otherwise re-checked with scrypt on every
  request (~0.5 s here, measured: FIELD-NOTES); a changed password reaches every worker within
  the minute.
"""

from __future__ import annotations

import os
import secrets
import shlex
import stat
from pathlib import Path

from train.errors import TrainError

ADMIN = "admin"
SECRETS_FILE = "server-auth.env"
AUTH_CONFIG = "basic_auth.ini"
AUTH_DB = "basic_auth.db"


class AuthSetupError(TrainError, RuntimeError):
    """The login files cannot be used safely; the message says what to do."""


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` atomically, readable by its owner only (0600) from the start."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_env_file(path: Path) -> dict[str, str]:
    """`export NAME=value` lines (as written by `env_lines`) back into a dict."""
    values: dict[str, str] = {}
    for line in path.read_text().splitlines():
        words = shlex.split(line, comments=True)
        if len(words) == 2 and words[0] == "export" and "=" in words[1]:
            name, _, value = words[1].partition("=")
            values[name] = value
    return values


def env_lines(values: dict[str, str]) -> str:
    return "".join(f"export {name}={shlex.quote(value)}\n" for name, value in values.items())


def _refuse_if_shared(path: Path) -> None:
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077 or path.stat().st_uid != os.geteuid():
        raise AuthSetupError(f"{path} holds the server's secrets but other users can read or "
                             f"change it (mode {mode:o}): `chmod 600 {path}` and check its "
                             "contents, or delete it to generate new ones.")


def secrets_path(auth_dir: Path) -> Path:
    return auth_dir / SECRETS_FILE


def prepare(auth_dir: Path) -> dict[str, str]:
    """The environment variables that turn MLflow's basic-auth app on (see module doc)."""
    auth_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = secrets_path(auth_dir)
    saved: dict[str, str] = {}
    if path.exists():
        _refuse_if_shared(path)
        saved = read_env_file(path)
    # The admin exists after the first start: its password is the saved one from then on.
    password = (saved.get("MLFLOW_TRACKING_PASSWORD")
                or os.environ.get("MLFLOW_AUTH_ADMIN_PASSWORD") or secrets.token_urlsafe(18))
    key = (os.environ.get("MLFLOW_FLASK_SERVER_SECRET_KEY")
           or saved.get("MLFLOW_FLASK_SERVER_SECRET_KEY") or secrets.token_urlsafe(32))
    if len(password) < 12:
        raise AuthSetupError("MLFLOW_AUTH_ADMIN_PASSWORD is shorter than 12 characters (MLflow "
                             "refuses it): choose a longer one, or unset it to have one "
                             "generated.")
    wanted = {"MLFLOW_TRACKING_USERNAME": ADMIN, "MLFLOW_TRACKING_PASSWORD": password,
              "MLFLOW_FLASK_SERVER_SECRET_KEY": key}
    if saved != wanted:
        write_private(path, "# MLflow server login (admin) and Flask secret key: keep private.\n"
                            + env_lines(wanted))
    config = auth_dir / AUTH_CONFIG
    write_private(config, "[mlflow]\n"
                          "default_permission = NO_PERMISSIONS\n"
                          f"database_uri = sqlite:///{(auth_dir / AUTH_DB).resolve()}\n"
                          f"admin_username = {ADMIN}\n"
                          "authorization_function = "
                          "mlflow.server.auth:authenticate_request_basic_auth\n"
                          "auth_cache_ttl_seconds = 60\n")
    return {"MLFLOW_AUTH_CONFIG_PATH": str(config.resolve()),
            "MLFLOW_AUTH_ADMIN_USERNAME": ADMIN, "MLFLOW_AUTH_ADMIN_PASSWORD": password,
            "MLFLOW_FLASK_SERVER_SECRET_KEY": key}

"""Logging in to a tracking server, checked before any rank starts (no mlflow import here).

The login is what MLflow's client sends: MLFLOW_TRACKING_USERNAME/PASSWORD, else
~/.mlflow/credentials (an ini file, `[mlflow]` with mlflow_tracking_username/password; keep it
0600). `check_credentials` asks the server who we are (`/api/2.0/mlflow/users/current`, which
basic-auth guards; `/health` answers anyone), so a wrong or missing password is one clear line
at once instead of a job failing later. HTTPS is verified with MLFLOW_TRACKING_SERVER_CERT_PATH
when set (a site's own CA or a self-signed certificate), else the system's CAs.
"""

from __future__ import annotations

import base64
import configparser
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from train.security.redact import redact, split_userinfo
from train.tracking.errors import TrackingError

CREDENTIALS_FILE = Path("~/.mlflow/credentials")
WHOAMI = "/api/2.0/mlflow/users/current"


def ssl_context() -> ssl.SSLContext:
    """How MLflow's client verifies HTTPS, for the pre-flight's own requests."""
    if os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() == "true":
        return ssl._create_unverified_context()  # the user's explicit choice, as in MLflow
    return ssl.create_default_context(cafile=os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH")
                                      or None)


def credentials(uri: str) -> tuple[str, str] | None:
    """(user, password) as MLflow's client would send them to `uri`, or None."""
    _, user, password = split_userinfo(uri)
    if user and password is not None:
        return user, password
    user = os.environ.get("MLFLOW_TRACKING_USERNAME")
    password = os.environ.get("MLFLOW_TRACKING_PASSWORD")
    path = CREDENTIALS_FILE.expanduser()
    if (not user or not password) and path.exists():
        config = configparser.ConfigParser()
        config.read(path)
        saved = dict(config.items("mlflow")) if config.has_section("mlflow") else {}
        user = user or saved.get("mlflow_tracking_username")
        password = password or saved.get("mlflow_tracking_password")
    return (user, password) if user and password else None


def login_request(uri: str, path: str) -> tuple[urllib.request.Request, tuple[str, str] | None]:
    """A GET of `path` on the server at `uri`, with the login MLflow's client would send."""
    base, _, _ = split_userinfo(uri)
    request = urllib.request.Request(base.rstrip("/") + path)
    login = credentials(uri)
    if login:
        token = base64.b64encode(f"{login[0]}:{login[1]}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    return request, login


def check_credentials(uri: str, experiment: str | None = None,
                      timeout_s: float = 10.0) -> str | None:
    """The user a tracking server knows us as (None: not a server, or one without logins);
    TrackingError, one line, when it refuses the login or, with `experiment`, refuses that
    login the experiment (another user's: NO_PERMISSIONS). Never retried: it will not change."""
    if not uri.startswith(("http://", "https://")):
        return None
    path = CREDENTIALS_FILE.expanduser()
    if path.exists() and path.stat().st_mode & 0o077:
        raise TrackingError(f"{path} holds a password but other users may read it: "
                            f"`chmod 600 {path}`.")
    user = _whoami(uri, timeout_s)
    if user is not None and experiment:
        _check_experiment(uri, experiment, user, timeout_s)
    return user


def _check_experiment(uri: str, experiment: str, user: str, timeout_s: float) -> None:
    """An experiment that exists must be readable by `user` (a missing one is created)."""
    query = urllib.parse.urlencode({"experiment_name": experiment})
    request, _ = login_request(uri, f"/api/2.0/mlflow/experiments/get-by-name?{query}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s, context=ssl_context()):
            return
    except urllib.error.HTTPError as e:
        if e.code != 403:
            return  # 404: it does not exist yet and will be this user's
    except urllib.error.URLError as e:
        raise TrackingError(f"MLflow server {redact(uri)} cannot be reached ({e.reason}).") \
            from None
    raise TrackingError(
        f"MLflow server {redact(uri)}: user {user!r} may not use experiment {experiment!r} "
        "(another user's). Choose your own with tracking.experiment=<name>, or ask its owner "
        "or the server's admin to grant you access.")


def _whoami(uri: str, timeout_s: float) -> str | None:
    request, login = login_request(uri, WHOAMI)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s, context=ssl_context()):
            return login[0] if login else None
    except urllib.error.URLError as e:
        if not isinstance(e, urllib.error.HTTPError):
            raise TrackingError(f"MLflow server {redact(uri)} cannot be reached ({e.reason}).") \
                from None
        return _refused(uri, login, e.code)


def _refused(uri: str, login: tuple[str, str] | None, code: int) -> None:
    """A server without logins (404) is fine; 401/403 end the pre-flight."""
    where = redact(uri)
    if code == 404:  # no basic-auth app on this server: nothing to log in to
        return None
    if code not in (401, 403):
        raise TrackingError(f"MLflow server {where} answered HTTP {code} to {WHOAMI}: is it an "
                            "MLflow server?")
    if login is None:
        raise TrackingError(
            f"MLflow server {where} needs a login and none is set: export "
            "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or write them to "
            "~/.mlflow/credentials, mode 600); the server's admin login is in its "
            "server-auth.env.")
    raise TrackingError(
        f"MLflow server {where} refused the login of user {login[0]!r} (HTTP {code}): check "
        "MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (or ~/.mlflow/credentials).")

"""Secrets out of what is recorded or shown: the userinfo (`user:password@`) of any URI.

`python -m train` moves a password found in the tracking URI into the environment before Hydra
composes the config (train/__main__.py, `move_uri_credentials_to_env`), so params, tags,
config.yaml, mlflow_run.json, checkpoints and MLflow's own "View run at" line never see it;
`redact` is the net for text that still names a URI (the server's banner, error messages).
No imports beyond the standard library: every entry point uses this before anything heavy.
"""

from __future__ import annotations

import os
import re
import urllib.parse

HIDDEN = "***"
# scheme://user:password@ ... anywhere in a text; the password is everything up to the last
# '@' before the host (passwords may contain '@' only percent-encoded, as URIs require).
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^/@\s:]*):"
                       r"(?P<password>[^/@\s]*)@")


def redact(text: str) -> str:
    """`text` with the password of every URI in it replaced by ***."""
    return _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:{HIDDEN}@", text)


def split_userinfo(uri: str) -> tuple[str, str | None, str | None]:
    """(uri without user:password@, user, password); user and password are unquoted."""
    parts = urllib.parse.urlsplit(uri)
    if "@" not in parts.netloc:
        return uri, None, None
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    clean = urllib.parse.urlunsplit(parts._replace(netloc=hostport))
    return (clean, urllib.parse.unquote(user) or None,
            urllib.parse.unquote(password) if password else None)


def move_uri_credentials_to_env(uri: str, env: dict[str, str] | os._Environ[str]) -> str:
    """The URI to record instead of `uri`; its credentials go where the client reads them.

    http(s): MLFLOW_TRACKING_USERNAME/PASSWORD (what MLflow's client sends as basic auth);
    postgresql: PGPASSWORD (libpq's; the user name stays in the URI, it is no secret).
    Other schemes keep their URI (their drivers take no password from the environment);
    `redact` still hides it wherever it is printed."""
    clean, user, password = split_userinfo(uri)
    scheme = uri.split(":", 1)[0].lower()
    if user is None and password is None:
        return uri
    if scheme in ("http", "https"):
        if user:
            env["MLFLOW_TRACKING_USERNAME"] = user
        if password is not None:
            env["MLFLOW_TRACKING_PASSWORD"] = password
        return clean
    if scheme.startswith("postgresql") and password is not None:
        env["PGPASSWORD"] = password
        parts = urllib.parse.urlsplit(clean)
        netloc = f"{urllib.parse.quote(user or '', safe='')}@{parts.netloc}" if user else \
            parts.netloc
        return urllib.parse.urlunsplit(parts._replace(netloc=netloc))
    return uri

"""Secrets and untrusted bytes: passwords kept out of URIs and logs, the tracking server's
logins, unpickling only plain arrays. The lowest wing: imports only train.errors."""

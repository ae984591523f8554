"""Who may join a parameter server: a shared secret, proven without sending it.

A worker that joins a server writes a join record into the store: its worker id, attempt, a
fresh nonce and HMAC-SHA256(token, server incarnation | worker | attempt | nonce). The server
recomputes the MAC; only then does it answer "ok" and build its end of the link. A record
with a wrong MAC, or a nonce seen before (a replay of a record read from the store), is
answered "refused" and logged; no link is built, so that joiner can neither push gradients
nor read parameters.

The token comes from SCALETRAIN_JOIN_TOKEN (the launcher sets it for its children from
``--join-token-file`` or its own environment; without either it draws a random one per run,
so only processes it started can join). What this does not cover: the TCPStore and the gloo
connections themselves are not authenticated (docs/cluster.md, "Trust model").
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from scaletrain import env


class JoinRefused(RuntimeError):
    pass


def read_token_file(path: str) -> str:
    """The token in ``path`` (surrounding whitespace dropped); ValueError naming the flag."""
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"join_token_file: cannot read {path}: {e.strerror}") from None
    if not token:
        raise ValueError(f"join_token_file: {path} is empty")
    return token


def launcher_token(token_file: str) -> str:
    """What the launcher gives its processes: the file's token, else the environment's, else
    a random one for this run."""
    if token_file:
        return read_token_file(token_file)
    return os.environ.get(env.JOIN_TOKEN) or secrets.token_hex(16)


def _mac(token: str, scope: str, worker: int, attempt: int, nonce: str) -> str:
    message = f"{scope}|{worker}|{attempt}|{nonce}".encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def join_record(token: str, scope: str, worker: int, attempt: int) -> str:
    nonce = secrets.token_hex(8)
    return f"{worker}:{attempt}:{nonce}:{_mac(token, scope, worker, attempt, nonce)}"


class Admission:
    """A server's check of join records for one incarnation (``scope``)."""

    def __init__(self, token: str, scope: str) -> None:
        self.token, self.scope = token, scope
        self.nonces: set[str] = set()

    def check(self, record: str) -> tuple[int, int, str | None]:
        """(worker, attempt, None) for a valid record, else (worker, attempt, the reason)."""
        try:
            worker_s, attempt_s, nonce, mac = record.split(":")
            worker, attempt = int(worker_s), int(attempt_s)
        except ValueError:
            return -1, -1, "malformed join record"
        if not hmac.compare_digest(mac, _mac(self.token, self.scope, worker, attempt, nonce)):
            return worker, attempt, "wrong join token"
        if nonce in self.nonces:
            return worker, attempt, "replayed join record"
        self.nonces.add(nonce)
        return worker, attempt, None

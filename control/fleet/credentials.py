"""Who may do what on the embedded broker: one Valkey ACL user per role, and the private
file through which `keybatch up` hands the operator's credential to the operator's tools.

Roles (docs/reliability.md, "Broker credentials"):

- ``gateway``: the request path's keys (``{kb}*``) and the Celery queues in them; no
  pub/sub, no administrative or dangerous command (MONITOR, CONFIG, ACL, DEBUG, KEYS,
  FLUSH*, CLIENT LIST/KILL...).
- ``replica``: the same keys, plus what a Celery worker needs besides: kombu's bindings
  and unacked bookkeeping, replies to a remote-control caller, PSUBSCRIBE to the
  remote-control channel (to hear commands) and PUBLISH to the events channels only. It
  cannot PUBLISH on the remote-control channel, so it cannot drain, move or resume a
  replica.
- ``operator``: everything (the fleet commands, the dashboard, Flower, the supervisor).

The ``default`` user is off: a connection that does not authenticate can run nothing.
Valkey is given only SHA-256 hashes of the passwords (the ACL file holds no secret).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import quote

Role = Literal["gateway", "replica", "operator"]
ROLES: tuple[Role, ...] = ("gateway", "replica", "operator")

# kombu's Redis transport names its pub/sub topics "/<db>.<exchange>[/<routing key>]";
# the embedded broker is always database 0.
PIDBOX_CHANNEL = "/0.celery.pidbox"
EVENTS_CHANNELS = "/0.celeryev/*"
CHORD_RESULT_CHANNELS = "{kb}:chord:*"  # Celery's result backend publishes each result on its key

# Commands no data-path role needs, beyond the @admin and @dangerous categories: pub/sub
# is granted per role below; scripts are loaded and run (EVAL/EVALSHA, SCRIPT LOAD) but
# never flushed or killed, and no function library is used.
_DATA_PATH_DENIED = "-@admin -@dangerous -@pubsub -function -script|flush -script|kill -script|debug"
_DATA_KEYS = "~{kb}*"
_ACL = {
    "gateway": f"resetkeys resetchannels {_DATA_KEYS} +@all {_DATA_PATH_DENIED}",
    "replica": (
        f"resetkeys resetchannels {_DATA_KEYS} ~_kombu.binding* ~unacked* ~*.celery.pidbox* "
        f"&{PIDBOX_CHANNEL} +@all {_DATA_PATH_DENIED} +psubscribe +punsubscribe +subscribe +unsubscribe "
        # A selector: PUBLISH allowed on the events channels alone, not on the root's channel.
        # and on the chord collector's result channels (tasks/replica/chord.py).
        f"(+publish resetchannels &{EVENTS_CHANNELS} &{CHORD_RESULT_CHANNELS})"
    ),
    "operator": "allkeys allchannels +@all",
}


@dataclass(frozen=True)
class BrokerSecrets:
    """A fresh password per role; the operator's may be given (`ADMIN_TOKEN`), so that an
    operator's tools elsewhere can act with a credential they already hold."""

    passwords: dict[str, str] = field(default_factory=lambda: {r: secrets.token_urlsafe(32) for r in ROLES})

    @classmethod
    def with_operator(cls, password: str | None) -> BrokerSecrets:
        made = cls()
        if password:
            made.passwords["operator"] = password
        return made

    def acl(self) -> str:
        """The ACL file: the default user off, each role with its rules and its password's hash."""
        lines = ["user default off resetpass resetkeys resetchannels -@all"]
        for role in ROLES:
            digest = hashlib.sha256(self.passwords[role].encode()).hexdigest()
            lines.append(f"user {role} on resetpass #{digest} {_ACL[role]}")
        return "\n".join(lines) + "\n"

    def url(self, role: Role, host: str, port: int, db: int = 0) -> str:
        return f"redis://{role}:{quote(self.passwords[role], safe='')}@{host}:{port}/{db}"


def private_dir(path: Path) -> Path:
    """`path` as a directory only its owner can enter (created if need be)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` readable by its owner alone, atomically (a reader sees the
    old file or the new one, never a part, nor a moment with wider permissions)."""
    private_dir(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # created 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def credentials_path(secrets_dir: Path, port: int) -> Path:
    """Where `keybatch up` serving on `port` keeps the operator's broker URL."""
    return secrets_dir.expanduser() / f"broker-{port}.json"


def write_operator_url(path: Path, urls: str | list[str]) -> None:
    """The operator's URL of each cell (the first also as `redis_url`, what one cell needs)."""
    cells = [urls] if isinstance(urls, str) else urls
    write_private(path, json.dumps({"redis_url": cells[0], "cells": cells}) + "\n")


def read_operator_cells(path: Path) -> list[str]:
    """The operator's URL of each cell that `keybatch up` left at `path` (empty: none)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    cells = data.get("cells") if isinstance(data, dict) else None
    if isinstance(cells, list) and cells and all(isinstance(url, str) for url in cells):
        return cells
    url = read_operator_url(path)
    return [url] if url else []


def read_operator_url(path: Path) -> str | None:
    """The operator's broker URL that `keybatch up` left at `path`, if any."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    url = data.get("redis_url") if isinstance(data, dict) else None
    return url if isinstance(url, str) else None

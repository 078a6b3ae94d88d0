"""Shared secrets: one convention for every control plane kvconnect runs.

A component that authenticates callers (the HF3FS metadata service, the peer pool's nodes,
the PD backend's control messages) takes its secret from, first to last: the option
``auth_token``, the file named by ``auth_token_file``, the environment variable
``KVCONNECT_<COMPONENT>_TOKEN``. No secret means no authentication. On gRPC the secret
travels as ``authorization: Bearer <secret>`` call metadata; elsewhere (framed TCP, ZMQ
messages) as a field of the first or every message. Secrets are compared in constant time.
"""

from __future__ import annotations

import hmac
import logging
import os
from typing import Any

from kvconnect.connectors.errors import ConfigError

log = logging.getLogger("kvconnect.auth")

AUTH_HEADER = "authorization"
"""gRPC metadata key carrying ``Bearer <secret>``."""


def env_var(component: str) -> str:
    """The environment variable of a component's secret (``KVCONNECT_PEER_TOKEN``, ...)."""
    return f"KVCONNECT_{component.upper()}_TOKEN"


def read_token_file(path: str, key: str = "auth_token_file") -> str:
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as e:
        raise ConfigError(key, f"cannot read {path!r}: {e.strerror}") from e
    if not token:
        raise ConfigError(key, f"{path!r} is empty")
    return token


def resolve_token(auth_token: str | None, auth_token_file: str | None, component: str) -> str | None:
    """The secret: ``auth_token``, else the contents of ``auth_token_file``, else the
    component's environment variable; None when none is set."""
    if auth_token:
        return auth_token
    if auth_token_file:
        return read_token_file(auth_token_file)
    return os.environ.get(env_var(component)) or None


def token_matches(expected: str | bytes | None, got: Any) -> bool:
    """Constant-time check of a presented secret (no secret configured: accept all)."""
    if not expected:
        return True
    if isinstance(got, str):
        got = got.encode()
    if not isinstance(got, bytes):
        return False
    return hmac.compare_digest(expected.encode() if isinstance(expected, str) else expected, got)


def grpc_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata that presents ``token`` (none without one)."""
    return ((AUTH_HEADER, f"Bearer {token}"),) if token else ()



def warn_token_on_command_line(flag: str, instead: str) -> None:
    """A secret given as a command-line argument is readable by every local user (``ps``)."""
    log.warning("%s puts the secret on the command line, where every user of this host can read it "
                "(ps, /proc/PID/cmdline); use %s or $KVCONNECT_<PART>_TOKEN instead", flag, instead)

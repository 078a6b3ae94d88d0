"""Mooncake Store error codes and what each means for a page store.

Mooncake returns negative ``ErrorCode`` values (``mooncake-store/include/types.h``). On the
data path they become values (a miss, a failed write, "already there"); outside it they
become our typed errors. Every code is classified here, once.
"""

from __future__ import annotations

from enum import Enum

from kvconnect.connectors.base import BackendUnavailable, KVStoreError, PageSizeMismatch, Unsupported


class Outcome(Enum):
    MISS = "miss"                  # the key is not (or no longer, or not yet) readable
    EXISTS = "exists"              # a put found the key already stored: success, bytes kept
    LEASED = "leased"              # a reader/writer holds a lease; retry after it lapses
    NO_SPACE = "no_space"          # segments full: a failed write, not an outage
    BAD_REQUEST = "bad_request"    # size mismatch / invalid arguments: a miss, logged
    TRANSIENT = "transient"        # transfer failed, lease expired mid-read: a miss
    UNAVAILABLE = "unavailable"    # master or peer unreachable: a miss, store goes unhealthy
    UNSUPPORTED = "unsupported"    # feature not enabled in this deployment
    INTERNAL = "internal"


# code -> (name, outcome)
CODES: dict[int, tuple[str, Outcome]] = {
    0: ("OK", Outcome.MISS),  # never looked up for a success
    -1: ("INTERNAL_ERROR", Outcome.INTERNAL),
    -10: ("BUFFER_OVERFLOW", Outcome.BAD_REQUEST),
    -100: ("SHARD_INDEX_OUT_OF_RANGE", Outcome.INTERNAL),
    -101: ("SEGMENT_NOT_FOUND", Outcome.NO_SPACE),
    -102: ("SEGMENT_ALREADY_EXISTS", Outcome.INTERNAL),
    -103: ("CLIENT_NOT_FOUND", Outcome.UNAVAILABLE),
    -200: ("NO_AVAILABLE_HANDLE", Outcome.NO_SPACE),
    -300: ("INVALID_VERSION", Outcome.TRANSIENT),
    -400: ("INVALID_KEY", Outcome.BAD_REQUEST),
    -500: ("WRITE_FAIL", Outcome.TRANSIENT),
    -600: ("INVALID_PARAMS", Outcome.BAD_REQUEST),
    -601: ("ILLEGAL_CLIENT", Outcome.UNAVAILABLE),
    -700: ("INVALID_WRITE", Outcome.BAD_REQUEST),
    -701: ("INVALID_READ", Outcome.BAD_REQUEST),
    -702: ("INVALID_REPLICA", Outcome.TRANSIENT),
    -703: ("REPLICA_IS_NOT_READY", Outcome.MISS),
    -704: ("OBJECT_NOT_FOUND", Outcome.MISS),
    -705: ("OBJECT_ALREADY_EXISTS", Outcome.EXISTS),
    -706: ("OBJECT_HAS_LEASE", Outcome.LEASED),
    -707: ("LEASE_EXPIRED", Outcome.TRANSIENT),
    -708: ("OBJECT_HAS_REPLICATION_TASK", Outcome.LEASED),
    -709: ("OBJECT_NO_REPLICATION_TASK", Outcome.INTERNAL),
    -710: ("REPLICA_NOT_FOUND", Outcome.MISS),
    -711: ("REPLICA_ALREADY_EXISTS", Outcome.EXISTS),
    -712: ("REPLICA_IS_GONE", Outcome.MISS),
    -800: ("TRANSFER_FAIL", Outcome.TRANSIENT),
    -900: ("RPC_FAIL", Outcome.UNAVAILABLE),
    -901: ("RPC_TIMEOUT", Outcome.UNAVAILABLE),  # master RPC past MC_RPC_TIMEOUT_MS (a stalled master)
    -1000: ("ETCD_OPERATION_ERROR", Outcome.UNAVAILABLE),
    -1001: ("ETCD_KEY_NOT_EXIST", Outcome.UNAVAILABLE),
    -1002: ("ETCD_TRANSACTION_FAIL", Outcome.UNAVAILABLE),
    -1003: ("ETCD_CTX_CANCELLED", Outcome.UNAVAILABLE),
    -1010: ("UNAVAILABLE_IN_CURRENT_STATUS", Outcome.UNAVAILABLE),
    -1011: ("UNAVAILABLE_IN_CURRENT_MODE", Outcome.UNSUPPORTED),
    -1100: ("FILE_NOT_FOUND", Outcome.MISS),
    -1101: ("FILE_OPEN_FAIL", Outcome.TRANSIENT),
    -1102: ("FILE_READ_FAIL", Outcome.TRANSIENT),
    -1103: ("FILE_WRITE_FAIL", Outcome.TRANSIENT),
    -1104: ("FILE_INVALID_BUFFER", Outcome.BAD_REQUEST),
    -1105: ("FILE_LOCK_FAIL", Outcome.TRANSIENT),
    -1106: ("FILE_INVALID_HANDLE", Outcome.TRANSIENT),
    -1200: ("BUCKET_NOT_FOUND", Outcome.MISS),
    -1201: ("BUCKET_ALREADY_EXISTS", Outcome.INTERNAL),
    -1202: ("KEYS_EXCEED_BUCKET_LIMIT", Outcome.NO_SPACE),
    -1203: ("KEYS_ULTRA_LIMIT", Outcome.NO_SPACE),
    -1300: ("UNABLE_OFFLOAD", Outcome.UNSUPPORTED),
    -1301: ("UNABLE_OFFLOADING", Outcome.TRANSIENT),
    -1400: ("TASK_NOT_FOUND", Outcome.INTERNAL),
    -1401: ("TASK_PENDING_LIMIT_EXCEEDED", Outcome.TRANSIENT),
}

OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
RPC_FAIL = -900


def code_name(code: int) -> str:
    return CODES.get(code, (f"UNKNOWN({code})", Outcome.INTERNAL))[0]


def outcome(code: int) -> Outcome:
    return CODES.get(code, ("", Outcome.INTERNAL))[1]


class MooncakeError(KVStoreError):
    """A Mooncake call failed outside the data path (setup, registration, admin calls)."""

    def __init__(self, operation: str, code: int):
        self.operation = operation
        self.code = code
        self.code_name = code_name(code)
        super().__init__(f"mooncake: {operation} failed: {self.code_name} ({code})")


def raise_for(operation: str, code: int, *, master: str = "") -> None:
    """Raise the typed error for a failed non-data-path call (``code`` < 0)."""
    kind = outcome(code)
    if kind is Outcome.UNAVAILABLE:
        raise BackendUnavailable("mooncake", f"{operation}: {code_name(code)} ({code})"
                                 + (f"; master {master}" if master else ""))
    if kind is Outcome.UNSUPPORTED:
        raise Unsupported(f"{operation} ({code_name(code)})", "mooncake")
    if code in (-600, -10) and operation.startswith("get"):
        raise PageSizeMismatch(f"mooncake: {operation}: {code_name(code)} ({code})")
    raise MooncakeError(operation, code)

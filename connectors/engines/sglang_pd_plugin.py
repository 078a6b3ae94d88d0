"""SGLang plugin (entry point ``sglang.srt.plugins``): adds the ``kvconnect`` PD transfer backend.

SGLang (0.5.23, 0.5.17) runs every ``sglang.srt.plugins`` entry point in each of its processes
(``sglang serve`` / ``launch_server`` before argument parsing, and every scheduler
process), then applies the hooks registered with ``HookRegistry``. ``register`` does three
small things and nothing else:

* appends ``"kvconnect"`` to ``--disaggregation-transfer-backend``'s choices;
* adds ``TransferBackend.KVCONNECT`` to SGLang's enum *in place* (the FlagCX way), so
  ``TransferBackend("kvconnect")`` works and ``TransferBackend.MOONCAKE`` stays the same
  object for code that already holds the class;
* wraps ``get_kv_class`` (an AROUND hook) so the ``kvconnect`` backend maps to
  ``kvconnect.connectors.engines.sglang_pd``'s manager, sender, receiver and bootstrap server.

It imports nothing heavy: the transfer classes (and Mooncake, stores) are imported only when
a process actually asks ``get_kv_class`` for the ``kvconnect`` backend. Any error here is
logged and swallowed: a broken plugin must never stop SGLang from starting.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

BACKEND_NAME = "kvconnect"
ENUM_MEMBER = "KVCONNECT"
GET_KV_CLASS_TARGET = "sglang.srt.disaggregation.utils.get_kv_class"

_hook_registered = False


def register() -> None:
    """Entry point. Harmless in processes that never use PD; never raises."""
    try:
        _add_cli_choice()
        _add_enum_member()
        _register_get_kv_class_hook()
    except Exception:  # noqa: BLE001 - a plugin must never break SGLang startup
        logger.exception("kvconnect: could not register the %r PD transfer backend; "
                         "SGLang continues without it", BACKEND_NAME)


def _add_cli_choice() -> None:
    try:
        from sglang.srt.arg_groups.choices import (
            DISAGG_TRANSFER_BACKEND_CHOICES,
            add_disagg_transfer_backend_choices,
        )
    except ImportError:  # releases before the arg_groups split
        from sglang.srt.server_args import (  # type: ignore[no-redef]
            DISAGG_TRANSFER_BACKEND_CHOICES,
            add_disagg_transfer_backend_choices,
        )
    if BACKEND_NAME not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND_NAME])  # a list: a str would add its letters


def _add_enum_member() -> None:
    """Inject ``KVCONNECT = "kvconnect"`` into the existing ``TransferBackend`` enum.

    Replacing the class (HookType.REPLACE) would leave modules that imported the old class
    comparing against different member objects; injecting keeps every identity intact.
    """
    from sglang.srt.disaggregation.utils import TransferBackend

    if BACKEND_NAME in TransferBackend._value2member_map_:
        return
    member = object.__new__(TransferBackend)
    member._name_ = ENUM_MEMBER
    member._value_ = BACKEND_NAME
    try:
        member.__objclass__ = TransferBackend
    except AttributeError:
        pass
    if hasattr(member, "_sort_order_"):
        member._sort_order_ = len(TransferBackend._member_names_)
    TransferBackend._value2member_map_[BACKEND_NAME] = member
    TransferBackend._member_map_[ENUM_MEMBER] = member
    TransferBackend._member_names_.append(ENUM_MEMBER)
    type.__setattr__(TransferBackend, ENUM_MEMBER, member)


def _register_get_kv_class_hook() -> None:
    global _hook_registered
    if _hook_registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(GET_KV_CLASS_TARGET, get_kv_class_hook, HookType.AROUND)
    _hook_registered = True


def get_kv_class_hook(original: Any, transfer_backend: Any, class_type: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of ``get_kv_class``: our classes for ``kvconnect``, SGLang's otherwise."""
    name = getattr(transfer_backend, "value", transfer_backend)
    kind = getattr(class_type, "value", class_type)
    if name != BACKEND_NAME:
        return original(transfer_backend, class_type, *args, **kwargs)
    if kind == "kvargs":
        try:
            return original(transfer_backend, class_type, *args, **kwargs)
        except ValueError:  # SGLang 0.5.17 knows KVArgs only per built-in backend
            from sglang.srt.disaggregation.base.conn import KVArgs

            return KVArgs
    from kvconnect.connectors.engines import sglang_pd  # heavy: sglang disaggregation + transports

    return sglang_pd.KV_CLASSES[kind]

"""A store that starts failing mid-run, for the vLLM tests (imported by the vLLM process:
``"store": "tests.integration.vllm_faulty:FlagFailStore"``).

It wraps a real store (``inner`` + ``inner_options``) and passes every call through until
the file ``fail_flag`` exists; from then on ``get_into`` raises (a backend gone between
the scheduler's lookup and the worker's load), while ``exists`` still answers from the real
store, so vLLM is promised pages it then cannot load: the load-error path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from connectors.base import BackendUnavailable, Page, PageStore
from connectors.config import StoreConfig, field_doc


@dataclass(frozen=True)
class FlagFailConfig(StoreConfig):
    inner: str = field(default="memory", metadata=field_doc("the real store"))
    inner_options: dict = field(default_factory=dict, metadata=field_doc("its options"))
    fail_flag: str = field(default="", metadata=field_doc("once this file exists, get_into raises"))


class FlagFailStore(PageStore):
    name = "flag_fail"
    config_class = FlagFailConfig

    def __init__(self, config: FlagFailConfig):
        super().__init__()
        from connectors.registry import create_store

        self.config = config
        self.inner = create_store(config.inner, config.inner_options)
        self.needs_registered_memory = self.inner.needs_registered_memory  # type: ignore[misc]

    def _failing(self) -> bool:
        return bool(self.config.fail_flag) and os.path.exists(self.config.fail_flag)

    def _exists(self, keys: list[str]) -> list[bool]:
        return self.inner.exists(keys)

    def _get_into(self, keys: list[str], pages: list[Page]) -> list[bool]:
        if self._failing():
            raise BackendUnavailable(self.name, "injected failure")
        return self.inner.get_into(keys, pages)

    def _put_from(self, keys: list[str], pages: list[Page]) -> list[bool]:
        return self.inner.put_from(keys, pages)

    def _delete(self, keys: list[str]) -> list[bool]:
        return self.inner.delete(keys)

    def _clear(self) -> None:
        self.inner.clear()

    def _register_memory(self, address: int, nbytes: int) -> None:
        self.inner.register_memory(address, nbytes)

    def _close(self) -> None:
        self.inner.close()

    def stats(self) -> Any:
        return self.inner.stats()

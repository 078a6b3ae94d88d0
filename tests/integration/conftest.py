"""Fixtures shared by integration test files."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model(tmp_path_factory) -> Path:
    """A tiny Llama-style model with random weights and a local tokenizer (nothing downloaded)."""
    from kvconnect.connectors.testing.vllm import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama") / "model")

"""Shared fixtures: the tiny model every test that needs one uses."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvkeep.model import TinyModelSpec, write_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model `make test` generated (KVKEEP_TINY_MODEL), or a fresh one."""
    given = os.environ.get("KVKEEP_TINY_MODEL")
    if given and (Path(given) / "config.json").is_file():
        return Path(given)
    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"), TinyModelSpec())

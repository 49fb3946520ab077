"""A real cache server for the worker-side tests (saver, loader): 8 MiB of RAM, 1 MiB extents."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from serverproc import Server, stop_all


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    (tmp_path / "srv").mkdir()
    srv = Server(tmp_path / "srv", ["--ram", "8MiB", "--extent", "1MiB"])
    srv.start()
    yield srv
    stop_all([srv])

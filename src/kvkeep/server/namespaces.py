"""Which namespaces a state directory holds blocks of, and the warning a mismatch deserves.

A namespace digest covers the model config, KV dtype, layout, block size, TP rank, cache_salt
and kvkeep's format version, so any change to those makes every old block unreachable. That is
the correct outcome, but silent: an operator only sees a hit rate of zero. So the first time a
namespace says HELLO to a server whose disk tier holds no block of it but blocks of others, the
server logs one warning that names both sides. Labels and block sizes of namespaces are kept in
``DIR/namespaces.json`` (written tmp + rename) so the warning can name namespaces that were
announced by an earlier server process.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("kvkeep.server")

_LISTED = 5  # other namespaces named in the warning


class NamespaceRegistry:
    """Thread-safe. ``announce`` blocks on file I/O and an O(blocks) count: call it off the
    event loop. It never raises: the registry is advisory and a full disk must not matter."""

    def __init__(self, path: Path, blocks: Callable[[], Counter[bytes]]) -> None:
        self.path = path
        self._blocks = blocks
        self._lock = threading.Lock()
        self._checked: set[bytes] = set()
        self._known = self._load()

    def announce(self, store_digest: bytes, digest: bytes, label: str, block_bytes: int) -> bool:
        """Record a namespace; warn (once per namespace and process) if the directory holds
        only other namespaces' blocks. Returns whether it warned."""
        with self._lock:
            if store_digest in self._checked:
                return False
            self._checked.add(store_digest)
            entry = {"namespace": digest.hex(), "label": label, "block_bytes": block_bytes}
            if self._known.get(store_digest.hex()) != entry:
                self._known[store_digest.hex()] = entry
                self._save()
        counts = self._blocks()
        if counts.get(store_digest, 0) or not counts:
            return False
        log.warning(
            "namespace %s has no cached blocks here, but %s holds %d blocks of %d other "
            "namespace(s): %s. They are never served to it: the model config, KV dtype, "
            "layout, block size or bytes, cache_salt or kvkeep format version differs. They "
            "age out as the disk tier fills (or remove the directory to reclaim the space now).",
            self._describe(store_digest),
            self.path.parent,
            sum(counts.values()),
            len(counts),
            "; ".join(f"{self._describe(d)}: {n} blocks" for d, n in counts.most_common(_LISTED)),
        )
        return True

    def _describe(self, store_digest: bytes) -> str:
        entry = self._known.get(store_digest.hex())
        if entry is None:
            return f"{store_digest.hex()[:12]} (never announced to this directory's registry)"
        return f"{entry['namespace'][:12]} ({entry['label']!r}, {entry['block_bytes']}-byte blocks)"

    def _load(self) -> dict[str, dict[str, Any]]:
        with contextlib.suppress(OSError, ValueError):
            known = json.loads(self.path.read_text())
            if isinstance(known, dict):
                return {k: v for k, v in known.items() if _valid_entry(v)}
        return {}

    def _save(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        try:
            tmp.write_text(json.dumps(self._known, indent=1, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            log.debug("could not save %s: %s", self.path, exc)


def _valid_entry(entry: Any) -> bool:
    return isinstance(entry, dict) and {"namespace", "label", "block_bytes"} <= entry.keys()

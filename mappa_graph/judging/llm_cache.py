"""Scored verdicts keyed by a hash of everything the judge was shown, in memory and optionally in SQLite, so
re-scoring the same actions makes no calls."""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path
from typing import Any


class JudgeCache:
    """Scored verdicts by prompt key: a dict, plus an SQLite file when `path` is given (kept across runs and
    shared by processes). Only scored verdicts are stored; an unscored action is tried again next time."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = None if path is None else Path(path)
        self._memory: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("CREATE TABLE IF NOT EXISTS verdicts (key TEXT PRIMARY KEY, data TEXT NOT NULL)")

    def get(self, key: str) -> dict[str, Any] | None:
        with self._lock:
            if key in self._memory:
                return self._memory[key]
            if self._db is None:
                return None
            row = self._db.execute("SELECT data FROM verdicts WHERE key=?", (key,)).fetchone()
            if row is None:
                return None
            self._memory[key] = json.loads(row[0])
            return self._memory[key]

    def put(self, key: str, verdict: dict[str, Any]) -> None:
        with self._lock:
            self._memory[key] = verdict
            if self._db is not None:
                self._db.execute("INSERT OR REPLACE INTO verdicts VALUES (?, ?)", (key, json.dumps(verdict)))

    def __len__(self) -> int:
        with self._lock:
            if self._db is None:
                return len(self._memory)
            return int(self._db.execute("SELECT COUNT(*) FROM verdicts").fetchone()[0])

    def clear(self) -> None:
        with self._lock:
            self._memory.clear()
            if self._db is not None:
                self._db.execute("DELETE FROM verdicts")

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

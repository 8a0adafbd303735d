"""Stored responses (`store: true` on `/v1/responses`), for `GET` / `DELETE
/v1/responses/{id}` and `previous_response_id`.

Each record is the response object and the conversation as items (input and output),
and belongs to the caller that created it (the API key's fingerprint; "" without keys):
another key's record is not found. Both stores are bounded: the oldest records go first
once `max_responses` records or `max_bytes` bytes are held.

- `MemoryResponseStore`: the default, lost at exit;
- `SqliteResponseStore`: `--response-store PATH`, kept across restarts (one file, one
  table; the standard library's sqlite3).
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict[str, Any]
    #: the whole conversation as Responses input items: earlier turns, input, output
    items: list[dict[str, Any]]


def _encode(record: StoredResponse) -> tuple[str, str]:
    return (json.dumps(record.response, ensure_ascii=False, separators=(",", ":")),
            json.dumps(record.items, ensure_ascii=False, separators=(",", ":")))


class ResponseStore:
    """The interface: put / get / delete, scoped by `owner`."""

    def __init__(self, max_responses: int, max_bytes: int) -> None:
        if max_responses < 1 or max_bytes < 1:
            raise ValueError("max_stored_responses and max_stored_response_bytes must be >= 1")
        self.max_responses = max_responses
        self.max_bytes = max_bytes

    def put(self, owner: str, response_id: str, record: StoredResponse) -> None:
        raise NotImplementedError

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        raise NotImplementedError

    def delete(self, owner: str, response_id: str) -> bool:
        raise NotImplementedError

    def close(self) -> None:
        pass


class MemoryResponseStore(ResponseStore):
    def __init__(self, max_responses: int = 1024, max_bytes: int = 256 * 2**20) -> None:
        super().__init__(max_responses, max_bytes)
        self._records: OrderedDict[str, tuple[str, int, StoredResponse]] = OrderedDict()
        self._bytes = 0

    def put(self, owner: str, response_id: str, record: StoredResponse) -> None:
        size = sum(map(len, _encode(record)))
        if size > self.max_bytes:
            return  # larger than the whole store: not kept
        self.delete(owner, response_id)
        self._records[response_id] = (owner, size, record)
        self._bytes += size
        while len(self._records) > self.max_responses or self._bytes > self.max_bytes:
            _, (_, old, _) = self._records.popitem(last=False)
            self._bytes -= old

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        found = self._records.get(response_id)
        return found[2] if found is not None and found[0] == owner else None

    def delete(self, owner: str, response_id: str) -> bool:
        found = self._records.get(response_id)
        if found is None or found[0] != owner:
            return False
        del self._records[response_id]
        self._bytes -= found[1]
        return True

    def __len__(self) -> int:
        return len(self._records)


class SqliteResponseStore(ResponseStore):
    def __init__(self, path: str, max_responses: int = 1024, max_bytes: int = 256 * 2**20) -> None:
        super().__init__(max_responses, max_bytes)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS responses (seq INTEGER PRIMARY KEY AUTOINCREMENT, "
                         "id TEXT UNIQUE NOT NULL, owner TEXT NOT NULL, response TEXT NOT NULL, items TEXT NOT NULL, "
                         "size INTEGER NOT NULL)")

    def put(self, owner: str, response_id: str, record: StoredResponse) -> None:
        response, items = _encode(record)
        size = len(response) + len(items)
        if size > self.max_bytes:
            return
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,))
                self._db.execute("INSERT INTO responses (id, owner, response, items, size) VALUES (?, ?, ?, ?, ?)",
                                 (response_id, owner, response, items, size))
                count, total = self._db.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM responses").fetchone()
                while count > self.max_responses or total > self.max_bytes:
                    seq, old = self._db.execute("SELECT seq, size FROM responses ORDER BY seq LIMIT 1").fetchone()
                    self._db.execute("DELETE FROM responses WHERE seq = ?", (seq,))
                    count, total = count - 1, total - old
            except BaseException:
                self._db.execute("ROLLBACK")  # the next put starts a fresh transaction
                raise
            self._db.execute("COMMIT")

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        with self._lock:
            row = self._db.execute("SELECT response, items FROM responses WHERE id = ? AND owner = ?",
                                   (response_id, owner)).fetchone()
        return None if row is None else StoredResponse(json.loads(row[0]), json.loads(row[1]))

    def delete(self, owner: str, response_id: str) -> bool:
        with self._lock:
            cur = self._db.execute("DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner))
        return cur.rowcount > 0

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()


def make_store(path: str | None, max_responses: int, max_bytes: int) -> ResponseStore:
    if path:
        return SqliteResponseStore(path, max_responses, max_bytes)
    return MemoryResponseStore(max_responses, max_bytes)

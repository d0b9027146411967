"""Jobs in SQLite, so a restart keeps finished jobs and knows which ones it interrupted."""

import json
import sqlite3
import threading
from pathlib import Path

_COLUMNS = ("id", "status", "created_at", "started_at", "finished_at", "request", "progress", "stage", "timings",
            "error", "result_path", "result_bytes", "uploads")
_JSON = ("request", "timings", "uploads")


class JobStore:
    """A thread-safe table of jobs. Rows are dicts with the columns above; JSON columns are decoded."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS jobs (id TEXT PRIMARY KEY, status TEXT NOT NULL, created_at REAL NOT NULL, "
            "started_at REAL, finished_at REAL, request TEXT NOT NULL, progress REAL NOT NULL DEFAULT 0, stage TEXT, "
            "timings TEXT NOT NULL DEFAULT '{}', error TEXT, result_path TEXT, result_bytes INTEGER, "
            "uploads TEXT NOT NULL DEFAULT '{}', seq INTEGER)"
        )
        self._db.execute("CREATE INDEX IF NOT EXISTS jobs_status ON jobs(status)")

    def _row(self, values) -> dict:
        row = dict(zip(_COLUMNS, values))
        for key in _JSON:
            row[key] = json.loads(row[key]) if row[key] else {}
        return row

    def insert(self, job: dict) -> None:
        values = [json.dumps(job.get(c, {})) if c in _JSON else job.get(c) for c in _COLUMNS]
        with self._lock:
            seq = self._db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM jobs").fetchone()[0]
            self._db.execute(f"INSERT INTO jobs ({', '.join(_COLUMNS)}, seq) VALUES ({', '.join('?' * len(_COLUMNS))}, ?)",
                             [*values, seq])

    def update(self, job_id: str, **fields) -> None:
        if not fields:
            return
        names = ", ".join(f"{name} = ?" for name in fields)
        values = [json.dumps(v) if k in _JSON else v for k, v in fields.items()]
        with self._lock:
            self._db.execute(f"UPDATE jobs SET {names} WHERE id = ?", [*values, job_id])

    def get(self, job_id: str) -> dict | None:
        with self._lock:
            values = self._db.execute(f"SELECT {', '.join(_COLUMNS)} FROM jobs WHERE id = ?", [job_id]).fetchone()
        return self._row(values) if values else None

    def delete(self, job_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM jobs WHERE id = ?", [job_id])

    def list(self, *, limit: int, after: str | None = None, newest_first: bool = True,
             statuses: tuple[str, ...] | None = None) -> list[dict]:
        """Jobs in submission order (or reverse), starting after job `after`, at most `limit`."""
        order = "DESC" if newest_first else "ASC"
        clauses, params = [], []
        if after is not None:
            clauses.append(f"seq {'<' if newest_first else '>'} (SELECT seq FROM jobs WHERE id = ?)")
            params.append(after)
        if statuses:
            clauses.append(f"status IN ({', '.join('?' * len(statuses))})")
            params += list(statuses)
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        with self._lock:
            rows = self._db.execute(
                f"SELECT {', '.join(_COLUMNS)} FROM jobs {where} ORDER BY seq {order} LIMIT ?", [*params, limit]
            ).fetchall()
        return [self._row(r) for r in rows]

    def count_by_status(self) -> dict[str, int]:
        with self._lock:
            rows = self._db.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status").fetchall()
        return dict(rows)

    def close(self) -> None:
        with self._lock:
            self._db.close()

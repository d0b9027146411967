"""Jobs in SQLite, so a restart keeps finished jobs and knows which ones it interrupted.

The database runs in WAL mode; `close()` checkpoints the WAL into the main file (`wal_checkpoint(TRUNCATE)`), so
after a clean shutdown `jobs.sqlite3` alone holds every job. On open the file is checked (`PRAGMA quick_check`); a
database that fails to open or to check is moved aside under a dated name, with an error in the log, and a fresh
one is started: a damaged store costs the job history, never the server.
"""

import json
import logging
import sqlite3
import threading
import time
from pathlib import Path

from h3gen.server.job import FIELDS, Job, JobStatus

logger = logging.getLogger(__name__)

_COLUMNS = FIELDS  # one column per field of `Job`
_JSON = ("request", "timings", "uploads")


class JobStore:
    """A thread-safe table of `Job`s, one column per field; `request`, `timings` and `uploads` are stored as JSON."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self.moved_aside: Path | None = None  # where a corrupt database went, if this open found one
        try:
            self._db = self._open()
        except sqlite3.DatabaseError as error:
            self.moved_aside = self._move_aside(error)
            self._db = self._open()

    def _open(self) -> sqlite3.Connection:
        """Connect, check the file and make sure the table exists; `sqlite3.DatabaseError` if the file is damaged."""
        db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        try:
            verdict = db.execute("PRAGMA quick_check").fetchone()
            if verdict is None or verdict[0] != "ok":
                raise sqlite3.DatabaseError(f"quick_check: {verdict[0] if verdict else 'no answer'}")
            self._create(db)
            db.execute(f"SELECT {', '.join(_COLUMNS)}, seq FROM jobs LIMIT 0")  # a table of some other shape fails
        except sqlite3.DatabaseError:
            db.close()
            raise
        return db

    def _move_aside(self, error: Exception) -> Path:
        """Rename the damaged database (and its -wal / -shm files) to `<name>.corrupt-<UTC time>`."""
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        for suffix in ("", "-wal", "-shm"):
            source = self.path.with_name(self.path.name + suffix)
            if source.exists():
                source.replace(aside.with_name(aside.name + suffix))
        logger.error(
            "THE JOB DATABASE %s IS DAMAGED (%s): moved it aside to %s and started an empty one; the jobs "
            "it held are no longer listed (their MP4s are adopted back where they decode).",
            self.path,
            error,
            aside.name,
        )
        return aside

    @staticmethod
    def _create(db: sqlite3.Connection) -> None:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(
            "CREATE TABLE IF NOT EXISTS jobs (id TEXT PRIMARY KEY, status TEXT NOT NULL, created_at REAL NOT NULL, "
            "started_at REAL, finished_at REAL, request TEXT NOT NULL, progress REAL NOT NULL DEFAULT 0, stage TEXT, "
            "timings TEXT NOT NULL DEFAULT '{}', error TEXT, result_path TEXT, result_bytes INTEGER, "
            "uploads TEXT NOT NULL DEFAULT '{}', seq INTEGER)"
        )
        db.execute("CREATE INDEX IF NOT EXISTS jobs_status ON jobs(status)")

    def _job(self, values) -> Job:
        row = dict(zip(_COLUMNS, values, strict=True))
        for key in _JSON:
            row[key] = json.loads(row[key]) if row[key] else {}
        return Job(**row)

    def insert(self, job: Job) -> None:
        values = [json.dumps(getattr(job, c)) if c in _JSON else getattr(job, c) for c in _COLUMNS]
        with self._lock:
            seq = self._db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM jobs").fetchone()[0]
            self._db.execute(
                f"INSERT INTO jobs ({', '.join(_COLUMNS)}, seq) VALUES ({', '.join('?' * len(_COLUMNS))}, ?)",
                [*values, seq],
            )

    def update(self, job_id: str, **fields) -> None:
        """Set the named fields of one job (the others are left as they are)."""
        if not fields:
            return
        unknown = set(fields) - set(_COLUMNS)
        if unknown:
            raise TypeError(f"a job has no field {', '.join(sorted(unknown))}")
        names = ", ".join(f"{name} = ?" for name in fields)
        values = [json.dumps(v) if k in _JSON else v for k, v in fields.items()]
        with self._lock:
            self._db.execute(f"UPDATE jobs SET {names} WHERE id = ?", [*values, job_id])

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            values = self._db.execute(f"SELECT {', '.join(_COLUMNS)} FROM jobs WHERE id = ?", [job_id]).fetchone()
        return self._job(values) if values else None

    def delete(self, job_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM jobs WHERE id = ?", [job_id])

    def list(
        self,
        *,
        limit: int | None = None,
        after: str | None = None,
        newest_first: bool = True,
        statuses: tuple[JobStatus, ...] | None = None,
    ) -> list[Job]:
        """Jobs in submission order (or reverse), starting after job `after`, at most `limit` (all with None), of
        `statuses` only if given."""
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
                f"SELECT {', '.join(_COLUMNS)} FROM jobs {where} ORDER BY seq {order} LIMIT ?",
                [*params, -1 if limit is None else limit],
            ).fetchall()
        return [self._job(r) for r in rows]

    def count_by_status(self) -> dict[str, int]:
        with self._lock:
            rows = self._db.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status").fetchall()
        return dict(rows)

    def close(self) -> None:
        """Fold the WAL into the database file, then close (idempotent). Later calls raise
        `sqlite3.ProgrammingError`. A checkpoint that fails (a full disk) loses nothing: the jobs stay in the WAL
        file beside the database, which the next open reads; the log says so."""
        with self._lock:
            try:
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.ProgrammingError:  # closed already
                return
            except sqlite3.Error as error:
                logger.error(
                    "could not fold the job database's WAL into %s (%s); the jobs are kept in %s-wal, "
                    "which the next start reads",
                    self.path.name,
                    error,
                    self.path.name,
                )
            self._db.close()

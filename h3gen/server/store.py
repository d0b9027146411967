"""The job store: `open_store` and the SQLite backend. The interface, `JobStore`, and the operations both backends
share are in `store_base.py`; the PostgreSQL backend, for a fleet of API nodes and GPU workers on several hosts, is
`store_postgres.py`, imported only when a location names PostgreSQL.

SQLite keeps the jobs of one host's processes in one file, so a restart keeps finished jobs and takes back the ones
its workers were running. The database runs in WAL mode; `close()` checkpoints the WAL into the main file
(`wal_checkpoint(TRUNCATE)`), so after a clean shutdown `jobs.sqlite3` alone holds every job. On open the file is
checked (`PRAGMA quick_check`); a database that fails to open or to check is moved aside under a dated name, with an
error in the log, and a fresh one is started: a damaged store costs the job history, never the server. A file made by
older code gains the columns it lacks (ALTER TABLE ADD COLUMN) when opened. Every write is one `BEGIN IMMEDIATE`
transaction, so store objects in other threads and processes see each operation whole.
"""

import logging
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from h3gen.server.job import FIELDS
from h3gen.server.store_base import JobStore, Run, StoreMismatch

__all__ = ["SQLITE_NAME", "JobStore", "SQLiteJobStore", "StoreMismatch", "open_store"]

logger = logging.getLogger(__name__)

SQLITE_NAME = "jobs.sqlite3"  # the database file in a folder given as the location
BUSY_SECONDS = 30.0  # how long an operation waits for another connection's write to end before it fails
SQLITE_TYPES = {"text": "TEXT", "real": "REAL", "int": "INTEGER", "bool": "INTEGER", "json": "TEXT"}
POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def open_store(location, fleet: str | None = None) -> JobStore:
    """The job store at `location`: a `postgresql://` or `postgres://` URL opens PostgreSQL (`store_postgres`);
    a folder (one that exists, or a path without a suffix) opens SQLite in `<folder>/jobs.sqlite3`, any other path
    that SQLite file. With `fleet`, the store must belong to that fleet, or to none yet (it then takes the name):
    a store of another fleet raises `StoreMismatch`."""
    text = str(location)
    if text.startswith(POSTGRES_SCHEMES):
        from h3gen.server.store_postgres import PostgresJobStore

        return PostgresJobStore(text, fleet)
    if "://" in text:
        raise ValueError(f"no job store can be opened at {text}: give a folder, a SQLite file or a postgresql:// URL")
    path = Path(location)
    if path.is_dir() or not path.suffix:
        path = path / SQLITE_NAME
    return SQLiteJobStore(path, fleet)


class SQLiteJobStore(JobStore):
    """The jobs in one SQLite file, for the threads and processes of one host; `request`, `timings`, `uploads` and
    `needs` are stored as JSON. `moved_aside` is where this open moved a damaged database, or None."""

    TYPES = SQLITE_TYPES
    SEQ = "seq INTEGER"

    def __init__(self, path: Path, fleet: str | None = None):
        self.path = Path(path)
        self.location = str(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self.moved_aside: Path | None = None
        try:
            self._db = self._open(fleet)
        except sqlite3.DatabaseError as error:
            self.moved_aside = self._move_aside(error)
            self._db = self._open(fleet)

    def _open(self, fleet: str | None) -> sqlite3.Connection:
        """Connect, check the file, make or migrate the tables and check the fleet name; `sqlite3.DatabaseError` if
        the file is damaged, `StoreMismatch` if it belongs to another fleet."""
        db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None, timeout=BUSY_SECONDS)
        try:
            verdict = db.execute("PRAGMA quick_check").fetchone()
            if verdict is None or verdict[0] != "ok":
                raise sqlite3.DatabaseError(f"quick_check: {verdict[0] if verdict else 'no answer'}")
            db.execute("PRAGMA journal_mode=WAL")
            with self._lock, self._write(db) as run:
                self._setup(run, fleet)
            db.execute(f"SELECT {', '.join(FIELDS)}, seq FROM jobs LIMIT 0")  # a table of some other shape fails
        except BaseException:
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
    @contextmanager
    def _write(db: sqlite3.Connection) -> Iterator[Run]:
        """A `BEGIN IMMEDIATE` transaction on `db`: it holds the database's write lock from its start, so what it
        reads stays true until it commits."""
        db.execute("BEGIN IMMEDIATE")
        try:
            yield lambda sql, params=(): db.execute(sql, params).fetchall()
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    @contextmanager
    def _transaction(self, write: bool = True) -> Iterator[Run]:
        with self._lock:
            if write:
                with self._write(self._db) as run:
                    yield run
            else:  # one statement reads a consistent snapshot by itself
                db = self._db
                yield lambda sql, params=(): db.execute(sql, params).fetchall()

    def _lock_queue(self, run: Run) -> None:
        pass  # every write transaction is BEGIN IMMEDIATE: the one writer of the file already

    def _columns_of(self, run: Run, table: str) -> set[str]:
        return {row[1] for row in run(f"PRAGMA table_info({table})")}

    def _insert_sql(self, names: Sequence[str]) -> str:
        return (
            f"INSERT INTO jobs ({', '.join(names)}, seq) VALUES ({', '.join('?' * len(names))}, "
            "(SELECT COALESCE(MAX(seq), 0) + 1 FROM jobs))"
        )

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

"""The job store's interface and what its backends share: the tables, how a `Job` is written and read back, and every
operation in SQL that SQLite and PostgreSQL both accept.

`JobStore` implements the operations once, with `?` placeholders (the PostgreSQL backend rewrites them). A backend
(`store.SQLiteJobStore`, `store_postgres.PostgresJobStore`) supplies the connection, its transactions
(`_transaction`), its column types, how a new job gets the next `seq`, the clause that makes `claim` skip jobs another
worker is looking at, and `close`. `store.open_store` picks the backend a location names.

A fleet's workers take jobs from the queue themselves: `claim` gives a worker the oldest queued job it can serve and a
lease on it; `heartbeat` renews the worker's leases and tells it which of its jobs were cancelled; `finish` writes the
outcome only while the worker still holds the job, and `hand_back` returns it to the queue when the worker stops;
`requeue_expired` puts the jobs of workers that stopped renewing back in the queue, in their old place, or fails them
once they have been tried `max_attempts` times.
"""

from __future__ import annotations  # `JobStore.list` shadows the builtin in the annotations after it

import abc
import enum
import json
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

from h3gen.server.job import FIELDS, Job, JobStatus

SCHEMA_VERSION = 1  # the tables' layout as this code writes them; a store of a newer layout is refused
CLAIM_BATCH = 32  # queued jobs `claim` reads at a time while it looks for one the worker can serve

# What a backend's transaction hands its body: run one statement with `?` placeholders, get its rows back.
Run = Callable[..., list[tuple]]


class StoreMismatch(Exception):
    """The store belongs to another fleet, or a newer h3gen wrote it; the message says which and what to do."""


@dataclass(frozen=True)
class Column:
    """One column: its `kind` (text, real, int, bool, or json: JSON text) maps to each backend's type; `default` is an
    SQL literal both dialects read alike."""

    name: str
    kind: str
    required: bool = False
    default: str | None = None

    def sql(self, types: dict[str, str]) -> str:
        """The column's definition for CREATE TABLE or ALTER TABLE ADD COLUMN, in the types of one backend."""
        text = f"{self.name} {types[self.kind]}"
        if self.required:
            text += " NOT NULL"
        if self.default is not None:
            text += f" DEFAULT {self.default}"
        return text


# The first column of each table is its primary key. `jobs` has one column per field of `Job`, plus `seq` (the
# submission order, whose definition each backend gives).
TABLES = {
    "jobs": (
        Column("id", "text", True),
        Column("status", "text", True),
        Column("created_at", "real", True),
        Column("request", "json", True),
        Column("uploads", "json", True, "'{}'"),
        Column("progress", "real", True, "0"),
        Column("stage", "text"),
        Column("timings", "json", True, "'{}'"),
        Column("error", "text"),
        Column("started_at", "real"),
        Column("finished_at", "real"),
        Column("result_path", "text"),
        Column("result_bytes", "int"),
        Column("attempts", "int", True, "0"),
        Column("worker_id", "text"),
        Column("lease_expires", "real"),
        Column("cancel_requested", "bool", True, "FALSE"),
        Column("needs", "json", True, "'{}'"),
        Column("current_window", "json"),
        Column("preview", "json"),
        Column("eta_seconds", "real"),
    ),
    "workers": (
        Column("id", "text", True),
        Column("host", "text", True, "''"),
        Column("capabilities", "json", True, "'{}'"),
        Column("registered_at", "real", True),
        Column("last_seen", "real", True),
    ),
    "store_meta": (  # one row (one = 1): whose store this is and the layout it has
        Column("one", "int", True),
        Column("fleet", "text"),
        Column("schema_version", "int", True),
        Column("created_at", "real", True),
    ),
}
INDEXES = (
    "CREATE INDEX IF NOT EXISTS jobs_status ON jobs(status)",
    "CREATE INDEX IF NOT EXISTS jobs_queue ON jobs(status, seq)",
    "CREATE INDEX IF NOT EXISTS jobs_seq ON jobs(seq)",
    "CREATE INDEX IF NOT EXISTS jobs_worker ON jobs(worker_id)",
)
JSON_FIELDS = frozenset(column.name for column in TABLES["jobs"] if column.kind == "json")
NULLABLE_JSON = frozenset(column.name for column in TABLES["jobs"] if column.kind == "json" and not column.required)
if {column.name for column in TABLES["jobs"]} != set(FIELDS):
    raise TypeError("store_base.TABLES['jobs'] must have one column per field of job.Job")
SELECT_JOB = f"SELECT {', '.join(FIELDS)} FROM jobs"


def lost_worker_error(attempts: int, worker_id: str | None, expired_at: float) -> str:
    """The error of a job given up on because its worker stopped renewing its lease on every attempt."""
    times = "once" if attempts == 1 else f"{attempts} times"
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(expired_at))
    return (
        f"the job's worker was lost {times} (the last, {worker_id or 'unknown'}, stopped renewing its lease, which "
        f"expired at {stamp}); not retried: submit the job again"
    )


def encode(name: str, value):
    """A `Job` field's value as its column holds it: JSON text for the json columns, a status as its string."""
    if name in JSON_FIELDS:
        return json.dumps(value)
    if isinstance(value, enum.Enum):
        return value.value
    return value


class JobStore(abc.ABC):
    """A thread-safe table of `Job`s shared by every process that opens the same location.

    Each operation is one transaction, so the fleet operations (`claim`, `heartbeat`, `finish`, `hand_back`,
    `requeue_expired`, `request_cancel`) are atomic across threads, store objects and processes. `location` names
    the store in messages (a URL without its password); `fleet` is the fleet name recorded in it, None if none is.
    """

    location: str = ""
    fleet: str | None = None
    moved_aside = None  # SQLite: where a damaged database went, if this open found one

    # ------------------------------------------------------------------ what a backend supplies

    TYPES: dict[str, str]  # SQL type per column kind
    SEQ: str  # the definition of `jobs.seq`
    LOCK_QUEUED = ""  # what `claim` appends to its read of the job it takes, to lock it against other workers

    @abc.abstractmethod
    def _transaction(self, write: bool = True) -> AbstractContextManager[Run]:
        """One transaction, serialized with this object's other calls; commits when the body ends, rolls back if it
        raises. `write=False` promises the body only reads."""

    @abc.abstractmethod
    def _columns_of(self, run: Run, table: str) -> set[str]:
        """The columns `table` has (an empty set if there is no such table)."""

    @abc.abstractmethod
    def _insert_sql(self, names: Sequence[str]) -> str:
        """INSERT INTO jobs of the named columns (one `?` each), giving the row the next `seq`."""

    def _now(self, run: Run) -> float:
        """The time leases and heartbeats are measured by (Unix seconds)."""
        return time.time()

    @abc.abstractmethod
    def close(self) -> None:
        """Release the connection (idempotent); later calls raise the backend's error."""

    # ------------------------------------------------------------------ opening

    def _setup(self, run: Run, fleet: str | None) -> None:
        """Make the tables, add the columns a store made by older code lacks, then check the layout version and the
        fleet name: a store of another fleet (or of a newer layout) raises `StoreMismatch`; one of no fleet takes
        `fleet`'s name. `fleet=None` checks no name. Runs inside the backend's first transaction."""
        changed = False
        for table, columns in TABLES.items():
            have = self._columns_of(run, table)
            if not have:
                definitions = [columns[0].sql(self.TYPES) + " PRIMARY KEY"]
                definitions += [column.sql(self.TYPES) for column in columns[1:]]
                if table == "jobs":
                    definitions.append(self.SEQ)
                run(f"CREATE TABLE {table} ({', '.join(definitions)})")
                changed = True
            for column in columns:
                if have and column.name not in have:
                    run(f"ALTER TABLE {table} ADD COLUMN {column.sql(self.TYPES)}")
                    changed = True
        if changed:
            for statement in INDEXES:
                run(statement)
        rows = run("SELECT fleet, schema_version FROM store_meta WHERE one = 1")
        if not rows:
            run(
                "INSERT INTO store_meta (one, fleet, schema_version, created_at) VALUES (1, NULL, ?, ?)",
                [SCHEMA_VERSION, time.time()],
            )
            rows = [(None, SCHEMA_VERSION)]
        owner, version = rows[0]
        if version > SCHEMA_VERSION:
            raise StoreMismatch(
                f"the job store {self.location} has layout {version}, newer than this h3gen's ({SCHEMA_VERSION}): "
                "upgrade h3gen on this node"
            )
        if fleet is not None and owner is None:
            run("UPDATE store_meta SET fleet = ? WHERE one = 1", [fleet])
            owner = fleet
        elif fleet is not None and owner != fleet:
            raise StoreMismatch(
                f"the job store {self.location} belongs to the fleet {owner!r}, not {fleet!r}: start this node "
                f"with the fleet name {owner!r} to join that fleet, or give it a store of its own"
            )
        self.fleet = owner

    # ------------------------------------------------------------------ rows

    @staticmethod
    def _job(values: Sequence) -> Job:
        row = dict(zip(FIELDS, values, strict=True))
        for key in JSON_FIELDS:
            row[key] = json.loads(row[key]) if row[key] else (None if key in NULLABLE_JSON else {})
        return Job(**row)

    @staticmethod
    def _assignments(fields: dict) -> tuple[str, list]:
        """`a = ?, b = ?` and the encoded values, for the named fields of a job; TypeError for a name that is no
        field."""
        unknown = set(fields) - set(FIELDS)
        if unknown:
            raise TypeError(f"a job has no field {', '.join(sorted(unknown))}")
        return ", ".join(f"{name} = ?" for name in fields), [encode(name, value) for name, value in fields.items()]

    # ------------------------------------------------------------------ the jobs

    def insert(self, job: Job, max_queued: int | None = None) -> bool:
        """Add a job after every other in submission order. With `max_queued`, only while fewer jobs than that are
        queued: the count and the insert are one transaction that no other submission to this store (from any thread,
        process or node) interleaves with. Returns whether the job was added."""
        with self._transaction() as run:
            if max_queued is not None:
                self._lock_queue(run)
                queued = run("SELECT COUNT(*) FROM jobs WHERE status = ?", [JobStatus.QUEUED.value])[0][0]
                if int(queued) >= max_queued:
                    return False
            run(self._insert_sql(FIELDS), [encode(name, getattr(job, name)) for name in FIELDS])
        return True

    @abc.abstractmethod
    def _lock_queue(self, run: Run) -> None:
        """Make the rest of this write transaction the only one counting and adding queued jobs."""

    def update(self, job_id: str, **fields) -> None:
        """Set the named fields of one job (the others are left as they are); TypeError for a name that is no
        field of `Job`."""
        if not fields:
            return
        names, values = self._assignments(fields)
        with self._transaction() as run:
            run(f"UPDATE jobs SET {names} WHERE id = ?", [*values, job_id])

    def update_held(self, job_id: str, worker_id: str, **fields) -> bool:
        """`update` for the worker running a job: written only while `worker_id` still holds it (running, its lease
        not taken back); True if written. A worker that stalled past its lease and lost the job writes nothing over
        the attempt that took it over."""
        names, values = self._assignments(fields)
        with self._transaction() as run:
            rows = run(
                f"UPDATE jobs SET {names} WHERE id = ? AND worker_id = ? AND status = ? RETURNING id",
                [*values, job_id, worker_id, JobStatus.RUNNING.value],
            )
        return bool(rows)

    def get(self, job_id: str) -> Job | None:
        """The job of that id, or None."""
        with self._transaction(write=False) as run:
            rows = run(f"{SELECT_JOB} WHERE id = ?", [job_id])
        return self._job(rows[0]) if rows else None

    def delete(self, job_id: str) -> None:
        """Remove the job's row (nothing if there is none)."""
        with self._transaction() as run:
            run("DELETE FROM jobs WHERE id = ?", [job_id])

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
        clauses, params = [], []
        if after is not None:
            clauses.append(f"seq {'<' if newest_first else '>'} (SELECT seq FROM jobs WHERE id = ?)")
            params.append(after)
        if statuses:
            clauses.append(f"status IN ({', '.join('?' * len(statuses))})")
            params += [encode("status", status) for status in statuses]
        sql = f"{SELECT_JOB} {'WHERE ' + ' AND '.join(clauses) if clauses else ''} "
        sql += f"ORDER BY seq {'DESC' if newest_first else 'ASC'}"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(limit)
        with self._transaction(write=False) as run:
            rows = run(sql, params)
        return [self._job(values) for values in rows]

    def count_by_status(self) -> dict[str, int]:
        """How many jobs there are of each status present (a status with none is absent)."""
        with self._transaction(write=False) as run:
            rows = run("SELECT status, COUNT(*) FROM jobs GROUP BY status")
        return {status: int(count) for status, count in rows}

    # ------------------------------------------------------------------ the fleet's workers take jobs

    def claim(self, worker_id: str, can_serve: Callable[[dict], bool], lease_seconds: float) -> Job | None:
        """Give `worker_id` the oldest queued job (in submission order) whose `needs` `can_serve` accepts, and
        return it as it is now: running, held by the worker until now + `lease_seconds`, one more attempt counted,
        `started_at` set if it was not. None if no queued job suits. An exception of `can_serve` claims nothing and
        propagates.

        One transaction reads the queue `CLAIM_BATCH` jobs at a time and asks `can_serve` of each; the first it
        accepts is locked (`LOCK_QUEUED`: on PostgreSQL `FOR UPDATE SKIP LOCKED`) and taken if it is still queued.
        Only that job is ever locked, so other workers see every other job meanwhile; one that another worker is
        taking at that instant is passed over for the next. Two workers never get the same job."""
        candidates = "SELECT id, seq, needs FROM jobs WHERE status = ? AND seq > ? ORDER BY seq LIMIT ?"
        lock = f"SELECT id FROM jobs WHERE id = ? AND status = ?{self.LOCK_QUEUED}"
        queued = JobStatus.QUEUED.value
        with self._transaction() as run:
            last = -1
            while True:
                rows = run(candidates, [queued, last, CLAIM_BATCH])
                for job_id, seq, needs in rows:
                    last = seq
                    if not can_serve(json.loads(needs) if needs else {}) or not run(lock, [job_id, queued]):
                        continue
                    now = self._now(run)
                    run(
                        "UPDATE jobs SET status = ?, worker_id = ?, lease_expires = ?, attempts = attempts + 1, "
                        "started_at = COALESCE(started_at, ?), cancel_requested = ? WHERE id = ?",
                        [JobStatus.RUNNING.value, worker_id, now + lease_seconds, now, False, job_id],
                    )
                    # Read back, not RETURNING: SQLite's RETURNING hands a REAL column's whole numbers as ints.
                    return self._job(run(f"{SELECT_JOB} WHERE id = ?", [job_id])[0])
                if len(rows) < CLAIM_BATCH:
                    return None

    def heartbeat(self, worker_id: str, lease_seconds: float) -> list[str]:
        """Renew the lease of every running job `worker_id` holds to now + `lease_seconds` and record that the worker
        was seen (`worker_seen`); return the ids of those jobs whose cancellation was requested (sorted)."""
        with self._transaction() as run:
            now = self._now(run)
            rows = run(
                "UPDATE jobs SET lease_expires = ? WHERE worker_id = ? AND status = ? RETURNING id, cancel_requested",
                [now + lease_seconds, worker_id, JobStatus.RUNNING.value],
            )
            run("UPDATE workers SET last_seen = ? WHERE id = ?", [now, worker_id])
        return sorted(job_id for job_id, cancel in rows if cancel)

    def finish(self, job_id: str, worker_id: str, **fields) -> bool:
        """Write the outcome (`fields`, e.g. status, finished_at, error, result_path) of a job `worker_id` still
        holds, and end its lease; True if written. False, writing nothing, if the job is no longer running under
        this worker: its lease ran out and it was requeued, taken by another worker, failed or cancelled."""
        names, values = self._assignments({**fields, "lease_expires": None})
        with self._transaction() as run:
            rows = run(
                f"UPDATE jobs SET {names} WHERE id = ? AND worker_id = ? AND status = ? RETURNING id",
                [*values, job_id, worker_id, JobStatus.RUNNING.value],
            )
        return bool(rows)

    def hand_back(self, job_id: str, worker_id: str) -> bool:
        """Give back a job `worker_id` holds because the worker is stopping, not because the job failed: it goes
        back to the queue in its old place, its lease ended, its progress reset and this attempt not counted; a job
        whose cancellation was requested is cancelled instead. True if done; False if the worker no longer held it."""
        held = "WHERE id = ? AND worker_id = ? AND status = ?"
        with self._transaction() as run:
            rows = run(f"SELECT cancel_requested FROM jobs {held}", [job_id, worker_id, JobStatus.RUNNING.value])
            if not rows:
                return False
            if rows[0][0]:
                fields = {"status": JobStatus.CANCELLED, "finished_at": self._now(run), "stage": None}
                counted = ""
            else:
                fields = {"status": JobStatus.QUEUED, "worker_id": None, "stage": None, "progress": 0.0, "timings": {}}
                counted = ", attempts = attempts - 1"
            fields.update(preview=None, eta_seconds=None, lease_expires=None)
            names, values = self._assignments(fields)
            changed = run(
                f"UPDATE jobs SET {names}{counted} {held} RETURNING id",
                [*values, job_id, worker_id, JobStatus.RUNNING.value],
            )
        return bool(changed)

    def cancel_requested(self, job_id: str) -> bool:
        """Whether the job's cancellation was requested while it ran (see `request_cancel`)."""
        with self._transaction(write=False) as run:
            rows = run("SELECT cancel_requested FROM jobs WHERE id = ?", [job_id])
        return bool(rows and rows[0][0])

    def requeue_expired(self, now: float | None = None, max_attempts: int = 2) -> list[tuple[str, JobStatus]]:
        """Take back the running jobs whose lease ran out before `now` (default: the store's clock): one with fewer
        than `max_attempts` attempts goes back to the queue in its old place (same `seq`), its progress reset; one
        whose cancellation was requested is cancelled; any other fails with `lost_worker_error`. Each loses its
        preview (the results folder's file is the caller's: `job_recovery.take_back_lost_jobs`). Returns each job
        taken back with its new status, in submission order."""
        done = []
        with self._transaction() as run:
            now = self._now(run) if now is None else now
            rows = run(
                "SELECT id, worker_id, attempts, lease_expires, cancel_requested FROM jobs "
                "WHERE status = ? AND lease_expires < ? ORDER BY seq",
                [JobStatus.RUNNING.value, now],
            )
            for job_id, worker_id, attempts, expired_at, cancel in rows:
                if cancel:
                    fields = {"status": JobStatus.CANCELLED, "finished_at": now, "stage": None}
                elif attempts < max_attempts:
                    fields = {"status": JobStatus.QUEUED, "worker_id": None, "stage": None, "progress": 0.0}
                    fields["timings"] = {}
                else:
                    error = lost_worker_error(attempts, worker_id, expired_at)
                    fields = {"status": JobStatus.FAILED, "finished_at": now, "stage": None, "error": error}
                # The lost attempt's preview and time left belong to no attempt that follows, nor to an outcome.
                fields.update(preview=None, eta_seconds=None, lease_expires=None)
                names, values = self._assignments(fields)
                changed = run(  # unless a heartbeat renewed it since, or another node took it back first
                    f"UPDATE jobs SET {names} WHERE id = ? AND status = ? AND lease_expires < ? RETURNING id",
                    [*values, job_id, JobStatus.RUNNING.value, now],
                )
                if changed:
                    done.append((job_id, fields["status"]))
        return done

    def request_cancel(self, job_id: str) -> JobStatus | None:
        """Cancel a job: a queued one at once (finished now); a running one is marked `cancel_requested`, which its
        worker's next `heartbeat` reports, and stays running until the worker stops it. A finished job is left as
        it is. Returns the job's status after, None if there is no such job."""
        with self._transaction() as run:
            now = self._now(run)
            run(
                "UPDATE jobs SET status = ?, finished_at = ?, stage = NULL WHERE id = ? AND status = ?",
                [JobStatus.CANCELLED.value, now, job_id, JobStatus.QUEUED.value],
            )
            run(
                "UPDATE jobs SET cancel_requested = ? WHERE id = ? AND status = ?",
                [True, job_id, JobStatus.RUNNING.value],
            )
            rows = run("SELECT status FROM jobs WHERE id = ?", [job_id])
        return JobStatus(rows[0][0]) if rows else None

    # ------------------------------------------------------------------ the workers

    def register_worker(self, worker_id: str, capabilities: dict, host: str) -> None:
        """Record a worker (again, replacing what was recorded): what it can serve and where it runs; seen now."""
        with self._transaction() as run:
            now = self._now(run)
            run(
                "INSERT INTO workers (id, host, capabilities, registered_at, last_seen) VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT (id) DO UPDATE SET host = excluded.host, capabilities = excluded.capabilities, "
                "registered_at = excluded.registered_at, last_seen = excluded.last_seen",
                [worker_id, host, json.dumps(capabilities), now, now],
            )

    def worker_seen(self, worker_id: str) -> None:
        """Record that the worker is alive now (`heartbeat` does it too)."""
        with self._transaction() as run:
            run("UPDATE workers SET last_seen = ? WHERE id = ?", [self._now(run), worker_id])

    def unregister_worker(self, worker_id: str) -> None:
        """Forget a worker (its jobs are untouched: a job it still holds is taken back when its lease runs out)."""
        with self._transaction() as run:
            run("DELETE FROM workers WHERE id = ?", [worker_id])

    def live_workers(self, within_seconds: float) -> list[dict]:
        """The workers seen in the last `within_seconds`, by id: each a dict of id, host, capabilities,
        registered_at, last_seen and running_job (the oldest running job it holds, or None)."""
        with self._transaction(write=False) as run:
            rows = run(
                "SELECT w.id, w.host, w.capabilities, w.registered_at, w.last_seen, (SELECT j.id FROM jobs j WHERE "
                "j.worker_id = w.id AND j.status = ? ORDER BY j.seq LIMIT 1) FROM workers w WHERE w.last_seen >= ? "
                "ORDER BY w.id",
                [JobStatus.RUNNING.value, self._now(run) - within_seconds],
            )
        keys = ("id", "host", "capabilities", "registered_at", "last_seen", "running_job")
        workers = [dict(zip(keys, row, strict=True)) for row in rows]
        for worker in workers:
            worker["capabilities"] = json.loads(worker["capabilities"] or "{}")
        return workers

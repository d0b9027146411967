"""A throw-away PostgreSQL server for the tests of the PostgreSQL job store (`h3gen.server.store_postgres`).

`postgres_cluster` (one per pytest run) makes a cluster with `initdb` in a fresh temporary folder, serves it on a
Unix socket in that folder only (no TCP), and stops it (`pg_ctl stop -m immediate`) and removes the folder when the
session ends; `postgres_url` gives each test a database of its own. The server's programs are found on PATH, else
under /usr/lib/postgresql/<version>/bin (Debian's `postgresql` package). PostgreSQL refuses to run as root, so as
root the cluster runs as `nobody`, in a folder given to it. Without the programs or psycopg the tests that need the
server skip, except where the environment variable CI is set: there they fail (`.ci/run` installs the server).
"""

import importlib.util
import itertools
import os
import pwd
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

PROGRAMS = ("initdb", "pg_ctl", "postgres")
USER = "h3gen"  # the cluster's superuser, trusted on the socket
PORT = 5432  # names the socket file only: the server listens on no TCP port
SETTINGS = "-c fsync=off -c synchronous_commit=off -c full_page_writes=off"  # a test server keeps nothing


def server_programs() -> Path | None:
    """The folder holding initdb, pg_ctl and postgres: PATH's (links followed), else Debian's newest, else None."""
    folders = []
    found = shutil.which("initdb")
    if found:
        folders.append(Path(found).resolve().parent)
    debian = Path("/usr/lib/postgresql").glob("*/bin")
    folders += sorted(debian, key=lambda p: [int(n) for n in re.findall(r"\d+", p.parent.name)], reverse=True)
    for folder in folders:
        if all((folder / name).is_file() for name in PROGRAMS):
            return folder
    return None


class Cluster:
    """One PostgreSQL server in a temporary folder: `start()`, `new_database()` per test, `stop()`."""

    def __init__(self, programs: Path):
        self.programs = programs
        self.root = Path(tempfile.mkdtemp(prefix="h3gen-pg-"))  # short: a socket's path is at most 107 bytes
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.account = pwd.getpwnam("nobody") if os.geteuid() == 0 else None
        if self.account is not None:
            os.chown(self.root, self.account.pw_uid, self.account.pw_gid)
        self._names = itertools.count(1)

    def _run(self, *command: str) -> None:
        """Run one of the server's programs, as `nobody` when this process is root; RuntimeError with its output."""
        as_user = {}
        if self.account is not None:
            as_user = {"user": self.account.pw_uid, "group": self.account.pw_gid, "extra_groups": []}
        result = subprocess.run(
            [str(self.programs / command[0]), *command[1:]],
            cwd=self.root,  # a folder the server's user may enter
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
            **as_user,
        )
        if result.returncode != 0:
            log = self.log.read_text()[-3000:] if self.log.exists() else ""
            raise RuntimeError(f"{' '.join(command[:2])} failed:\n{result.stdout}{result.stderr}{log}")

    def start(self) -> None:
        """initdb, then start the server and make the database `h3gen`."""
        self._run("initdb", "-D", str(self.data), "-U", USER, "--auth=trust", "-E", "UTF8", "--locale=C", "--no-sync")
        options = f"-k {self.root} -c listen_addresses='' -p {PORT} {SETTINGS}"
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "-t", "60", "start")
        self._create("h3gen")

    def url(self, database: str = "h3gen") -> str:
        return f"postgresql://{USER}@/{database}?host={self.root}&port={PORT}"

    def _create(self, database: str) -> None:
        import psycopg

        with psycopg.connect(self.url("postgres"), autocommit=True) as db:
            db.execute(f'CREATE DATABASE "{database}"')

    def new_database(self) -> str:
        """The URL of a new, empty database."""
        name = f"test{next(self._names)}"
        self._create(name)
        return self.url(name)

    def stop(self) -> None:
        """Stop the server at once (nothing in it is kept) and remove its folder."""
        try:
            if (self.data / "postmaster.pid").exists():
                self._run("pg_ctl", "-D", str(self.data), "stop", "-m", "immediate", "-w")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_cluster():
    """A running PostgreSQL server for the session (see the module's docstring for when it skips or fails)."""
    programs = server_programs()
    problem = None
    if programs is None:
        problem = "the PostgreSQL server is not installed (apt-get install -y postgresql)"
    elif importlib.util.find_spec("psycopg") is None:
        problem = "psycopg is not installed (pip install 'psycopg[binary]')"
    if problem is not None:
        if os.environ.get("CI"):
            pytest.fail(f"{problem}; CI runs the PostgreSQL job store tests")
        pytest.skip(problem)
    cluster = Cluster(programs)
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    yield cluster
    cluster.stop()


@pytest.fixture
def postgres_url(postgres_cluster) -> str:
    """A URL of an empty database of its own for one test."""
    return postgres_cluster.new_database()

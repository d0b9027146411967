"""One server per results folder: an exclusive `flock` on `<results>/.lock`, held for the server's life, with the
holder (pid, host, what it serves) written inside so a second server can say who is in the way.

The kernel drops the lock when the holding process dies, however it dies, so a crashed server never leaves a stale
lock behind; the file itself stays and is rewritten by the next holder.
"""

import fcntl
import os
import socket
import time
from pathlib import Path

LOCK_NAME = ".lock"


class FolderBusy(Exception):
    """Another live process holds the results folder; the message names it."""


class FolderLock:
    """`acquire()` takes the lock or raises `FolderBusy`; `release()` gives it back (also done at process exit)."""

    def __init__(self, folder: Path, holder: str = ""):
        self.path = Path(folder) / LOCK_NAME
        self.holder = holder
        self._file = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.path, "a+")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # BlockingIOError: held by another open file, in this process or another
            handle.seek(0)
            who = handle.read().strip() or "an unknown process"
            handle.close()
            raise FolderBusy(
                f"the results folder {self.path.parent} is in use by {who}; stop that server or give "
                "this one another --results-dir."
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(
            f"pid {os.getpid()} on {socket.gethostname()}"
            + (f" ({self.holder})" if self.holder else "")
            + f", since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
        )
        handle.flush()
        self._file = handle

    def release(self) -> None:
        if self._file is None:
            return
        self._file.seek(0)
        self._file.truncate()
        fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
        self._file.close()
        self._file = None

    @property
    def held(self) -> bool:
        return self._file is not None

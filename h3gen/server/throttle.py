"""Back-off for wrong credentials, per client: a few free failures, then each further one locks the client out for
twice as long as the last (1 s, 2 s, 4 s ... up to `max_delay`). A success forgets the client's failures.

While a client is locked out every attempt is refused, the right key too: otherwise the refusals would tell a
guesser which of its guesses was right. The table holds at most `max_clients` entries (the quietest go first)."""

import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class _Record:
    failures: int = 0
    locked_until: float = 0.0
    last_seen: float = 0.0


class FailureThrottle:
    """Counts failed logins / API keys per client (an IP address) and says how long a client must wait."""

    def __init__(
        self,
        *,
        free_failures: int = 5,
        base_delay: float = 1.0,
        max_delay: float = 300.0,
        forget_after: float = 3600.0,
        max_clients: int = 10_000,
        clock=time.monotonic,
    ):
        self.free_failures = free_failures
        self.base_delay = base_delay
        self.max_delay = max_delay
        self.forget_after = forget_after
        self.max_clients = max_clients
        self._clock = clock
        self._records: OrderedDict[str, _Record] = OrderedDict()
        self._lock = threading.Lock()

    def retry_after(self, client: str) -> int | None:
        """Whole seconds `client` must still wait before its next attempt, or None when it may try now."""
        with self._lock:
            record = self._records.get(client)
            if record is None:
                return None
            now = self._clock()
            if now - record.last_seen > self.forget_after:
                del self._records[client]
                return None
            return math.ceil(record.locked_until - now) if record.locked_until > now else None

    def failure(self, client: str) -> None:
        """One more wrong credential from `client`; past the free ones it is locked out for a doubling delay."""
        with self._lock:
            now = self._clock()
            record = self._records.pop(client, None) or _Record()
            if now - record.last_seen > self.forget_after:
                record = _Record()
            record.failures += 1
            record.last_seen = now
            extra = record.failures - self.free_failures
            if extra > 0:
                record.locked_until = now + min(self.max_delay, self.base_delay * 2 ** min(extra - 1, 32))
            self._records[client] = record  # most recent last
            while len(self._records) > self.max_clients:
                self._records.popitem(last=False)

    def success(self, client: str) -> None:
        """`client` presented the right credential: its failures are forgotten."""
        with self._lock:
            self._records.pop(client, None)

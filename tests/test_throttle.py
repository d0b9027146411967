"""The per-client back-off of wrong credentials, on a fake clock."""

from h3gen.server.throttle import FailureThrottle


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_free_failures_then_a_doubling_lockout():
    clock = Clock()
    throttle = FailureThrottle(free_failures=3, base_delay=1.0, max_delay=8.0, clock=clock)
    for _ in range(3):
        assert throttle.retry_after("a") is None
        throttle.failure("a")
    assert throttle.retry_after("a") is None  # three free failures
    waits = []
    for _ in range(6):
        throttle.failure("a")
        waits.append(throttle.retry_after("a"))
        clock.now += waits[-1]  # wait it out exactly
        assert throttle.retry_after("a") is None
    assert waits == [1, 2, 4, 8, 8, 8]  # doubling, capped at max_delay


def test_locked_client_waits_others_do_not_and_success_forgets():
    clock = Clock()
    throttle = FailureThrottle(free_failures=1, base_delay=10.0, clock=clock)
    throttle.failure("a")
    throttle.failure("a")
    assert throttle.retry_after("a") == 10 and throttle.retry_after("b") is None
    clock.now += 2.5
    assert throttle.retry_after("a") == 8  # whole seconds, rounded up
    clock.now += 8
    throttle.success("a")
    throttle.failure("a")
    assert throttle.retry_after("a") is None  # the count started again


def test_failures_are_forgotten_after_a_quiet_hour_and_the_table_is_bounded():
    clock = Clock()
    throttle = FailureThrottle(free_failures=1, forget_after=3600.0, max_clients=3, clock=clock)
    throttle.failure("a")
    clock.now += 3601
    throttle.failure("a")
    assert throttle.retry_after("a") is None  # the first failure was forgotten
    for client in "bcde":
        throttle.failure(client)
        throttle.failure(client)
    assert len(throttle._records) == 3 and "a" not in throttle._records
    assert throttle.retry_after("e") == 1

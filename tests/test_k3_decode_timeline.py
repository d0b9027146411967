"""The decode timeline benchmark's bookkeeping (`benchmarks/k3_decode_timeline.py`): replays split apart, the
fastest warm one kept, marginal times of overlapping kernels."""

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from k3_decode_timeline import marginal_times, step_kernels


def _event(name, start, end):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))


def test_marginal_time_is_the_end_past_the_latest_end_before():
    rows = marginal_times([("a", 0.0, 5.0), ("b", 3.0, 9.0), ("c", 4.0, 8.0), ("d", 8.5, 10.0)])
    assert [round(r[4], 6) for r in rows] == [5.0, 4.0, -1.0, 1.0]  # c ends inside b: it costs nothing
    assert [r[3] for r in rows] == [5.0, 6.0, 4.0, 1.5]


def test_the_fastest_warm_replay_is_kept_relative_to_its_start():
    """Replay 0 is the fastest but a warm-up one: replay 3 is kept."""
    events = []
    for replay, span in enumerate([3.0, 8.0, 7.0, 5.0, 6.0]):
        base = 100.0 * replay
        events += [_event("gemv", base, base + 2.0), _event("argmax", base + 1.0, base + span)]
    kernels = step_kernels(list(reversed(events)), replays=5)
    assert kernels == [("gemv", 0.0, 2.0), ("argmax", 1.0, 5.0)]

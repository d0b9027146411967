"""Fleet scaling: jobs per hour with 1, 2 and 4 workers on one job store, and the store's own cost per job.

Each worker runs a sleep-bound stand-in for the pipeline (`--steps` denoising reports `--step-seconds` apart, then a
placeholder file), so the figure measures the queue (claims, leases, heartbeats, progress writes, cancellation
checks), not the model: on a real GPU fleet a job takes minutes and the queue's share is smaller still. Workers are
`JobWorker`s on threads, each with its own store connection, as separate processes have. The store's overhead per
job is the measured wall time less the ideal (jobs x job time / workers), divided by the jobs.

    python benchmarks/bench_fleet.py --jobs 40 --store sqlite
    python benchmarks/bench_fleet.py --jobs 40 --store postgresql://h3gen@/h3gen?host=/tmp/pg
"""

import argparse
import tempfile
import time
from pathlib import Path

from h3gen.server.job_files import JobFiles
from h3gen.server.job_worker import JobWorker
from h3gen.server.jobs import JobManager
from h3gen.server.store import open_store


class SleepEngine:
    """A pipeline stand-in: `steps` reports `step_seconds` apart, then an empty result file."""

    load_error = None
    model_path = None
    ready = True
    tasks = ("t2va", "fl2va")
    max_seconds = 60.0
    lora_folder = None
    options = None

    def __init__(self, steps: int, step_seconds: float):
        self.steps, self.step_seconds = steps, step_seconds

    def load(self) -> None:
        pass

    def devices(self) -> list[str]:
        return ["sleep"]

    def run(self, request, uploads, out_path, callback) -> dict:
        callback("encode_text", 0, 1)
        callback("encode_text", 1, 1)
        callback("denoise", 0, self.steps)
        for step in range(1, self.steps + 1):
            time.sleep(self.step_seconds)
            callback("denoise", step, self.steps)
        Path(out_path).write_bytes(b"")
        return {}


def measure(location: str, results: Path, workers: int, jobs: int, steps: int, step_seconds: float) -> float:
    """Wall seconds for `jobs` jobs on `workers` workers."""
    manager = JobManager(SleepEngine(steps, step_seconds), results, store=location, local_worker=False, max_queue=jobs)
    manager.start()
    running = []
    for index in range(workers):
        store = open_store(location or results)
        worker = JobWorker(store, SleepEngine(steps, step_seconds), JobFiles(results), worker_id=f"bench-{index}")
        worker.start()
        running.append((worker, store))
    deadline = time.monotonic() + 60
    while len(manager.live_workers()) < workers and time.monotonic() < deadline:
        time.sleep(0.05)
    started = time.perf_counter()
    ids = [manager.submit({"prompt": f"job {i}", "task": "t2va", "quality": "lossless"})["id"] for i in range(jobs)]
    for job_id in ids:
        view = manager.wait(job_id, 600)
        assert view["status"] == "succeeded", view
    wall = time.perf_counter() - started
    for worker, store in running:
        worker.stop()
        store.close()
    manager.stop()
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=40)
    parser.add_argument("--steps", type=int, default=20, help="denoising reports per job")
    parser.add_argument("--step-seconds", dest="step_seconds", type=float, default=0.05)
    parser.add_argument("--store", default="sqlite", help="sqlite, or a postgresql:// URL (an empty database)")
    parser.add_argument("--workers", default="1,2,4", help="worker counts to measure")
    args = parser.parse_args()
    job_seconds = args.steps * args.step_seconds
    rows = []
    for count in [int(n) for n in args.workers.split(",")]:
        with tempfile.TemporaryDirectory(prefix="h3gen-fleet-") as folder:
            results = Path(folder) / "results"
            location = None if args.store == "sqlite" else args.store
            if location is not None:
                _empty(location)
            wall = measure(location, results, count, args.jobs, args.steps, args.step_seconds)
        ideal = args.jobs * job_seconds / count
        rows.append((count, wall, args.jobs / wall * 3600, (wall - ideal) / args.jobs * 1000))
    base = rows[0][2]
    print(f"store {args.store.split('?')[0]}: {args.jobs} jobs of {job_seconds:.2f} s")
    print("workers  wall s  jobs/hour  vs 1 worker  store overhead ms/job")
    for count, wall, per_hour, overhead in rows:
        print(f"{count:7d}  {wall:6.2f}  {per_hour:9.0f}  {per_hour / base:10.2f}x  {overhead:8.1f}")


def _empty(location: str) -> None:
    """Drop the tables of a PostgreSQL store left by an earlier measurement."""
    import psycopg

    with psycopg.connect(location, autocommit=True) as connection:
        for table in ("jobs", "workers", "store_meta"):
            connection.execute(f"DROP TABLE IF EXISTS {table}")


if __name__ == "__main__":
    main()

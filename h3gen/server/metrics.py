"""Prometheus metrics, written in the text exposition format (no client library needed for a handful of series)."""

import threading

from h3gen.server.job import FINISHED, JobStatus


class Metrics:
    """Counters and summaries the job manager feeds; `render` adds the gauges it is given."""

    def __init__(self):
        self._lock = threading.Lock()
        self.submitted = 0
        self.finished: dict[str, int] = {}
        self.job_seconds_sum = 0.0
        self.job_count = 0
        self.step_seconds_sum = 0.0
        self.step_count = 0
        self.stage_seconds: dict[str, list[float]] = {}  # stage -> [sum, count]

    def count_submitted(self) -> None:
        with self._lock:
            self.submitted += 1

    def count_finished(self, status: JobStatus, seconds: float) -> None:
        with self._lock:
            self.finished[status] = self.finished.get(status, 0) + 1
            if status == JobStatus.SUCCEEDED:
                self.job_seconds_sum += seconds
                self.job_count += 1

    def observe_step(self, seconds: float) -> None:
        with self._lock:
            self.step_seconds_sum += seconds
            self.step_count += 1

    def observe_stage(self, stage: str, seconds: float) -> None:
        with self._lock:
            entry = self.stage_seconds.setdefault(stage, [0.0, 0])
            entry[0] += seconds
            entry[1] += 1

    def mean_job_seconds(self, default: float = 30.0) -> float:
        with self._lock:
            return self.job_seconds_sum / self.job_count if self.job_count else default

    def mean_step_seconds(self) -> float | None:
        """The mean measured denoising step, or None before the first."""
        with self._lock:
            return self.step_seconds_sum / self.step_count if self.step_count else None

    def render(
        self,
        *,
        queue_depth: int,
        jobs_by_status: dict[str, int],
        ready: bool,
        queue_by_task: dict[str, int] | None = None,
        workers_by_task: dict[str, int] | None = None,
    ) -> str:
        """The /metrics page; `queue_by_task` and `workers_by_task`: queued jobs and live workers per task."""
        lines = [
            "# HELP h3gen_ready 1 when the model is loaded and jobs can run.",
            "# TYPE h3gen_ready gauge",
            f"h3gen_ready {int(ready)}",
            "# HELP h3gen_queue_depth Jobs waiting for the engine.",
            "# TYPE h3gen_queue_depth gauge",
            f"h3gen_queue_depth {queue_depth}",
            "# HELP h3gen_jobs Jobs in the store by status.",
            "# TYPE h3gen_jobs gauge",
        ]
        for status in JobStatus:
            lines.append(f'h3gen_jobs{{status="{status}"}} {jobs_by_status.get(status, 0)}')
        lines += ["# HELP h3gen_queued_jobs Queued jobs per task.", "# TYPE h3gen_queued_jobs gauge"]
        lines += [
            f'h3gen_queued_jobs{{task="{task}"}} {count}' for task, count in sorted((queue_by_task or {}).items())
        ]
        lines += ["# HELP h3gen_live_workers Live workers that serve each task.", "# TYPE h3gen_live_workers gauge"]
        lines += [f'h3gen_live_workers{{task="{task}"}} {n}' for task, n in sorted((workers_by_task or {}).items())]
        with self._lock:
            lines += [
                "# HELP h3gen_jobs_submitted_total Jobs accepted since start.",
                "# TYPE h3gen_jobs_submitted_total counter",
                f"h3gen_jobs_submitted_total {self.submitted}",
                "# HELP h3gen_jobs_finished_total Jobs finished since start, by outcome.",
                "# TYPE h3gen_jobs_finished_total counter",
            ]
            for status in FINISHED:
                lines.append(f'h3gen_jobs_finished_total{{status="{status}"}} {self.finished.get(status, 0)}')
            lines += [
                "# HELP h3gen_step_seconds Duration of one denoising step.",
                "# TYPE h3gen_step_seconds summary",
                f"h3gen_step_seconds_sum {self.step_seconds_sum:.6f}",
                f"h3gen_step_seconds_count {self.step_count}",
                "# HELP h3gen_stage_seconds Duration of each pipeline stage.",
                "# TYPE h3gen_stage_seconds summary",
            ]
            for stage, (total, count) in sorted(self.stage_seconds.items()):
                lines.append(f'h3gen_stage_seconds_sum{{stage="{stage}"}} {total:.6f}')
                lines.append(f'h3gen_stage_seconds_count{{stage="{stage}"}} {count}')
        return "\n".join(lines) + "\n"

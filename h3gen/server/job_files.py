"""Where a job's files live in the results folder, and how they go.

<results>/<job id>.mp4              a succeeded job's video (written as `.<job id>.mp4.partial-*` first)
<results>/uploads/<job id>/         the uploads a job keeps, one `<field><suffix>` each
<results>/uploads/staging-<hex>/    one request's uploads before it is accepted
<results>/previews/<job id>.jpg     a running job's latest preview (written as `.<job id>.jpg.partial-*`, renamed)
"""

import os
import re
import shutil
import uuid
from pathlib import Path

from h3gen.server.job import Job

JOB_ID = re.compile(r"^[0-9a-f]{32}$")  # a job's id, and the stem of the files named after it
STAGING_PREFIX = "staging-"


class JobFiles:
    """The results folder of one job manager: job videos at the top, uploads under `uploads/`."""

    def __init__(self, results_dir):
        self.results_dir = Path(results_dir)
        self.uploads_dir = self.results_dir / "uploads"
        self.previews_dir = self.results_dir / "previews"

    def result(self, job_id: str) -> Path:
        """Where the job's MP4 is written."""
        return self.results_dir / f"{job_id}.mp4"

    def preview(self, job_id: str) -> Path:
        """Where a running job's latest preview (a JPEG) is."""
        return self.previews_dir / f"{job_id}.jpg"

    def write_preview(self, job_id: str, jpeg: bytes) -> Path:
        """Replace the job's preview with `jpeg`: written aside and renamed, so that a reader on any node sees a
        whole picture, the old one or the new."""
        self.previews_dir.mkdir(exist_ok=True)
        target = self.preview(job_id)
        partial = target.with_name(f".{target.name}.partial-{uuid.uuid4().hex}")
        try:
            partial.write_bytes(jpeg)
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
        return target

    def remove_stale_previews(self, running: set[str]) -> None:
        """Remove partial previews and the previews of jobs not in `running` (after a restart)."""
        if not self.previews_dir.is_dir():
            return
        for path in self.previews_dir.iterdir():
            if path.name.startswith(".") or path.stem not in running:
                path.unlink(missing_ok=True)

    def uploads(self, job_id: str) -> Path:
        """The folder of the uploads a job keeps."""
        return self.uploads_dir / job_id

    def staging_dir(self) -> Path:
        """A fresh folder for one request's uploads before it is accepted."""
        folder = self.uploads_dir / f"{STAGING_PREFIX}{uuid.uuid4().hex}"
        folder.mkdir(parents=True)
        return folder

    def staging_dirs(self) -> list[Path]:
        return list(self.uploads_dir.glob(f"{STAGING_PREFIX}*"))

    def keep_uploads(self, job_id: str, uploads: dict[str, Path]) -> dict[str, str]:
        """Move a request's uploads (field -> file) under the job's folder and remove the staging folders they leave
        empty; returns field -> kept file."""
        kept = {}
        if not uploads:
            return kept
        folder = self.uploads(job_id)
        folder.mkdir()
        for name, path in uploads.items():
            target = folder / f"{name}{Path(path).suffix}"
            shutil.move(str(path), target)
            kept[name] = str(target)
        for staging in {Path(path).parent for path in uploads.values()}:
            if staging.parent == self.uploads_dir and staging.name.startswith(STAGING_PREFIX):
                shutil.rmtree(staging, ignore_errors=True)
        return kept

    def remove(self, job: Job, *, result: bool, uploads: bool) -> None:
        """Remove the job's video (`result`) and the uploads it kept (`uploads`)."""
        if result and job.result_path:
            Path(job.result_path).unlink(missing_ok=True)
        if result:
            self.result(job.id).unlink(missing_ok=True)
        self.preview(job.id).unlink(missing_ok=True)
        if uploads:
            shutil.rmtree(self.uploads(job.id), ignore_errors=True)

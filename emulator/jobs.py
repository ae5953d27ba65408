"""Background jobs of the device (exports): their threads and progress, for log page C2h."""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ..protocol.status import DeviceError, Status

log = logging.getLogger(__name__)

# Finished jobs kept for the log page (newest kept); running jobs are always listed.
MAX_FINISHED_JOBS = 64


@dataclasses.dataclass
class Job:
    """One background job. Progress fields are plain ints, updated by its thread."""

    job_id: int
    kind: str
    nsid: int
    namespace: str
    tag: str | None
    step: int
    path: str
    bytes_total: int
    bytes_done: int = 0
    state: str = "running"  # running | done | failed
    status: str = Status.SUCCESS.name
    error: str | None = None
    started: float = dataclasses.field(default_factory=time.time)
    finished: float | None = None

    def describe(self) -> dict[str, Any]:
        return {
            "job": self.job_id, "kind": self.kind, "nsid": self.nsid, "namespace": self.namespace,
            "tag": self.tag, "step": self.step, "path": self.path, "state": self.state,
            "bytes_done": self.bytes_done, "bytes_total": self.bytes_total,
            "status": self.status, "error": self.error,
            "started": self.started, "finished": self.finished,
        }


class JobTable:
    """The jobs of one running device (in memory: a remount starts an empty table)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: collections.OrderedDict[int, Job] = collections.OrderedDict()
        self._threads: dict[int, threading.Thread] = {}
        self._next_id = 1

    def next_id(self) -> int:
        with self._lock:
            job_id = self._next_id
            self._next_id += 1
            return job_id

    def start(self, job: Job, work: Callable[[Job], None], cleanup: Callable[[], None]) -> Job:
        """Run work(job) on its own thread; `cleanup` runs after it whatever happened."""
        thread = threading.Thread(target=self._run, args=(job, work, cleanup),
                                  name=f"cossd-job-{job.job_id}", daemon=True)
        with self._lock:
            self._jobs[job.job_id] = job
            self._threads[job.job_id] = thread
            self._trim()
        thread.start()
        return job

    def _run(self, job: Job, work: Callable[[Job], None], cleanup: Callable[[], None]) -> None:
        error: str | None
        state, status, error = "failed", Status.INTERNAL_ERROR.name, "interrupted"
        try:
            work(job)
            state, status, error = "done", Status.SUCCESS.name, None
        except DeviceError as exc:
            state, status, error = "failed", exc.status.name, exc.message
            log.error("%s job %d failed: %s", job.kind, job.job_id, exc)
        except Exception as exc:  # a bug must fail the job, not hide it
            log.exception("%s job %d failed", job.kind, job.job_id)
            state, status, error = "failed", Status.INTERNAL_ERROR.name, f"internal error: {exc}"
        finally:
            try:
                cleanup()
            except Exception:
                log.exception("cleaning up after %s job %d failed", job.kind, job.job_id)
            # Only now: a client that sees the job finished finds nothing left behind.
            job.status, job.error, job.finished = status, error, time.time()
            job.state = state
            with self._lock:
                self._threads.pop(job.job_id, None)

    def _trim(self) -> None:
        finished = [job_id for job_id, job in self._jobs.items() if job.state != "running"]
        for job_id in finished[: max(0, len(finished) - MAX_FINISHED_JOBS)]:
            del self._jobs[job_id]

    def jobs(self, nsid: int | None = None) -> list[dict[str, Any]]:
        """Every kept job (of namespace `nsid` only, unless None), oldest first."""
        with self._lock:
            jobs = list(self._jobs.values())
        return [job.describe() for job in jobs if nsid is None or job.nsid == nsid]

    def join(self, timeout_s: float | None = None) -> None:
        """Wait for every running job (tests, and a clean shutdown that wants them done)."""
        with self._lock:
            threads = list(self._threads.values())
        for thread in threads:
            thread.join(timeout_s)

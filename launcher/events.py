"""Change notifications for watchers: the launcher bumps a job's version, WatchJob waits on it."""

import threading


class JobEvents:
    def __init__(self):
        self._versions = {}
        self._changed = threading.Condition()
        self.closed = False

    def publish(self, job_id: str):
        self.publish_many((job_id,))

    def publish_many(self, job_ids):
        with self._changed:
            for job_id in job_ids:
                self._versions[job_id] = self._versions.get(job_id, 0) + 1
            self._changed.notify_all()

    def version(self, job_id: str) -> int:
        with self._changed:
            return self._versions.get(job_id, 0)

    def wait(self, job_id: str, seen: int, timeout: float) -> int:
        """Blocks until the job's version passes `seen`, the timeout ends or events close."""
        with self._changed:
            self._changed.wait_for(
                lambda: self.closed or self._versions.get(job_id, 0) != seen, timeout
            )
            return self._versions.get(job_id, 0)

    def forget(self, job_id: str):
        with self._changed:
            self._versions.pop(job_id, None)

    def close(self):
        with self._changed:
            self.closed = True
            self._changed.notify_all()

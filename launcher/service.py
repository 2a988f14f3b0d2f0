"""The `kitchen.v1.Launcher` gRPC service: what clients and trainers call.

Handlers validate, check who may see what, and hand state changes to the controller; they
read jobs straight from the store (WAL readers never wait for the writer).
"""

import glob
import os
import time

import grpc

from launcher import validation
from launcher.auth import TokenAuth, bearer
from launcher.controller import FINAL
from launcher.store_base import PageTokenError, RequestIdReused
from protos import job_pb2, launcher_pb2, launcher_pb2_grpc, run_refs
from protos.attempt_file import ATTEMPTS_DIR, OUTPUT_LOG
from protos.config_yaml import ConfigError

LOG_CHUNK_BYTES = 64 * 1024
WATCH_RECHECK_SECONDS = 1.0
CANCEL_WAIT_SECONDS = 10.0  # a follower waits this long for the leader to act on a cancel
CANCEL_POLL_SECONDS = 0.1


class LauncherService(launcher_pb2_grpc.LauncherServicer):
    def __init__(self, cfg, store, controller, events, auth: TokenAuth | None, leadership=None):
        self.cfg = cfg
        self.leadership = leadership  # launcher/leader.py with replicas, else None
        self.store = store
        self.controller = controller
        self.events = events
        self.auth = auth

    def _caller(self, context):
        """The caller's AccessToken, or None when auth is off (everyone may do everything)."""
        if self.auth is None:
            return None
        caller = self.auth.identify(context.invocation_metadata())
        if caller is None:  # the interceptor lets only ReportProgress and health through
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "unknown or missing bearer token")
        return caller

    def _job(self, job_id, context) -> job_pb2.Job:
        caller = self._caller(context)
        job = self.store.get(job_id)
        if job is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no job {job_id!r}")
        if caller is not None and not caller.admin and job.spec.team != caller.team:
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"job {job_id} belongs to team {job.spec.team!r}; you are in {caller.team!r}",
            )
        return self.controller.overlay(job)

    def _leader_only(self, what: str, context):
        """A replica that is not the leader answers UNAVAILABLE: clients then try the next
        address; a trainer's progress stream retries (launcher/leader.py)."""
        if self.controller.leading:
            return
        holder = self.leadership.leader() if self.leadership is not None else None
        where = f"the leader is {holder.address}" if holder and holder.address else "no leader yet"
        context.abort(
            grpc.StatusCode.UNAVAILABLE, f"{what}: this replica is not the leader ({where})"
        )

    def SubmitJob(self, request, context):
        caller = self._caller(context)
        spec = job_pb2.JobSpec()
        spec.CopyFrom(request.spec)
        if caller is not None:
            for field, mine in (("owner", caller.user), ("team", caller.team)):
                theirs = getattr(spec, field)
                if theirs and theirs != mine and not caller.admin:
                    context.abort(
                        grpc.StatusCode.PERMISSION_DENIED,
                        f"spec.{field}: {theirs!r} is not yours ({mine!r}); only admins may",
                    )
                setattr(spec, field, theirs or mine)
        try:  # `run:NAME` paths first: the path policy then checks what they name
            resolved = run_refs.resolve(spec.trainer, self._successful_runs(spec.team))
            pool = validation.validate(spec, self.cfg, self.store.team_of)
        except ConfigError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"spec.{e.field}: {e.problem}")
        if "\x00" in request.request_id:  # PostgreSQL's text takes none: refused on every store
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: contains a NUL character")
        job = job_pb2.Job(spec=spec, pool=pool)
        for r in resolved:
            job.resolved.add(field=r.field, reference=r.reference, job_id=r.job_id, path=r.path)
        try:  # a request_id is scoped to the spec's team and owner (the caller's, with auth)
            job, _ = self.controller.submit(job, request.request_id)
        except RequestIdReused as e:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        return launcher_pb2.SubmitJobResponse(job=self.controller.overlay(job))

    def _successful_runs(self, team: str) -> run_refs.Candidates:
        """What `run:NAME` may name in a job of `team`: the team's SUCCEEDED jobs called NAME,
        newest first (protos/run_refs.py)."""

        def candidates(name: str):
            token = ""
            while True:
                jobs, token = self.store.page(
                    states=[job_pb2.SUCCEEDED], team=team, page_token=token
                )
                yield from ((j.id, j.run_dir) for j in jobs if j.spec.name == name and j.run_dir)
                if not token:
                    return

        return candidates

    def GetJob(self, request, context):
        return self._job(request.id, context)

    def ListJobs(self, request, context):
        caller = self._caller(context)
        team = request.team
        if caller is not None and not caller.admin:
            if team and team != caller.team:
                context.abort(
                    grpc.StatusCode.PERMISSION_DENIED, f"team: you may list only {caller.team!r}"
                )
            team = caller.team
        if request.page_size < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "page_size: cannot be negative")
        try:
            jobs, token = self.store.page(
                states=list(request.states),
                team=team,
                owner=request.owner,
                pool=request.pool,
                page_size=request.page_size,
                page_token=request.page_token,
            )
        except PageTokenError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        jobs = [self.controller.overlay(j) for j in jobs]
        return launcher_pb2.ListJobsResponse(jobs=jobs, next_page_token=token)

    def CancelJob(self, request, context):
        self._job(request.id, context)
        if self.controller.leading or self.leadership is None:
            return self.controller.overlay(self.controller.cancel(request.id))
        # A replica that does not lead stores the request; the leader acts on it within a
        # scan (launcher/replica_inbox.py). Answered once it has, or after CANCEL_WAIT with
        # the request still stored (a leader taking over acts on it).
        self.store.request_cancel(request.id)
        deadline = time.monotonic() + CANCEL_WAIT_SECONDS
        while self.store.cancel_requested(request.id) and time.monotonic() < deadline:
            time.sleep(CANCEL_POLL_SECONDS)
        return self.controller.overlay(self.store.get(request.id))

    def WatchJob(self, request, context):
        self._job(request.id, context)
        sent = None
        while context.is_active() and not self.events.closed:
            version = self.events.version(request.id)
            job = self.controller.overlay(self.store.get(request.id))
            data = job.SerializeToString()
            if data != sent:
                sent = data
                yield job
            if job.state in FINAL:
                return
            self.events.wait(request.id, version, WATCH_RECHECK_SECONDS)

    def StreamLogs(self, request, context):
        job = self._job(request.id, context)
        offsets = {}  # attempt dir -> bytes sent
        while context.is_active():
            final = job.state in FINAL  # read before the logs: nothing written after is missed
            sent_any = False
            for attempt in sorted(glob.glob(os.path.join(job.run_dir, ATTEMPTS_DIR, "*"))):
                path = os.path.join(attempt, OUTPUT_LOG)
                if attempt not in offsets:
                    offsets[attempt] = 0
                    header = f"===== attempt {int(os.path.basename(attempt))} =====\n"
                    yield launcher_pb2.LogChunk(data=header.encode())
                for chunk in _read_from(path, offsets[attempt]):
                    offsets[attempt] += len(chunk)
                    sent_any = True
                    yield launcher_pb2.LogChunk(data=chunk)
            if not request.follow or (final and not sent_any):
                return
            if not sent_any:
                time.sleep(0.25)
            job = self.store.get(request.id)

    def ReportProgress(self, request_iterator, context):
        job_id = attempt = None
        for progress in request_iterator:
            if job_id is None:
                job_id, attempt = progress.job_id, progress.attempt
                self._check_trainer(job_id, context)
                self._leader_only("ReportProgress", context)  # a follower knows no attempt
            if (progress.job_id, progress.attempt) != (job_id, attempt):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "one stream reports one attempt")
            if not self.controller.report_progress(job_id, attempt, progress):
                return launcher_pb2.ReportProgressResponse(stop=True)
        return launcher_pb2.ReportProgressResponse(stop=False)

    def _check_trainer(self, job_id, context):
        """With auth on, a trainer proves it runs the attempt with the attempt's token."""
        if self.auth is None:
            return
        metadata = context.invocation_metadata()
        if self.store.attempt_token_matches(job_id, bearer(metadata) or ""):
            return
        caller = self.auth.identify(metadata)
        if caller is None or not caller.admin:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "progress needs the attempt's token")


def _read_from(path, offset):
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            while chunk := f.read(LOG_CHUNK_BYTES):
                yield chunk
    except FileNotFoundError:
        return

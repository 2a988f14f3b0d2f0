"""Runs attempts as Kubernetes batch/v1 Jobs.

One node: a plain Job (backoffLimit 0: the launcher does the retrying). Several nodes: an
Indexed Job with a headless Service, each pod running `torchrun --node-rank=$(JOB_COMPLETION_INDEX)`
against pod 0 (JobSet needs a CRD that cannot be validated offline; an Indexed Job can).
Every manifest is checked with kubernetes-validate (strict) before anything is sent.

Submission talks to the API server's REST interface with the credentials of a kubeconfig
(token or client certificate). No API server can run on the machine this was written on: the
manifests are validated offline and the REST calls are tested against a small fake server.
Without a kubeconfig the pool only renders: the attempt fails with the manifest's path.

The attempt's handoff reaches the pod without a shared file system: attempt.json (with its
token_file and tls_ca pointing into HANDOFF_DIR) and the TLS root certificate go in a
ConfigMap, the token in a Secret; both are mounted read-only at HANDOFF_DIR
(/etc/kitchen/attempt/) and the trainer runs as `<trainer_cmd> --attempt
/etc/kitchen/attempt/attempt.json`. With `state_volume_claim` the state dir (run dirs, the
precook cache) is mounted too, at the launcher's own path. The Service, ConfigMap and Secret
are owned by the Job (ownerReferences): deleting the Job deletes them.
"""

import base64
import json
import os
import ssl
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import kubernetes_validate
import yaml

from launcher.executors import handoff
from launcher.executors.base import (
    OUTPUT_LOG,
    PORTABLE_ENV,
    Executor,
    Launch,
    Observed,
    Status,
    torchrun,
)
from protos import attempt_pb2, launcher_pb2
from protos.files import write_atomic

K8S_VERSION = "1.30.0"  # the schema the manifests are validated against
MASTER_PORT = 29500
HANDOFF_DIR = "/etc/kitchen/attempt"  # where a pod sees its attempt's handoff, read-only
TLS_CA_FILE = "tls_ca.pem"
# The REST collection of each kind of object the executor makes.
COLLECTIONS = {
    "Job": "/apis/batch/v1",
    "Service": "/api/v1",
    "ConfigMap": "/api/v1",
    "Secret": "/api/v1",
    "Pod": "/api/v1",
}


class KubernetesError(RuntimeError):
    pass


def object_name(job_id: str, attempt: int) -> str:
    return f"kitchen-{job_id.lower()}-a{attempt}"


def pod_attempt(attempt: attempt_pb2.Attempt) -> attempt_pb2.Attempt:
    """The Attempt as a pod sees it: token and TLS root in HANDOFF_DIR."""
    inside = attempt_pb2.Attempt()
    inside.CopyFrom(attempt)
    if attempt.token_file:
        inside.token_file = f"{HANDOFF_DIR}/{handoff.TOKEN_FILE}"
    if attempt.tls_ca:
        inside.tls_ca = f"{HANDOFF_DIR}/{TLS_CA_FILE}"
    return inside


def _handoff_objects(launch: Launch, name: str, labels: dict) -> tuple[list, dict]:
    """The ConfigMap (and Secret) holding the attempt's handoff, and the pod volume of both."""
    attempt = launch.attempt
    data = {handoff.ATTEMPT_FILE: handoff.to_json(pod_attempt(attempt))}
    if attempt.tls_ca:
        with open(attempt.tls_ca) as f:
            data[TLS_CA_FILE] = f.read()
    metadata = {"name": name, "labels": labels}
    objects = [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data}]
    sources: list[dict[str, Any]] = [{"configMap": {"name": name}}]
    if attempt.token_file:
        with open(attempt.token_file, "rb") as f:
            token = base64.b64encode(f.read()).decode()
        objects.append(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": dict(metadata),
                "type": "Opaque",
                "data": {handoff.TOKEN_FILE: token},
            }
        )
        # Readable by the file's owner only: root, as Kitchen's images run (an image with
        # another user would need the pod's fsGroup).
        item = {"key": handoff.TOKEN_FILE, "path": handoff.TOKEN_FILE, "mode": 0o400}
        sources.append({"secret": {"name": name, "items": [item]}})
    volume = {"name": "attempt", "projected": {"sources": sources, "defaultMode": 0o444}}
    return objects, volume


def render(
    launch: Launch, pool, grace_seconds: float, torchrun_cmd: list, state_dir: str = ""
) -> list:
    """The manifests (dicts) of one attempt: a Job, a headless Service for several nodes, the
    handoff's ConfigMap and (with auth on) Secret. `state_dir`: where the state volume claim
    is mounted (the launcher's own state dir)."""
    job, k8s = launch.job, pool.kubernetes
    r = job.spec.resources
    nodes, nproc = r.nodes or 1, r.processes_per_node or 1
    name = object_name(job.id, job.attempts)
    labels = {"app.kubernetes.io/managed-by": "kitchen", "kitchen/job": job.id.lower()}
    argv = [*launch.trainer_cmd, *launch.trainer_args(f"{HANDOFF_DIR}/{handoff.ATTEMPT_FILE}")]
    if nodes > 1:
        rendezvous = [
            f"--nnodes={nodes}", "--node-rank=$(JOB_COMPLETION_INDEX)",
            f"--master-addr={name}-0.{name}", f"--master-port={MASTER_PORT}",
        ]  # fmt: skip
        argv = torchrun(torchrun_cmd, argv, nproc, rendezvous)
    elif nproc > 1:
        argv = torchrun(torchrun_cmd, argv, nproc, ["--standalone", "--nnodes=1"])
    container: dict[str, Any] = {
        "name": "trainer",
        "image": job.spec.image or k8s.image,
        "command": argv,
        "env": [{"name": k, "value": launch.env[k]} for k in PORTABLE_ENV if k in launch.env],
    }
    gpus = r.gpus_per_node or pool.gpus_per_node
    if gpus:
        container["resources"] = {"limits": {k8s.gpu_resource or "nvidia.com/gpu": gpus}}
    pod: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": int(grace_seconds),
    }
    pod["containers"] = [container]
    if k8s.service_account:
        pod["serviceAccountName"] = k8s.service_account
    handoff_objects, volume = _handoff_objects(launch, name, labels)
    container["volumeMounts"] = [{"name": "attempt", "mountPath": HANDOFF_DIR, "readOnly": True}]
    pod["volumes"] = [volume]
    if k8s.state_volume_claim:
        # The whole state dir: run dirs and the precook cache, at the launcher's own path.
        if not state_dir:
            raise KubernetesError(f"pool {pool.name}: state_volume_claim needs the state dir")
        container["volumeMounts"].append({"name": "state", "mountPath": state_dir})
        pod["volumes"].append(
            {"name": "state", "persistentVolumeClaim": {"claimName": k8s.state_volume_claim}}
        )
    spec = {"backoffLimit": 0, "template": {"metadata": {"labels": labels}, "spec": pod}}
    manifests: list[dict[str, Any]] = []
    if nodes > 1:
        spec.update(completionMode="Indexed", completions=nodes, parallelism=nodes)
        pod["subdomain"] = name
        manifests.append(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": name, "labels": labels},
                "spec": {"clusterIP": "None", "selector": {"job-name": name}},
            }
        )
    manifests.insert(
        0,
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": name, "labels": labels},
            "spec": spec,
        },
    )
    manifests += handoff_objects
    for m in manifests:
        m["metadata"]["namespace"] = k8s.namespace or "default"
        validate(m)
    return manifests


def validate(manifest: dict):
    kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)


def owned_by(manifest: dict, job: dict) -> dict:
    """`manifest` owned by the Job object `job` (as the API server returned it), so that
    deleting the Job deletes it."""
    meta = job["metadata"]
    owner = {"apiVersion": "batch/v1", "kind": "Job", "name": meta["name"], "uid": meta["uid"]}
    out = {**manifest, "metadata": {**manifest["metadata"], "ownerReferences": [owner]}}
    validate(out)
    return out


class Cluster:
    """The few REST calls the executor needs, with a kubeconfig's current context."""

    def __init__(self, kubeconfig: str):
        with open(kubeconfig) as f:
            cfg = yaml.safe_load(f)
        context = _named(cfg, "contexts", cfg["current-context"])["context"]
        cluster = _named(cfg, "clusters", context["cluster"])["cluster"]
        user = _named(cfg, "users", context["user"])["user"]
        self.server = cluster["server"].rstrip("/")
        self.headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if user.get("token"):
            self.headers["Authorization"] = f"Bearer {user['token']}"
        self.ssl = None
        if self.server.startswith("https"):
            self.ssl = ssl.create_default_context(cafile=_file(cluster, "certificate-authority"))
            if cluster.get("insecure-skip-tls-verify"):
                self.ssl.check_hostname, self.ssl.verify_mode = False, ssl.CERT_NONE
            if user.get("client-certificate") or user.get("client-certificate-data"):
                self.ssl.load_cert_chain(
                    _file(user, "client-certificate"), _file(user, "client-key")
                )

    def call(self, method: str, path: str, body=None, ok_missing=False):
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.server + path, data, self.headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=30, context=self.ssl) as response:
                raw = response.read()
                return json.loads(raw) if raw.strip().startswith(b"{") else raw.decode()
        except urllib.error.HTTPError as e:
            if ok_missing and e.code in (404, 409):
                return None
            raise KubernetesError(f"{method} {path}: HTTP {e.code}: {e.read()[:300]!r}") from None
        except urllib.error.URLError as e:
            raise KubernetesError(f"{method} {path}: {e.reason}") from None


def _named(cfg, section, name):
    for item in cfg.get(section, []):
        if item["name"] == name:
            return item
    raise KubernetesError(f"kubeconfig: no {section[:-1]} named {name!r}")


def _file(entry, key):
    """A kubeconfig path field, or its inline `-data` twin written to a private temp file."""
    if entry.get(key):
        return entry[key]
    if entry.get(f"{key}-data"):
        fd, path = tempfile.mkstemp(prefix="kitchen-kube-")
        with os.fdopen(fd, "wb") as f:
            f.write(base64.b64decode(entry[f"{key}-data"]))
        return path
    return None


class KubernetesExecutor(Executor):
    kind = "kubernetes"

    def __init__(
        self,
        pool: launcher_pb2.PoolConfig,
        torchrun_cmd: list,
        grace_seconds: float = 60.0,
        clock=time.time,
        state_dir: str = "",
    ):
        self.pool = pool
        self.namespace = pool.kubernetes.namespace or "default"
        self.torchrun_cmd = torchrun_cmd
        self.grace = grace_seconds
        self.clock = clock
        self.state_dir = state_dir  # the launcher's: where state_volume_claim is mounted
        self.cluster = Cluster(pool.kubernetes.kubeconfig) if pool.kubernetes.kubeconfig else None

    def _api(self) -> Cluster:
        """The cluster of a pool with a kubeconfig (only such a pool's attempts have handles)."""
        if self.cluster is None:
            raise KubernetesError(f"pool {self.pool.name} has no kubeconfig")
        return self.cluster

    def _path(self, kind: str, name: str = "") -> str:
        """The REST path of the collection of `kind` (Job, Service, ..., Pod), or one object."""
        path = f"{COLLECTIONS[kind]}/namespaces/{self.namespace}/{kind.lower()}s"
        return path + (f"/{name}" if name else "")

    def start(self, launch: Launch):
        manifests = render(launch, self.pool, self.grace, self.torchrun_cmd, self.state_dir)
        os.makedirs(launch.attempt_dir, exist_ok=True)
        manifest_path = os.path.join(launch.attempt_dir, "manifest.yaml")
        text = yaml.safe_dump_all(manifests, sort_keys=False)
        write_atomic(manifest_path, text, mode=handoff.SECRET_MODE)  # it holds the Secret
        if self.cluster is None:
            raise KubernetesError(
                f"pool {self.pool.name} has no kubeconfig; manifest: {manifest_path}"
            )
        job, dependents = manifests[0], manifests[1:]
        name = job["metadata"]["name"]
        with open(launch.log_path, "a") as f:
            f.write(f"in Kubernetes: kubectl -n {self.namespace} logs -l job-name={name} -f\n")
        made = self.cluster.call("POST", self._path("Job"), job, ok_missing=True)
        if made is None:  # 409: made by a launcher that crashed before storing the handle
            made = self.cluster.call("GET", self._path("Job", name))
        # Pods cannot start before their ConfigMap and Secret exist, which come after the
        # Service: pod 0's name resolves when torchrun starts.
        for m in dependents:
            self.cluster.call("POST", self._path(m["kind"]), owned_by(m, made), ok_missing=True)
        return {**launch.handle, "name": name}, Status.PENDING

    def poll(self, handles: dict) -> dict:
        return {job_id: self._observe(h) for job_id, h in handles.items()}

    def _observe(self, h) -> Observed:
        job = self._api().call("GET", self._path("Job", h["name"]), ok_missing=True)
        if job is None:
            return Observed(Status.LOST, detail=f"Kubernetes Job {h['name']} is gone")
        status = job.get("status", {})
        if status.get("succeeded", 0) >= job["spec"].get("completions", 1):
            return self._ended(h, 0)
        if status.get("failed", 0):
            return self._ended(h, None)
        return Observed(Status.RUNNING if status.get("active") else Status.PENDING)

    def _ended(self, h, code):
        """Exit code from the pods (first non-zero one), and their logs into output.log."""
        selector = urllib.parse.quote(f"job-name={h['name']}")
        pods = self._api().call("GET", self._path("Pod") + f"?labelSelector={selector}")
        codes = []
        with open(os.path.join(h["attempt_dir"], OUTPUT_LOG), "a") as log:
            for pod in pods.get("items", []):
                for c in pod.get("status", {}).get("containerStatuses", []):
                    done = c.get("state", {}).get("terminated")
                    if done is not None:
                        codes.append(done["exitCode"])
                name = pod["metadata"]["name"]
                log.write(f"----- pod {name} -----\n")
                text = self._api().call("GET", self._path("Pod", name) + "/log", ok_missing=True)
                log.write(text if isinstance(text, str) else "(no log)\n")
        failed = [c for c in codes if c != 0]
        if code is None and not failed:
            return Observed(
                Status.LOST, detail=f"Kubernetes Job {h['name']} failed without an exit code"
            )
        return Observed(Status.EXITED, failed[0] if failed else 0)

    def terminate(self, handle: dict):
        self._delete(handle, self.grace)

    def kill(self, handle: dict):
        self._delete(handle, 0)

    def _delete(self, handle, grace):
        """Deletes the Job; the API server's garbage collector deletes what it owns (pods,
        the Service, the handoff's ConfigMap and Secret)."""
        body = {"propagationPolicy": "Background", "gracePeriodSeconds": int(grace)}
        self._api().call("DELETE", self._path("Job", handle["name"]), body, ok_missing=True)

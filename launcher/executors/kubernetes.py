"""Runs attempts as Kubernetes batch/v1 Jobs.

One node: a plain Job (backoffLimit 0: the launcher does the retrying). Several nodes: an
Indexed Job with a headless Service, each pod running `torchrun --node-rank=$(JOB_COMPLETION_INDEX)`
against pod 0 (JobSet needs a CRD that cannot be validated offline; an Indexed Job can).
Every manifest is checked with kubernetes-validate (strict) before anything is sent.

Submission talks to the API server's REST interface with the credentials of a kubeconfig
(token or client certificate). No API server can run on the machine this was written on: the
manifests are validated offline and the REST calls are tested against a small fake server.
Without a kubeconfig the pool only renders: the attempt fails with the manifest's path.
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

import kubernetes_validate
import yaml

from launcher.executors.base import Executor, Launch, Observed, Status, torchrun

K8S_VERSION = "1.30.0"  # the schema the manifests are validated against
MASTER_PORT = 29500


class KubernetesError(RuntimeError):
    pass


def object_name(job_id: str, attempt: int) -> str:
    return f"kitchen-{job_id.lower()}-a{attempt}"


def render(launch: Launch, pool, grace_seconds: float, torchrun_cmd: list) -> list:
    """The manifests (dicts) of one attempt: a Job, plus a headless Service for several nodes."""
    job, k8s = launch.job, pool.kubernetes
    r = job.spec.resources
    nodes, nproc = r.nodes or 1, r.processes_per_node or 1
    name = object_name(job.id, job.attempts)
    labels = {"app.kubernetes.io/managed-by": "kitchen", "kitchen/job": job.id.lower()}
    argv = launch.argv
    if nodes > 1:
        rendezvous = [
            f"--nnodes={nodes}", "--node-rank=$(JOB_COMPLETION_INDEX)",
            f"--master-addr={name}-0.{name}", f"--master-port={MASTER_PORT}",
        ]  # fmt: skip
        argv = torchrun(torchrun_cmd, argv, nproc, rendezvous)
    elif nproc > 1:
        argv = torchrun(torchrun_cmd, argv, nproc, ["--standalone", "--nnodes=1"])
    container = {
        "name": "trainer",
        "image": job.spec.image or k8s.image,
        "command": argv,
        "env": [{"name": k, "value": v} for k, v in sorted(launch.env.items())],
    }
    gpus = r.gpus_per_node or pool.gpus_per_node
    if gpus:
        container["resources"] = {"limits": {k8s.gpu_resource or "nvidia.com/gpu": gpus}}
    pod = {"restartPolicy": "Never", "terminationGracePeriodSeconds": int(grace_seconds)}
    pod["containers"] = [container]
    if k8s.service_account:
        pod["serviceAccountName"] = k8s.service_account
    if k8s.state_volume_claim:
        # The whole state dir: run dirs and the precook cache, at the launcher's own path.
        state_dir = launch.env.get("KITCHEN_STATE_DIR") or os.path.dirname(job.run_dir)
        container["volumeMounts"] = [{"name": "state", "mountPath": state_dir}]
        pod["volumes"] = [
            {"name": "state", "persistentVolumeClaim": {"claimName": k8s.state_volume_claim}}
        ]
    spec = {"backoffLimit": 0, "template": {"metadata": {"labels": labels}, "spec": pod}}
    manifests = []
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
    for m in manifests:
        m["metadata"]["namespace"] = k8s.namespace or "default"
        kubernetes_validate.validate(m, K8S_VERSION, strict=True)
    return manifests


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

    def __init__(self, pool, torchrun_cmd: list, grace_seconds: float = 60.0, clock=time.time):
        self.pool = pool  # kitchen.v1.PoolConfig
        self.namespace = pool.kubernetes.namespace or "default"
        self.torchrun_cmd = torchrun_cmd
        self.grace = grace_seconds
        self.clock = clock
        self.cluster = Cluster(pool.kubernetes.kubeconfig) if pool.kubernetes.kubeconfig else None

    def _path(self, kind: str, name: str = "") -> str:
        group = "/api/v1" if kind in ("services", "pods") else "/apis/batch/v1"
        return f"{group}/namespaces/{self.namespace}/{kind}" + (f"/{name}" if name else "")

    def start(self, launch: Launch):
        manifests = render(launch, self.pool, self.grace, self.torchrun_cmd)
        os.makedirs(launch.attempt_dir, exist_ok=True)
        manifest_path = os.path.join(launch.attempt_dir, "manifest.yaml")
        with open(manifest_path, "w") as f:
            yaml.safe_dump_all(manifests, f, sort_keys=False)
        if self.cluster is None:
            raise KubernetesError(
                f"pool {self.pool.name} has no kubeconfig; manifest: {manifest_path}"
            )
        name = manifests[0]["metadata"]["name"]
        with open(launch.log_path, "a") as f:
            f.write(f"in Kubernetes: kubectl -n {self.namespace} logs -l job-name={name} -f\n")
        for m in reversed(manifests):  # the Service first, so pod 0 resolves when torchrun starts
            kind = "jobs" if m["kind"] == "Job" else "services"
            self.cluster.call("POST", self._path(kind), m, ok_missing=True)  # 409: already made
        return {**launch.handle, "name": name, "services": len(manifests) > 1}, Status.PENDING

    def poll(self, handles: dict) -> dict:
        return {job_id: self._observe(h) for job_id, h in handles.items()}

    def _observe(self, h) -> Observed:
        job = self.cluster.call("GET", self._path("jobs", h["name"]), ok_missing=True)
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
        pods = self.cluster.call("GET", self._path("pods") + f"?labelSelector={selector}")
        codes = []
        with open(os.path.join(h["attempt_dir"], "output.log"), "a") as log:
            for pod in pods.get("items", []):
                for c in pod.get("status", {}).get("containerStatuses", []):
                    done = c.get("state", {}).get("terminated")
                    if done is not None:
                        codes.append(done["exitCode"])
                name = pod["metadata"]["name"]
                log.write(f"----- pod {name} -----\n")
                text = self.cluster.call("GET", self._path("pods", name) + "/log", ok_missing=True)
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
        body = {"propagationPolicy": "Background", "gracePeriodSeconds": int(grace)}
        self.cluster.call("DELETE", self._path("jobs", handle["name"]), body, ok_missing=True)
        if handle.get("services"):
            self.cluster.call("DELETE", self._path("services", handle["name"]), ok_missing=True)

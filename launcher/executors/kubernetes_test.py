"""The Kubernetes executor. Manifests are validated offline (kubernetes-validate, strict).
No Kubernetes API server can run here, so the REST calls go to a small fake API server that
answers like one for the endpoints used, and records what it was sent."""

import base64
import http.server
import itertools
import json
import os
import stat
import threading
import time
from typing import Any

import kubernetes_validate
import pytest
import yaml
from google.protobuf import json_format

from launcher.executors import handoff
from launcher.executors import kubernetes as k8s
from launcher.executors.base import Launch, Status, attempt_dir
from protos import attempt_pb2, job_pb2, launcher_pb2

TORCHRUN = ["python3", "-m", "torch.distributed.run"]
TOKEN = "attempt-secret-for-j12"
CA_PEM = "-----BEGIN CERTIFICATE-----\nnot a real one\n-----END CERTIFICATE-----\n"
IN_POD = "/etc/kitchen/attempt"


def pool(kubeconfig="", state_volume_claim="kitchen-state"):
    p = launcher_pb2.PoolConfig(
        name="h100", executor=launcher_pb2.KUBERNETES, nodes=4, gpus_per_node=8
    )
    p.kubernetes.namespace = "ml"
    p.kubernetes.image = "registry.local/kitchen/trainer:1"
    p.kubernetes.state_volume_claim = state_volume_claim
    p.kubernetes.kubeconfig = kubeconfig
    return p


def launch(tmp_path, nodes=1, processes=1, gpus=0, token=TOKEN, tls=True):
    """An attempt of j12 with its handoff files written as the launcher writes them."""
    job = job_pb2.Job(id="j12", attempts=3, run_dir="/state/runs/j12")
    r = job.spec.resources
    r.nodes, r.processes_per_node, r.gpus_per_node = nodes, processes, gpus
    cfg = launcher_pb2.LauncherConfig(state_dir="/state", advertise="launcher.ml:50051")
    if tls:
        (tmp_path / "ca.pem").write_text(CA_PEM)
        cfg.tls_cert = str(tmp_path / "ca.pem")
    handle: dict[str, Any] = {
        "attempt_dir": attempt_dir(str(tmp_path), 3),
        "launched_at": time.time(),
    }
    attempt = handoff.write(job, cfg, handle["attempt_dir"], token)
    env = {"PYTHONUNBUFFERED": "1", "PYTHONPATH": "/launcher/host/only"}
    return Launch(job, attempt, ["/app/trainer/train"], env, handle)


def render(one, **fields):
    return k8s.render(one, pool(**fields), 60, TORCHRUN, state_dir="/state")


def test_single_node_job_manifest(tmp_path):
    job, config_map, secret = render(launch(tmp_path, processes=2, gpus=4))
    assert (job["kind"], job["metadata"]["name"], job["metadata"]["namespace"]) == (
        "Job",
        "kitchen-j12-a3",
        "ml",
    )
    assert job["spec"]["backoffLimit"] == 0  # retries are the launcher's
    pod = job["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["image"] == "registry.local/kitchen/trainer:1"
    assert c["command"][:4] == [*TORCHRUN, "--standalone"]
    assert "--nproc-per-node=2" in c["command"]
    assert c["command"][-3:] == ["/app/trainer/train", "--attempt", f"{IN_POD}/attempt.json"]
    assert c["resources"]["limits"] == {"nvidia.com/gpu": 4}
    assert c["volumeMounts"] == [
        {"name": "attempt", "mountPath": IN_POD, "readOnly": True},
        {"name": "state", "mountPath": "/state"},
    ]
    assert c["env"] == [{"name": "PYTHONUNBUFFERED", "value": "1"}]  # no host PYTHONPATH
    assert pod["terminationGracePeriodSeconds"] == 60 and pod["restartPolicy"] == "Never"
    assert (config_map["kind"], secret["kind"]) == ("ConfigMap", "Secret")


def test_the_handoff_is_a_config_map_and_a_secret_mounted_read_only(tmp_path):
    job, config_map, secret = render(launch(tmp_path))
    name = "kitchen-j12-a3"
    assert config_map["metadata"]["name"] == secret["metadata"]["name"] == name
    inside = json_format.Parse(config_map["data"]["attempt.json"], attempt_pb2.Attempt())
    assert (inside.job_id, inside.number, inside.run_dir) == ("j12", 3, "/state/runs/j12")
    assert (inside.launcher, inside.cache_dir) == ("launcher.ml:50051", "/state/precook")
    assert (inside.token_file, inside.tls_ca) == (f"{IN_POD}/token", f"{IN_POD}/tls_ca.pem")
    assert config_map["data"]["tls_ca.pem"] == CA_PEM
    assert base64.b64decode(secret["data"]["token"]).decode() == TOKEN
    volume = job["spec"]["template"]["spec"]["volumes"][0]
    assert volume["projected"]["sources"] == [
        {"configMap": {"name": name}},
        {"secret": {"name": name, "items": [{"key": "token", "path": "token", "mode": 0o400}]}},
    ]
    # The token is only in the Secret: not in the Job (argv, env) nor in the ConfigMap.
    assert TOKEN not in json.dumps(job) and TOKEN not in json.dumps(config_map)


def test_without_auth_tls_or_a_state_claim_the_pod_gets_only_attempt_json(tmp_path):
    job, config_map = render(launch(tmp_path, token="", tls=False), state_volume_claim="")
    inside = json_format.Parse(config_map["data"]["attempt.json"], attempt_pb2.Attempt())
    assert (inside.token_file, inside.tls_ca) == ("", "")
    assert list(config_map["data"]) == ["attempt.json"]
    pod = job["spec"]["template"]["spec"]
    assert pod["volumes"] == [
        {
            "name": "attempt",
            "projected": {
                "sources": [{"configMap": {"name": "kitchen-j12-a3"}}],
                "defaultMode": 0o444,
            },
        }
    ]
    assert pod["containers"][0]["volumeMounts"] == [
        {"name": "attempt", "mountPath": IN_POD, "readOnly": True}
    ]


def test_multi_node_is_an_indexed_job_with_a_headless_service(tmp_path):
    job, service, *_ = render(launch(tmp_path, nodes=2, processes=8))
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 2
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert "--node-rank=$(JOB_COMPLETION_INDEX)" in command
    assert "--master-addr=kitchen-j12-a3-0.kitchen-j12-a3" in command
    assert job["spec"]["template"]["spec"]["subdomain"] == "kitchen-j12-a3"
    assert service["spec"] == {"clusterIP": "None", "selector": {"job-name": "kitchen-j12-a3"}}
    assert job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] == {
        "nvidia.com/gpu": 8
    }


def test_the_validator_really_rejects_bad_manifests(tmp_path):
    job, *_ = render(launch(tmp_path))
    job["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = 7
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, k8s.K8S_VERSION, strict=True)


def test_without_kubeconfig_the_pool_only_renders(tmp_path):
    ex = k8s.KubernetesExecutor(pool(), TORCHRUN, state_dir="/state")
    one = launch(tmp_path)
    with pytest.raises(k8s.KubernetesError, match="no kubeconfig; manifest: .*manifest.yaml"):
        ex.start(one)
    path = f"{one.attempt_dir}/manifest.yaml"
    written = list(yaml.safe_load_all(open(path)))
    assert [m["kind"] for m in written] == ["Job", "ConfigMap", "Secret"]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # it holds the Secret


def test_a_state_claim_needs_the_state_dir(tmp_path):
    with pytest.raises(k8s.KubernetesError, match="state_volume_claim needs the state dir"):
        k8s.render(launch(tmp_path), pool(), 60, TORCHRUN)


class FakeApiServer(http.server.ThreadingHTTPServer):
    """Answers the Job, Service and Pod endpoints the executor uses, from in-memory state."""

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.objects, self.requests, self.pods = {}, [], {}
        self.uids = (f"uid-{n}" for n in itertools.count(1))
        threading.Thread(target=self.serve_forever, daemon=True).start()


class _Handler(http.server.BaseHTTPRequestHandler):
    server: FakeApiServer  # the server it answers for, with its state

    def log_message(self, *args):
        pass

    def _reply(self, code, body):
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(code)
        self.end_headers()
        self.wfile.write(data)

    def _record(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.server.requests.append(
            (self.command, self.path, self.headers.get("Authorization"), body)
        )
        return body

    def do_POST(self):
        body = self._record()
        key = (self.path, body["metadata"]["name"])
        if key in self.server.objects:
            return self._reply(409, {"reason": "AlreadyExists"})
        body["metadata"]["uid"] = next(self.server.uids)
        self.server.objects[key] = body
        self._reply(201, body)

    def do_GET(self):
        self._record()
        path = self.path.split("?")[0]
        if path.endswith("/pods"):
            return self._reply(200, {"items": list(self.server.pods.values())})
        if path.endswith("/log"):
            return self._reply(200, "trainer output\n")
        base, name = path.rsplit("/", 1)
        obj = self.server.objects.get((base, name))
        self._reply(200, obj) if obj else self._reply(404, {"reason": "NotFound"})

    def do_DELETE(self):
        self._record()
        base, name = self.path.rsplit("/", 1)
        self.server.objects.pop((base, name), None)
        self._reply(200, {"status": "Success"})


def test_submit_watch_and_stop_through_the_rest_api(tmp_path):
    api = FakeApiServer()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "current-context": "test",
                "contexts": [{"name": "test", "context": {"cluster": "c", "user": "u"}}],
                "clusters": [
                    {"name": "c", "cluster": {"server": f"http://127.0.0.1:{api.server_port}"}}
                ],
                "users": [{"name": "u", "user": {"token": "sekret"}}],
            }
        )
    )
    ex = k8s.KubernetesExecutor(
        pool(str(kubeconfig)), TORCHRUN, grace_seconds=30, state_dir="/state"
    )
    one = launch(tmp_path, nodes=2)
    handle, status = ex.start(one)
    assert status == Status.PENDING and handle["name"] == "kitchen-j12-a3"
    posted = [(p, b) for m, p, _, b in api.requests if m == "POST"]
    assert [p for p, _ in posted] == [
        "/apis/batch/v1/namespaces/ml/jobs",  # first: the others name it as their owner
        "/api/v1/namespaces/ml/services",
        "/api/v1/namespaces/ml/configmaps",
        "/api/v1/namespaces/ml/secrets",
    ]
    owner = {"apiVersion": "batch/v1", "kind": "Job", "name": "kitchen-j12-a3", "uid": "uid-1"}
    assert all(b["metadata"]["ownerReferences"] == [owner] for _, b in posted[1:])
    assert all(auth == "Bearer sekret" for _, _, auth, _ in api.requests)
    ex.start(one)  # a retried start after a launcher crash: 409 Conflict is fine
    again = [b for m, _, _, b in api.requests[len(posted) :] if m == "POST"][1:]
    assert all(b["metadata"]["ownerReferences"] == [owner] for b in again)  # the Job's uid

    stored = api.objects[("/apis/batch/v1/namespaces/ml/jobs", "kitchen-j12-a3")]
    assert ex.poll({"j12": handle})["j12"].status == Status.PENDING
    stored["status"] = {"active": 2}
    assert ex.poll({"j12": handle})["j12"].status == Status.RUNNING
    stored["status"] = {"failed": 1, "active": 1}
    api.pods = {
        "p0": {
            "metadata": {"name": "p0"},
            "status": {"containerStatuses": [{"state": {"terminated": {"exitCode": 0}}}]},
        },
        "p1": {
            "metadata": {"name": "p1"},
            "status": {"containerStatuses": [{"state": {"terminated": {"exitCode": 3}}}]},
        },
    }
    seen = ex.poll({"j12": handle})["j12"]
    assert (seen.status, seen.exit_code) == (Status.EXITED, 3)
    assert "trainer output" in open(one.log_path).read()

    ex.terminate(handle)
    deletes = [(p, b) for m, p, _, b in api.requests if m == "DELETE"]
    # Only the Job: the API server's garbage collector deletes what it owns.
    assert deletes == [
        (
            "/apis/batch/v1/namespaces/ml/jobs/kitchen-j12-a3",
            {"propagationPolicy": "Background", "gracePeriodSeconds": 30},
        )
    ]
    assert ex.poll({"j12": handle})["j12"].status == Status.LOST  # deleted: gone
    api.shutdown()

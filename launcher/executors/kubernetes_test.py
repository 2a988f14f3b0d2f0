"""The Kubernetes executor. Manifests are validated offline (kubernetes-validate, strict).
No Kubernetes API server can run here, so the REST calls go to a small fake API server that
answers like one for the endpoints used, and records what it was sent."""

import http.server
import json
import threading
import time

import kubernetes_validate
import pytest
import yaml

from launcher.executors import kubernetes as k8s
from launcher.executors.base import Launch, Status, attempt_dir
from protos import job_pb2, launcher_pb2

TORCHRUN = ["python3", "-m", "torch.distributed.run"]


def pool(kubeconfig=""):
    p = launcher_pb2.PoolConfig(
        name="h100", executor=launcher_pb2.KUBERNETES, nodes=4, gpus_per_node=8
    )
    p.kubernetes.namespace = "ml"
    p.kubernetes.image = "registry.local/kitchen/trainer:1"
    p.kubernetes.state_volume_claim = "kitchen-state"
    p.kubernetes.kubeconfig = kubeconfig
    return p


def launch(tmp_path, nodes=1, processes=1, gpus=0):
    job = job_pb2.Job(id="j12", attempts=3, run_dir="/state/runs/j12")
    r = job.spec.resources
    r.nodes, r.processes_per_node, r.gpus_per_node = nodes, processes, gpus
    handle = {"attempt_dir": attempt_dir(str(tmp_path), 3), "launched_at": time.time()}
    argv = ["/app/trainer/train", "--spec", "/state/runs/j12/job.json", "--job-id", "j12"]
    env = {"KITCHEN_LAUNCHER_TOKEN": "t", "KITCHEN_STATE_DIR": "/state"}
    return Launch(job, argv, env, handle)


def test_single_node_job_manifest(tmp_path):
    [job] = k8s.render(launch(tmp_path, processes=2, gpus=4), pool(), 60, TORCHRUN)
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
    assert "--nproc-per-node=2" in c["command"] and c["command"][-5:][0] == "/app/trainer/train"
    assert c["resources"]["limits"] == {"nvidia.com/gpu": 4}
    assert c["volumeMounts"] == [{"name": "state", "mountPath": "/state"}]
    assert {"name": "KITCHEN_STATE_DIR", "value": "/state"} in c["env"]
    assert pod["terminationGracePeriodSeconds"] == 60 and pod["restartPolicy"] == "Never"


def test_multi_node_is_an_indexed_job_with_a_headless_service(tmp_path):
    job, service = k8s.render(launch(tmp_path, nodes=2, processes=8), pool(), 60, TORCHRUN)
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
    [job] = k8s.render(launch(tmp_path), pool(), 60, TORCHRUN)
    job["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = 7
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, k8s.K8S_VERSION, strict=True)


def test_without_kubeconfig_the_pool_only_renders(tmp_path):
    ex = k8s.KubernetesExecutor(pool(), TORCHRUN)
    one = launch(tmp_path)
    with pytest.raises(k8s.KubernetesError, match="no kubeconfig; manifest: .*manifest.yaml"):
        ex.start(one)
    written = list(yaml.safe_load_all(open(f"{one.attempt_dir}/manifest.yaml")))
    assert written[0]["metadata"]["name"] == "kitchen-j12-a3"


class FakeApiServer(http.server.ThreadingHTTPServer):
    """Answers the Job, Service and Pod endpoints the executor uses, from in-memory state."""

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.objects, self.requests, self.pods = {}, [], {}
        threading.Thread(target=self.serve_forever, daemon=True).start()


class _Handler(http.server.BaseHTTPRequestHandler):
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
    ex = k8s.KubernetesExecutor(pool(str(kubeconfig)), TORCHRUN, grace_seconds=30)
    one = launch(tmp_path, nodes=2)
    handle, status = ex.start(one)
    assert status == Status.PENDING and handle["name"] == "kitchen-j12-a3"
    posted = [(m, p) for m, p, _, _ in api.requests if m == "POST"]
    assert posted == [
        ("POST", "/api/v1/namespaces/ml/services"),
        ("POST", "/apis/batch/v1/namespaces/ml/jobs"),
    ]
    assert all(auth == "Bearer sekret" for _, _, auth, _ in api.requests)
    ex.start(one)  # a retried start after a launcher crash: 409 Conflict is fine

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
    assert deletes[0] == (
        "/apis/batch/v1/namespaces/ml/jobs/kitchen-j12-a3",
        {"propagationPolicy": "Background", "gracePeriodSeconds": 30},
    )
    assert deletes[1][0] == "/api/v1/namespaces/ml/services/kitchen-j12-a3"
    assert ex.poll({"j12": handle})["j12"].status == Status.LOST  # deleted: gone
    api.shutdown()

"""deploy/: the compose files are valid (compose-go, offline) and say what a deployment needs (a
GPU reservation for the GPU worker, a gRPC health check with a start period, the HTTP/WebRTC port);
every path they and the Dockerfiles name exists; the build context leaves out what no image needs;
the CUDA image carries no second cuDNN; the healthcheck's command works against a real server."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"


def _compose() -> str:
    exe = shutil.which("docker-compose", path=str(Path(sys.executable).parent)) or shutil.which("docker-compose")
    assert exe, "compose-go (dev extra) provides docker-compose"
    return exe


def _config(*files: str) -> dict:
    """The resolved compose model (compose-go, offline) of deploy/ files layered in order."""
    args = [a for f in files for a in ("-f", str(DEPLOY / f))]
    r = subprocess.run([_compose(), *args, "config", "--format", "json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_compose_config_is_valid():
    r = subprocess.run([_compose(), "-f", str(DEPLOY / "docker-compose.yml"), "config", "-q"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_compose_services_and_dockerfiles_exist():
    r = subprocess.run([_compose(), "-f", str(DEPLOY / "docker-compose.yml"), "config", "--format", "json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    services = json.loads(r.stdout)["services"]
    assert {"cloud", "edge", "prometheus"} <= set(services)
    for name in ("cloud", "edge"):
        build = services[name]["build"]
        assert (Path(build["context"]) / build["dockerfile"]).is_file()
    assert services["edge"]["depends_on"]["cloud"]["condition"] == "service_healthy"


def test_dockerfiles_copy_existing_paths():
    for dockerfile in DEPLOY.glob("Dockerfile.*"):
        for line in dockerfile.read_text().splitlines():
            m = re.match(r"COPY\s+(.+)\s+\S+$", line.strip())
            if m:
                for src in m.group(1).split():
                    assert (ROOT / src).exists(), f"{dockerfile.name}: COPY {src} does not exist"


def test_prometheus_scrapes_the_metrics_port():
    cfg = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    targets = cfg["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == ["cloud:9090"]


def test_gpu_worker_reserves_an_nvidia_gpu_and_the_cpu_stack_does_not():
    gpu = _config("docker-compose.yml", "docker-compose.gpu.yml")["services"]["cloud"]
    assert gpu["build"]["dockerfile"] == "deploy/Dockerfile.cloud-cuda"
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert gpu["command"][gpu["command"].index("--device") + 1] == "cuda"
    cpu = _config("docker-compose.yml")["services"]["cloud"]
    assert cpu["build"]["dockerfile"] == "deploy/Dockerfile.cloud-cpu"
    assert "devices" not in (cpu.get("deploy") or {}).get("resources", {}).get("reservations", {})


def test_cloud_healthcheck_is_the_grpc_health_check_with_a_start_period_and_the_http_port_is_open():
    for files in (["docker-compose.yml"], ["docker-compose.yml", "docker-compose.gpu.yml"]):
        services = _config(*files)["services"]
        cloud = services["cloud"]
        check = cloud["healthcheck"]
        assert check["test"][:3] == ["CMD", "harken", "health"], check  # grpc.health.v1, not a TCP connect
        assert check["start_period"] == "10m0s" and check["retries"] >= 1
        http_port = cloud["command"][cloud["command"].index("--http-port") + 1]
        assert {(p["target"], p["published"]) for p in cloud["ports"]} >= {
            (50051, "50051"), (9090, "9090"), (int(http_port), http_port)}
        assert services["edge"]["depends_on"]["cloud"]["condition"] == "service_healthy"
    for name in ("Dockerfile.cloud-cpu", "Dockerfile.cloud-cuda"):
        text = (DEPLOY / name).read_text()
        assert re.search(r"^EXPOSE .*\b8080\b", text, re.M), name
        assert re.search(r"^HEALTHCHECK .*--start-period=\S+ CMD \[\"harken\", \"health\"", text, re.M), name


def test_cuda_image_does_not_carry_cudnn_twice():
    """torch's wheels bring cuDNN (nvidia-cudnn-cu*) and the other CUDA libraries: the base image
    is the -base flavour, without cuDNN or the CUDA math libraries."""
    base = re.search(r"^FROM\s+(\S+)", (DEPLOY / "Dockerfile.cloud-cuda").read_text(), re.M).group(1)
    assert base.startswith("nvidia/cuda:") and "-base-" in base and "cudnn" not in base, base


def _dockerignore_excludes(patterns: list[str], path: str) -> bool:
    """Docker's rule (moby/patternmatcher): the last matching pattern wins, `!` re-includes, a
    pattern matching a directory excludes everything under it; `*` and `?` stay within one path
    element, `**` spans any number of them."""
    def regex(pattern: str) -> re.Pattern:
        out, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                out, i = out + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                out, i = out + ".*", i + 2
            elif pattern[i] == "*":
                out, i = out + "[^/]*", i + 1
            elif pattern[i] == "?":
                out, i = out + "[^/]", i + 1
            elif pattern[i] == "[":
                j = pattern.index("]", i)
                out, i = out + pattern[i:j + 1], j + 1
            else:
                out, i = out + re.escape(pattern[i]), i + 1
        return re.compile(out + "$")

    parts = path.split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    excluded = False
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw.lstrip("!").strip("/")
        if any(regex(pattern).match(p) for p in prefixes):
            excluded = not negate
    return excluded


def test_dockerignore_keeps_the_venv_and_caches_out_and_every_copied_file_in():
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    for path in (".venv/lib/python3.11/site-packages/torch/__init__.py", ".git/HEAD", ".git/objects/ab/cdef",
                 "cloud/__pycache__/server.cpython-311.pyc", "cloud/model/__pycache__/asr.cpython-311.pyc",
                 "edge/stray.pyc", ".pytest_cache/v/cache/nodeids", ".hypothesis/examples/x", ".mypy_cache/3.11/x",
                 "build/lib/harken/cli.py", "harken.egg-info/PKG-INFO", "out/run/log.jsonl", "tests/test_deploy.py"):
        assert _dockerignore_excludes(patterns, path), f"{path} would go into the build context"
    copied = set()
    for dockerfile in DEPLOY.glob("Dockerfile.*"):
        for line in dockerfile.read_text().splitlines():
            m = re.match(r"COPY\s+(.+)\s+\S+$", line.strip())
            if m:
                copied.update(m.group(1).split())
    tracked = subprocess.run(["git", "ls-files", "--", *sorted(copied)], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    assert len(tracked) > 50 and "cloud/web/index.html" in tracked and "edge/models/silero_vad.onnx" in tracked
    left_out = [path for path in tracked if _dockerignore_excludes(patterns, path)]
    assert not left_out, f"the images COPY these, but .dockerignore leaves them out: {left_out}"


def test_the_healthcheck_command_asks_a_real_server(asr):
    """`harken health` (the compose and Dockerfile healthcheck): exit 0 and SERVING from a live
    server, 1 and one line on stderr when nothing listens, 1 when the server says NOT_SERVING."""
    import asyncio
    import os
    import socket

    from grpc_health.v1 import health_pb2

    from harken.cloud.server import ServerOptions, start_server

    async def health(*args: str) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "harken", "health", *args, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, cwd=ROOT, env={k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"})
        out, err = await proc.communicate()
        return proc.returncode, out.decode(), err.decode()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"

    async def main():
        server = await start_server(asr, ServerOptions(host="127.0.0.1", port=0))
        try:
            serving = await health(f"127.0.0.1:{server.port}")
            await server._health.set("harken.v1.Transcription", health_pb2.HealthCheckResponse.NOT_SERVING)
            not_serving = await health(f"127.0.0.1:{server.port}")
        finally:
            await server.stop(0)
        return serving, not_serving, await health(dead, "--timeout", "2")

    serving, not_serving, unreachable = asyncio.run(main())
    assert serving[0] == 0 and serving[1].strip().endswith("SERVING"), serving
    assert not_serving[0] == 1 and not_serving[1].strip().endswith("NOT_SERVING"), not_serving
    rc, out, err = unreachable
    assert rc == 1 and out == "" and err.count("\n") == 1 and err.startswith("harken health: "), unreachable


# ---- harken on Ray Serve: deploy/ray-serve.yaml and the KubeRay RayService (issue 15) ----------

def _rayservice() -> list[dict]:
    return list(yaml.safe_load_all((DEPLOY / "kuberay-rayservice.yaml").read_text()))


def test_ray_serve_config_is_a_valid_serve_config_and_the_rayservice_embeds_it():
    """Ray's own schema (offline) accepts the Serve config; the RayService runs the same one."""
    pytest = __import__("pytest")
    schema = pytest.importorskip("ray.serve.schema")
    config = yaml.safe_load((DEPLOY / "ray-serve.yaml").read_text())
    schema.ServeDeploySchema.model_validate(config)
    service = next(d for d in _rayservice() if d["kind"] == "RayService")
    assert yaml.safe_load(service["spec"]["serveConfigV2"]) == config
    from harken.cloud.ray_app import SERVICER_FUNCTIONS

    assert config["grpc_options"]["grpc_servicer_functions"] == SERVICER_FUNCTIONS


def test_ray_serve_config_builds_the_application_it_describes():
    """The config's args through `app_builder` (no cluster needed to build): sticky routing, one
    request per session slot, autoscaling on harken's policy between the bounds given."""
    pytest = __import__("pytest")
    pytest.importorskip("ray.serve")
    from harken.cloud.ray_app import ROUTER, app_builder, autoscaling_policy

    app = yaml.safe_load((DEPLOY / "ray-serve.yaml").read_text())["applications"][0]
    assert app["import_path"] == "harken.cloud.ray_app:app_builder"
    d = app_builder(app["args"])._bound_deployment
    config = d._deployment_config
    assert config.max_ongoing_requests == int(app["args"]["max_sessions"])
    assert config.request_router_config.request_router_class == ROUTER
    lo, hi = map(int, app["args"]["autoscale"].split(":"))
    assert (config.autoscaling_config.min_replicas, config.autoscaling_config.max_replicas) == (lo, hi)
    policy = config.autoscaling_config.policy.policy_function
    assert policy in (autoscaling_policy, "harken.cloud.ray_app.autoscaling_policy"), policy
    assert d.ray_actor_options["num_gpus"] == 1


def test_rayservice_pods_and_service_are_valid_kubernetes():
    """kubernetes-validate has no schema for KubeRay's CRD: the Service is checked as it is, and
    the head and worker pod templates as the Pods KubeRay makes of them (strict: no unknown
    fields); the GPU workers ask for an NVIDIA GPU, autoscale, and expose the gRPC port."""
    pytest = __import__("pytest")
    kv = pytest.importorskip("kubernetes_validate")
    docs = _rayservice()
    service = next(d for d in docs if d["kind"] == "RayService")
    assert service["apiVersion"] == "ray.io/v1"
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    templates = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    for i, template in enumerate(templates):
        kv.validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"pod-{i}"}, **template},
                    "1.37.0", strict=True)
    (gpu,) = cluster["workerGroupSpecs"]
    assert gpu["minReplicas"] < gpu["maxReplicas"]
    worker = gpu["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
    grpc_port = yaml.safe_load(service["spec"]["serveConfigV2"])["grpc_options"]["port"]
    assert {"containerPort": grpc_port, "name": "grpc"} in worker["ports"]
    for d in docs:
        if d["kind"] != "RayService":
            kv.validate(d, "1.37.0", strict=True)
            assert d["spec"]["ports"][0]["targetPort"] == grpc_port

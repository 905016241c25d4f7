"""deploy/: the compose file is valid (compose-go, offline) and every path it and the Dockerfiles
name exists in the repository."""

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

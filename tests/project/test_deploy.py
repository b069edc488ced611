"""deploy/ agrees with itself and with worker/config/settings.py.

Static checks only (no systemd, Docker or cluster needed): every variable named in the
deployment files is a real setting, every setting is documented with its real default,
and the numbers that must match across files (ports, timeouts, stream and group, uid,
secret keys) do. The YAML is read with PyYAML when it is installed, otherwise with the
small block-style subset reader below, which refuses anything outside that subset.
"""

from __future__ import annotations

import importlib
import json
import re
import shlex
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import pytest

from tests.support.redis_server import free_port
from worker.cli import run as run_command
from worker.config import table
from worker.config.settings import WorkerConfig

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "systemd" / "gpufeed-worker@.service"
ENV_EXAMPLE = DEPLOY / "systemd" / "worker.env.example"
DOCKERFILE = DEPLOY / "container" / "Dockerfile"
DOCKERIGNORE = DEPLOY / "container" / "Dockerfile.dockerignore"
HEALTHCHECK = DEPLOY / "container" / "healthcheck.py"
K8S = DEPLOY / "k8s"

SETTINGS = {str(s.env): s for s in table.PUBLIC}
# Variables the unit sets per GPU instance; a shared env file must not override them.
PER_INSTANCE = {"CUDA_VISIBLE_DEVICES", "GPUFEED_WORKER_NAME", "GPUFEED_METRICS_PORT"}
# Metadata fields of KEDA's redis-streams scaler; KEDA ignores any other name silently.
KEDA_REDIS_STREAMS_FIELDS = {
    "address",
    "addressFromEnv",
    "host",
    "hostFromEnv",
    "port",
    "portFromEnv",
    "usernameFromEnv",
    "passwordFromEnv",
    "stream",
    "consumerGroup",
    "pendingEntriesCount",
    "streamLength",
    "lagCount",
    "activationLagCount",
    "enableTLS",
    "unsafeSsl",
    "databaseIndex",
}
KEDA_REDIS_AUTH_PARAMETERS = {"username", "password", "tls", "ca", "cert", "key", "keyPassword"}


# ----------------------------------------------------------------- a YAML subset reader
class _Line(NamedTuple):
    number: int
    indent: int
    text: str


_KEY = re.compile(r"^([A-Za-z0-9_./-]+):(?:[ ]+(.*))?$")
_INT = re.compile(r"^[-+]?[0-9]+$")
_FLOAT = re.compile(r"^[-+]?[0-9]*\.[0-9]+$")
_BOOLS = {
    **dict.fromkeys(("true", "True", "yes", "Yes", "on", "On"), True),
    **dict.fromkeys(("false", "False", "no", "No", "off", "Off"), False),
}


def _strip_comment(line: str) -> str:
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "\"'" and line[:i].rstrip()[-1:] in ("", ":", "-"):
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i].rstrip()
    return line.rstrip()


def _scalar(raw: str, line: _Line) -> Any:
    if raw.startswith('"'):
        if not raw.endswith('"') or len(raw) < 2:
            raise ValueError(f"line {line.number}: unterminated string")
        return json.loads(raw)
    if raw.startswith("'"):
        if not raw.endswith("'") or len(raw) < 2:
            raise ValueError(f"line {line.number}: unterminated string")
        return raw[1:-1].replace("''", "'")
    if raw[0] in "[{|>&*!%@`":
        raise ValueError(f"line {line.number}: outside the supported YAML subset: {raw!r}")
    if raw in _BOOLS:
        return _BOOLS[raw]
    if raw in ("null", "~"):
        return None
    if _INT.match(raw):
        return int(raw)
    if _FLOAT.match(raw):
        return float(raw)
    return raw


def _is_item(text: str) -> bool:
    return text == "-" or text.startswith("- ")


def _block(lines: list[_Line], i: int, indent: int) -> tuple[Any, int]:
    if _is_item(lines[i].text):
        return _sequence(lines, i, indent)
    return _mapping(lines, i, indent)


def _mapping(lines: list[_Line], i: int, indent: int) -> tuple[dict[str, Any], int]:
    out: dict[str, Any] = {}
    while i < len(lines) and lines[i].indent == indent and not _is_item(lines[i].text):
        line = lines[i]
        m = _KEY.match(line.text)
        if not m:
            raise ValueError(f"line {line.number}: expected 'key: value', got {line.text!r}")
        key, rest = m.group(1), m.group(2)
        if key in out:
            raise ValueError(f"line {line.number}: duplicate key {key!r}")
        i += 1
        if rest:
            out[key] = _scalar(rest, line)
        elif i < len(lines) and (
            lines[i].indent > indent or (lines[i].indent == indent and _is_item(lines[i].text))
        ):
            out[key], i = _block(lines, i, lines[i].indent)
        else:
            out[key] = None
    if i < len(lines) and lines[i].indent > indent:
        raise ValueError(f"line {lines[i].number}: unexpected indentation")
    return out, i


def _sequence(lines: list[_Line], i: int, indent: int) -> tuple[list[Any], int]:
    out: list[Any] = []
    while i < len(lines) and lines[i].indent == indent and _is_item(lines[i].text):
        line = lines[i]
        rest = line.text[1:].lstrip()
        if not rest:
            i += 1
            if i >= len(lines) or lines[i].indent <= indent:
                raise ValueError(f"line {line.number}: empty sequence item")
            value, i = _block(lines, i, lines[i].indent)
        elif _KEY.match(rest):
            # "- key: value" opens a mapping whose keys line up with "key".
            sub = indent + len(line.text) - len(rest)
            lines[i] = _Line(line.number, sub, rest)
            value, i = _mapping(lines, i, sub)
        else:
            value, i = _scalar(rest, line), i + 1
        out.append(value)
    return out, i


def _subset_load_all(text: str) -> list[Any]:
    docs: list[list[_Line]] = [[]]
    for number, raw in enumerate(text.splitlines(), 1):
        if raw.rstrip() == "---":
            docs.append([])
            continue
        body = raw.lstrip(" ")
        if body.startswith("\t"):
            raise ValueError(f"line {number}: tab in indentation")
        stripped = _strip_comment(body)
        if stripped:
            docs[-1].append(_Line(number, len(raw) - len(body), stripped))
    out = []
    for lines in docs:
        if not lines:
            continue
        value, end = _block(lines, 0, lines[0].indent)
        if end != len(lines):
            raise ValueError(f"line {lines[end].number}: unexpected content")
        out.append(value)
    return out


def _pyyaml() -> ModuleType | None:
    try:
        return importlib.import_module("yaml")
    except ImportError:
        return None


def load_all(path: Path) -> list[Any]:
    yaml = _pyyaml()
    if yaml is not None:
        return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return _subset_load_all(path.read_text())


# ------------------------------------------------------------------------ file readers
class EnvExample(NamedTuple):
    defaults: dict[str, str]  # "#VAR=value" lines: the documented default
    active: dict[str, str]  # "VAR=value" lines: what the example sets
    sections: dict[str, str]  # each variable's "# --- <section> ---" heading

    def effective(self, var: str) -> str:
        return self.active.get(var, self.defaults.get(var, ""))


def read_env_example() -> EnvExample:
    defaults: dict[str, str] = {}
    active: dict[str, str] = {}
    sections: dict[str, str] = {}
    section = ""
    for number, line in enumerate(ENV_EXAMPLE.read_text().splitlines(), 1):
        if heading := re.match(r"^# --- (.+?) -+$", line):
            section = heading.group(1)
        m = re.match(r"^(#?)([A-Z][A-Z0-9_]*)=(.*)$", line)
        if m:
            target = defaults if m.group(1) else active
            assert m.group(2) not in target, f"line {number}: {m.group(2)} given twice"
            target[m.group(2)] = m.group(3)
            sections[m.group(2)] = section
    return EnvExample(defaults, active, sections)


def read_unit() -> dict[str, dict[str, list[str]]]:
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in UNIT.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        assert current is not None, f"{line!r} outside any section"
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def seconds(value: str) -> float:
    units = {"": 1, "s": 1, "sec": 1, "ms": 0.001, "m": 60, "min": 60, "h": 3600}
    parts = re.findall(r"([0-9.]+)\s*([a-z]*)", value)
    assert parts, f"not a duration: {value!r}"
    return sum(float(n) * units[u] for n, u in parts)


def read_dockerfile() -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for raw in joined.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            instruction, _, rest = line.partition(" ")
            out.append((instruction.upper(), rest.strip()))
    return out


def dockerfile_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for instruction, rest in read_dockerfile():
        if instruction == "ENV":
            for token in shlex.split(rest):
                key, _, value = token.partition("=")
                env[key] = value
    return env


def dockerfile_one(instruction: str) -> str:
    found = [rest for ins, rest in read_dockerfile() if ins == instruction]
    assert len(found) >= 1, f"no {instruction} in the Dockerfile"
    return found[-1]  # the runtime stage's


def k8s_docs() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs.extend(load_all(path))
    return docs


def k8s(kind: str) -> dict[str, Any]:
    found = [d for d in k8s_docs() if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def worker_container() -> dict[str, Any]:
    containers: list[dict[str, Any]] = k8s("Deployment")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def configmap_value(var: str) -> str:
    data = k8s("ConfigMap")["data"]
    return str(data[var]) if var in data else str(SETTINGS[var].default)


def secret_data() -> dict[str, str]:
    data: dict[str, str] = k8s("Secret")["stringData"]
    return data


# --------------------------------------------------------- variable names and defaults
def test_every_variable_named_in_deploy_is_a_real_setting() -> None:
    named: dict[str, set[str]] = {}
    for path in DEPLOY.rglob("*"):
        if path.is_file() and "__pycache__" not in path.parts:
            for var in re.findall(r"\b((?:GPUFEED|REDIS)_[A-Z0-9_]*[A-Z0-9])\b", path.read_text()):
                named.setdefault(var, set()).add(str(path.relative_to(ROOT)))
    unknown = {var: sorted(paths) for var, paths in named.items() if var not in SETTINGS}
    assert unknown == {}


def test_every_setting_is_documented_in_the_env_example_with_its_real_default() -> None:
    example = read_env_example()
    assert sorted(set(SETTINGS) - set(example.defaults)) == []
    for var, raw in example.defaults.items():
        assert var in SETTINGS, var
        entry = SETTINGS[var]
        loaded = getattr(WorkerConfig.load(env={var: raw}), entry.name)
        if var == "GPUFEED_WORKER_NAME":
            assert raw == ""  # the default is computed (<host>-<pid>)
        else:
            assert loaded == entry.default, f"{var}: example says {raw!r}, is {entry.default!r}"
        # In the section the configuration page shows it in (worker/config/table.py).
        assert example.sections[var] == entry.group, var


def test_env_example_settings_are_valid_and_leave_per_instance_ones_to_the_unit() -> None:
    example = read_env_example()
    assert set(example.active) <= set(SETTINGS)
    assert sorted(PER_INSTANCE & set(example.active)) == []
    WorkerConfig.load(env=example.active)  # raises ConfigError on a bad value


def test_k8s_env_names_are_real_settings_and_configmap_values_are_strings() -> None:
    data = k8s("ConfigMap")["data"]
    assert set(data) <= set(SETTINGS)
    assert {k: v for k, v in data.items() if not isinstance(v, str)} == {}
    WorkerConfig.load(env={**data, "REDIS_URL": secret_data()["REDIS_URL"]})
    env_names = {e["name"] for e in worker_container()["env"]}
    assert env_names <= set(SETTINGS)


# ----------------------------------------------------------------------------- systemd
def test_systemd_unit() -> None:
    unit = read_unit()
    service = unit["Service"]
    env = dict(e.split("=", 1) for e in service["Environment"])
    assert env["CUDA_VISIBLE_DEVICES"] == "%i"
    assert env["GPUFEED_WORKER_NAME"] == "%H-gpu%i"
    assert "/etc/gpufeed/worker.env" in service["EnvironmentFile"]
    assert service["KillSignal"] == ["SIGTERM"]
    assert service["Restart"] == ["on-failure"]
    assert service["ProtectSystem"] == ["strict"]
    assert service["NoNewPrivileges"] == ["yes"]
    assert service["PrivateTmp"] == ["yes"]
    # /dev/nvidia* must stay reachable: no private /dev, no device allow-list.
    for hides_gpus in ("PrivateDevices", "DevicePolicy", "DeviceAllow", "ProtectClock"):
        assert hides_gpus not in service, hides_gpus
    # Every cache the worker writes is inside a writable path.
    writable = " ".join(service["ReadWritePaths"]).split()
    for var in ("TORCH_HOME", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "HOME"):
        assert any(env[var] == w or env[var].startswith(w + "/") for w in writable), var
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]


def test_systemd_stop_timeout_exceeds_the_shutdown_grace() -> None:
    grace = float(read_env_example().effective("GPUFEED_SHUTDOWN_GRACE_S"))
    timeout = seconds(read_unit()["Service"]["TimeoutStopSec"][0])
    assert timeout > grace + 5


def test_systemd_exec_start_runs_the_worker_with_real_flags() -> None:
    (exec_start,) = read_unit()["Service"]["ExecStart"]
    argv = exec_start.split()
    assert argv[:3] == ["/opt/gpufeed/.venv/bin/python", "-m", "worker"]
    known = {opt for param in run_command.params for opt in param.opts}
    flags = [a.split("=", 1)[0] for a in argv[3:] if a.startswith("--")]
    assert set(flags) <= known


# --------------------------------------------------------------------------- container
def test_dockerfile() -> None:
    assert json.loads(dockerfile_one("ENTRYPOINT")) == ["python", "-m", "worker"]
    assert dockerfile_one("STOPSIGNAL") == "SIGTERM"
    user = dockerfile_one("USER").split(":")[0]
    assert user not in ("root", "0")
    assert "healthcheck.py" in dockerfile_one("HEALTHCHECK")
    env = dockerfile_env()
    assert dockerfile_one("EXPOSE") == env["GPUFEED_METRICS_PORT"] == "9400"
    # A published port reaches the container's own interface, not its loopback.
    assert env["GPUFEED_METRICS_HOST"] == "0.0.0.0"
    (volume,) = json.loads(dockerfile_one("VOLUME"))
    for var in ("TORCH_HOME", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        assert env[var].startswith(volume + "/"), var
    assert "NVIDIA_VISIBLE_DEVICES" not in env  # left to --gpus and the device plugin


def test_dockerfile_copies_only_what_exists_and_the_context_lets_through() -> None:
    allowed = {
        line[1:].strip().rstrip("/")
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.startswith("!")
    }
    for instruction, rest in read_dockerfile():
        if instruction != "COPY" or "--from=" in rest:
            continue
        sources = [t for t in rest.split()[:-1] if not t.startswith("--")]
        for source in sources:
            clean = source.removeprefix("./").rstrip("/")
            assert (ROOT / clean).exists(), source
            assert clean in allowed, f"{source} is excluded from the build context"


@pytest.fixture
def live_server() -> Iterator[tuple[int, list[int]]]:
    status = [200]

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status[0] if self.path == "/live" else 404)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1], status
    server.shutdown()
    server.server_close()
    thread.join()


def _healthcheck() -> ModuleType:
    # Executed from its source, so that no __pycache__ lands in deploy/.
    module = ModuleType("gpufeed_healthcheck")
    module.__file__ = str(HEALTHCHECK)
    exec(compile(HEALTHCHECK.read_text(), str(HEALTHCHECK), "exec"), module.__dict__)
    return module


def test_container_healthcheck(live_server: tuple[int, list[int]]) -> None:
    check = _healthcheck().check
    port, status = live_server
    assert check({"GPUFEED_METRICS_PORT": str(port)})[0] is True
    status[0] = 503
    assert check({"GPUFEED_METRICS_PORT": str(port)})[0] is False
    assert check({"GPUFEED_METRICS_PORT": str(free_port())})[0] is False
    assert check({"GPUFEED_METRICS_PORT": "nine"})[0] is False
    assert check({"GPUFEED_METRICS_PORT": "0"})[0] is True  # endpoints off
    assert check({})[0] is True


# -------------------------------------------------------------------------- kubernetes
def test_k8s_manifests_parse_and_name_no_namespace() -> None:
    docs = k8s_docs()
    assert {d["kind"] for d in docs} >= {
        "ConfigMap",
        "Secret",
        "Deployment",
        "PodDisruptionBudget",
        "ScaledObject",
        "TriggerAuthentication",
    }
    for d in docs:
        assert d["apiVersion"] and d["metadata"]["name"]
        assert "namespace" not in d["metadata"], d["metadata"]["name"]


def test_subset_reader_agrees_with_pyyaml() -> None:
    yaml = _pyyaml()
    if yaml is None:
        pytest.skip("PyYAML is not installed")
    for path in sorted(K8S.glob("*.yaml")):
        expected = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert _subset_load_all(path.read_text()) == expected, path.name


def test_subset_reader_reads_block_yaml_and_refuses_the_rest() -> None:
    text = 'a:\n  b: "1"\n  c: 2\n  d:\n    - x: y  # note\n      z: true\n    - w\n---\ne: f\n'
    assert _subset_load_all(text) == [
        {"a": {"b": "1", "c": 2, "d": [{"x": "y", "z": True}, "w"]}},
        {"e": "f"},
    ]
    for bad in ("a: [1, 2]\n", "a:\n  b: 1\n   c: 2\n", "a: 1\na: 2\n", 'a: "x\n'):
        with pytest.raises(ValueError):
            _subset_load_all(bad)


def test_deployment_probes_ports_and_annotations_agree() -> None:
    port = int(configmap_value("GPUFEED_METRICS_PORT"))
    assert port != 0
    # The kubelet probes the pod's IP: a loopback listener would fail every probe.
    assert configmap_value("GPUFEED_METRICS_HOST") == "0.0.0.0"
    container = worker_container()
    ports = {p.get("name", str(p["containerPort"])): p["containerPort"] for p in container["ports"]}
    assert list(ports.values()) == [port]

    def probe(name: str) -> tuple[str, int]:
        get = container[name]["httpGet"]
        target = get["port"]
        return get["path"], ports[target] if isinstance(target, str) else target

    assert probe("startupProbe") == ("/ready", port)
    assert probe("readinessProbe") == ("/ready", port)
    assert probe("livenessProbe") == ("/live", port)
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # torch.compile
    annotations = k8s("Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(port)


def test_deployment_gpu_identity_shutdown_and_wiring() -> None:
    deployment = k8s("Deployment")
    pod = deployment["spec"]["template"]
    container = worker_container()
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    env = {e["name"]: e for e in container["env"]}
    name_ref = env["GPUFEED_WORKER_NAME"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert name_ref == "metadata.name"
    grace = float(configmap_value("GPUFEED_SHUTDOWN_GRACE_S"))
    assert pod["spec"]["terminationGracePeriodSeconds"] > grace + 5
    # Selector, ConfigMap and Secret references resolve.
    labels = pod["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert [r["configMapRef"]["name"] for r in container["envFrom"]] == [
        k8s("ConfigMap")["metadata"]["name"]
    ]
    ref = env["REDIS_URL"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == k8s("Secret")["metadata"]["name"]
    assert ref["key"] in secret_data()
    # The pod runs as the image's user, and the cache volume sits where the image expects.
    uid, gid = (int(x) for x in dockerfile_one("USER").split(":"))
    security = pod["spec"]["securityContext"]
    assert (security["runAsUser"], security["runAsGroup"], security["fsGroup"]) == (uid, gid, gid)
    (volume,) = json.loads(dockerfile_one("VOLUME"))
    assert volume in {m["mountPath"] for m in container["volumeMounts"]}


def test_pdb_selects_the_workers() -> None:
    pdb = k8s("PodDisruptionBudget")
    deployment = k8s("Deployment")
    assert pdb["spec"]["selector"] == deployment["spec"]["selector"]
    assert "minAvailable" not in pdb["spec"]  # would block node drains at one replica


def test_keda_scales_the_deployment_on_the_configured_stream_and_group() -> None:
    scaled = k8s("ScaledObject")
    spec = scaled["spec"]
    assert spec["scaleTargetRef"]["name"] == k8s("Deployment")["metadata"]["name"]
    assert 0 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    assert spec["cooldownPeriod"] > 0
    triggers = spec["triggers"]
    assert triggers
    assert any("lagCount" in t["metadata"] for t in triggers)
    for trigger in triggers:
        meta = trigger["metadata"]
        assert trigger["type"] == "redis-streams"
        assert set(meta) <= KEDA_REDIS_STREAMS_FIELDS, sorted(set(meta) - KEDA_REDIS_STREAMS_FIELDS)
        assert all(isinstance(v, str) for v in meta.values()), meta
        assert meta["stream"] == configmap_value("GPUFEED_STREAM")
        if "streamLength" in meta:
            # KEDA scales on XLEN only for a trigger without a consumer group.
            assert "consumerGroup" not in meta
        else:
            assert meta["consumerGroup"] == configmap_value("GPUFEED_GROUP")
        if "lagCount" in meta:
            assert "activationLagCount" in meta


def test_keda_wakes_from_zero_when_the_lag_is_unknown() -> None:
    # Redis reports the lag as nil after deletions and KEDA reads that as 0: scaling to
    # zero needs a trigger that does not depend on the lag.
    spec = k8s("ScaledObject")["spec"]
    if spec["minReplicaCount"] > 0:
        return
    lengths = [t["metadata"] for t in spec["triggers"] if "streamLength" in t["metadata"]]
    assert len(lengths) == 1
    # One replica from this trigger alone, far past the backlog at which the lag trigger
    # already asks for every replica: the lag trigger does the sizing.
    (lag_count,) = [
        int(t["metadata"]["lagCount"]) for t in spec["triggers"] if "lagCount" in t["metadata"]
    ]
    assert int(lengths[0]["streamLength"]) >= 10 * lag_count * spec["maxReplicaCount"]


def test_keda_reaches_the_same_redis_as_the_workers() -> None:
    url = urlsplit(secret_data()["REDIS_URL"])
    auth = k8s("TriggerAuthentication")
    refs = auth["spec"]["secretTargetRef"]
    assert {r["parameter"] for r in refs} <= KEDA_REDIS_AUTH_PARAMETERS
    for ref in refs:
        assert ref["name"] == k8s("Secret")["metadata"]["name"]
        assert ref["key"] in secret_data(), ref["key"]
    for trigger in k8s("ScaledObject")["spec"]["triggers"]:
        meta = trigger["metadata"]
        assert meta["address"] == f"{url.hostname}:{url.port or 6379}"
        assert meta.get("enableTLS", "false") == ("true" if url.scheme == "rediss" else "false")
        assert meta.get("databaseIndex", "0") == (url.path.strip("/") or "0")
        assert trigger["authenticationRef"]["name"] == auth["metadata"]["name"]

"""deploy/k8s: every manifest passes strict schema validation against the
Kubernetes OpenAPI schemas (kubernetes-validate bundles them: no network),
every workload runs a real entry point with flags its real parser accepts and
a config its Struct accepts, every Secret, ConfigMap and claim it mounts is
produced, and the NATS chart values give JetStream R3 with TLS and the
accounts file at the path the servers include."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from deploy_helpers import DEPLOY, ROOT, check_command

from gearshift import config_check as config
from gearshift.bus import auth
from gearshift.bus.natsd import nats_server_binary

kubernetes_validate = pytest.importorskip("kubernetes_validate")

K8S = DEPLOY / "k8s"
VERSIONS = ("1.30", "1.37")  # the oldest Kubernetes still in common support, and the newest bundled
SAMPLE_ENV = {"NODE_NAME": "gpu-1", "HOST_IP": "10.0.0.17"}
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def manifests() -> list[dict]:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    docs = []
    for name in kust["resources"]:
        docs += [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    return docs


def by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in manifests() if d["kind"] == kind}


def workloads() -> dict[str, dict]:
    return {**by_kind("Deployment"), **by_kind("DaemonSet")}


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command, args and subPathExpr."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def container_env(c: dict) -> dict[str, str]:
    env = {}
    for e in c.get("env", []):
        env[e["name"]] = e["value"] if "value" in e else SAMPLE_ENV.get(e["name"], f"<{e['name']}>")
    return env


@pytest.fixture(scope="module")
def generated_secrets(tmp_path_factory) -> list[dict]:
    """make-secrets.py's output for credentials and certificates made here."""
    tmp = tmp_path_factory.mktemp("secrets")
    tls = tmp / "tls"
    r = subprocess.run(["bash", str(DEPLOY / "make-certs.sh"), "-o", str(tls),
                        "--names", "nats,nats.gearshift.svc,*.nats-headless.gearshift.svc.cluster.local"],
                       capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        pytest.skip(f"make-certs.sh: {r.stderr}")
    authdir = tmp / "auth"
    auth.write_auth_dir(authdir, ["gpu-1", "gpu-2"], ["nlp"])
    # the credentials tool's <role>.creds files (their format is its business)
    for role in ("admission", "optimizer", "perfmodel", "profiler", "dashboard", "agent-gpu-1", "agent-gpu-2"):
        (authdir / f"{role}.creds").write_text(f"credentials of {role}\n")
    out = subprocess.run([sys.executable, str(K8S / "make-secrets.py"), "--auth", str(authdir), "--tls", str(tls)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_kustomization_lists_every_manifest():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kust["namespace"] == "gearshift"
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml", "nats-values.yaml"}
    assert set(kust["resources"]) == files


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_passes_schema_validation(version, generated_secrets, monkeypatch):
    import socket

    def offline(*_a, **_k):
        raise AssertionError("schema validation tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", offline)  # CI has no network beyond package registries
    docs = manifests() + generated_secrets
    assert {d["kind"] for d in docs} >= {"Namespace", "ServiceAccount", "ConfigMap", "PersistentVolumeClaim",
                                         "Deployment", "DaemonSet", "PodDisruptionBudget", "Secret", "Service"}
    for doc in docs:
        # strict: an unknown field (a typo) is an error, as kubectl's server-side validation makes it
        kubernetes_validate.validate(doc, version, strict=True)
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "gearshift", doc["metadata"]["name"]


def test_schema_validation_catches_mistakes():
    (dep,) = [d for d in manifests() if d["metadata"]["name"] == "gearshift-optimizer" and d["kind"] == "Deployment"]
    bad = json.loads(json.dumps(dep))
    bad["spec"]["replica"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSIONS[0], strict=True)
    bad = json.loads(json.dumps(dep))
    bad["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "metrics"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSIONS[0], strict=True)


def test_workloads_run_the_real_entry_points(tmp_path):
    cm = by_kind("ConfigMap")["gearshift-config"]["data"]
    seen = {}
    for name, w in workloads().items():
        spec = w["spec"]["template"]["spec"]
        (c,) = spec["containers"]
        assert c["image"] == f"gearshift:{VERSION}", (name, c["image"])
        env = container_env(c)
        argv = [expand(a, env) for a in c["command"] + c.get("args", [])]
        module, opts, cfg_path = check_command(argv)
        seen[module] = name
        service = config.CONFIGS[module].service
        # its config file is in the ConfigMap and valid for its Struct
        mount = {m["name"]: m for m in c["volumeMounts"]}["config"]
        assert cfg_path == f"{mount['mountPath']}/{service}.yaml"
        (tmp_path / f"{service}.yaml").write_text(cm[f"{service}.yaml"])
        cfg = config.check_file(tmp_path / f"{service}.yaml", module)
        assert cfg.server == "tls://nats.gearshift.svc:4222"  # the chart's client Service (release "nats")
        # metrics: one port, the same in env, the container, the probes and the scrape annotation
        port = int(env["GEARSHIFT_METRICS_PORT"])
        assert env["GEARSHIFT_METRICS_HOST"] == "0.0.0.0"
        assert {p["name"]: p["containerPort"] for p in c["ports"]}["metrics"] == port
        ann = w["spec"]["template"]["metadata"]["annotations"]
        assert (ann["prometheus.io/scrape"], ann["prometheus.io/port"], ann["prometheus.io/path"]) == \
            ("true", str(port), "/metrics")
        assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
        assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
        # the pod's labels are what the selector matches
        sel = w["spec"]["selector"]["matchLabels"]
        assert sel.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        if module == "gearshift-agent":
            assert opts["node"] == SAMPLE_ENV["NODE_NAME"] and opts["address"] == SAMPLE_ENV["HOST_IP"]
    assert set(seen) == set(config.CONFIGS), seen


def test_optimizer_pair_and_gpu_daemonset():
    opt = by_kind("Deployment")["gearshift-optimizer"]
    assert opt["spec"]["replicas"] == 2  # one leader on the KV lease, one standby
    assert opt["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    pdb = by_kind("PodDisruptionBudget")["gearshift-optimizer"]
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == opt["spec"]["selector"]["matchLabels"]
    assert by_kind("Deployment")["gearshift-admission"]["spec"]["replicas"] >= 2

    agent = by_kind("DaemonSet")["gearshift-agent"]["spec"]["template"]["spec"]
    assert agent["hostPID"] is True  # NVML's process PIDs are the host's
    assert agent["hostNetwork"] is True and agent["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert agent["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in agent["tolerations"]
    assert agent["runtimeClassName"] == "nvidia"
    env = container_env(agent["containers"][0])
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and "utility" in env["NVIDIA_DRIVER_CAPABILITIES"]
    grace = yaml.safe_load(by_kind("ConfigMap")["gearshift-config"]["data"]["agent.yaml"])["grace"]
    assert agent["terminationGracePeriodSeconds"] > grace  # SIGTERM -> checkpoint -> exit fits


def test_dashboard_service_reaches_the_page_and_metrics():
    """The Service selects the dashboard's pods and forwards to the ports the
    page (its config file) and /metrics really listen on; the pod's identity
    is the read-only dashboard role, never admin."""
    dep = by_kind("Deployment")["gearshift-dashboard"]
    (svc,) = [d for d in manifests() if d["kind"] == "Service" and d["metadata"]["name"] == "gearshift-dashboard"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    env = container_env(c)
    page = yaml.safe_load(by_kind("ConfigMap")["gearshift-config"]["data"]["dashboard.yaml"])
    assert page["host"] == "0.0.0.0" and page["require_login"] is True
    named = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert named == {"http": page["port"], "metrics": int(env["GEARSHIFT_METRICS_PORT"])} == \
        {"http": 8080, "metrics": 9106}
    assert {p["name"]: (p["port"], named[p["targetPort"]]) for p in svc["spec"]["ports"]} == \
        {"http": (8080, 8080), "metrics": (9106, 9106)}
    assert env["GEARSHIFT_CREDS"].endswith("/dashboard.creds")
    (creds,) = [v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "creds"]
    assert creds["secret"]["secretName"] == "gearshift-creds-dashboard"


def test_every_mounted_object_exists_and_each_role_gets_only_its_identity(generated_secrets):
    secrets = {s["metadata"]["name"]: s for s in generated_secrets}
    configmaps, claims = by_kind("ConfigMap"), by_kind("PersistentVolumeClaim")
    for name, w in workloads().items():
        spec = w["spec"]["template"]["spec"]
        assert spec["serviceAccountName"] in by_kind("ServiceAccount")
        (c,) = spec["containers"]
        env = container_env(c)
        vols = {v["name"]: v for v in spec["volumes"]}
        for m in c["volumeMounts"]:
            assert m["name"] in vols, (name, m["name"])
        for v in vols.values():
            if "secret" in v:
                assert v["secret"]["secretName"] in secrets, (name, v)
            if "configMap" in v:
                assert v["configMap"]["name"] in configmaps, (name, v)
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims, (name, v)
        # GEARSHIFT_CREDS is a file of the Secret mounted for this role, and only that
        module = check_command([expand(a, env) for a in c["command"] + c.get("args", [])])[0]
        role = config.CONFIGS[module].service
        creds = env["GEARSHIFT_CREDS"]
        mounts = [m for m in c["volumeMounts"] if "secret" in vols[m["name"]]
                  and vols[m["name"]]["secret"]["secretName"].startswith("gearshift-creds-")]
        (m,) = mounts
        sec = secrets[vols[m["name"]]["secret"]["secretName"]]
        if role == "agent":
            assert m["mountPath"] == creds and "subPathExpr" in m
            key = expand(m["subPathExpr"], env)
            assert key == f"agent-{SAMPLE_ENV['NODE_NAME']}.creds" and key in sec["data"]
        else:
            assert creds == f"{m['mountPath']}/{role}.creds"
            assert list(sec["data"]) == [f"{role}.creds"]
        ca = env["GEARSHIFT_TLS_CA"]
        (ca_mount,) = [m for m in c["volumeMounts"] if ca.startswith(m["mountPath"] + "/")]
        assert vols[ca_mount["name"]]["secret"]["secretName"] == "gearshift-ca"
        assert Path(ca).name in secrets["gearshift-ca"]["data"]


def test_no_clear_passwords_in_deploy_files():
    for path in list(K8S.glob("*.yaml")) + list((DEPLOY / "systemd").glob("*")) + list((DEPLOY / "config").glob("*")):
        text = path.read_text().lower()
        assert "password" not in text, path
    for d in manifests():
        assert d["kind"] != "Secret", "Secrets are generated (make-secrets.py), never committed"


def test_nats_chart_values(generated_secrets):
    values = yaml.safe_load((K8S / "nats-values.yaml").read_text())
    cfg = values["config"]
    assert cfg["cluster"]["enabled"] is True and cfg["cluster"]["replicas"] == 3  # R3 needs three servers
    assert cfg["jetstream"]["enabled"] is True
    assert cfg["jetstream"]["fileStore"]["enabled"] is True and cfg["jetstream"]["fileStore"]["pvc"]["enabled"] is True
    assert cfg["nats"]["tls"]["enabled"] is True
    assert cfg["cluster"]["tls"]["enabled"] is True and cfg["cluster"]["tls"]["merge"]["verify"] is True
    secrets = {s["metadata"]["name"] for s in generated_secrets}
    named = {cfg["nats"]["tls"]["secretName"], cfg["cluster"]["tls"]["secretName"], values["tlsCA"]["secretName"]}
    (vol,) = [p["value"] for p in values["podTemplate"]["patch"] if p["path"] == "/spec/volumes/-"]
    named.add(vol["secret"]["secretName"])
    assert named <= secrets, named - secrets
    ca = next(s for s in generated_secrets if s["metadata"]["name"] == values["tlsCA"]["secretName"])
    assert values["tlsCA"]["key"] in ca["data"]
    # the accounts file: the chart's nats.conf lives in /etc/nats-config and includes it
    (mount,) = [p["value"] for p in values["container"]["patch"] if p["path"] == "/volumeMounts/-"]
    assert mount["name"] == vol["name"]
    include = cfg["merge"]["$include"]
    assert os.path.normpath(os.path.join("/etc/nats-config", include)) == f"{mount['mountPath']}/nats-auth.conf"
    # the GEARSHIFT_REPLICAS the services run with matches the servers
    for w in workloads().values():
        env = container_env(w["spec"]["template"]["spec"]["containers"][0])
        if "GEARSHIFT_REPLICAS" in env:
            assert int(env["GEARSHIFT_REPLICAS"]) == cfg["cluster"]["replicas"]


def test_the_include_layout_loads_in_a_real_server(tmp_path):
    """The accounts file services.auth writes, included the way the chart's
    nats.conf includes it (relative to /etc/nats-config), passes nats-server -t."""
    values = yaml.safe_load((K8S / "nats-values.yaml").read_text())
    etc = tmp_path / "etc"
    (etc / "nats-config").mkdir(parents=True)
    (mount,) = [p["value"] for p in values["container"]["patch"] if p["path"] == "/volumeMounts/-"]
    authdir = etc / Path(mount["mountPath"]).relative_to("/etc")
    auth.write_auth_dir(authdir, ["gpu-1"], ["nlp"])
    merge = values["config"]["merge"]
    conf = "\n".join(f"{k}: {v}" for k, v in merge.items() if not k.startswith("$"))
    conf += f"\njetstream {{ store_dir: \"{tmp_path / 'js'}\" }}\ninclude {merge['$include']}\n"
    (etc / "nats-config" / "nats.conf").write_text(conf)
    r = subprocess.run([nats_server_binary(), "-t", "-c", str(etc / "nats-config" / "nats.conf")],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    shutil.rmtree(authdir)
    r = subprocess.run([nats_server_binary(), "-t", "-c", str(etc / "nats-config" / "nats.conf")],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode != 0  # the check can fail


def test_scrape_config_matches_the_ports():
    prom = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    pods = jobs["gearshift-pods"]
    assert pods["kubernetes_sd_configs"][0]["namespaces"]["names"] == ["gearshift"]
    keep = pods["relabel_configs"][0]
    assert keep["source_labels"] == ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"] and keep["action"] == "keep"
    # the address rewrite really produces host:annotated-port
    rewrite = pods["relabel_configs"][1]
    m = re.fullmatch(rewrite["regex"], "10.1.2.3:8080;9102")
    assert m and m.expand(rewrite["replacement"].replace("$", "\\")) == "10.1.2.3:9102"
    # systemd hosts: each service's static port is the one its unit sets
    ports = {}
    for w in workloads().values():
        c = w["spec"]["template"]["spec"]["containers"][0]
        module = c["command"][0]
        ports[config.CONFIGS[module].service] = int(container_env(c)["GEARSHIFT_METRICS_PORT"])
    assert len(set(ports.values())) == len(ports), "one port per service (they share systemd hosts)"
    for group in jobs["gearshift-hosts"]["static_configs"]:
        svc = group["labels"]["service"]
        assert {int(t.rsplit(":", 1)[1]) for t in group["targets"]} == {ports[svc]}, svc
    for unit in (DEPLOY / "systemd").glob("gearshift-*.service"):
        svc = unit.name.removeprefix("gearshift-").split(".")[0].rstrip("@")
        assert f"GEARSHIFT_METRICS_PORT={ports[svc]}" in unit.read_text(), unit.name


def test_make_secrets_refuses_missing_files(tmp_path):
    (tmp_path / "auth").mkdir()
    (tmp_path / "tls").mkdir()
    r = subprocess.run([sys.executable, str(K8S / "make-secrets.py"), "--auth", str(tmp_path / "auth"),
                        "--tls", str(tmp_path / "tls")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith("make-secrets.py: error: ") and "admission.creds: not found" in r.stderr
    assert r.stdout == ""


def test_make_secrets_packages_extra_roles(tmp_path, generated_secrets):
    authdir, tls = tmp_path / "auth", tmp_path / "tls"
    authdir.mkdir()
    tls.mkdir()
    for role in ("admission", "optimizer", "perfmodel", "profiler", "dashboard", "agent-gpu-1", "tools"):
        (authdir / f"{role}.creds").write_text(role)
    for f in ("nats-auth.conf",):
        (authdir / f).write_text("")
    for f in ("ca.pem", "server.pem", "server-key.pem", "route.pem", "route-key.pem"):
        (tls / f).write_text(f)
    r = subprocess.run([sys.executable, str(K8S / "make-secrets.py"), "--auth", str(authdir), "--tls", str(tls),
                        "--role", "tools"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    docs = {d["metadata"]["name"]: d for d in yaml.safe_load_all(r.stdout) if d}
    assert list(docs["gearshift-creds-tools"]["data"]) == ["tools.creds"]
    assert "gearshift-creds-tools" not in {s["metadata"]["name"] for s in generated_secrets}


def test_dockerfile_copies_every_package():
    text = (DEPLOY / "Dockerfile").read_text()
    copied = {line.split()[1] for line in text.splitlines() if line.startswith("COPY ")}
    for src in copied:
        for part in src.split():
            assert (ROOT / part).exists(), part
    # every folder the wheel installs under gearshift.* (package-dir), and nothing the wheel leaves out
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert set(dirs.values()) <= copied
    assert "loadtest" not in copied and "tests" not in copied
    assert "USER 10001" in text  # the manifests' runAsUser

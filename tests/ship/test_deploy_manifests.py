"""deploy/kubernetes: yamllint, the core kinds against Kubernetes' own schemas
(kubernetes-validate, offline), the custom resources against the upstream field names, and the
project's own invariants: probes, drain timing, `aioinfer serve` flags, selectors, and the metric
series that KEDA, the HPA, prometheus-adapter and the endpoint picker read, which must be series
the real app exports (scraped from /metrics over the fake runner).

The kustomizations are rendered by a small renderer here (resources, patches, images: the only
fields they may use); where `kubectl` is installed its `kustomize` must render the same.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import re
import shutil
import subprocess
import types
import typing
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")
yamllint_linter = pytest.importorskip("yamllint.linter")
from yamllint.config import YamlLintConfig  # noqa: E402

from aioinfer.config import CONFIG_CLASSES, ServerConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
BUILDS = {
    "base": DEPLOY / "base",
    "hpa-prometheus-adapter": DEPLOY / "overlays" / "hpa-prometheus-adapter",
    "inference-pool": DEPLOY / "overlays" / "inference-pool",
}
K8S_VERSION = "1.31"  # the oldest release we claim (preStop's native sleep needs 1.30)
CORE_KINDS = {
    "Deployment",
    "Service",
    "PodDisruptionBudget",
    "HorizontalPodAutoscaler",
    "ConfigMap",
}
CUSTOM_KINDS = {"ScaledObject", "PodMonitor", "InferencePool", "HTTPRoute"}
YAML_FILES = sorted(
    p
    for p in DEPLOY.rglob("*")
    if p.is_file() and (p.suffix in (".yaml", ".yml") or p.name == ".yamllint")
)
KUSTOMIZATIONS = sorted(DEPLOY.rglob("kustomization.yaml"))


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ------------------------------------------------------------------------------ rendering

# What the renderer below implements; a kustomization using anything else fails, rather than
# being rendered wrong.
KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "patches", "images"}


def kustomization(directory: Path) -> dict[str, Any]:
    (doc,) = load_docs(directory / "kustomization.yaml")
    return doc


def patch_paths() -> set[Path]:
    return {
        (path.parent / patch["path"]).resolve()
        for path in KUSTOMIZATIONS
        for patch in kustomization(path.parent).get("patches", [])
    }


def key(doc: dict[str, Any]) -> tuple[str, str, str]:
    return doc["apiVersion"], doc["kind"], doc["metadata"]["name"]


def merge(target: dict[str, Any], patch: dict[str, Any], where: str) -> None:
    """A strategic merge of maps only (a list in a patch would need the kind's merge keys)."""
    for name, value in patch.items():
        assert not isinstance(value, list), f"{where}.{name}: the renderer merges no lists"
        if isinstance(value, dict) and isinstance(target.get(name), dict):
            merge(target[name], value, f"{where}.{name}")
        else:
            target[name] = copy.deepcopy(value)


@cache
def render(directory: Path) -> tuple[dict[str, Any], ...]:
    """kustomize's output for `directory`, for the fields KUSTOMIZATION_KEYS allows."""
    spec = kustomization(directory)
    assert set(spec) <= KUSTOMIZATION_KEYS, f"{rel(directory)}: {set(spec) - KUSTOMIZATION_KEYS}"
    docs: list[dict[str, Any]] = []
    for entry in spec.get("resources", []):
        path = (directory / entry).resolve()
        docs += copy.deepcopy(list(render(path)) if path.is_dir() else load_docs(path))
    for entry in spec.get("patches", []):
        assert set(entry) == {"path"}, f"{rel(directory)}: patches by path only"
        for patch in load_docs(directory / entry["path"]):
            matches = [d for d in docs if key(d) == key(patch)]
            assert len(matches) == 1, f"{entry['path']} patches {key(patch)}: {len(matches)} found"
            if patch.get("$patch") == "delete":
                docs.remove(matches[0])
            else:
                merge(matches[0], {k: v for k, v in patch.items() if k != "$patch"}, entry["path"])
    for image in spec.get("images", []):
        for container in (c for d in docs for c in containers(d)):
            if container["image"] == image["name"]:
                container["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
    return tuple(docs)


def containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    if doc["kind"] != "Deployment":
        return []
    return doc["spec"]["template"]["spec"]["containers"]


def only(docs: tuple[dict[str, Any], ...], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def kinds(docs: tuple[dict[str, Any], ...]) -> set[str]:
    return {d["kind"] for d in docs}


def all_rendered() -> Iterator[tuple[str, dict[str, Any]]]:
    for name, directory in BUILDS.items():
        for doc in render(directory):
            yield name, doc


def test_the_builds_hold_what_they_promise():
    assert kinds(render(BUILDS["base"])) == {
        "Deployment", "Service", "PodDisruptionBudget", "PodMonitor", "ScaledObject"
    }  # fmt: skip
    hpa = kinds(render(BUILDS["hpa-prometheus-adapter"]))
    assert "ScaledObject" not in hpa and {"HorizontalPodAutoscaler", "ConfigMap"} <= hpa
    assert {"InferencePool", "HTTPRoute", "ConfigMap"} <= kinds(render(BUILDS["inference-pool"]))
    for _, doc in all_rendered():
        assert doc["kind"] in CORE_KINDS | CUSTOM_KINDS, doc["kind"]
        assert doc["metadata"]["labels"]["app.kubernetes.io/name"] == "aioinfer", key(doc)


@pytest.mark.parametrize("path", KUSTOMIZATIONS, ids=rel)
def test_every_kustomization_names_paths_that_exist(path: Path):
    spec = kustomization(path.parent)
    entries = spec.get("resources", []) + [p["path"] for p in spec.get("patches", [])]
    assert entries
    for entry in entries:
        target = path.parent / entry
        assert target.is_file() or (target / "kustomization.yaml").is_file(), (
            f"{rel(path)}: {entry}"
        )


@pytest.mark.parametrize("name", BUILDS)
def test_kubectl_kustomize_renders_the_same(name: str):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    result = subprocess.run(
        [kubectl, "kustomize", str(BUILDS[name])], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    theirs = sorted(yaml.safe_load_all(result.stdout), key=key)
    assert theirs == sorted(render(BUILDS[name]), key=key)


# ------------------------------------------------------------------------------ yamllint


def lint(text: str, path: Path) -> list[str]:
    config = YamlLintConfig(file=str(DEPLOY / ".yamllint"))
    problems = yamllint_linter.run(text, config, str(path))
    return [f"{rel(path)}:{p.line}:{p.column} {p.desc} ({p.rule})" for p in problems]


@pytest.mark.parametrize("path", YAML_FILES, ids=rel)
def test_yamllint_is_clean(path: Path):
    assert lint(path.read_text(), path) == []


def test_yamllint_config_catches_problems():
    path = DEPLOY / "base" / "service.yaml"
    text = path.read_text()
    assert lint(text + "extra:  1  \n", path)  # trailing spaces
    assert lint(text + "spec: {}\n", path)  # a key twice
    assert lint(text + "#" + " word" * 30 + "\n", path)  # a long line


# ------------------------------------------------------------------------------ schemas


def core_documents() -> Iterator[tuple[str, dict[str, Any]]]:
    """The core-kind documents of every file a kustomization lists as a resource (patches are
    partial: they are checked merged, in the renders), and of every render."""
    patches = patch_paths()
    for path in YAML_FILES:
        if path.name in ("kustomization.yaml", ".yamllint") or path.resolve() in patches:
            continue
        for doc in load_docs(path):
            if doc["kind"] in CORE_KINDS:
                yield rel(path), doc
    for name, doc in all_rendered():
        if doc["kind"] in CORE_KINDS:
            yield f"{name}:{doc['kind']}", doc


CORE_DOCUMENTS = list(core_documents())


@pytest.mark.parametrize(("where", "doc"), CORE_DOCUMENTS, ids=[w for w, _ in CORE_DOCUMENTS])
def test_core_kinds_validate_strictly(where: str, doc: dict[str, Any]):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_validator_rejects_wrong_types_and_unknown_fields():
    deployment = only(render(BUILDS["base"]), "Deployment")
    kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "60"
    unknown = copy.deepcopy(deployment)
    unknown["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    for bad in (wrong_type, unknown):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


# The custom resources' fields, as far as these manifests use them: a tree of allowed keys
# (ANY: a value not checked further; [tree]: a list of them). Sources: KEDA v2
# apis/keda/v1alpha1/scaledobject_types.go and its prometheus scaler docs; prometheus-operator
# monitoring.coreos.com/v1 PodMonitor; GIE v1.x api/v1/inferencepool_types.go; Gateway API v1
# HTTPRoute.
ANY = object()
METADATA = {"name": ANY, "namespace": ANY, "labels": ANY, "annotations": ANY}
MATCH_LABELS = {"matchLabels": ANY}
FIELDS: dict[str, dict[str, Any]] = {
    "ScaledObject": {
        "spec": {
            "scaleTargetRef": {"apiVersion": ANY, "kind": ANY, "name": ANY},
            "pollingInterval": ANY, "cooldownPeriod": ANY, "initialCooldownPeriod": ANY,
            "idleReplicaCount": ANY, "minReplicaCount": ANY, "maxReplicaCount": ANY,
            "fallback": ANY,
            "advanced": {
                "restoreToOriginalReplicaCount": ANY,
                "horizontalPodAutoscalerConfig": {"name": ANY, "behavior": ANY},
            },
            "triggers": [{
                "type": ANY, "name": ANY, "metricType": ANY, "authenticationRef": ANY,
                "metadata": {
                    "serverAddress": ANY, "query": ANY, "threshold": ANY,
                    "activationThreshold": ANY, "namespace": ANY, "customHeaders": ANY,
                    "ignoreNullValues": ANY, "queryParameters": ANY, "unsafeSsl": ANY,
                    "timeout": ANY,
                },
            }],
        },
    },
    "PodMonitor": {
        "spec": {
            "jobLabel": ANY, "podTargetLabels": ANY, "namespaceSelector": ANY,
            "selector": MATCH_LABELS,
            "podMetricsEndpoints": [{
                "port": ANY, "path": ANY, "scheme": ANY, "interval": ANY, "scrapeTimeout": ANY,
                "relabelings": ANY, "metricRelabelings": ANY,
            }],
        },
    },
    "InferencePool": {
        "spec": {
            "selector": MATCH_LABELS,
            "targetPorts": [{"number": ANY}],
            "appProtocol": ANY,
            "endpointPickerRef": {
                "group": ANY, "kind": ANY, "name": ANY, "port": {"number": ANY},
                "failureMode": ANY,
            },
        },
    },
    "HTTPRoute": {
        "spec": {
            "parentRefs": [{
                "group": ANY, "kind": ANY, "namespace": ANY, "name": ANY, "sectionName": ANY,
                "port": ANY,
            }],
            "hostnames": ANY,
            "rules": [{
                "name": ANY, "filters": ANY,
                "matches": [{"path": {"type": ANY, "value": ANY}, "headers": ANY, "method": ANY}],
                "backendRefs": [{
                    "group": ANY, "kind": ANY, "name": ANY, "namespace": ANY, "port": ANY,
                    "weight": ANY,
                }],
                "timeouts": {"request": ANY, "backendRequest": ANY},
            }],
        },
    },
}  # fmt: skip
API_VERSIONS = {
    "ScaledObject": "keda.sh/v1alpha1",
    "PodMonitor": "monitoring.coreos.com/v1",
    "InferencePool": "inference.networking.k8s.io/v1",
    "HTTPRoute": "gateway.networking.k8s.io/v1",
}


def unknown_fields(value: Any, tree: Any, where: str) -> list[str]:
    if tree is ANY:
        return []
    if isinstance(tree, list):
        assert isinstance(value, list), f"{where} must be a list"
        items = [(item, tree[0], f"{where}[{i}]") for i, item in enumerate(value)]
    else:
        assert isinstance(value, dict), f"{where} must be a map"
        items = [(value[n], tree[n], f"{where}.{n}") for n in value if n in tree]
    unknown = [f"{where}.{n}" for n in value if n not in tree] if isinstance(tree, dict) else []
    return unknown + [e for item in items for e in unknown_fields(*item)]


@pytest.mark.parametrize("kind", sorted(CUSTOM_KINDS))
def test_custom_resources_use_known_fields(kind: str):
    docs = [doc for _, doc in all_rendered() if doc["kind"] == kind]
    assert docs
    tree = {"apiVersion": ANY, "kind": ANY, "metadata": METADATA, **FIELDS[kind]}
    for doc in docs:
        assert doc["apiVersion"] == API_VERSIONS[kind]
        assert unknown_fields(doc, tree, kind) == []
    bad = copy.deepcopy(docs[0])
    bad["spec"]["selectr"] = {}  # and the check catches a typo
    assert unknown_fields(bad, tree, kind) == [f"{kind}.spec.selectr"]


def test_inference_pool_and_route_fit_the_gie_api():
    docs = render(BUILDS["inference-pool"])
    pool, route = only(docs, "InferencePool"), only(docs, "HTTPRoute")
    assert 1 <= len(pool["spec"]["targetPorts"]) <= 8
    picker = pool["spec"]["endpointPickerRef"]
    assert picker["name"] and picker["port"]["number"]
    assert picker.get("kind", "Service") == "Service"
    assert picker.get("failureMode", "FailClose") in ("FailOpen", "FailClose")
    refs = [ref for rule in route["spec"]["rules"] for ref in rule["backendRefs"]]
    assert refs == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": key(pool)[2]}
    ]


def test_scaled_object_trigger():
    scaled = only(render(BUILDS["base"]), "ScaledObject")
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    metadata = trigger["metadata"]
    assert {"serverAddress", "query", "threshold"} <= set(metadata)
    # KEDA's trigger metadata is a map of strings.
    assert all(isinstance(v, str) for v in metadata.values()), metadata
    assert float(metadata["threshold"]) > 0
    assert 1 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]


# ------------------------------------------------------------------------------ the server


def serve_options(args: list[str]) -> dict[str, Any]:
    """`aioinfer serve` container args (MODEL, then flags) as config values, each flag checked
    against the config dataclasses that the CLI generates its flags from (--flag-name <->
    field flag_name; --no-flag for booleans that default to true), each value parsed as the
    field's type, and the configs built (their own validation runs)."""
    fields = {
        f.name: (f, typing.get_type_hints(cls)[f.name])
        for cls in CONFIG_CLASSES
        for f in dataclasses.fields(cls)
    }
    model, *rest = args
    assert not model.startswith("-"), "the model comes first"
    values: dict[str, Any] = {"model": model}
    items = iter(rest)
    for arg in items:
        assert arg.startswith("--"), f"{arg!r} is not a flag"
        flag, has_value, inline = arg[2:].partition("=")
        # vLLM's underscore spellings are being added; the manifests use the canonical ones.
        assert "_" not in flag, f"--{flag}: spell flags with dashes"
        name = flag.replace("-", "_")
        negated = name not in fields and name.startswith("no_")
        name = name.removeprefix("no_") if negated else name
        assert name in fields and name != "model", f"--{flag} is not an `aioinfer serve` flag"
        field, hint = fields[name]
        if hint is bool:
            assert not has_value and (not negated or field.default is True), arg
            values[name] = not negated
            continue
        assert not negated, arg
        text = inline if has_value else next(items, None)
        assert text is not None, f"--{flag} needs a value"
        if typing.get_origin(hint) is tuple:
            values[name] = (*values.get(name, ()), text)
        else:
            values[name] = parse_value(text, hint)
    for cls in CONFIG_CLASSES:
        names = {f.name for f in dataclasses.fields(cls)}
        cls(**{k: v for k, v in values.items() if k in names})  # raises on a bad value
    return values


def parse_value(text: str, hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return int(text) if hint is int else float(text) if hint is float else text


def test_serve_options_parser_rejects_what_the_cli_would():
    assert serve_options(["m", "--shutdown-timeout", "38", "--no-enable-prefix-caching"]) == {
        "model": "m",
        "shutdown_timeout": 38.0,
        "enable_prefix_caching": False,
    }
    assert serve_options(["m", "--served-model-name=a", "--served-model-name", "b"])[
        "served_model_name"
    ] == ("a", "b")
    for bad in (
        ["--port", "8000"],  # no model
        ["m", "--shutdown-timeuot", "38"],
        ["m", "--max_model_len", "8"],
        ["m", "--no-enable-lora"],  # its default is false: no --no- form
        ["m", "--port"],
    ):
        with pytest.raises(AssertionError):
            serve_options(bad)
    with pytest.raises(ValueError):
        serve_options(["m", "--port", "eighty"])
    with pytest.raises(ValueError):
        serve_options(["m", "--shutdown-timeout", "-1"])  # the config's own check


def server_container(docs: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    (container,) = containers(only(docs, "Deployment"))
    return container


def pod_spec(docs: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    return only(docs, "Deployment")["spec"]["template"]["spec"]


def server_port(container: dict[str, Any]) -> int:
    return int(serve_options(container["args"]).get("port", ServerConfig().port))


def port_number(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p.get("name") == port]
    return number


def dockerfile(instruction: str) -> str:
    (line,) = re.findall(rf"^{instruction}\s+(.+)$", (ROOT / "Dockerfile").read_text(), re.M)
    return line.strip()


@pytest.mark.parametrize("name", BUILDS)
def test_container_runs_aioinfer_serve_as_the_image_expects(name: str):
    docs = render(BUILDS[name])
    container = server_container(docs)
    options = serve_options(container["args"])  # MODEL then real flags
    assert "command" not in container, "the image's ENTRYPOINT is `aioinfer serve`"
    host = options.get("host", ServerConfig().host)
    assert host in ("0.0.0.0", "::"), "the server must listen on the pod's IP"
    assert not options.get("uds") and not options.get("ssl_certfile"), "the probes speak plain HTTP"
    port = server_port(container)
    assert port == int(dockerfile("EXPOSE"))
    assert [p["containerPort"] for p in container["ports"]] == [port]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1, "one process per GPU"
    security = pod_spec(docs)["securityContext"]
    assert security["runAsNonRoot"] is True
    assert str(security["runAsUser"]) == dockerfile("USER").split(":")[0]
    hf_home = re.search(r"HF_HOME=(\S+)", (ROOT / "Dockerfile").read_text()).group(1)  # type: ignore[union-attr]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts[hf_home] in {v["name"] for v in pod_spec(docs)["volumes"]}
    images = kustomization(BUILDS["base"])["images"]
    assert container["image"] in {f"{i['newName']}:{i['newTag']}" for i in images}


@pytest.mark.parametrize("name", BUILDS)
def test_probes_hit_health_on_the_server_port(name: str):
    container = server_container(render(BUILDS[name]))
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        check = container[probe]["httpGet"]
        assert check["path"] == "/health", probe
        assert check.get("scheme", "HTTP") == "HTTP", probe
        assert port_number(container, check["port"]) == server_port(container), probe
    startup = container["startupProbe"]
    # Loading a model from the hub takes minutes: as long as the image's HEALTHCHECK allows.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
    assert container["readinessProbe"]["failureThreshold"] == 1, "out of rotation at once"


def prestop_seconds(container: dict[str, Any]) -> int:
    pre_stop = container["lifecycle"]["preStop"]
    if "sleep" in pre_stop:
        return int(pre_stop["sleep"]["seconds"])
    command = pre_stop["exec"]["command"]
    assert Path(command[0]).name == "sleep", command
    return int(command[1])


@pytest.mark.parametrize("name", BUILDS)
def test_the_drain_fits_the_grace_period(name: str):
    """preStop sleep, then SIGTERM: --shutdown-timeout for requests in flight, then the
    handlers of aborted ones get ABORT_GRACE; all before the kubelet's SIGKILL."""
    from aioinfer.server.app import ABORT_GRACE

    docs = render(BUILDS[name])
    container = server_container(docs)
    pre_stop = prestop_seconds(container)
    assert pre_stop > 0
    options = serve_options(container["args"])
    shutdown = options.get("shutdown_timeout", ServerConfig().shutdown_timeout)
    grace = pod_spec(docs).get("terminationGracePeriodSeconds", 30)
    assert grace > pre_stop + shutdown + ABORT_GRACE, (grace, pre_stop, shutdown)


@pytest.mark.parametrize("name", BUILDS)
def test_selectors_match_the_pods(name: str):
    docs = render(BUILDS[name])
    deployment = only(docs, "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    container = server_container(docs)
    selectors = {"Deployment": deployment["spec"]["selector"]["matchLabels"]}
    for doc in docs:
        kind, spec = doc["kind"], doc.get("spec", {})
        if kind == "Service":
            selectors[kind] = spec["selector"]
            (port,) = spec["ports"]
            assert port_number(container, port["targetPort"]) == server_port(container)
        elif kind in ("PodDisruptionBudget", "PodMonitor", "InferencePool"):
            selectors[kind] = spec["selector"]["matchLabels"]
        if kind == "PodMonitor":
            for endpoint in spec["podMetricsEndpoints"]:
                assert port_number(container, endpoint["port"]) == server_port(container)
                assert endpoint.get("path", "/metrics") == "/metrics"
        if kind == "InferencePool":
            assert [p["number"] for p in spec["targetPorts"]] == [server_port(container)]
        if kind in ("ScaledObject", "HorizontalPodAutoscaler"):
            target = spec["scaleTargetRef"]
            assert target.get("kind", "Deployment") == "Deployment"
            assert target["name"] == deployment["metadata"]["name"]
    assert {"Deployment", "Service", "PodDisruptionBudget", "PodMonitor"} <= set(selectors)
    for kind, selector in selectors.items():
        assert selector and selector.items() <= labels.items(), (kind, selector, labels)
    if name == "inference-pool":
        label_key, engine = epp_engine_label()
        assert labels[label_key] == engine
        # The pool does not select on the engine label: pods that export vLLM's names
        # (--metrics-prefix vllm, being added) join it without the label.
        assert label_key not in selectors["InferencePool"]


# ------------------------------------------------------------------------------ metric names


@dataclasses.dataclass(frozen=True)
class Series:
    type: str
    labels: frozenset[str]
    value: float


async def scrape_metrics() -> dict[str, Series]:
    from aiohttp.test_utils import TestClient, TestServer
    from prometheus_client.parser import text_string_to_metric_families

    from aioinfer.config import CacheConfig, ModelConfig, SchedulerConfig
    from aioinfer.engine.async_engine import AsyncEngine
    from aioinfer.server.app import create_app
    from tests.engine.test_engine import FakeRunnerFactory
    from tests.support.tokenizers import make_tokenizer

    engine = await AsyncEngine.create(
        ModelConfig(model="fake", enable_lora=True),  # lora_requests_info needs LoRA on
        CacheConfig(block_size=4),
        SchedulerConfig(max_num_batched_tokens=256),
        runner_factory=FakeRunnerFactory(),
        tokenizer=make_tokenizer(),
    )
    try:
        async with TestClient(TestServer(create_app(engine, ServerConfig()))) as client:
            response = await client.get("/metrics")
            assert response.status == 200
            text = await response.text()
    finally:
        await engine.shutdown()
    series: dict[str, Series] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series[sample.name] = Series(family.type, frozenset(sample.labels), sample.value)
    return series


@pytest.fixture(scope="module")
def exported() -> dict[str, Series]:
    """Every series /metrics serves (default prefix aioinfer:), by sample name."""
    return asyncio.run(scrape_metrics())


PROMQL_WORDS = {
    "sum", "avg", "min", "max", "count", "rate", "irate", "increase", "by", "without", "on",
    "ignoring", "group_left", "group_right", "and", "or", "unless", "offset", "bool",
}  # fmt: skip


def promql_series(query: str) -> set[str]:
    """The metric names a PromQL query reads: identifiers outside label matchers, strings and
    ranges, less PromQL's own words."""
    stripped = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"|'[^']*'", " ", query)
    names = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", stripped)) - PROMQL_WORDS
    return {n for n in names if not re.fullmatch(r"[0-9.]+[a-z]*", n)}


def test_promql_series():
    assert promql_series('sum(rate(a:b_total{job="x:y"}[5m])) by (pod) / max(c)') == {
        "a:b_total", "pod", "c"
    }  # fmt: skip


def test_keda_query_reads_the_waiting_queue(exported: dict[str, Series]):
    (trigger,) = only(render(BUILDS["base"]), "ScaledObject")["spec"]["triggers"]
    names = promql_series(trigger["metadata"]["query"])
    assert names == {"aioinfer:num_requests_waiting"}
    assert exported["aioinfer:num_requests_waiting"].type == "gauge"


def adapter_rules() -> list[dict[str, Any]]:
    configmap = next(
        d for d in render(BUILDS["hpa-prometheus-adapter"])
        if d["kind"] == "ConfigMap" and "config.yaml" in d["data"]
    )  # fmt: skip
    return yaml.safe_load(configmap["data"]["config.yaml"])["rules"]


def test_hpa_metric_is_the_adapter_rename_of_an_exported_series(exported: dict[str, Series]):
    served: set[str] = set()
    for rule in adapter_rules():
        series = re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", rule["seriesQuery"]).group(0)  # type: ignore[union-attr]
        assert series in exported, series
        assert {"namespace", "pod"} <= set(rule["resources"]["overrides"])
        assert {"<<.Series>>", "<<.LabelMatchers>>"} <= set(
            re.findall(r"<<[^>]*>>", rule["metricsQuery"])
        )
        # The adapter's Go regexp and ${1} template; the result is a name the custom metrics
        # API can carry (no colon).
        pattern, template = rule["name"]["matches"], rule["name"]["as"]
        renamed = re.sub(pattern, template.replace("${", "\\g<").replace("}", ">"), series)
        assert re.search(pattern, series) and ":" not in renamed, renamed
        served.add(renamed)
    hpa = only(render(BUILDS["hpa-prometheus-adapter"]), "HorizontalPodAutoscaler")
    metrics = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    assert metrics == ["aioinfer_num_requests_waiting"]
    assert set(metrics) <= served


# core-metrics-extractor's engineConfigs fields (llm-d-router v0.10,
# pkg/epp/framework/plugins/datalayer/extractor/metrics/factories.go).
ENGINE_CONFIG_FIELDS = {
    "name", "queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "loraSpec",
    "cacheInfoSpec", "cacheBlockSizeLabelName", "cacheNumBlocksLabelName", "cacheBlockSizeSpec",
    "cacheNumBlocksSpec", "customMetrics",
}  # fmt: skip
EPP_CONFIG_FIELDS = {
    "apiVersion", "kind", "featureGates", "plugins", "schedulingProfiles", "dataLayer",
    "flowControl", "requestHandler", "saturationDetector", "parser",
}  # fmt: skip


def epp_config() -> dict[str, Any]:
    configmap = next(
        d for d in render(BUILDS["inference-pool"])
        if d["kind"] == "ConfigMap" and any("EndpointPickerConfig" in v for v in d["data"].values())
    )  # fmt: skip
    (text,) = configmap["data"].values()
    return yaml.safe_load(text)


def epp_extractor() -> dict[str, Any]:
    (plugin,) = [p for p in epp_config()["plugins"] if p["type"] == "core-metrics-extractor"]
    return plugin.get("parameters", {})


def epp_engine_label() -> tuple[str, str]:
    params = epp_extractor()
    (engine,) = [e["name"] for e in params["engineConfigs"] if e["name"] == "aioinfer"]
    return params.get("engineLabelKey", "llm-d.ai/engine-type"), engine


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """An EPP metric spec: NAME or NAME{label=value,...}."""
    match = re.fullmatch(r"([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?", spec.strip())
    assert match, spec
    pairs = [p.split("=", 1) for p in (match.group(2) or "").split(",") if p.strip()]
    return match.group(1), {k.strip(): v.strip().strip('"') for k, v in pairs}


def test_epp_config_shape():
    config = epp_config()
    assert config["apiVersion"] == "llm-d.ai/v1alpha1" and config["kind"] == "EndpointPickerConfig"
    assert set(config) <= EPP_CONFIG_FIELDS
    plugin_names = {p.get("name", p["type"]) for p in config["plugins"]}
    for profile in config["schedulingProfiles"]:
        assert {p["pluginRef"] for p in profile["plugins"]} <= plugin_names
    for source in config["dataLayer"]["sources"]:
        refs = {source["pluginRef"]} | {e["pluginRef"] for e in source["extractors"]}
        assert refs <= plugin_names
    for engine in epp_extractor()["engineConfigs"]:
        assert set(engine) <= ENGINE_CONFIG_FIELDS, set(engine) - ENGINE_CONFIG_FIELDS


def test_epp_engine_config_names_exported_series(exported: dict[str, Series]):
    (engine,) = [e for e in epp_extractor()["engineConfigs"] if e["name"] == "aioinfer"]
    wanted = {
        "queuedRequestsSpec": ("gauge", set()),
        "runningRequestsSpec": ("gauge", set()),
        "kvUsageSpec": ("gauge", set()),
        "loraSpec": ("gauge", {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}),
        "cacheInfoSpec": (
            "gauge",
            {engine.get("cacheBlockSizeLabelName", "block_size"),
             engine.get("cacheNumBlocksLabelName", "num_gpu_blocks")},
        ),
    }  # fmt: skip
    for field, (kind, labels) in wanted.items():
        name, matchers = parse_spec(engine[field])
        assert name.startswith("aioinfer:"), f"{field}: the entry is for the default prefix"
        assert name in exported, f"{field}: {name} is not exported"
        assert exported[name].type == kind, field
        assert labels | set(matchers) <= exported[name].labels, field
    assert 0 <= exported[parse_spec(engine["kvUsageSpec"])[0]].value <= 1


def test_docs_name_exported_series(exported: dict[str, Series]):
    text = (ROOT / "docs" / "scale-out.md").read_text()
    names = set(re.findall(r"\baioinfer:[a-z0-9_]+", text))
    assert "aioinfer:num_requests_waiting" in names
    # Sample names, and the names of their families (histograms and counters).
    families = set(exported) | {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in exported}
    assert names <= families, names - families

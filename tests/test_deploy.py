"""What a real deployment runs stays in step with our programs, the launch recipes and the
Kubernetes API: docker-compose.yml's `rocm` profile, deploy/control-plane.yml and the manifests
in deploy/k8s/, rendered and checked here with no Docker engine, cluster or GPU (what that
leaves unchecked: docs/REAL_GPUS.md)."""

from __future__ import annotations

import importlib
import os
import re
import shlex
import shutil
import subprocess
from functools import cache
from pathlib import Path, PurePosixPath

import kubernetes_validate
import pytest
import yaml

from core import deployment
from core.processes import PROJECT_ROOT
from core.recipes import DEFAULT_RECIPES, load_recipes
from tests.test_deployment import _operator_files

DEPLOY = PROJECT_ROOT / "deploy"
K8S = DEPLOY / "k8s"
GUIDE = PROJECT_ROOT / "docs" / "REAL_GPUS.md"
KUBERNETES_VERSIONS = ("1.29", "1.37")  # the oldest the manifests claim; the newest kubernetes-validate bundles
CONTROL_NAMESPACE, SITES_NAMESPACE = "inference-federation", "inference-federation-sites"
# Variables the compose files read: cleared so that a test sees the files' own defaults.
COMPOSE_VARIABLES = (
    "SITE REGION GPUS ADVERTISE SCHEDULER_0 SCHEDULER_1 RECIPES MODEL_CACHE SGLANG_IMAGE GRAFANA_ADMIN_PASSWORD".split()
)
MODULES = {
    "scheduler": "scheduler.__main__",
    "federation.gateway": "federation.gateway.__main__",
    "nodes.agent": "nodes.agent.__main__",
}
SITES = {"kr-mi300x": "mi300x", "us-mi355x": "mi355x"}  # the guide's two sites: name -> GPU

needs_compose = pytest.mark.skipif(
    shutil.which("docker-compose") is None, reason="needs Debian's docker-compose (apt-get install docker-compose)"
)


# --- what the operator makes first (docs/REAL_GPUS.md §2), made in a temporary directory ----------


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The CA, every certificate and the API keys file, laid out as fedctl lays them out."""
    root = tmp_path_factory.mktemp("operator")
    _operator_files(root)
    (root / "deploy").mkdir()
    shutil.copy(DEPLOY / "federation.yaml", root / "deploy")  # its paths lead to the files above
    return root


def _expanded(command: list[str], mounts: dict[str, Path]) -> tuple[str, list[str]]:
    """(MODULE, its whole command line) of `command` (`python -m MODULE ARGS`): each path in a
    mounted directory or file replaced by where it is here, and `--config` read as the process
    reads it (core/deployment.py)."""
    python, dash_m, module, *args = command
    assert python in ("python", "python3") and dash_m == "-m", command

    def here(arg: str) -> str:
        for inside, outside in mounts.items():
            if arg == inside or arg.startswith(inside.rstrip("/") + "/"):
                return str(outside / PurePosixPath(arg).relative_to(inside))
        return arg

    return module, deployment.expand([here(a) for a in args], module)


def _parse(command: list[str], mounts: dict[str, Path]) -> list[str]:
    """Parse `command` with its program's own parser (as `_expanded` reads it); its command line."""
    module, args = _expanded(command, mounts)
    importlib.import_module(MODULES[module]).parse_args(args)
    return args


def _flag(command: list[str], name: str) -> list[str]:
    """Every value of `--name` in a command line."""
    return [command[i + 1] for i, arg in enumerate(command) if arg == name]


# --- docker-compose.yml's rocm profile and deploy/control-plane.yml ---------------------------


@cache
def _render(*flags: str) -> dict:
    """`docker-compose ... config`: the file as Compose reads it, variables at their defaults
    unless an env file gives them."""
    env = {k: v for k, v in os.environ.items() if k not in COMPOSE_VARIABLES}
    done = subprocess.run(
        ["docker-compose", *flags, "config"], cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)


def _rocm_sites(rendered: dict) -> dict[str, dict]:
    return {name: s for name, s in rendered["services"].items() if s.get("profiles") == ["rocm"]}


def _compose_mounts(service: dict, made: Path) -> dict[str, Path]:
    """A rendered service's bind mounts: container path -> host path, with what the operator
    makes (certificates, keys) taken from `made`."""
    mounts = {}
    for volume in service["volumes"]:
        host, container, *_ = volume.split(":")
        if host.startswith("/"):
            relative = Path(host).relative_to(PROJECT_ROOT)
            mine = relative.parts[0] in ("federation-ca", "certs", "keys") or relative == Path("deploy/federation.yaml")
            mounts[container] = made / relative if mine else Path(host)
    return mounts


def _published(port: dict | str) -> tuple[str, int]:
    """(host address or "", host port) of a rendered port, in either of Compose's syntaxes."""
    if isinstance(port, dict):
        return port.get("host_ip", ""), int(port["published"])
    address, published, _ = ["", *port.split("/")[0].split(":")][-3:]
    return address, int(published)


@needs_compose
def test_rocm_profile_holds_the_gpu_sites_and_nothing_else() -> None:
    """The `rocm` profile holds one site service per GPU type and nothing else, and only the
    profile holds them: a plain `docker compose up` starts the embedded default as before."""
    services = _render("--profile", "rocm")["services"]
    assert set(_rocm_sites(_render("--profile", "rocm"))) == {"site-mi300x", "site-mi355x"}
    unprofiled = {name for name, s in services.items() if "profiles" not in s}
    assert unprofiled == {"scheduler-0", "scheduler-1", "wan-kr-to-schedulers", "wan-gateway-to-kr"} | {
        "agent-kr-mi300x",
        "agent-us-mi355x",
        "gateway",
    }


@needs_compose
def test_rocm_sites_run_in_their_recipes_image_with_the_gpus(made: Path) -> None:
    """Each GPU site builds deploy/rocm/Dockerfile on the SGLang ROCm image its GPU type's
    built-in recipe names, gets the GPUs' device nodes, the `video` group, host IPC and a large
    /dev/shm, keeps the Hugging Face cache (HF_HOME) on a volume, mounts deploy/federation.yaml
    (which holds its recipes) and its certificate read-only (never the CA's key), runs
    unprivileged, and publishes the agent's gRPC port."""
    dockerfile = (DEPLOY / "rocm" / "Dockerfile").read_text()
    assert re.search(r"^ARG SGLANG_IMAGE=(\S+)$", dockerfile, re.M)[1] == DEFAULT_RECIPES["mi300x"].image
    for name, site in _rocm_sites(_render("--profile", "rocm")).items():
        gpu = name.removeprefix("site-")
        command = _parse(site["command"], _compose_mounts(site, made))
        assert _flag(command, "--gpu") == [gpu] and _flag(command, "--launch") == ["sglang"], name
        assert site["build"]["dockerfile"] == "deploy/rocm/Dockerfile", name
        assert site["build"]["args"] == {"SGLANG_IMAGE": DEFAULT_RECIPES[gpu].image}, name
        assert site["devices"] == ["/dev/kfd", "/dev/dri"] and site["group_add"] == ["video"], name
        assert site["ipc"] == "host" and site["shm_size"] == "16gb", name
        assert not {"privileged", "cap_add", "security_opt"} & set(site), name
        assert {_published(p) for p in site["ports"]} == {("", int(_flag(command, "--port")[0])), ("", 9462)}
        models = [v for v in site["volumes"] if not v.startswith("/")]
        assert models == [f"model-cache:{site['environment']['HF_HOME']}:rw"], name
        files = [v for v in site["volumes"] if v.startswith("/")]
        assert all(v.endswith(":ro") and "ca.key" not in v for v in files), name
        assert load_recipes(Path(_flag(command, "--recipes")[0])) == DEFAULT_RECIPES, name  # the built-in ones


@needs_compose
def test_control_plane_file_publishes_the_schedulers_and_a_keyed_gateway(made: Path) -> None:
    """deploy/control-plane.yml runs two scheduler replicas and a gateway that needs API keys,
    each command parsing with its program's parser and its own certificate; each replica has a
    port of its own for the sites, the gateway's API is public and its /health local."""
    services = _render("-f", "deploy/control-plane.yml")["services"]
    assert set(services) == {"scheduler-0", "scheduler-1", "gateway"}
    commands = {}
    for name, service in services.items():
        assert all(v.endswith(":ro") and "ca.key" not in v for v in service["volumes"])
        commands[name] = _parse(service["command"], _compose_mounts(service, made))
    published = {n: sorted(_published(p) for p in s["ports"]) for n, s in services.items()}
    assert published == {
        "scheduler-0": [("", 50051)],
        "scheduler-1": [("", 50052)],
        "gateway": [("", 8080), ("127.0.0.1", 8081)],
    }
    assert _flag(commands["gateway"], "--api-keys") == [str(made / "deploy" / ".." / "keys" / "federation-keys.json")]
    assert _flag(commands["gateway"], "--scheduler") == ["scheduler-0:50051", "scheduler-1:50051"]
    assert [_flag(commands[f"scheduler-{i}"], "--port") for i in range(2)] == [["50051"], ["50051"]]


def test_recipe_files_load_over_the_built_in_ones() -> None:
    """deploy/recipes.yaml is the built-in recipes as they are; deploy/recipes-tp8.yaml is
    sgl-cookbook's TP8 variant, one worker per 8-GPU node on the same images; the manifests'
    ConfigMaps are recipes files the agent reads too."""
    assert load_recipes(DEPLOY / "recipes.yaml") == DEFAULT_RECIPES
    tp8 = load_recipes(DEPLOY / "recipes-tp8.yaml")
    assert {gpu: (r.tp, r.workers(8), r.image) for gpu, r in tp8.items()} == {
        gpu: (8, 1, r.image) for gpu, r in DEFAULT_RECIPES.items()
    }
    assert (tp8["mi300x"].model_path, tp8["mi355x"].model_path) == ("lmsys/gpt-oss-120b-bf16", "openai/gpt-oss-120b")
    assert load_recipes(DEPLOY / "federation.yaml") == DEFAULT_RECIPES  # the one config's: the built-in ones


def test_guide_shows_the_built_in_recipes_as_they_are() -> None:
    """docs/REAL_GPUS.md's table of the built-in recipes says what core/recipes.py holds: each
    GPU type's checkpoint, weight format, flags, environment and image."""
    rows = {}
    for line in GUIDE.read_text().splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if cells[0] in DEFAULT_RECIPES:
            rows[cells[0]] = cells[1:]
    assert rows.keys() == DEFAULT_RECIPES.keys()
    for gpu, recipe in DEFAULT_RECIPES.items():
        checkpoint, weights, flags, env, image = rows[gpu]
        assert weights.upper().startswith(recipe.weight_format.upper()), gpu
        assert (checkpoint, flags, image) == (recipe.model_path, " ".join(recipe.args), recipe.image), gpu
        assert env == " ".join(f"{k}={v}" for k, v in recipe.env.items()), gpu


# --- deploy/k8s ---------------------------------------------------------------------------------


@cache
def _manifests() -> tuple[tuple[Path, dict], ...]:
    found = tuple((path, doc) for path in sorted(K8S.rglob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()))
    assert found and all(doc for _, doc in found)
    return found


def _objects(kind: str) -> list[dict]:
    return [doc for _, doc in _manifests() if doc["kind"] == kind]


def _workloads() -> list[dict]:
    return _objects("StatefulSet") + _objects("Deployment")


def _namespace(doc: dict) -> str:
    return doc["metadata"]["namespace"]


def test_kubernetes_manifests_match_the_api_schemas() -> None:
    """Every manifest is a valid Kubernetes object of its kind (strict: a misspelt or misplaced
    field fails) for the oldest and the newest Kubernetes they claim, from the schemas
    kubernetes-validate bundles (nothing fetched)."""
    for path, doc in _manifests():
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                where = ".".join(str(p) for p in exc.path)
                pytest.fail(
                    f"{path.relative_to(PROJECT_ROOT)}: {doc['kind']} {doc['metadata']['name']}: {where}: {exc.message}"
                )
    kinds = sorted({doc["kind"] for _, doc in _manifests()})
    assert kinds == [
        "Deployment",
        "Namespace",
        "PodDisruptionBudget",
        "Service",
        "StatefulSet",
    ]  # ConfigMaps: the guide makes them


def test_kubernetes_pods_are_unprivileged_bounded_and_probed() -> None:
    """No pod is privileged, escalates, keeps a capability, shares a host namespace or mounts a
    host path, or reads the Kubernetes API; every container has CPU and memory requests and
    limits, readiness and liveness probes and its Secrets read-only (unreadable by others). The
    control plane runs as non-root on a read-only root filesystem, as its namespace enforces;
    a site runs as the SGLang image's user with a writable root (its JIT kernels), and its
    namespace enforces `baseline`."""
    enforced = {doc["metadata"]["name"]: doc["metadata"]["labels"] for doc in _objects("Namespace")}
    assert enforced[CONTROL_NAMESPACE]["pod-security.kubernetes.io/enforce"] == "restricted"
    assert enforced[SITES_NAMESPACE]["pod-security.kubernetes.io/enforce"] == "baseline"
    for workload in _workloads():
        name, pod = workload["metadata"]["name"], workload["spec"]["template"]["spec"]
        control = _namespace(workload) == CONTROL_NAMESPACE
        assert pod["automountServiceAccountToken"] is False, name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert not {"hostNetwork", "hostPID", "hostIPC"} & set(pod), name
        assert all("hostPath" not in v for v in pod["volumes"]), name
        assert pod["securityContext"].get("runAsNonRoot", False) is control, name
        secrets = {v["name"]: v["secret"] for v in pod["volumes"] if "secret" in v}
        assert secrets and all(s["defaultMode"] & 0o007 == 0 for s in secrets.values()), name
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False and not context.get("privileged"), name
            assert context["capabilities"] == {"drop": ["ALL"]}, name
            assert context["readOnlyRootFilesystem"] is control, name
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(container["resources"][bound]), name
            assert {"readinessProbe", "livenessProbe"} <= set(container), name
            mounted = {m["name"]: m for m in container["volumeMounts"]}
            assert all(mounted[s]["readOnly"] for s in secrets), name


def test_kubernetes_objects_refer_to_each_other(made: Path, tmp_path: Path) -> None:
    """What the schemas cannot see: each Service selects pods that exist and names their ports;
    a StatefulSet's service is headless; a per-replica Service names a replica that exists;
    probes name the container's ports; ConfigMaps are there (the manifests' or the guide's); the
    gateways list every scheduler
    replica by its stable name; a site asks for the GPUs it declares on nodes of its GPU type,
    in an image built on its recipe's SGLang image, keeps HF_HOME on its volume claim, gets a
    memory-backed /dev/shm and advertises its public Service's port."""
    workloads = list(_workloads())

    def pods_of(selector: dict, namespace: str) -> list[dict]:
        """The workloads whose pods `selector` selects (a replica's own label: one that exists)."""
        selector = dict(selector)
        replica = selector.pop("statefulset.kubernetes.io/pod-name", None)
        match = [
            w
            for w in workloads
            if _namespace(w) == namespace and selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        if replica is not None:
            owner, _, ordinal = replica.rpartition("-")
            match = [w for w in match if w["metadata"]["name"] == owner and int(ordinal) < w["spec"]["replicas"]]
        return match

    for service in _objects("Service"):
        name = service["metadata"]["name"]
        selected = pods_of(service["spec"]["selector"], _namespace(service))
        assert selected, name
        for w in selected:
            ports = {p["name"] for c in w["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
            assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports, name
    for budget in _objects("PodDisruptionBudget"):
        assert pods_of(budget["spec"]["selector"]["matchLabels"], _namespace(budget)), budget["metadata"]["name"]
    services = {(_namespace(s), s["metadata"]["name"]): s for s in _objects("Service")}
    config_maps = {(_namespace(c), c["metadata"]["name"]) for c in _objects("ConfigMap")} | set(_guide_config_maps())
    for w in workloads:
        name, pod = w["metadata"]["name"], w["spec"]["template"]["spec"]
        assert w["spec"]["selector"]["matchLabels"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
        if w["kind"] == "StatefulSet":
            assert services[(_namespace(w), w["spec"]["serviceName"])]["spec"]["clusterIP"] == "None", name
        for volume in pod["volumes"]:
            if "configMap" in volume:
                assert (_namespace(w), volume["configMap"]["name"]) in config_maps, name
        for container in pod["containers"]:
            ports = {p["name"] for p in container["ports"]}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe in container:
                    check = container[probe].get("tcpSocket") or container[probe]["httpGet"]
                    assert check["port"] in ports, (name, probe)
    schedulers = next(w for w in workloads if w["metadata"]["name"] == "scheduler")
    gateway = next(w for w in workloads if w["metadata"]["name"] == "gateway")
    replicas = range(schedulers["spec"]["replicas"])
    assert all((CONTROL_NAMESPACE, f"scheduler-{i}-public") in services for i in replicas)  # one address each
    expected = [f"scheduler-{i}.scheduler:50051" for i in replicas]
    assert _flag(gateway["spec"]["template"]["spec"]["containers"][0]["command"], "--scheduler") == expected
    sites = [w for w in workloads if _namespace(w) == SITES_NAMESPACE]
    assert sorted(w["metadata"]["name"] for w in sites) == sorted(f"site-{s}" for s in SITES)
    for site in sites:
        name, pod = site["metadata"]["name"], site["spec"]["template"]["spec"]
        (agent,) = pod["containers"]
        command = _expanded(agent["command"], _pod_mounts(site, made, tmp_path / name))[1]
        gpu = _flag(command, "--gpu")[0]
        assert site["spec"]["replicas"] == 1 and _flag(command, "--site") == [name.removeprefix("site-")], name
        assert SITES[name.removeprefix("site-")] == gpu == pod["nodeSelector"]["inference-federation/gpu"], name
        gpus = _flag(command, "--gpus")[0]
        assert agent["resources"]["requests"]["amd.com/gpu"] == agent["resources"]["limits"]["amd.com/gpu"] == gpus
        assert agent["image"].rpartition(":")[2] == DEFAULT_RECIPES[gpu].image.rpartition(":")[2], name
        mounts = {m["name"]: m["mountPath"] for m in agent["volumeMounts"]}
        env = {e["name"]: e["value"] for e in agent["env"]}
        (claim,) = site["spec"]["volumeClaimTemplates"]
        assert mounts[claim["metadata"]["name"]] == env["HF_HOME"], name
        shm = next(v for v in pod["volumes"] if mounts.get(v["name"]) == "/dev/shm")
        assert shm["emptyDir"].get("medium") == "Memory", name
        public = services[(SITES_NAMESPACE, f"{name}-public")]
        assert public["spec"]["type"] == "LoadBalancer", name
        assert [str(p["port"]) for p in public["spec"]["ports"]] == [
            _flag(command, "--advertise")[0].rpartition(":")[2]
        ]


# --- the commands, with the Secrets the guide makes ---------------------------------------------


def _guide_secrets() -> dict[tuple[str, str], dict[str, str]]:
    """Each `kubectl -n NS create secret generic NAME --from-file=KEY=PATH ...` in the guide."""
    return _guide_objects("secret generic")


def _guide_objects(kind: str) -> dict[tuple[str, str], dict[str, str]]:
    """Each `kubectl -n NS create KIND NAME --from-file=KEY=PATH ...` in the guide: its files."""
    text = GUIDE.read_text().replace("\\\n", " ")
    made = {}
    for line in text.splitlines():
        if f"create {kind} " not in line:
            continue
        words = shlex.split(line.strip())
        namespace = words[words.index("-n") + 1]
        name = words[words.index(kind.split()[-1]) + 1]
        files = dict(w.removeprefix("--from-file=").split("=", 1) for w in words if w.startswith("--from-file="))
        made[(namespace, name)] = files
    return made


def _guide_config_maps() -> dict[tuple[str, str], dict[str, str]]:
    """Each `kubectl -n NS create configmap NAME --from-file=KEY=PATH ...` in the guide."""
    return _guide_objects("configmap")


def _pod_mounts(workload: dict, made: Path, tmp: Path) -> dict[str, Path]:
    """A workload's first container's mounts of Secrets and of the ConfigMaps the guide makes
    (the files it makes them from, as made in `made`) and of the manifests' own ConfigMaps
    (written out under `tmp`)."""
    pod, namespace = workload["spec"]["template"]["spec"], _namespace(workload)
    config_maps = {c["metadata"]["name"]: c["data"] for c in _objects("ConfigMap") if _namespace(c) == namespace}
    secrets = _guide_secrets()
    made_maps = {name: files for (ns, name), files in _guide_config_maps().items() if ns == namespace}
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {}
    for mount in pod["containers"][0]["volumeMounts"]:
        volume = volumes.get(mount["name"], {})
        if "secret" in volume:
            files = secrets[(namespace, volume["secret"]["secretName"])]
            directory = tmp / mount["name"]
            directory.mkdir(parents=True)
            for key, source in files.items():
                (directory / key).symlink_to(made / source)
            mounts[mount["mountPath"]] = directory
        elif "configMap" in volume and volume["configMap"]["name"] in made_maps:
            directory = tmp / mount["name"]
            directory.mkdir(parents=True)
            for key, source in made_maps[volume["configMap"]["name"]].items():
                (directory / key).symlink_to(made / source)
            mounts[mount["mountPath"]] = directory
        elif "configMap" in volume:
            directory = tmp / mount["name"]
            directory.mkdir(parents=True)
            for key, text in config_maps[volume["configMap"]["name"]].items():
                (directory / key).write_text(text)
            mounts[mount["mountPath"]] = directory
    return mounts


def test_guide_makes_every_secret_the_manifests_mount() -> None:
    """docs/REAL_GPUS.md creates each Secret a pod mounts, in the pod's namespace, with every
    file the pod's command reads from it, from files fedctl makes."""
    secrets = _guide_secrets()
    for workload in _workloads():
        pod = workload["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        for container in pod["containers"]:
            for mount in container["volumeMounts"]:
                if "secret" not in volumes.get(mount["name"], {}):  # (a claim template's volume is not the pod's)
                    continue
                name = volumes[mount["name"]]["secret"]["secretName"]
                files = secrets.get((_namespace(workload), name))
                assert files is not None, f"the guide makes no Secret {name} in {_namespace(workload)}"
                read = {
                    a.removeprefix(mount["mountPath"] + "/")
                    for a in container["command"]
                    if a.startswith(mount["mountPath"] + "/")
                }
                assert read and read <= set(files), (name, read, files)
                assert all(p.startswith(("federation-ca/ca.crt", "certs/", "keys/")) for p in files.values()), files


def test_kubernetes_control_plane_commands_parse_with_their_own_certificates(made: Path, tmp_path: Path) -> None:
    """The schedulers' and the gateways' command lines parse with their programs' own parsers,
    with the certificate and the keys file their Secrets hold (a gateway's certificate for the
    gateway, the scheduler's for the schedulers)."""
    for workload in _workloads():
        if _namespace(workload) == CONTROL_NAMESPACE:
            name = workload["metadata"]["name"]
            _parse(
                workload["spec"]["template"]["spec"]["containers"][0]["command"],
                _pod_mounts(workload, made, tmp_path / name),
            )


@needs_compose
def test_site_agent_command_lines_parse_with_their_own_certificates(made: Path, tmp_path: Path) -> None:
    """Every real site's agent command (compose's rocm profile with each deploy/rocm/*.env, and
    each Kubernetes site) parses with the agent's own parser, with its site's certificate and
    its recipes file. (It needs the agent's `--launch`: until the agent has it, this fails.)"""
    env_files = sorted((DEPLOY / "rocm").glob("*.env"))
    assert [f.stem for f in env_files] == sorted(SITES)
    for env_file in env_files:
        service = _render("--env-file", str(env_file), "--profile", "rocm")["services"][f"site-{SITES[env_file.stem]}"]
        assert _flag(service["command"], "--site") == [env_file.stem]
        _parse(service["command"], _compose_mounts(service, made))
    for workload in _workloads():
        if _namespace(workload) == SITES_NAMESPACE:
            name = workload["metadata"]["name"]
            _parse(
                workload["spec"]["template"]["spec"]["containers"][0]["command"],
                _pod_mounts(workload, made, tmp_path / name),
            )

"""docker-compose.yml, docker-compose.cpu.yml, the Dockerfiles and .dockerignore, checked without
a Docker engine (the GPU hosts have none; tests/e2e/test_compose_run.py runs the CPU stack for
real).

Each service's command goes through the real `pagedserve` argparse parser and each healthcheck
through the probe's parser, so a renamed flag or subcommand breaks this test, not a deployment.
(The probes themselves, against real processes: tests/pagedserve/test_probes.py.)
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import re
import tomllib
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from pagedserve import cli, probe
from tests.conftest import ROOT

ENV = {"MODEL_DIR": "/models/checkpoint"}  # the one variable without a default
PAGEDSERVE_SERVICES = ("kvstore", "compute", "gateway")
GPU_SERVICES = ("kvstore", "compute")


# ------------------------------------------------------------------ helpers
def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's variable interpolation (``$$``, ``${VAR}``, ``${VAR:-default}``,
    ``${VAR-default}``, ``${VAR:?error}``, ``${VAR?error}``) over every string in ``value``."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op, arg = match.group("name"), match.group("op") or "", match.group("arg") or ""
        present = name in env and (env[name] != "" or ":" not in op)
        if present:
            return env[name]
        if op.endswith("?"):
            raise KeyError(f"${{{name}}}: {arg}")
        return arg if op.endswith("-") else ""

    pattern = r"\$\$|\$\{(?P<name>\w+)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"
    return re.sub(pattern, one, value)


class Reset:
    """Compose's ``!reset`` tag: the override file removes the key it is on."""


class ComposeLoader(yaml.SafeLoader):
    pass


ComposeLoader.add_constructor("!reset", lambda loader, node: Reset())


def load_compose(env: dict[str, str] = ENV, name: str = "docker-compose.yml") -> dict[str, Any]:
    raw = yaml.load((ROOT / name).read_text(), Loader=ComposeLoader)  # a SafeLoader
    compose: dict[str, Any] = interpolate(raw, env)
    return compose


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose()


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, Any]:
    services: dict[str, Any] = compose["services"]
    return services


def pagedserve_parser() -> argparse.ArgumentParser:
    """The parser `pagedserve` itself uses."""
    return cli.build_parser()


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices) if actions else {}


def parse(parser: argparse.ArgumentParser, argv: list[str], what: str) -> argparse.Namespace:
    """``parser.parse_args(argv)``; every ``--flag`` must be spelled out in full (argparse
    would also take a prefix of a flag, which a rename could turn into another flag)."""
    target = subparsers(parser).get(argv[0], parser) if argv else parser
    options = {s for a in target._actions for s in a.option_strings}
    abbreviated = [arg.split("=")[0] for arg in argv if arg.startswith("--")]
    assert set(abbreviated) <= options, f"{what}: unknown flags {set(abbreviated) - options}"
    try:
        return parser.parse_args(argv)
    except SystemExit as exit_:  # argparse printed why (captured by pytest)
        pytest.fail(f"{what}: the parser rejects {argv} (exit {exit_.code})")


@pytest.fixture(scope="module")
def parsed(services: dict[str, Any]) -> dict[str, argparse.Namespace]:
    """Each pagedserve service's command, parsed by the real CLI (the gateway's only once
    `pagedserve gateway` exists; a missing kvstore or compute subcommand fails)."""
    parser = pagedserve_parser()
    known = subparsers(parser)
    out = {}
    for name in PAGEDSERVE_SERVICES:
        command = [str(arg) for arg in services[name]["command"]]
        if name != "gateway" or "gateway" in known:
            out[name] = parse(parser, command, f"service {name}")
    return out


def service_command(parsed: dict[str, argparse.Namespace], name: str) -> argparse.Namespace:
    if name not in parsed:
        pytest.skip(
            f"pagedserve.cli has no `{name}` subcommand yet: its compose command is unchecked"
        )
    return parsed[name]


def health_argv(service: dict[str, Any]) -> list[str]:
    """A healthcheck's probe arguments: ``["CMD", "python", "-m", "pagedserve.probe", ...]``."""
    test = [str(arg) for arg in service["healthcheck"]["test"]]
    assert test[:4] == ["CMD", "python", "-m", "pagedserve.probe"], test
    return test[4:]


def host_port(url: str) -> tuple[str | None, int | None]:
    parts = urlsplit(url)
    return parts.hostname, parts.port


# ------------------------------------------------------------------ docker-compose.yml
def test_compose_v2_services(compose: dict[str, Any]) -> None:
    assert "version" not in compose, "Compose v2 files have no version key"
    assert set(compose["services"]) == {"redis", *PAGEDSERVE_SERVICES}
    for name, service in compose["services"].items():
        assert service.get("restart") == "unless-stopped", name
        assert "healthcheck" in service, name


def test_model_dir_is_required() -> None:
    with pytest.raises(KeyError, match="MODEL_DIR"):
        load_compose({})


def test_redis_append_only_with_a_volume(compose: dict[str, Any]) -> None:
    redis = compose["services"]["redis"]
    assert redis["image"].startswith("redis:")
    command = redis["command"]
    assert command[0] == "redis-server"
    assert command[command.index("--appendonly") + 1] == "yes"
    volume, target = redis["volumes"][0].split(":")[:2]
    assert target == "/data" and volume in compose["volumes"]
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]


def test_one_image_and_a_read_only_model(
    services: dict[str, Any], parsed: dict[str, argparse.Namespace]
) -> None:
    images = {services[name]["image"] for name in PAGEDSERVE_SERVICES}
    assert len(images) == 1, images
    for name in PAGEDSERVE_SERVICES:
        service = services[name]
        assert service["build"]["context"] == ".", name
        mounts = [v.split(":") for v in service["volumes"]]
        assert ["/models/checkpoint", "/model", "ro"] in mounts, (name, mounts)
    for name, ns in parsed.items():
        assert ns.model == "/model", name


def test_kvstore_command(services: dict[str, Any], parsed: dict[str, argparse.Namespace]) -> None:
    from kvstore.daemon import KVStoreConfig
    from kvstore.device import parse_memory
    from pagedserve.config import from_namespace

    ns = service_command(parsed, "kvstore")
    assert ns.command == "kvstore" and ns.device == "cuda"
    parse_memory(ns.kv_memory)  # raises on a malformed size
    parse_memory(ns.swap_memory)
    from_namespace(KVStoreConfig, ns)
    assert "ports" not in services["kvstore"], "the kvstore's control plane is never published"


def test_the_kvstore_socket_is_on_a_volume_only_pagedserve_shares(
    compose: dict[str, Any], services: dict[str, Any], parsed: dict[str, argparse.Namespace]
) -> None:
    """The control plane is a unix socket (no TCP: nothing outside the containers reaches it),
    on a named volume mounted by the kvstore, the workers and the gateway alone."""
    endpoint = service_command(parsed, "kvstore").endpoint
    assert endpoint.startswith("ipc:///"), endpoint
    directory = endpoint.removeprefix("ipc://").rsplit("/", 1)[0]
    for name in PAGEDSERVE_SERVICES:
        mounts = [v.split(":") for v in services[name]["volumes"]]
        assert any(m[1] == directory and m[0] in compose["volumes"] for m in mounts), name
    assert "volumes" not in services["redis"] or all(
        directory not in v for v in services["redis"]["volumes"]
    )


def test_compute_command(parsed: dict[str, argparse.Namespace]) -> None:
    from compute.worker import ComputeConfig
    from pagedserve.config import from_namespace

    ns = service_command(parsed, "compute")
    kvstore = service_command(parsed, "kvstore")
    assert ns.command == "compute" and ns.device == "cuda"
    assert ns.dtype == kvstore.dtype, "the workers' dtype must be the pool's"
    assert ns.worker_id == "", "a fixed --worker-id breaks --scale and the worker probe"
    assert ns.kvstore == kvstore.endpoint
    assert host_port(ns.redis_url) == ("redis", 6379)
    from_namespace(ComputeConfig, ns)


def test_gateway_command(services: dict[str, Any], parsed: dict[str, argparse.Namespace]) -> None:
    ns = service_command(parsed, "gateway")  # skips while `pagedserve gateway` does not exist
    kvstore = service_command(parsed, "kvstore")
    assert ns.command == "gateway"
    assert ns.host == "0.0.0.0"
    assert host_port(ns.redis_url) == ("redis", 6379)
    assert ns.kvstore == kvstore.endpoint
    assert ns.served_model_name
    published = [str(p).rsplit(":", 1) for p in services["gateway"]["ports"]]
    assert [(host, int(container)) for host, container in published] == [
        ("127.0.0.1:8000", int(ns.port))
    ]
    grace = float(str(services["gateway"]["stop_grace_period"]).removesuffix("s"))
    assert grace >= ns.shutdown_timeout_s + 10, "docker must not SIGKILL the gateway's drain"


def test_gateway_port_and_admin_token(services: dict[str, Any]) -> None:
    """Checked from the YAML alone, whether or not `pagedserve gateway` exists yet."""
    gateway = services["gateway"]
    command = [str(arg) for arg in gateway["command"]]
    port = command[command.index("--port") + 1]
    assert port == "8000"
    # Published on the host's loopback unless PAGEDSERVE_BIND says otherwise.
    assert [str(p) for p in gateway["ports"]] == [f"127.0.0.1:8000:{port}"]
    exposed = load_compose({**ENV, "PAGEDSERVE_BIND": "0.0.0.0"})["services"]["gateway"]
    assert [str(p) for p in exposed["ports"]] == [f"0.0.0.0:8000:{port}"]
    # Passed through from the shell (a null value), never written into the file.
    assert gateway["environment"] == {"PAGEDSERVE_ADMIN_TOKEN": None, "PAGEDSERVE_API_KEY": None}
    assert all("ports" not in services[name] for name in services if name != "gateway")


def test_healthchecks_call_the_probe(
    services: dict[str, Any], parsed: dict[str, argparse.Namespace]
) -> None:
    parser = probe.build_parser()
    kv = parse(parser, health_argv(services["kvstore"]), "kvstore healthcheck")
    assert kv.target == "kvstore"

    worker = parse(parser, health_argv(services["compute"]), "compute healthcheck")
    assert worker.target == "worker" and worker.worker_id is None  # this container's worker
    compute = [str(arg) for arg in services["compute"]["command"]]
    assert worker.endpoint == compute[compute.index("--kvstore") + 1]

    gateway = parse(parser, health_argv(services["gateway"]), "gateway healthcheck")
    assert gateway.target == "gateway"
    assert host_port(gateway.url) == ("127.0.0.1", 8000)
    assert urlsplit(gateway.url).path == "/health"
    if "kvstore" in parsed:
        assert kv.endpoint == parsed["kvstore"].endpoint
    for name in PAGEDSERVE_SERVICES:
        check = services[name]["healthcheck"]
        timeout_s = float(str(check["timeout"]).removesuffix("s"))
        assert timeout_s > 5.0, "the probe's own --timeout-s (5 s) must fire first"
        assert "start_period" in check, name


def test_start_order(services: dict[str, Any]) -> None:
    def conditions(name: str) -> dict[str, str]:
        return {dep: v["condition"] for dep, v in services[name].get("depends_on", {}).items()}

    healthy = "service_healthy"
    assert conditions("kvstore") == {}
    assert conditions("compute") == {"kvstore": healthy, "redis": healthy}
    assert services["compute"]["depends_on"]["kvstore"].get("restart") is True
    assert conditions("gateway") == {"redis": healthy, "kvstore": healthy, "compute": healthy}


def test_gpus_and_shared_namespaces(services: dict[str, Any]) -> None:
    reservations = []
    for name in GPU_SERVICES:
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1, name
        (device,) = devices
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"], name
        reservations.append(device)
    # The workers open the kvstore's pool: the same GPU, not just as many.
    assert reservations[0] == reservations[1]
    assert reservations[0]["device_ids"] == ["0"]
    for name in ("redis", "gateway"):
        assert "deploy" not in services[name], name

    kvstore, compute = services["kvstore"], services["compute"]
    assert kvstore["ipc"] == "shareable"
    assert compute["ipc"] == "service:kvstore" and compute["pid"] == "service:kvstore"
    assert kvstore.get("init") is True  # PID 1 of the shared PID namespace reaps
    # Scalable: nothing that names or binds one container.
    assert "container_name" not in compute and "ports" not in compute


# ------------------------------------------------------------------ Dockerfile, .dockerignore
def dockerfile_instructions(name: str = "Dockerfile") -> list[tuple[str, str]]:
    text = (ROOT / name).read_text()
    logical = re.sub(r"\\\n", " ", text)  # line continuations
    out = []
    for line in logical.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def test_dockerfile() -> None:
    instructions = dockerfile_instructions()
    by_keyword: dict[str, list[str]] = {}
    for keyword, rest in instructions:
        by_keyword.setdefault(keyword, []).append(rest)
    assert instructions[0][0] in ("ARG", "FROM")
    assert json.loads(by_keyword["ENTRYPOINT"][-1]) == ["pagedserve"]
    runs = " ".join(by_keyword["RUN"])
    assert re.search(r"pip install [^&]*\s\.(\s|$)", runs), "the project is not pip-installed"
    assert "gcc" in runs, "Triton needs a C compiler at run time"
    user = by_keyword["USER"][-1]
    assert user not in ("root", "0"), "the image must not run as root"
    # Everything pyproject installs is copied in (before the install).
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = [
        p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    ]
    copied = {rest.split()[0] for rest in by_keyword["COPY"]}
    copied |= {name for rest in by_keyword["COPY"] for name in rest.split()[:-1]}
    for needed in [*packages, "pyproject.toml", pyproject["project"]["readme"]]:
        assert needed in copied, f"Dockerfile does not COPY {needed}"
        assert (ROOT / needed).exists(), needed


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether Docker leaves ``path`` out of the build context: it or a parent directory
    matches a pattern, segment by segment (``*`` never crosses a ``/``; ``**`` is any number
    of segments), as Go's filepath.Match does for Docker."""

    def match(parts: list[str], pattern: list[str]) -> bool:
        if not pattern:
            return not parts
        if pattern[0] == "**":
            return any(match(parts[i:], pattern[1:]) for i in range(len(parts) + 1))
        return (
            bool(parts)
            and fnmatch.fnmatchcase(parts[0], pattern[0])
            and match(parts[1:], pattern[1:])
        )

    parts = path.split("/")
    return any(
        match(parts[:depth], pattern.strip("/").split("/"))
        for depth in range(1, len(parts) + 1)
        for pattern in patterns
    )


def test_dockerignore() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert not [p for p in patterns if p.startswith("!")], "exceptions are not checked here"
    unwanted = [".venv/bin/python", ".whl/redis.whl", ".git/HEAD", "x.whl", ".pytest_cache/v"]
    unwanted.append(".env")  # compose's variables: PAGEDSERVE_ADMIN_TOKEN may be in it
    for path in unwanted:
        assert dockerignored(path, patterns), f".dockerignore keeps {path}"
    assert dockerignored("kvstore/__pycache__/client.cpython-311.pyc", patterns)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = [
        p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    ]
    needed = ["pyproject.toml", "README.md", "Dockerfile"]
    needed += ["docker/wheels/README.md", "docker/wheels/torch-2.13.0+cpu-cp311-x.whl"]  # a bind
    needed += [str(f.relative_to(ROOT)) for p in packages for f in (ROOT / p).glob("*.py")]
    assert "pagedserve/probe.py" in needed
    for path in needed:
        assert not dockerignored(path, patterns), f".dockerignore leaves out {path}"

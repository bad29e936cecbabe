"""The architecture as docs/architecture.md states it: who may import whom (checked on the
source, lazy imports included, and by importing every module in a fresh interpreter), no import
circle between modules, every module the document names exists, and its Redis keys are the
code's. Also every file or folder that README.md, docs/*.md, bench/README.md and BENCHMARKS.md
name exists."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from contracts import queue_keys
from tests.conftest import ROOT

SERVICES = ("kvstore", "compute", "gateway")
OURS = ("contracts", "kvstore", "compute", "gateway", "kernels", "pagedserve")
# What each package may import of ours; the kvstore's client side is open to everyone.
KVSTORE_CLIENT = ("kvstore.protocol", "kvstore.client", "kvstore.mapping")
ALLOWED: dict[str, tuple[str, ...]] = {
    "contracts": ("contracts",),
    "kernels": ("kernels",),
    "kvstore": ("kvstore", "contracts", "kernels"),  # kernels: copies between GPUs' pools
    "compute": ("compute", "contracts", "kernels", *KVSTORE_CLIENT),
    "gateway": ("gateway", "contracts", *KVSTORE_CLIENT),
}
DOC = ROOT / "docs" / "architecture.md"


def modules_of(package: str) -> list[str]:
    """Every module of ``package``, its sub-packages' included."""
    return sorted(
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for path in (ROOT / package).rglob("*.py")
    )


def allowed(package: str, imported: str) -> bool:
    if imported.split(".")[0] not in OURS:
        return True  # the standard library and third-party packages
    return any(imported == a or imported.startswith(a + ".") for a in ALLOWED[package])


def imports_in(path: Path) -> set[str]:
    """Every module an ``import`` anywhere in the file names (functions' lazy ones too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_no_import_crosses_a_boundary_in_the_source(package: str) -> None:
    """``compute`` never imports ``gateway`` nor the reverse, no service imports the CLI
    package ``pagedserve``, and only the kvstore's client side is imported by others."""
    crossings = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in (ROOT / package).rglob("*.py")
        for name in imports_in(path)
        if not allowed(package, name)
        # "from kvstore import protocol" names the package, then the module: judge the module
        and not (name in OURS and any(n.startswith(name + ".") for n in imports_in(path)))
    }
    assert not crossings, sorted(crossings)


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_no_import_crosses_a_boundary_when_loaded(package: str) -> None:
    """Every module of ``package`` imported in a fresh interpreter (``python -c``): none of
    the modules it pulls in is one the package may not import."""
    code = (
        "import json, sys\n"
        f"for m in {modules_of(package)!r}: __import__(m)\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.splitlines()[-1])
    crossings = [m for m in loaded if not allowed(package, m) and m not in OURS]
    assert not crossings, crossings


def module_graph() -> dict[str, dict[str, int]]:
    """Module -> the modules of ours it imports -> the line of the first such import: every
    ``import`` in the file (in functions and under ``TYPE_CHECKING`` too), ``from a import b``
    naming the module ``a.b`` where there is one, else ``a``."""
    paths = {
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): path
        for package in OURS
        for path in (ROOT / package).rglob("*.py")
    }
    graph: dict[str, dict[str, int]] = {}
    for module, path in paths.items():
        edges = graph.setdefault(module, {})
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [
                    f"{node.module}.{alias.name}"
                    if f"{node.module}.{alias.name}" in paths
                    else node.module
                    for alias in node.names
                ]
            else:
                continue
            for name in names:
                if name in paths and name != module:
                    edges.setdefault(name, node.lineno)
    return graph


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in graph[module]:
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = [stack.pop()]
            while component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


def test_no_import_circle_between_modules() -> None:
    """No module of ours reaches itself through imports, lazy and type-only ones included: a
    piece two modules need lives in a third that both import (``pagedserve.procs``,
    ``gateway.model_info``, ``pagedserve.bench_config``)."""
    graph = module_graph()
    assert "pagedserve.up" in graph["pagedserve.cli"], "the graph holds the imports"
    circles = [
        [f"{a}:{graph[a][b]} -> {b}" for a in cycle for b in graph[a] if b in cycle]
        for cycle in import_cycles(graph)
    ]
    assert not circles, circles


# compute's wings, each importing only those before it (and compute's shared modules)
WINGS = ("parallel", "model", "sampling", "batch", "loop")


def test_compute_wings_import_only_the_wings_below_them() -> None:
    """compute/ is in wings: tensor parallelism, the model path, sampling, the requests and
    their batching, the loop; a wing imports none after it, so no circle runs between wings
    either."""
    graph = module_graph()
    upward = [
        f"{module}:{line} -> {imported}"
        for module, edges in graph.items()
        for imported, line in edges.items()
        if (wing := _wing(module)) is not None
        and (other := _wing(imported)) is not None
        and WINGS.index(other) > WINGS.index(wing)
    ]
    assert not upward, upward
    assert {w for m in graph if (w := _wing(m))} == set(WINGS), "every wing holds modules"


def test_no_product_file_is_over_400_lines_and_the_engine_step_reads_in_under_40() -> None:
    """Files a reader takes in whole; the worker's step, the one place a tensor-parallel rank 0
    will extend, short enough to read top to bottom."""
    long = {
        str(path.relative_to(ROOT)): n
        for package in OURS
        for path in (ROOT / package).rglob("*.py")
        if (n := len(path.read_text().splitlines())) > 400
    }
    assert not long, long
    tree = ast.parse((ROOT / "compute" / "loop" / "engine.py").read_text())
    [step] = [
        node
        for cls in tree.body
        if isinstance(cls, ast.ClassDef) and cls.name == "Engine"
        for node in cls.body
        if isinstance(node, ast.FunctionDef) and node.name == "step"
    ]
    assert step.end_lineno is not None and step.end_lineno - step.lineno + 1 < 40


def _wing(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[0] == "compute" else None


def test_the_circle_check_finds_a_circle() -> None:
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert import_cycles(graph) == [["a", "b", "c"]]


def test_contracts_and_the_kvstore_client_side_are_torch_free() -> None:
    modules = [*modules_of("contracts"), "kvstore.protocol", "kvstore.client"]
    code = f"import sys\nfor m in {modules!r}: __import__(m)\n"
    code += "assert 'torch' not in sys.modules, 'torch imported'"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_every_module_the_document_names_exists() -> None:
    named = set(re.findall(r"`((?:[a-z_]+/)+[a-z_]+\.py)`", DOC.read_text()))
    assert len(named) > 30, "the document names the modules"
    missing = sorted(name for name in named if not (ROOT / name).is_file())
    assert not missing, missing


# The pages a reader follows: every file or folder of the repository they name must exist, so
# that moving or deleting one fails here until the pages say so. The benchmarks' archive is left
# out: it keeps its entries as they were written, files since removed included.
PAGES = sorted(
    [
        *(ROOT / "docs").glob("*.md"),
        ROOT / "README.md",
        ROOT / "bench" / "README.md",
        ROOT / "BENCHMARKS.md",
    ]
)
# a path of the repository: one of its top-level folders, then a slash (not inside a longer
# path, a URL or a dotted name); a sentence's full stop or comma after it is not part of it
TOP_FOLDERS = "|".join(re.escape(d) for d in (*OURS, "bench", "tests", "docs", "docker", ".ci"))
REPO_PATH = re.compile(rf"(?<![\w./:-])((?:{TOP_FOLDERS})/[\w./-]*)")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def paths_named(page: Path) -> set[str]:
    text = page.read_text()
    named = {m.rstrip(".,") for m in REPO_PATH.findall(text)}
    links = {
        str((page.parent / target).resolve().relative_to(ROOT.resolve()))
        for target in LINK.findall(text)
        if "://" not in target
    }
    return named | links


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_a_page_names_exists(page: Path) -> None:
    """README.md, docs/*.md, bench/README.md and BENCHMARKS.md: every path of the repository
    they name (a module, a script, a folder) and every page they link to exists."""
    named = paths_named(page)
    missing = sorted(name for name in named if not (ROOT / name).exists())
    assert not missing, missing


def test_the_pages_name_files() -> None:
    """The check above sees what it should: the pages name their modules and link each other."""
    assert len(paths_named(ROOT / "docs" / "packages.md")) > 100
    assert "bench/README.md" in paths_named(ROOT / "README.md")
    assert "docs/architecture.md" in paths_named(ROOT / "docs" / "kvstore.md")


def test_the_documents_redis_keys_are_the_codes() -> None:
    key = r"`(pagedserve:[a-z_]+(?::\{[a-z_]+\}){0,2})`"
    documented = set(re.findall(key, DOC.read_text()))
    assert queue_keys.request_stream(0) == queue_keys.REQUEST_STREAM
    assert queue_keys.request_stream(3) == queue_keys.REQUEST_STREAM + ":3"
    assert queue_keys.request_stream(0, "h2") == queue_keys.REQUEST_STREAM + ":h2:0"
    code = {
        queue_keys.REQUEST_STREAM,
        queue_keys.REQUEST_STREAM + ":{pool}",
        queue_keys.REQUEST_STREAM + ":{node}:{pool}",
        queue_keys.REQUEST_GROUP,
        queue_keys.output_key("{req_id}"),
        queue_keys.abort_key("{req_id}"),
        queue_keys.wake_key("{reader}"),
        queue_keys.gateway_key("{gateway_id}"),
    }
    assert documented == code
    # and every key name the module builds is one of those
    functions = [f for f in dir(queue_keys) if f.endswith("_key") and f != "KEY_PREFIX"]
    assert sorted(functions) == ["abort_key", "gateway_key", "output_key", "wake_key"]


def test_nothing_links_outside_the_repository() -> None:
    texts = [p for p in ROOT.rglob("*") if p.suffix in (".md", ".py") and ".venv" not in p.parts]
    outside = [
        str(p.relative_to(ROOT))
        for p in texts
        if p != Path(__file__) and "../shared" in p.read_text(errors="replace")
    ]
    assert not outside, outside

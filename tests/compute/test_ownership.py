"""One writer per datum in the compute worker: no object writes another's fields.

Collaborators hand state over by return values, arguments and method calls (``KVSync.free``,
``Intake.found``, ``Requests.admitted``, ...), never by assigning another object's attributes,
mutating its containers or patching its methods. Checked on the source of ``compute/*.py`` with
``ast``: a write is an assignment, augmented assignment or ``del`` whose target is an attribute
of anything but ``self`` (``other.x = ...``, ``self.a.x = ...``), a subscript assignment into a
container reached through another object (``self.a.x[k] = ...``, ``other.x[k] = ...``), a
mutating call on such a container (``self.a.x.append(...)``, ``other.x.update(...)``) or a
``setattr``. Writes to ``self``'s own attributes and to local names are the owner's.
"""

from __future__ import annotations

import ast

from tests.conftest import ROOT

MUTATORS = frozenset(
    (
        "append",
        "extend",
        "insert",
        "add",
        "discard",
        "update",
        "pop",
        "popitem",
        "clear",
        "remove",
        "setdefault",
        "__setitem__",
    )
)

# The writes kept on purpose: (file, the written expression's beginning) -> why. Each entry
# must still match a write (a stale one fails the test).
ALLOWED = {
    # ``Sequence`` is a record defined in compute/batch/scheduler.py, written only by its Scheduler
    ("scheduler.py", "seq."): "the scheduler's own Sequence records",
    # ``Active``/``Branch`` (compute/batch/requests.py) are built and owned by ``Requests``
    ("registry.py", "active."): "Requests fills in the Active records it makes",
    ("registry.py", "owner.cached_tokens"): "Requests records the kvstore's cache hit",
    ("requests.py", "active.prompt_logprobs"): "output_record hands the prompt logprobs over "
    "once (the same module's record)",
    # ``StopChecker.append`` is the checker's own method (a token in), not a container's
    ("registry.py", "branch.stop.append"): "a method of the stop checker",
    ("model_step.py", "branch.stop.append"): "a method of the stop checker",
    # ``Budget`` is a record of compute/model/profile.py that its measuring functions account into
    ("profile.py", "budget."): "the same module's accumulator record",
    # load-time model surgery on transformers' modules (GPU code path: left as it is)
    ("fused.py", "module."): "fuses a transformers module in place",
    ("fused.py", "lin."): "a projection becomes a view of the merged weight",
    ("fused.py", "setattr("): "registers the merged weights on the module",
    # load-time model surgery for tensor parallelism, on a model built on the meta device
    ("sharding.py", "attn."): "an attention's projections become its rank's parallel layers",
    ("sharding.py", "mlp."): "an MLP's projections become its rank's parallel layers",
    ("sharding.py", "model."): "the embedding and LM head become vocabulary-parallel",
    ("sharding.py", "setattr("): "a meta parameter becomes the tensor read from the checkpoint",
}


def _foreign(node: ast.expr) -> bool:
    """Whether ``node`` is a container reached through another object's attribute."""
    return isinstance(node, ast.Attribute) and not (
        isinstance(node.value, ast.Name) and node.value.id == "self"
    )


def writes(source: str) -> list[tuple[int, str]]:
    """(line, written expression) of every write into another object in ``source``."""
    found: list[tuple[int, str]] = []

    def target(node: ast.expr, line: int) -> None:
        if isinstance(node, ast.Tuple | ast.List):
            for element in node.elts:
                target(element, line)
        elif isinstance(node, ast.Starred):
            target(node.value, line)
        elif isinstance(node, ast.Attribute):
            if not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                found.append((line, ast.unparse(node)))
        elif isinstance(node, ast.Subscript) and _foreign(node.value):
            found.append((line, ast.unparse(node)))

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign | ast.Delete):
            for t in node.targets:
                target(t, node.lineno)
        elif isinstance(node, ast.AugAssign) or (
            isinstance(node, ast.AnnAssign) and node.value is not None
        ):
            target(node.target, node.lineno)
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in MUTATORS and _foreign(func.value):
                found.append((node.lineno, ast.unparse(func)))
            elif isinstance(func, ast.Name) and func.id == "setattr":
                found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def test_no_compute_object_writes_another_s_state() -> None:
    unexplained, used = [], set()
    for path in sorted((ROOT / "compute").rglob("*.py")):  # module names are unique
        for line, written in writes(path.read_text()):
            keys = [k for k in ALLOWED if k[0] == path.name and written.startswith(k[1])]
            used.update(keys)
            if not keys:
                unexplained.append(f"{path.relative_to(ROOT)}:{line}: {written}")
    assert not unexplained, "writes into another object's state:\n" + "\n".join(unexplained)
    assert not set(ALLOWED) - used, f"allow-list entries matching nothing: {set(ALLOWED) - used}"


def test_the_check_sees_each_kind_of_write() -> None:
    source = """
def f(self, other):
    self.own = 1
    self.own_list.append(1)
    self.own_dict[1] = 2
    local = []
    local.append(1)
    other.x = 1
    self.kvsync.copies = []
    self.kvsync.frees += []
    self.kvsync.forks.setdefault(1, []).append(2)
    self.intake.incoming.extend([])
    other.table[1] = 2
    del other.y
    setattr(other, "z", 1)
"""
    assert [w for _, w in writes(source)] == [
        "other.x",
        "self.kvsync.copies",
        "self.kvsync.frees",
        "self.kvsync.forks.setdefault",
        "self.intake.incoming.extend",
        "other.table[1]",
        "other.y",
        "setattr(other, 'z', 1)",
    ]

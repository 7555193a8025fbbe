"""The code stays lint-clean, type-checked (mypy strict on our packages), and its import graph
has no circle and crosses no boundary the design forbids."""

import ast
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def test_ruff_is_clean():
    out = subprocess.run([BIN / "ruff", "check", "."], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:]


def test_mypy_strict_is_clean():
    out = subprocess.run([BIN / "mypy", "coordinator/campugrid", "provider-agent/campugrid",
                          "sandbox/campugrid", "builders/campugrid", "checkpoint-hooks/campugrid"],
                         cwd=REPO,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:]


# --- the import graph of our own modules ------------------------------------------------

ROOTS = ("coordinator", "provider-agent", "sandbox", "builders", "checkpoint-hooks")
# (importer, imported) package prefixes that must never meet: the coordinator runs no job
# code, the contract depends on nothing of ours, and the hooks live inside jobs.
FORBIDDEN = (
    ("campugrid.coordinator", "campugrid.builders"),  # campugrid.buildpolicy is not builders
    ("campugrid.buildpolicy", "campugrid.builders"),
    ("campugrid.buildpolicy", "campugrid.sandbox"),
    ("campugrid.buildpolicy", "campugrid.agent"),
    ("campugrid.coordinator", "campugrid.agent"),
    ("campugrid.coordinator", "campugrid.sandbox"),
    ("campugrid.protocol", "campugrid.coordinator"),
    ("campugrid.protocol", "campugrid.agent"),
    ("campugrid.protocol", "campugrid.builders"),
    ("campugrid.protocol", "campugrid.sandbox"),
    ("campugrid.agent", "campugrid.coordinator"),
    ("campugrid.agent", "campugrid.client"),
    ("campugrid.client", "campugrid.coordinator"),
    ("campugrid.coordinator", "campugrid.client"),  # the contract they share is in protocol
    ("campugrid.console", "campugrid.client"),
    ("campugrid.client", "campugrid.agent"),
    ("campugrid.client", "campugrid.cli"),
    ("campugrid.hooks", "campugrid.coordinator"),
    ("campugrid.hooks", "campugrid.agent"),
    ("campugrid.hooks", "campugrid.sandbox"),
    ("campugrid.hooks", "campugrid.builders"),
)
# What lives in coordinator/ imports nothing of the machine's side: the agent's own commands
# are mounted by name (campugrid/cli/main.py), the process guards are campugrid.guards.
COORDINATOR_SIDE = ("campugrid.cli", "campugrid.client", "campugrid.console",
                    "campugrid.coordinator", "campugrid.egress", "campugrid.guards",
                    "campugrid.protocol")
FORBIDDEN += tuple((side, machine) for side in COORDINATOR_SIDE
                   for machine in ("campugrid.agent", "campugrid.sandbox", "campugrid.builders"))


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def crossings(graph: dict[str, set[str]]) -> list[str]:
    """Every import that FORBIDDEN forbids, and every import of `campugrid.protocol` (the
    leaf contract) of anything of ours outside it."""
    return [f"{a} imports {b}" for a, deps in sorted(graph.items()) for b in sorted(deps)
            if any(_under(a, x) and _under(b, y) for x, y in FORBIDDEN)
            or (_under(a, "campugrid.protocol") and not _under(b, "campugrid.protocol"))]


def import_graph() -> dict[str, set[str]]:
    """Module -> our modules it imports (imports under TYPE_CHECKING count: a circle of
    types is still a circle of design)."""
    files = {}
    for root in ROOTS:
        for path in (REPO / root).rglob("*.py"):
            if "migrations" in path.parts or path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            parts = list(path.relative_to(REPO / root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                names = [base, *(f"{base}.{a.name}" for a in node.names)]
            for name in names:
                while name and name not in files:
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    found.add(name)
        graph[mod] = found
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_circle_finder_finds_circles():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_our_modules_import_no_circle_and_cross_no_boundary():
    graph = import_graph()
    assert "campugrid.coordinator.store" in graph and "campugrid.agent.task" in graph
    assert circles(graph) == []
    assert crossings(graph) == []


def test_the_boundary_check_sees_what_it_forbids():
    """The rules above, on a made-up graph: each kind of crossing is caught."""
    graph = {"campugrid.protocol.spec": {"campugrid.hooks"},
             "campugrid.coordinator.service": {"campugrid.buildpolicy.dockerfiles",
                                               "campugrid.builders.buildah"},
             "campugrid.buildpolicy.tarballs": {"campugrid.buildpolicy.dockerfiles",
                                                    "campugrid.builders.base"}}
    assert crossings(graph) == [
        "campugrid.buildpolicy.tarballs imports campugrid.builders.base",
        "campugrid.coordinator.service imports campugrid.builders.buildah",
        "campugrid.protocol.spec imports campugrid.hooks"]


def test_the_layout_names_every_module():
    doc = (REPO / "docs" / "architecture.md").read_text()
    layout = doc[doc.index("## Layout"):]
    layout = layout[:layout.index("\n## ", 1)] if "\n## " in layout[1:] else layout
    named = set(re.findall(r"`([a-z_+.]+)`", layout))
    named |= {part for word in list(named) for part in word.split(" + ")}
    missing = sorted(mod.rpartition(".")[2] for mod in import_graph()
                     if mod.count(".") == 2 and mod.rpartition(".")[2] not in named
                     and not mod.endswith("__main__"))
    assert missing == [], f"modules the layout table (docs/architecture.md) does not name: {missing}"


# --- rules that keep the house's shape (issue 35) ------------------------------------------

COORDINATOR = REPO / "coordinator" / "campugrid"
# What answers callers: they call the coordinator's services, never its store.
TRANSPORTS = (COORDINATOR / "coordinator" / "api.py", COORDINATOR / "coordinator" / "agent_service.py",
              COORDINATOR / "coordinator" / "server.py", COORDINATOR / "coordinator" / "metrics.py",
              *sorted((COORDINATOR / "console").glob("*.py")),
              *sorted((COORDINATOR / "coordinator" / "rest").glob("*.py")))


def store_reaches(source: str, name: str = "<source>") -> list[int]:
    """The lines of `source` that reach for an attribute called `store`."""
    return sorted(node.lineno for node in ast.walk(ast.parse(source, name))
                  if isinstance(node, ast.Attribute) and node.attr == "store")


def hand_written_fences(source: str, name: str = "<source>") -> list[int]:
    """The lines of `source` that compare an attempt (or a token) and a machine in one
    expression: the fence, which fence.py alone writes."""
    def compared(node: ast.AST) -> set[str]:
        found = set()
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                if isinstance(side, ast.Attribute):
                    found.add(side.attr)
                elif isinstance(side, ast.Name):
                    found.add(side.id)
        return found

    out = []
    for node in ast.walk(ast.parse(source, name)):
        parts = (node.values if isinstance(node, ast.BoolOp) else
                 node.elts if isinstance(node, ast.List | ast.Tuple) else [])
        names = set().union(*(compared(p) for p in parts)) if parts else set()
        if names & {"attempt", "token"} and "machine_id" in names:
            out.append(node.lineno)
    return sorted(out)


def test_no_transport_reaches_for_the_store():
    found = {str(p.relative_to(REPO)): lines for p in TRANSPORTS
             if (lines := store_reaches(p.read_text(), str(p)))}
    assert found == {}, f"transports that use the store, not the services: {found}"


def test_the_fence_is_written_once():
    fence = COORDINATOR / "coordinator" / "fence.py"
    found = {str(p.relative_to(REPO)): lines
             for p in sorted((COORDINATOR / "coordinator").rglob("*.py"))
             if p != fence and "migrations" not in p.parts
             and (lines := hand_written_fences(p.read_text(), str(p)))}
    assert found == {}, f"fences written outside coordinator/fence.py: {found}"
    assert hand_written_fences(fence.read_text())  # the rule sees the real one


def test_the_shape_rules_see_what_they_forbid():
    assert store_reaches("coord.store.limiter\nx = coord.jobs.get(1)\n") == [1]
    assert hand_written_fences(
        "ok = row.attempt == token and row.machine_id == machine_id\n"
        "where = [Job.attempt == ref.token, Job.machine_id == ref.machine_id]\n"
        "fine = job.attempt == 1 and lease.shard is None\n") == [1, 2]


CONCRETE_BACKENDS = ("PodmanRunsc", "FakeRuntime", "BuildahBuilder", "KanikoBuilder",
                     "FakeBuilder", "CliOps", "ApiOps")


def backend_tests(source: str, name: str = "<source>") -> list[int]:
    """The lines of `source` that test a backend's type, or compare a name with a backend's
    name (`builder.name == "buildah"`), instead of asking what it can do."""
    names = {"buildah", "kaniko", "fake", "podman-runsc"}
    out = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id == "isinstance" and len(node.args) == 2:
            kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            if any(isinstance(k, ast.Name | ast.Attribute) and
                   (k.id if isinstance(k, ast.Name) else k.attr) in CONCRETE_BACKENDS
                   for k in kinds):
                out.append(node.lineno)
        if isinstance(node, ast.Compare) and any(
                isinstance(side, ast.Constant) and side.value in names
                for side in (node.left, *node.comparators)) and any(
                isinstance(side, ast.Attribute) and side.attr == "name"
                for side in (node.left, *node.comparators)):
            out.append(node.lineno)
    return sorted(out)


def dialect_names(source: str, name: str = "<source>") -> list[int]:
    """The lines of `source` that read a database dialect's name."""
    return sorted(node.lineno for node in ast.walk(ast.parse(source, name))
                  if isinstance(node, ast.Attribute) and node.attr == "name"
                  and isinstance(node.value, ast.Attribute) and node.value.attr == "dialect")


def test_backends_are_asked_not_tested():
    """The agent asks its runtime and builder what they can do (Runtime.ops,
    Builder.capabilities); only a backend's own package names it."""
    found = {}
    for root in ("provider-agent", "coordinator"):
        for p in sorted((REPO / root / "campugrid").rglob("*.py")):
            if lines := backend_tests(p.read_text(), str(p)):
                found[str(p.relative_to(REPO))] = lines
    assert found == {}, f"backends tested by type or name: {found}"


def test_the_database_dialect_is_decided_in_db_py():
    allowed = {COORDINATOR / "coordinator" / "db.py",
               COORDINATOR / "coordinator" / "models.py"}  # the UTC column type's own hook
    found = {str(p.relative_to(REPO)): lines
             for p in sorted(COORDINATOR.rglob("*.py"))
             if p not in allowed and "migrations" not in p.parts  # Alembic's, frozen in time
             and (lines := dialect_names(p.read_text(), str(p)))}
    assert found == {}, f"dialect names read outside db.py (ask dialect_of): {found}"


def test_the_backend_and_dialect_rules_see_what_they_forbid():
    assert backend_tests("if isinstance(sandbox, PodmanRunsc):\n    pass\n"
                         "ok = builder.name == 'buildah'\n"
                         "fine = isinstance(x, dict)\n") == [1, 3]
    assert dialect_names("pg = engine.dialect.name == 'postgresql'\nname = job.name\n") == [1]


def starts_processes(source: str, name: str = "<source>") -> list[int]:
    """The lines of `source` that start a process or a confined child, or name this Python
    to start one."""
    starters = {"subprocess": {"run", "Popen", "call", "check_call", "check_output"},
                "os": {"fork", "system", "popen", "execv", "spawnv"},
                "confine": {"call", "Worker"}, "sys": {"executable"}}
    out = []
    for node in ast.walk(ast.parse(source, name)):
        if (isinstance(node, ast.Import | ast.ImportFrom) and any(
                a.name.split(".")[0] == "multiprocessing" for a in node.names)) or (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.attr in starters.get(node.value.id, ())):
            out.append(node.lineno)
    return sorted(out)


def test_unit_tests_start_no_process():
    found = {str(p.relative_to(REPO)): lines
             for p in sorted((REPO / "tests" / "unit").glob("*.py"))
             if (lines := starts_processes(p.read_text(), str(p)))}
    assert found == {}, f"unit tests that start processes (move them to tests/integration): {found}"


def test_the_process_rule_sees_what_it_forbids():
    assert starts_processes("subprocess.run(['true'])\nconfine.call(f)\nx = sys.executable\n"
                            "done = subprocess.CompletedProcess([], 0)\n") == [1, 2, 3]

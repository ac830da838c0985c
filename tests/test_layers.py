"""The floors of the house: imports run one way, from the top down to the shared base.

core (and the generated proto) at the bottom; on it, side by side and blind to each other, the
control plane (scheduler), the site side (nodes: the agent and the SGLang stand-in, which knows
nothing of the agent) and the front door (federation.gateway); the operator's tools (the rest of
federation) on top. Read from the source, every import, including those inside functions.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OURS = ("core", "proto", "scheduler", "nodes", "federation")

# A module under the first prefix may import, of ours, only modules under these prefixes.
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("core", ("core", "proto")),
    ("proto", ("proto",)),
    ("scheduler", ("core", "proto", "scheduler")),
    ("nodes.emulator", ("core", "proto", "nodes.emulator")),
    ("nodes", ("core", "proto", "nodes")),
    ("federation.gateway", ("core", "proto", "federation.gateway")),
]


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def imports_of(path: Path) -> list[str]:
    """Every module of ours that the file imports (absolute; the house uses no relative imports)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            if node.module is None:
                continue
            names = [node.module] if node.module not in OURS else [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found += [n for n in names if n.split(".")[0] in OURS]
    return found


def modules() -> list[tuple[str, Path]]:
    found = []
    for top in OURS:
        for path in sorted((ROOT / top).rglob("*.py")):
            found.append((".".join(path.relative_to(ROOT).with_suffix("").parts), path))
    return found


def floor_of(module: str) -> tuple[str, ...] | None:
    for prefix, allowed in FLOORS:
        if _under(module, prefix):
            return allowed
    return None  # the operator's tools: anything below them


def test_every_import_runs_down_the_house() -> None:
    wrong = []
    for module, path in modules():
        allowed = floor_of(module)
        if allowed is None:
            continue
        for target in imports_of(path):
            if not any(_under(target, a) for a in allowed):
                wrong.append(f"{path.relative_to(ROOT)}: {module} imports {target}")
    assert not wrong, "imports against the floors:\n" + "\n".join(wrong)


def test_the_check_sees_every_package_and_a_wrong_import() -> None:
    """The rule must be able to fail: it reads real modules of every layer, and an import from
    the control plane into the site side (as capacity once took the emulator's GPU profiles) breaks it."""
    seen = {module.split(".")[0] for module, _ in modules()}
    assert seen == set(OURS)
    assert "core.gpus" in imports_of(ROOT / "scheduler" / "capacity.py")
    allowed = floor_of("scheduler.capacity")
    assert allowed is not None and not any(_under("nodes.emulator.engine", a) for a in allowed)
    assert floor_of("federation.cli") is None


@pytest.mark.parametrize("module", ["core.wire", "core.gpus", "core.policy", "core.config", "core.tokens"])
def test_the_base_imports_alone(module: str) -> None:
    """Each base module loads in a fresh interpreter without pulling in a layer above it."""
    code = (
        f"import sys, {module}; "
        "above = sorted(m for m in sys.modules if m.split('.')[0] in ('scheduler', 'nodes', 'federation')); "
        "print(above); sys.exit(1 if above else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def _graph(package: str) -> dict[str, set[str]]:
    """Each module of `package` and the modules of it that it imports (`from package import m`
    counted as importing m; imports under TYPE_CHECKING too)."""
    directory = ROOT.joinpath(*package.split("."))
    names = {p.stem for p in directory.glob("*.py")} - {"__init__", "__main__"}
    graph: dict[str, set[str]] = {}
    for name in names:
        found = set()
        for node in ast.walk(ast.parse((directory / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == package:
                found |= {a.name for a in node.names if a.name in names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(package + "."):
                found.add(node.module.removeprefix(package + ".").split(".")[0])
            elif isinstance(node, ast.Import):
                found |= {a.name.removeprefix(package + ".") for a in node.names if a.name.startswith(package + ".")}
        graph[name] = found & names
    return graph


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """An import circle in `graph` (the modules around it), or None."""
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> list[str] | None:
        if name in path:
            return [*path[path.index(name) :], name]
        if name in done:
            return None
        for imported in sorted(graph[name]):
            if found := visit(imported, [*path, name]):
                return found
        done.add(name)
        return None

    return next((c for name in sorted(graph) if (c := visit(name, []))), None)


def test_the_gateways_modules_import_one_way() -> None:
    """No import circle inside the gateway: the types its response path shares live in
    `pieces.py`, below the modules that make them and those that say them."""
    graph = _graph("federation.gateway")
    assert {"responses", "responses_api", "jobs", "failover", "pieces"} <= graph.keys()
    assert _circle(graph) is None, " -> ".join(_circle(graph) or [])
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the check finds one

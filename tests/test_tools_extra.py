"""The product apart from its tools: the runtime processes and `fedctl up` import nothing from
the `tools` extra (pyproject.toml), which a production image does not install, and a tool run
without it says which extra to install and exits 2."""

from __future__ import annotations

import subprocess
import sys
import tomllib

from core.processes import PROJECT_ROOT
from federation.cli import TOOL_MODULES, TOOLS_EXTRA

# Modules every runtime process, and `fedctl up`'s embedded federation, imports.
RUNTIME = (
    "scheduler.__main__",
    "federation.gateway.__main__",
    "nodes.agent.__main__",
    "nodes.agent.reader",
    "nodes.emulator.__main__",
    "federation.linkproxy",
    "federation.embedded",
    "federation.cli",
)


def _without_tools(code: str) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh interpreter where every tool package is missing, as in an image
    installed without the extra (None in sys.modules: import fails, find_spec finds nothing)."""
    hide = f"import sys\nfor m in {TOOL_MODULES!r}: sys.modules[m] = None\n"
    return subprocess.run(
        [sys.executable, "-c", hide + code], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=60
    )


def test_the_tools_packages_are_an_extra_not_a_dependency() -> None:
    project = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]
    names = {d.split(">")[0].split("=")[0].strip().replace("-", "_") for d in project["dependencies"]}
    tools = {d.split(">")[0].strip() for d in project["optional-dependencies"]["tools"]}
    assert not names & {"hypothesis", "matplotlib", "mlcommons_loadgen", "sglang_router", "tqdm"}, names
    assert tools == {"hypothesis", "matplotlib", "mlcommons-loadgen", "sglang-router", "tqdm"}
    assert TOOLS_EXTRA in project["optional-dependencies"]["test"][0]


def test_the_runtime_imports_without_the_tools() -> None:
    proc = _without_tools("import importlib\n" + "".join(f"importlib.import_module({m!r})\n" for m in RUNTIME))
    assert proc.returncode == 0, proc.stderr


def test_a_tool_without_its_extra_says_which_to_install_and_exits_2() -> None:
    for command in ("bench", "drill", "fuzz"):
        proc = _without_tools(f"from federation.cli import main\nsys.exit(main([{command!r}, '--help']))")
        assert proc.returncode == 2, (command, proc.stdout, proc.stderr)
        assert f"pip install '{TOOLS_EXTRA}'" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    up = _without_tools("from federation.cli import main\nsys.exit(main(['up', '--help']))")
    assert up.returncode == 0 and "usage: fedctl up" in up.stdout, up.stderr

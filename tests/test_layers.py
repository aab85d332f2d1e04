"""The layers: the gateway never loads torch or the replica side, and no project module
imports another that imports it back (at import time)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("api", "control", "tasks", "tui")


def test_the_gateway_imports_no_torch_no_engine_no_replica() -> None:
    code = (
        "import sys\n"
        "from api import create_app\n"
        "from control.serve import serve\n"
        "from control.settings import Settings\n"
        "create_app(Settings(redis_url='redis://127.0.0.1:9'))  # connects lazily: nothing listens there\n"
        "banned = ['torch', 'transformers', 'tasks.engine', 'tasks.replica', 'tasks.worker', 'tasks.lm']\n"
        "print(','.join(sorted(m for m in sys.modules if any(m == b or m.startswith(b + '.') for b in banned))))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""


def _module_imports() -> dict[str, set[str]]:
    """Project modules and the project modules each imports at module level."""
    graph: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            tree = ast.parse(path.read_text())
            found = set()
            for node in tree.body:  # module level only: imports inside functions are lazy on purpose
                if isinstance(node, ast.Import):
                    found |= {alias.name for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    found.add(node.module)
                    found |= {f"{node.module}.{alias.name}" for alias in node.names}
            graph[name] = {m for m in found if m.split(".")[0] in PACKAGES}
    return {name: {m for m in deps if m in graph and m != name} for name, deps in graph.items()}


def test_no_import_cycles() -> None:
    graph = _module_imports()
    assert "tasks.replica" in graph and graph["tasks.replica"]  # the walk found the modules and their imports
    cycles = []
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == []


POLICY = [
    "tasks.collector",
    "tasks.pullgate",
    "tasks.scheduler",
    "control.admission",
    "control.rebalance",
    "control.lifecycle",
    "control.sim",
    "control.capacity",
    "control.simsplit",
    "control.conntable",
]
NOT_IN_POLICY = ["redis", "celery", "kombu", "flask", "gevent", "torch", "transformers"]


def test_policy_code_imports_no_broker_client_no_web_framework_no_torch() -> None:
    """The simulator runs the policy code the replicas and gateways run: none of it may
    load a Redis client, Celery, Flask or torch."""
    code = (
        "import importlib, json, sys\n"
        f"for name in {POLICY!r}: importlib.import_module(name)\n"
        f"print(json.dumps([m for m in {NOT_IN_POLICY!r} if m in sys.modules]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"

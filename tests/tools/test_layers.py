"""The layers: each folder imports only the folders below it (lazy imports counted), no
module imports another that imports it back, the gateway never loads torch or the
replica side, and policy code loads no broker client, web framework or torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("api", "control", "tasks", "tui")

# Lowest first. A module belongs to the longest folder that holds it; it may import its
# own folder and anything listed before it, never after.
LAYERS = (
    "control.core",  # settings, vocabularies, what crosses processes, clocks, connections
    "tasks.policy",  # collector, pull gate, scheduler, step costs
    "control.policy",  # admission, rebalance
    "control.broker",  # key names, scripts, records, envelope, traffic, registry
    "tasks.celery",  # the Celery app and the internals adapters
    "tasks.engine",  # the engine contract and the fixed engine
    "tasks.lm",  # the torch engine
    "tasks.lm.train",  # building and judging the models
    "tasks.replica",  # the replica and its Celery glue
    "api",  # the gateway's app
    "api.server",  # the gateway's HTTP server
    "control.fleet",  # the supervisor, embedded Valkey, operator, region client
    "control.load",  # the load generator
    "control.sim",  # the simulator and capacity
    "control.bench",  # the deployment harness, the reports, the benchmarks
    "control.chaos",  # faults under load
    "tui",  # the dashboard
    "control.cli",  # the `keybatch` command
    "control",  # control/__init__.py and `python -m control`
)
POLICY = (
    "control.core.vocab",
    "control.core.clock",
    "control.core.lifecycle",
    "control.core.protocol",
    "tasks.policy",
    "control.policy",
    "control.sim.config",
    "control.sim.continuous",
    "control.sim.cost",
    "control.sim.events",
    "control.sim.faults",
    "control.sim.gateway",
    "control.sim.group",
    "control.sim.replica",
    "control.sim.result",
    "control.sim.simulate",
    "control.sim.states",
    "control.sim.workload",
    "control.sim.capacity",
    "control.sim.capacity_cli",
    "control.sim.split",
    "api.server.conntable",
)
NOT_IN_POLICY = ["redis", "celery", "kombu", "flask", "gevent", "torch", "transformers"]


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            found[".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")] = path
    return found


def _imports() -> dict[str, set[str]]:
    """Each project module and the project modules it imports, anywhere in its body."""
    modules = _modules()

    def resolve(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {resolve(alias.name) for alias in node.names if alias.name.split(".")[0] in PACKAGES}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    deps.add(full if full in modules else resolve(node.module))
        graph[name] = deps - {name, ""}
    return graph


def _layer(module: str) -> int:
    held = [i for i, folder in enumerate(LAYERS) if module == folder or module.startswith(folder + ".")]
    assert held, f"{module} is in no layer: add its folder to LAYERS"
    return max(held, key=lambda i: len(LAYERS[i]))


def test_every_import_goes_down_the_layers() -> None:
    graph = _imports()
    assert len(graph) > 80 and graph["tasks.replica.replica"]  # the walk found the modules and their imports
    upward = [
        f"{module} -> {dep} ({LAYERS[_layer(module)]} is below {LAYERS[_layer(dep)]})"
        for module, deps in sorted(graph.items())
        for dep in sorted(deps)
        if _layer(dep) > _layer(module)
    ]
    assert upward == []


def test_no_import_cycles() -> None:
    graph = _imports()
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


def test_the_gateway_imports_no_torch_no_engine_no_replica() -> None:
    code = (
        "import sys\n"
        "from api.app import create_app\n"
        "from api.server.serve import serve\n"
        "from control.core.settings import Settings\n"
        "create_app(Settings(redis_url='redis://127.0.0.1:9'))  # connects lazily: nothing listens there\n"
        "banned = ['torch', 'transformers', 'tasks.engine', 'tasks.replica', 'tasks.lm']\n"
        "print(','.join(sorted(m for m in sys.modules if any(m == b or m.startswith(b + '.') for b in banned))))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""


def test_policy_code_imports_no_broker_client_no_web_framework_no_torch() -> None:
    """The simulator runs the policy code the replicas and gateways run: none of it may
    load a Redis client, Celery, Flask or torch."""
    names = [name for name in _modules() if any(name == m or name.startswith(m + ".") for m in POLICY)]
    assert "tasks.policy.collector" in names and "control.policy.admission" in names
    code = (
        "import importlib, json, sys\n"
        f"for name in {names!r}: importlib.import_module(name)\n"
        f"print(json.dumps([m for m in {NOT_IN_POLICY!r} if m in sys.modules]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"

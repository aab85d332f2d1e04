"""The `keybatch` command (also `python -m control`)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import dataclass

from control.core.settings import Settings
from control.core.vocab import BACKENDS, POLICIES


def _settings_help() -> str:
    """Every setting's name, from the Settings object itself."""
    names = [name.upper() for name in Settings.model_fields]
    lines, line = [], " "
    for name in names:
        if len(line) + len(name) > 88:
            lines.append(line)
            line = " "
        line += " " + name
    lines.append(line)
    return "settings (environment, prefix KEYBATCH_, or a .env file; README: Configuration):\n" + "\n".join(lines)


SERVING_COMMANDS = ("up", "api", "worker")


def _parser(serving_only: bool = False) -> argparse.ArgumentParser:
    """Every command's parser; only the serving ones for a serving process, which then
    boots without importing the tools' modules (a restarted replica serves sooner)."""
    top = argparse.ArgumentParser(prog="keybatch", description="Batched code-completion serving.")
    sub = top.add_subparsers(dest="command", required=True)
    _add_serving_commands(sub)
    if serving_only:
        return top
    _add_bench_commands(sub)
    _add_tool_commands(sub)
    _add_watching_commands(sub)
    return top


def _add_serving_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """up, api, worker: the processes that serve."""
    up = sub.add_parser(
        "up",
        help="broker, replicas and gateway in the foreground",
        epilog=_settings_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    up.add_argument("--workers", type=int, default=None, help="model replicas (default 2 per model served)")
    up.add_argument("--backend", choices=BACKENDS, default="hf", help="hf: the local models; fixed: simulated")
    up.add_argument("--policy", choices=POLICIES, default=None, help="default: the POLICY setting")
    up.add_argument("--models", default="", help="comma-separated model names (default: all configured)")
    up.add_argument("--port", type=int, default=None)
    up.add_argument(
        "--cells", type=int, default=None, help="embedded brokers, one cell each, replicas spread over them (default 1)"
    )
    up.add_argument(
        "--replicas-per-host",
        type=int,
        default=0,
        help="group the replicas into simulated hosts of this many (HOST-h1, HOST-h2...), to test a host's loss",
    )

    sub.add_parser("api", help="one gateway (HTTP) process group").add_argument("--port", type=int, default=None)

    worker = sub.add_parser("worker", help="one model replica")
    worker.add_argument("--model", required=True)
    worker.add_argument("--backend", choices=BACKENDS, default="hf")
    worker.add_argument("--policy", choices=POLICIES, default=None, help="default: the POLICY setting")
    worker.add_argument("--name", default=None, help="replica name (default MODEL-PID@HOST)")
    worker.add_argument("--loglevel", default="INFO")
    worker.add_argument(
        "--standby",
        action="store_true",
        help="boot, load MODEL's engine, then wait on stdin for the replica to become (`keybatch up` keeps one)",
    )


def _add_bench_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """bench ...: the benchmarks that print figures."""
    bench = sub.add_parser("bench", help="benchmarks that print figures")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    from control.cli.args import (
        add_broker_bench_args,
        add_cycle_args,
        add_dash_bench_args,
        add_engine_bench_args,
        add_floor_args,
        add_goodput_args,
        add_host_loss_sim_args,
        add_ops_bench_args,
        add_path_cpu_args,
        add_peer_args,
        add_policies_args,
        add_rebalance_bench_args,
        add_serving_args,
        add_simcheck_args,
        add_tiers_sim_args,
    )

    add_serving_args(bench_sub.add_parser("serving", help="the serving path under Poisson load"))
    add_policies_args(bench_sub.add_parser("policies", help="static against continuous batching on a real model"))
    add_engine_bench_args(bench_sub.add_parser("engine", help="the torch engine's step time: decode and prefill"))
    add_peer_args(
        bench_sub.add_parser("peer", help="keybatch against transformers serve (needs `pip install -e .[peer]`)")
    )
    add_simcheck_args(bench_sub.add_parser("simcheck", help="the simulator against the live fleet at the same loads"))
    add_tiers_sim_args(
        bench_sub.add_parser("tiers-sim", help="paid against free, simulated: the rest of a batch handed back or not")
    )
    add_host_loss_sim_args(
        bench_sub.add_parser(
            "host-loss-sim", help="a lost host, simulated: no copies, copies of running or buffered too"
        )
    )
    add_dash_bench_args(bench_sub.add_parser("dash", help="the dashboard's own CPU, watching a fleet under load"))
    add_rebalance_bench_args(
        bench_sub.add_parser("rebalance", help="demand moves between the models: do the replicas follow?")
    )
    add_goodput_args(bench_sub.add_parser("goodput", help="answered 200 a second at and past capacity, both policies"))
    add_cycle_args(bench_sub.add_parser("cycle", help="one saturated replica: does the engine wait for its loop?"))
    add_path_cpu_args(
        bench_sub.add_parser(
            "path-cpu",
            aliases=["gateway-cpu"],
            help="CPU per request of the gateway, the replicas and the broker: this checkout against another",
        )
    )
    add_floor_args(
        bench_sub.add_parser(
            "floor", help="CPU per request of the gateway's stack alone: Flask and bare WSGI on gunicorn"
        )
    )
    add_broker_bench_args(
        bench_sub.add_parser("broker", help="Valkey's commands, bytes and CPU per request, and one core's share")
    )
    add_ops_bench_args(
        bench_sub.add_parser("ops", help="drain and move a replica under load: nothing lost, how long, p99")
    )


def _add_tool_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """load, chaos, model, capacity and the fleet's commands."""
    from control.cli.args import add_load_args

    add_load_args(sub.add_parser("load", help="open-loop load against a running gateway"))
    from control.cli.args import add_chaos_args

    add_chaos_args(sub.add_parser("chaos", help="inject one fault into a live deployment under load and report"))

    from control.cli.args import add_model_args

    add_model_args(sub.add_parser("model", help="build the local code models, or measure their quality"))

    from control.sim.capacity_cli import add_capacity_args

    add_capacity_args(sub.add_parser("capacity", help="capacity arithmetic and simulation at any request rate"))

    from control.cli.fleet import add_fleet_args

    add_fleet_args(sub)


def _add_watching_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """dash, flower: watching a running fleet."""
    dash = sub.add_parser("dash", help="the operators' terminal dashboard (Textual)")
    dash.add_argument("--poll-s", type=float, default=1.0, help="seconds between reads of the fleet")
    dash.add_argument("--slo-ms", type=float, default=600.0, help="the end-to-end p99 the fleet promises")
    dash.add_argument("--screenshot", default=None, help="write an SVG of the screen here when it quits")
    dash.add_argument("--exit-after", type=float, default=None, help="quit after this many seconds")
    dash.add_argument("--port", type=int, default=None, help="the deployment whose gateway serves on this port")
    flower = sub.add_parser("flower", help="Celery Flower against the same broker")
    flower.add_argument("--flower-port", type=int, default=5555)
    flower.add_argument("--port", type=int, default=None, help="the deployment whose gateway serves on this port")
    flower.add_argument("--cell", type=int, default=0, help="the cell to watch (one Flower a cell)")
    flower.add_argument(
        "--address", default="127.0.0.1", help="where to listen; anything but loopback needs --basic-auth"
    )
    flower.add_argument(
        "--basic-auth",
        default=None,
        help="user:password (or set FLOWER_BASIC_AUTH); required off loopback; on loopback one is generated",
    )


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    args = _parser(serving_only=bool(given) and given[0] in SERVING_COMMANDS).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = Settings()
    if getattr(args, "port", None) is not None:
        settings = settings.model_copy(update={"port": args.port})
    if getattr(args, "policy", "") is None:  # every command's --policy defaults to the one setting
        args.policy = settings.policy
    return COMMANDS[args.command](settings, args)


def operator_settings(settings: Settings) -> Settings:
    """The settings an operator's tool acts with: the configured broker URL, else the
    operator's credentials that `keybatch up` (serving on PORT) left in SECRETS_DIR."""
    if settings.redis_url is not None or settings.broker_url is not None or settings.cells:
        return settings
    from control.fleet.credentials import credentials_path, read_operator_cells

    path = credentials_path(settings.secrets_dir, settings.port)
    cells = read_operator_cells(path)
    if not cells:
        raise SystemExit(
            f"keybatch: no broker: set KEYBATCH_REDIS_URL, or run this as the user who ran `keybatch up` "
            f"(it leaves the operator's credentials in {path}; KEYBATCH_PORT picks the deployment)"
        )
    return settings.model_copy(update={"redis_url": cells[0], "cells": cells if len(cells) > 1 else []})


def _up(settings: Settings, args: argparse.Namespace) -> int:
    from control.fleet.up import Plan, PlanError, System

    models = [m for m in args.models.split(",") if m]
    if args.backend == "hf":
        from control.cli.models import ensure_models

        models = ensure_models(settings, models)
        if not models:
            return 2
    plan = Plan(
        workers=args.workers,
        backend=args.backend,
        policy=args.policy,
        models=models,
        port=settings.port,
        cells=args.cells,
        replicas_per_host=args.replicas_per_host,
    )
    try:
        system = System(settings, plan)
    except PlanError as exc:
        print(f"keybatch up: {exc}", file=sys.stderr)
        return 2
    system.start()
    print(f"keybatch ready: {system.url}", flush=True)
    return system.wait()


def _api(settings: Settings, args: argparse.Namespace) -> int:
    from api.server.serve import serve

    serve(settings)
    return 0


def _worker(settings: Settings, args: argparse.Namespace) -> int:
    from control.core.memory import freeze_while_waiting
    from tasks.engine.contract import Engine
    from tasks.replica.backends import make_engine
    from tasks.replica.worker import import_worker_modules, run_worker

    if args.model not in settings.models:
        print(f"unknown model {args.model!r}; configured: {', '.join(settings.models)}", file=sys.stderr)
        return 2
    name = args.name
    preloaded: tuple[str, Engine] | None = None  # a standby's engine, loaded while it waits
    if args.standby:
        if not _has_folder(settings, args.model, args.backend):
            return 2
        preloaded = (args.model, make_engine(settings, args.model, args.backend, args.policy))
        import_worker_modules()
        freeze_while_waiting()
        taken = _take_place()
        if taken is None:
            return 0  # the supervisor stopped (or died) before it needed this standby
        settings, name, args.model = Settings(), taken.name, taken.model
    name = name or f"{args.model}-{os.getpid()}@{settings.host}"
    model = _assigned_model(settings, name) or args.model
    if not _has_folder(settings, model, args.backend):
        return 2

    def load_engine(other: str) -> Engine:
        return make_engine(settings, other, args.backend, args.policy)

    engine = preloaded[1] if preloaded is not None and preloaded[0] == model else load_engine(model)
    del preloaded  # another model's engine is not kept for the worker's life
    return run_worker(settings, model, engine, name, loglevel=args.loglevel, load_engine=load_engine)


def _has_folder(settings: Settings, model: str, backend: str) -> bool:
    if backend == "hf" and not (settings.model_path(model) / "config.json").exists():
        print(f"no model folder at {settings.model_path(model)}: `keybatch model build`", file=sys.stderr)
        return False
    return True


@dataclass
class Place:
    """The replica a standby becomes: its name, its model, its environment."""

    name: str
    model: str
    env: dict[str, str]


def _take_place() -> Place | None:
    """A standby's wait: one line of JSON on stdin (`keybatch up` writes it when a replica
    dies), or the end of stdin when the supervisor stopped or died."""
    line = sys.stdin.readline()
    if not line.strip():
        return None
    raw = json.loads(line)
    place = Place(str(raw["name"]), str(raw["model"]), {str(k): str(v) for k, v in raw["env"].items()})
    os.environ.clear()
    os.environ.update(place.env)
    logging.getLogger(__name__).info("standby (pid %d) takes the place of replica %s", os.getpid(), place.name)
    return place


def _assigned_model(settings: Settings, name: str) -> str | None:
    """The model this replica was last moved to (`keybatch move`), if it still is configured:
    a replica restarted by its supervisor keeps serving what the operator moved it to."""
    import redis

    from control.broker import keys
    from control.core import connect

    try:
        client = connect.client(settings.state_url, socket_timeout=2, socket_connect_timeout=2)
        raw = client.get(keys.assignment_key(name))
    except (redis.RedisError, RuntimeError):
        return None
    model = raw.decode() if isinstance(raw, bytes) else None
    if model and model in settings.models:
        logging.getLogger(__name__).info("replica %s serves %s, where it was moved", name, model)
        return model
    return None


def _bench(settings: Settings, args: argparse.Namespace) -> int:
    if args.bench == "engine":
        from control.bench.engine import run_engine_bench

        return run_engine_bench(settings, args)
    from control.bench import serving as bench

    if args.bench == "policies":
        return bench.run_policies(settings, args)
    if args.bench == "peer":
        from control.bench.peer import run_peer

        return run_peer(settings, args)
    if args.bench == "broker" and args.cells:
        from control.bench.cells import run_cells_bench

        return run_cells_bench(args)
    if args.bench == "broker":
        from control.bench.broker_cost import run_broker

        return run_broker(args)
    if args.bench == "rebalance":
        from control.bench.rebalancing import run_rebalance_bench

        return run_rebalance_bench(args)
    if args.bench == "dash":
        from control.bench.dashboard import run_dash_bench

        return run_dash_bench(args)
    if args.bench == "simcheck":
        from control.bench.simcheck import run_simcheck

        return run_simcheck(args)
    if args.bench == "tiers-sim":
        from control.bench.tiers_sim import run_tiers_sim

        return run_tiers_sim(args)
    if args.bench == "host-loss-sim":
        from control.bench.host_loss_sim import run_host_loss_sim

        return run_host_loss_sim(args)
    if args.bench == "ops":
        from control.bench.operations import run_ops

        return run_ops(settings, args)
    if args.bench == "goodput":
        from control.bench.goodput import run_goodput

        return run_goodput(args)
    if args.bench == "cycle":
        from control.bench.cycle import run_cycle

        return run_cycle(args)
    if args.bench == "floor":
        from control.bench.floor import run_floor

        return run_floor(args)
    if args.bench in ("path-cpu", "gateway-cpu"):
        from control.bench.path_cpu import run_path_cpu

        return run_path_cpu(args)
    return bench.run_serving(settings, args)


def _load(settings: Settings, args: argparse.Namespace) -> int:
    from control.load.loadgen import run_load

    return run_load(args)


def _dash(settings: Settings, args: argparse.Namespace) -> int:
    from control.fleet.operator import Operator
    from tui.dash import run_dash

    run_dash(Operator(operator_settings(settings)), args.poll_s, args.slo_ms, args.screenshot, args.exit_after)
    return 0


def _flower(settings: Settings, args: argparse.Namespace) -> int:
    import ipaddress

    from tasks.celery.app import make_celery

    auth = args.basic_auth or os.environ.get("FLOWER_BASIC_AUTH")
    try:
        loopback = ipaddress.ip_address(args.address).is_loopback
    except ValueError:
        loopback = args.address == "localhost"
    if not loopback and not auth:
        print(
            f"refusing to serve Flower on {args.address} without credentials: "
            "give --basic-auth user:password (or FLOWER_BASIC_AUTH), or listen on 127.0.0.1",
            file=sys.stderr,
        )
        return 2
    settings = operator_settings(settings)  # Flower's inspect commands are remote control
    if not 0 <= args.cell < len(settings.cell_urls):
        print(f"keybatch flower: --cell {args.cell}: the deployment has {len(settings.cell_urls)}", file=sys.stderr)
        return 2
    settings = settings.model_copy(update={"broker_url": settings.cell_urls[args.cell], "cells": []})
    if not auth:  # loopback is every local user's: a generated password, kept privately
        auth = _flower_credential(settings, args.flower_port)
    argv = ["flower", f"--port={args.flower_port}", f"--address={args.address}", f"--basic-auth={auth}"]
    app = make_celery(settings)
    # Replicas send task events while a monitor asks (KEYBATCH_TASK_EVENTS=watched): ask now,
    # not at Flower's first periodic ask 5 s in, so the first requests are listed too.
    app.control.enable_events()
    app.start(argv)
    return 0


def _flower_credential(settings: Settings, port: int) -> str:
    """A fresh `keybatch:PASSWORD`, written to a file only this user can read."""
    import secrets

    from control.fleet.credentials import write_private

    auth = f"keybatch:{secrets.token_urlsafe(24)}"
    path = settings.secrets_dir / f"flower-{port}.auth"
    write_private(path, auth + "\n")
    print(f"keybatch flower: basic auth user:password in {path}", file=sys.stderr, flush=True)
    return auth


def _chaos(settings: Settings, args: argparse.Namespace) -> int:
    from control.chaos.run import run_chaos

    return run_chaos(settings, args)


def _capacity(settings: Settings, args: argparse.Namespace) -> int:
    from control.sim.capacity_cli import run_capacity

    return run_capacity(args)


def _fleet(settings: Settings, args: argparse.Namespace) -> int:
    from control.cli.fleet import run_fleet_command

    return run_fleet_command(operator_settings(settings), args)


def _model(settings: Settings, args: argparse.Namespace) -> int:
    from control.cli.models import run_model

    return run_model(settings, args)


COMMANDS = {
    "up": _up,
    "api": _api,
    "worker": _worker,
    "bench": _bench,
    "load": _load,
    "flower": _flower,
    "dash": _dash,
    "chaos": _chaos,
    "model": _model,
    "capacity": _capacity,
    **dict.fromkeys(("fleet", "drain", "resume", "move", "rebalance"), _fleet),
}

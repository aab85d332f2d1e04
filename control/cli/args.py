"""Arguments of the bench and load commands (kept apart so `keybatch` starts fast)."""

from __future__ import annotations

import argparse

from control.core.vocab import ARRIVALS, BACKENDS, FREE, PAID, POLICIES


def add_serving_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of the 90%% load run")
    p.add_argument(
        "--scenarios",
        default="low,load90,overload",
        help="comma-separated: low,load90,overload,curve (curve: system time at 20-90%% load, not run by default)",
    )
    p.add_argument(
        "--overload-batch",
        type=int,
        default=None,
        help="max_batch for the 2x-capacity scenario (default: KEYBATCH_MAX_BATCH, 64)",
    )
    p.add_argument(
        "--collector",
        choices=["native", "chord"],
        default=None,
        help="how the replicas run a batch (default: KEYBATCH_COLLECTOR, native; docs/decisions/0001-collector.md)",
    )
    p.add_argument("--json", default=None, help="write all figures here")


def add_policies_args(p: argparse.ArgumentParser) -> None:
    p.description = "Static against continuous batching on a real model, on the same open-loop workload."
    p.add_argument("--model", default="kb-small")
    p.add_argument("--workers", type=int, default=1, help="replicas (each uses KEYBATCH_ENGINE_THREADS threads)")
    p.add_argument("--policies", default="static,continuous")
    p.add_argument("--duration", type=float, default=20.0, help="seconds per rate")
    p.add_argument("--start-rate", type=float, default=1.0)
    p.add_argument("--step", type=float, default=1.5, help="each rate of the ladder is this times the last")
    p.add_argument("--max-rate", type=float, default=200.0)
    p.add_argument("--common-rate", type=float, default=None, help="default: the lower sustainable rate")
    p.add_argument("--p99-ms", type=float, default=1000.0, help="the latency target a sustainable rate meets")
    p.add_argument("--deadline-ms", type=float, default=5000.0, help="the clients' X-Deadline-Ms")
    p.add_argument("--requests", type=int, default=400, help="distinct request bodies, sent in turn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefix", action="store_true", help="also the shared-header workload, cache on and off")
    p.add_argument("--prefix-rate", type=float, default=20.0, help="offered rate of the prefix runs")
    p.add_argument("--json", default=None, help="write all figures here")


def add_peer_args(p: argparse.ArgumentParser) -> None:
    p.description = (
        "keybatch against `transformers serve --continuous-batching` on the same model folder and the same "
        "open-loop workload: each one's sustainable rate, then a burst at twice it and how long until a probe "
        "is served normally again. The peer needs `pip install -e .[peer]`."
    )
    p.add_argument("--model", default="kb-small", help="keybatch's name for the model")
    p.add_argument("--model-path", default=None, help="the model folder both serve (default: the model's folder)")
    p.add_argument("--servers", default="peer,keybatch", help="comma-separated: which of peer,keybatch to measure")
    p.add_argument("--workers", type=int, default=1, help="keybatch replicas; the peer gets as many torch threads")
    p.add_argument("--duration", type=float, default=20.0, help="seconds per rate of the ladder")
    p.add_argument("--start-rate", type=float, default=1.0)
    p.add_argument("--step", type=float, default=1.5, help="each rate of the ladder is this times the last")
    p.add_argument("--max-rate", type=float, default=200.0)
    p.add_argument("--p99-ms", type=float, default=1000.0, help="the latency target a sustainable rate meets")
    p.add_argument("--timeout-s", type=float, default=10.0, help="a ladder client gives up after this")
    p.add_argument("--deadline-ms", type=float, default=10_000.0, help="keybatch's X-Deadline-Ms on the ladder")
    p.add_argument("--requests", type=int, default=400, help="distinct request bodies, sent in turn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--burst-factor", type=float, default=2.0, help="the burst's rate over the sustainable rate")
    p.add_argument("--burst-s", type=float, default=20.0)
    p.add_argument("--burst-deadline-ms", type=float, default=2000.0, help="keybatch's X-Deadline-Ms in the burst")
    p.add_argument("--margin-ms", type=float, default=250.0, help="an answer this late past its deadline is in time")
    p.add_argument("--probe-rps", type=float, default=1.0)
    p.add_argument("--probe-tokens", type=int, default=8, help="max_tokens of a probe (the shortest prompt)")
    p.add_argument("--idle-probes", type=int, default=10, help="probes of the idle server that set what is normal")
    p.add_argument("--recovery-factor", type=float, default=1.5, help="normal: probe p50 within this x idle p50")
    p.add_argument("--recovery-s", type=float, default=120.0, help="probe at most this long after the burst")
    p.add_argument("--hold-probes", type=int, default=5, help="normal probes after the burst that end the probe")
    p.add_argument("--settle-s", type=float, default=60.0, help="at most this long to settle between runs")
    p.add_argument("--peer-memory", type=float, default=0.2, help="the peer's --cb-max-memory-percent")
    p.add_argument(
        "--no-peer-cb", dest="peer_cb", action="store_false", help="start the peer without continuous batching"
    )
    p.add_argument(
        "--peer-arg",
        action="append",
        default=[],
        help="one more argument to transformers serve, e.g. --peer-arg=--cb-max-batch-tokens=512 (repeatable)",
    )
    p.add_argument("--start-timeout-s", type=float, default=300.0, help="to load the model and answer once")
    p.add_argument("--json", default=None, help="write all figures here")


def add_engine_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default="kb-small", help="a configured model name (under KEYBATCH_MODELS_DIR) or a model folder"
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    p.add_argument("--batches", default="1,2,4,8,16,32,64", help="comma-separated decode batch sizes")
    p.add_argument("--contexts", default="128,256,512,1024", help="comma-separated context lengths")
    p.add_argument("--chunks", default="16,32,64,128,256,512", help="comma-separated prefill chunk sizes")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point (the median is kept)")
    p.add_argument(
        "--serve", type=int, default=0, help="also serve this many requests with each policy (0: the curve only)"
    )
    p.add_argument("--serve-rps", default="4,16", help="their Poisson arrival rates, comma-separated (one run each)")
    p.add_argument("--serve-batch", type=int, default=16, help="slots of the serving engines")
    p.add_argument("--json", default=None, help="write the curve here")


def add_load_args(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Open-loop load against keybatch or any OpenAI-compatible completions URL: arrivals on schedule "
        "whatever the answers take; a report per tier, per model and per time window."
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="base URL (http://host:port, or .../v1)")
    p.add_argument(
        "--rps", type=float, default=None, help="requests a second (the peak for diurnal); not with --tenant"
    )
    p.add_argument("--duration", type=float, required=True, help="seconds")
    p.add_argument(
        "--arrivals",
        choices=ARRIVALS,
        default="poisson",
        help="poisson: flat; bursts: 3x for 2 s of every 20 s; diurnal: a day compressed into the run, "
        "20%% at night up to the peak mid-run; typing: users in typing sessions, a request per "
        "keystroke pause with X-Session-Id, each superseding the one before (409 superseded)",
    )
    p.add_argument(
        "--profile",
        choices=[FREE, "mixed", PAID],
        default="free",
        help="free: all free; mixed: 30%% paid; paid: all paid",
    )
    p.add_argument("--paid-fraction", type=float, default=None, help="share of paid requests (instead of --profile)")
    p.add_argument("--model", default="kb-small", help="the model, without --models")
    p.add_argument("--models", default=None, help="a mix, e.g. kb-small=0.8,kb-large=0.2")
    p.add_argument("--shift-to", default=None, help="the mix the demand moves to, e.g. kb-small=0.2,kb-large=0.8")
    p.add_argument("--shift-from-s", type=float, default=None, help="when the shift starts (seconds into the run)")
    p.add_argument("--shift-over-s", type=float, default=None, help="how long it takes, linearly (0: at once)")
    p.add_argument("--keystrokes", type=float, default=6.0, help="typing: requests per session on average")
    p.add_argument("--pause-ms", type=float, default=350.0, help="typing: a pause is 100 ms + exponential of this")
    p.add_argument("--paid-key", default=None)
    p.add_argument("--free-key", default=None)
    p.add_argument("--api-key", default=None, help="one key for every request (a server without paid/free tiers)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--deadline-ms", type=float, default=None, help="sent as X-Deadline-Ms")
    p.add_argument("--seed", type=int, default=1, help="the arrivals, tiers and models drawn")
    p.add_argument("--window-s", type=float, default=5.0, help="report p50/p99 per window of this many seconds")
    p.add_argument("--slo-ms", type=float, default=None, help="say from when each model's p99 per window held it")
    p.add_argument(
        "--tenant",
        action="append",
        default=None,
        metavar="SPEC",
        help="one key's own load, reported apart (repeat for several; instead of --rps): "
        "name=N,key=K,rps=R[,deadline-ms=D][,prompt-chars=C][,from-s=S][,for-s=S] (key=- sends no key)",
    )
    p.add_argument("--json", default=None, help="write the report and every request here")
    p.add_argument("--plot", default=None, help="draw latency, offered rate and answers other than 200 over time (PNG)")


CHAOS_SCENARIOS = {  # control/chaos/faults.py has one fault for each
    "replica-kill": "SIGKILL a replica while it runs a batch",
    "replica-hang": "SIGSTOP a replica for 5 s, then SIGCONT",
    "broker-stall": "SIGSTOP the broker for 5 s, then SIGCONT",
    "broker-loss": "SIGKILL the broker (the supervisor should restart it)",
    "cell-loss": "--cells N (default 3): SIGKILL one cell's broker, or with --pause SIGSTOP it for 5 s",
    "host-loss": "--replicas-per-host K (default 2): SIGSTOP every replica of one host for 5 s, then SIGKILL them",
    "gateway-kill": "SIGKILL one gateway worker process",
    "client-hangup": "20% of clients close their connection 100 ms after sending",
    "region-loss": "two deployments, A with peer B; SIGKILL A's broker and replicas",
    "slowloris": "hundreds of connections dribble header bytes during the load",
    "idle-connections": "2,100 connections from 10 loopback addresses send nothing during the load",
    "overload-spike": "arrivals jump to --spike x capacity for --spike-s seconds",
}


def add_chaos_args(p: argparse.ArgumentParser) -> None:
    p.description = "Inject one fault into a live deployment under load; exit 0 when nothing was lost or duplicated."
    p.epilog = "scenarios:\n" + "\n".join(f"  {name:14} {what}" for name, what in CHAOS_SCENARIOS.items())
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("scenario", choices=list(CHAOS_SCENARIOS), metavar="SCENARIO", help="see below")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--cells", type=int, default=None, help="`up --cells` (default 1; cell-loss: 3)")
    p.add_argument("--pause", action="store_true", help="cell-loss: SIGSTOP the cell's broker for 5 s, not SIGKILL")
    p.add_argument(
        "--replicas-per-host", type=int, default=None, help="`up --replicas-per-host` (default 0; host-loss: 2)"
    )
    p.add_argument("--load", type=float, default=0.7, help="share of capacity (replicas x batch per batch time)")
    p.add_argument(
        "--peer-load",
        type=float,
        default=None,
        help="start a peer region B (as many replicas, A lists it in PEERS) and drive its own clients at this "
        "share of its capacity (0: idle); region-loss always has one (default there: 0)",
    )
    p.add_argument("--paid-share", type=float, default=0.3)
    p.add_argument("--duration", type=float, default=30.0, help="seconds of load")
    p.add_argument("--fault-at", type=float, default=8.0, help="seconds into the load")
    p.add_argument("--repeat", type=int, default=1, help="inject the fault this often, a few seconds apart")
    p.add_argument("--deadline-ms", type=float, default=None, help="the clients' X-Deadline-Ms")
    p.add_argument("--seed", type=int, default=1, help="arrivals and the choice of victims")
    p.add_argument("--spike", type=float, default=3.0, help="overload-spike: arrivals as a multiple of capacity")
    p.add_argument("--spike-s", type=float, default=30.0, help="overload-spike: how long")
    p.add_argument(
        "--client-retries",
        type=int,
        default=2,
        help="a client whose connection breaks resends with the same X-Request-Id (joins the request)",
    )
    p.add_argument("--backend", choices=BACKENDS, default="fixed", help="the replicas' engine (`up --backend`)")
    p.add_argument("--policy", choices=POLICIES, default=None, help="`up --policy` (default: the POLICY setting)")
    idle = p.add_argument_group("client-hangup --idle: one fault at a time on an idle deployment, no load")
    idle.add_argument("--idle", action="store_true", help="hang-ups and cancels alternately, nothing else running")
    idle.add_argument("--hangups", type=int, default=100, help="clients that hang up 100 ms after sending")
    idle.add_argument("--cancels", type=int, default=100, help="clients that cancel (DELETE) 100 ms after sending")
    idle.add_argument("--every", type=float, default=0.5, help="seconds from one fault to the next")
    idle.add_argument(
        "--tail",
        type=float,
        default=None,
        help="quiet seconds after the last fault, then a request per replica (default: what the stall watchdog needs)",
    )
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--keep-logs", action="store_true", help="keep the deployments' logs of a passed run too")


def add_model_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="model_command", required=True)
    build = sub.add_parser("build", help="train a model (tokenizer, weights) into MODELS_DIR")
    build.add_argument("--name", default=None, help="NAME-small or NAME-large (default: every configured model)")
    build.add_argument("--steps", type=int, default=None, help="training steps (default: the size's, a few minutes)")
    build.add_argument("--seed", type=int, default=0)
    quality = sub.add_parser("eval", help="next-line quality on held-out code, next to the untrained model")
    quality.add_argument("--name", default=None, help="a built model (default: every configured model)")
    quality.add_argument("-n", type=int, default=200, help="prompts")
    quality.add_argument("--seed", type=int, default=0, help="which prompts")
    quality.add_argument("--json", default=None, help="write the figures here")


def add_path_cpu_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkout", required=True, help="the other checkout (a git worktree) to compare with")
    p.add_argument("--rate", type=float, default=300.0, help="offered requests per second")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of measured load per run")
    p.add_argument("--rounds", type=int, default=3, help="runs of each side, interleaved")
    p.add_argument("--workers", type=int, default=2, help="replicas")
    p.add_argument(
        "--replicas-per-host", type=int, default=0, help="`up --replicas-per-host` (1: a host each, for hedging)"
    )
    p.add_argument("--json", default=None, help="write all figures here")
    p.add_argument("--profile", default=None, help="then profile each side's gateway (cProfile) into this folder")
    p.add_argument("--profile-rate", type=float, default=50.0, help="offered requests per second while profiling")
    p.add_argument(
        "--other-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting for the other side's deployment only (with --checkout . : one checkout, two settings)",
    )


def add_floor_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rate", type=float, default=300.0, help="offered requests per second")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of measured load per run")
    p.add_argument("--rounds", type=int, default=3, help="runs of each app, interleaved")
    p.add_argument("--json", default=None, help="write all figures here")


def add_broker_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rate", type=float, default=300.0, help="offered requests per second")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of load read through Valkey's counters")
    p.add_argument("--idle", type=float, default=5.0, help="seconds of no load first (background rates)")
    p.add_argument("--sample", type=float, default=3.0, help="seconds of load under MONITOR (calls by script)")
    p.add_argument("--workers", type=int, default=2, help="replicas")
    p.add_argument("--paid-share", type=float, default=0.3, help="share of paid requests")
    p.add_argument(
        "--no-own-ids", dest="own_ids", action="store_false", help="no X-Request-Id (no answers kept for retries)"
    )
    p.add_argument("--replay-rounds", type=int, default=5, help="replays of the sample on a fresh Valkey (0: none)")
    p.add_argument("--target-rps", type=float, default=40_000.0, help="requests per second a region must carry")
    p.add_argument("--utilization", type=float, default=0.5, help="the share of a Valkey core to plan on")
    p.add_argument(
        "--cells", default=None, help="e.g. 1,2,3: the same load on deployments of that many cells, compared"
    )
    p.add_argument("--json", default=None, help="write all figures here")


def add_tiers_sim_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cases", default="2x32,2x64,4x64,8x64", help="REPLICASxBATCH, comma-separated")
    p.add_argument("--loads", default="0.5,0.7,0.9,1.1,2.0", help="shares of the replicas' capacity")
    p.add_argument("--horizons", default="0.6,0.85", help="other urgency horizons tried at 110%% and 200%%")
    p.add_argument(
        "--switch",
        choices=["hand-back", "pull-early", "admit-phased", "concentrate", "bump", "lead-yields", "admit-open"],
        default="hand-back",
        help="what each case runs off and on: HAND_BACK_REST, PULL_EARLY, ADMIT_PHASED, arrivals concentrated "
        "on an idle replica already gathering (SINGLE_LISTENER), free requests bumped by paid ones "
        "(ADMIT_BUMP), or busy replicas yielding their lead to an idle listener (LEAD_YIELDS, one listener "
        "in both arms), or admission as deep as the best phase allows while the demand is below capacity "
        "(ADMIT_OPEN); no other horizons then",
    )
    p.add_argument("--jitter-ms", type=float, default=0.0, help="a batch takes 250 ms plus up to this much more")
    p.add_argument("--seconds", type=float, default=40.0, help="simulated seconds a run")
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--json", default=None, help="write all figures here")


def add_host_loss_sim_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--replicas-per-host", type=int, default=2, help="the first host's are lost")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--loads", default="0.35,0.45,0.7", help="shares of the replicas' capacity")
    p.add_argument("--seeds", type=int, default=5, help="arrivals: one run, and one loss, per seed and arm")
    p.add_argument("--seconds", type=float, default=20.0, help="simulated seconds a run")
    p.add_argument("--lease-ms", type=float, default=300.0, help="a lost replica's requests are copied until then")
    p.add_argument("--detect-ms", type=float, default=400.0, help="from the loss to the sweep (lease and sweep)")
    p.add_argument(
        "--bump", action="store_true", help="every arm admits free requests that paid ones may bump (simulator only)"
    )
    p.add_argument(
        "--no-open",
        action="store_true",
        help="every arm admits by the worst phase's limit at any load (ADMIT_OPEN off; it is on by default)",
    )
    p.add_argument(
        "--arms",
        default="off,running,+buffered",
        help="copies: off, of running requests, +buffered ones too, +idle: and batches of copies on idle replicas",
    )
    p.add_argument(
        "--single-listener", action="store_true", help="every arm sends an arrival to the idle replica gathering"
    )
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--json", default=None, help="write all figures here")


def add_simcheck_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--loads", default="0.3,0.6,0.9", help="shares of the fleet's capacity")
    p.add_argument("--workers", type=int, default=2, help="replicas")
    p.add_argument("--duration", type=float, default=30.0, help="seconds per load")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--sim-runs", type=int, default=5, help="simulated runs pooled per load, each its own arrivals")
    p.add_argument("--sim-warmup", type=float, default=10.0, help="simulated seconds not counted at the start of a run")
    p.add_argument("--hf-rps", type=float, default=0.0, help="also the torch engine (kb-small) at this rate; 0: not")
    p.add_argument("--hf-curve", default=None, help="the engine curve JSON for that check (default: measured first)")
    p.add_argument("--hf-curve-out", default=None, help="write the curve scaled to the serving engine's times here")
    p.add_argument("--json", default=None, help="write all figures here")


def add_dash_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=8, help="over two models")
    p.add_argument("--duration", type=float, default=30.0, help="seconds the dashboard's CPU is read over")
    p.add_argument("--load", type=float, default=0.5, help="offered load, a share of each model's capacity")
    p.add_argument("--svg", default=None, help="write the dashboard's last screen here (SVG)")
    p.add_argument("--json", default=None, help="write all figures here")


def add_rebalance_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--load", type=float, default=0.6, help="offered load, a share of the whole fleet's capacity")
    p.add_argument("--max-batch", type=int, default=16, help="small batches keep the two cores for the replicas")
    p.add_argument("--steady-s", type=float, default=20.0)
    p.add_argument("--shift-s", type=float, default=60.0)
    p.add_argument("--after-s", type=float, default=60.0)
    p.add_argument("--modes", default="auto,off", help="auto: with the rebalancer; off: without")
    p.add_argument("--json", default=None, help="write all figures here")


def add_ops_bench_args(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Drain or move a replica of a live deployment under load (fixed backend, static policy) as an operator "
        "would, with the operator's API; report what every request got, p50/p99 before, during and after "
        "the action, and how long until the replica was drained or serving the other model. Exit 0 when nothing "
        "was lost or failed."
    )
    p.add_argument("--action", choices=["drain", "move", "both"], default="both", help="both: each on its own run")
    p.add_argument("--replicas", type=int, default=4, help="kb-small replicas (a move adds one kb-large)")
    p.add_argument("--load", type=float, default=0.7, help="kb-small's rate, as a share of its replicas' capacity")
    p.add_argument(
        "--other-load", type=float, default=0.1, help="move: kb-large's rate, as a share of one replica's capacity"
    )
    p.add_argument("--paid-share", type=float, default=0.3)
    p.add_argument("--duration", type=float, default=30.0, help="seconds of load")
    p.add_argument("--action-at", type=float, default=10.0, help="seconds into the load")
    p.add_argument("--seed", type=int, default=1, help="arrivals")
    p.add_argument("--json", default=None, help="write the report here (one entry per action)")


def add_cycle_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkout", default=None, help="another checkout (a git worktree) to compare with")
    p.add_argument("--policies", default="static,continuous")
    p.add_argument("--seconds", type=float, default=8.0, help="seconds of saturation per run")
    p.add_argument("--rounds", type=int, default=3, help="runs of each side and policy, interleaved")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--batch-ms", type=float, default=250.0)
    p.add_argument("--json", default=None, help="write all figures here")


def add_goodput_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cases", default="32x1.1,32x2.0,64x0.9", help="BATCHxLOAD, comma-separated (load: of nominal)")
    p.add_argument("--policies", default="static,continuous")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of load per run")
    p.add_argument("--workers", type=int, default=2, help="replicas")
    p.add_argument("--json", default=None, help="write all figures here")

"""`keybatch bench engine`: what a step of the torch engine costs, measured.

The decode step's time against batch size and context length, and a prefill chunk's
time against its size: the curve that replaces the fixed backend's one batch time. A
decode point fills the slot cache to the context length (its values do not change the
time) and runs the engine's own decode forward over that many rows; a prefill point runs
the engine's prefill forward from position 0.

With `--serve N`, the same N requests (Poisson arrivals, prompts cut from a few code
files, so some share prefixes) are served by the static policy, the continuous one, and
the continuous one without the prefix cache, each on a fresh engine, in real time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from control.core.protocol import Job
from control.core.settings import Settings
from control.core.vocab import Policy
from tasks.engine.contract import Engine
from tasks.lm.hf_engine import PREFIX_CACHE_TOKENS, HFEngine

SOURCE_FILES = 4  # the served prompts are cut from this many synthetic code files


def _median_ms(run: Callable[[], object], repeats: int) -> float:
    run()  # the first call of a shape pays for allocation
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append((time.perf_counter() - started) * 1000.0)
    return statistics.median(times)


def decode_curve(
    engine: HFEngine, batches: list[int], contexts: list[int], repeats: int
) -> dict[str, dict[str, float]]:
    """{context: {batch: ms}} of one decode forward, each row attending over `context` positions."""
    curve: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for context in (c for c in contexts if c <= engine.max_context):
            row: dict[str, float] = {}
            for batch in (b for b in batches if b <= engine.max_batch):
                tokens = torch.full((batch,), engine.pad_id)
                positions = torch.full((batch,), context - 1)
                row[str(batch)] = _median_ms(partial(engine.forward_decode, tokens, positions), repeats)
            curve[str(context)] = row
    return curve


def prefill_curve(engine: HFEngine, chunks: list[int], repeats: int) -> dict[str, float]:
    """{chunk: ms} of one prefill forward of `chunk` prompt tokens."""
    curve: dict[str, float] = {}
    with torch.inference_mode():
        for chunk in (c for c in chunks if c < engine.max_context):
            ids = [engine.pad_id] * chunk
            curve[str(chunk)] = _median_ms(partial(engine.forward_prefill, 0, ids, 0), repeats)
    return curve


def describe(engine: HFEngine, folder: Path) -> dict[str, object]:
    config = engine.model.config
    return {
        "name": engine.name,
        "folder": folder.name,
        "parameters": sum(p.numel() for p in engine.model.parameters()),
        "hidden_size": config.hidden_size,
        "layers": config.num_hidden_layers,
        "heads": config.num_attention_heads,
        "kv_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        "context": engine.max_context,
        "vocab": config.vocab_size,
        "kv_cache_mb": engine.cache.nbytes / 2**20,
    }


def _commit() -> str | None:
    """The code's commit, when it runs from a git checkout."""
    try:
        found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5)
    except OSError:
        return None
    return found.stdout.strip() or None


def _machine(threads: int) -> dict[str, object]:
    return {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "commit": _commit(),
        "cpus": os.cpu_count(),
        "torch_threads": threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_avg_1m": os.getloadavg()[0],
    }


def _print(report: dict) -> None:
    model, machine = report["model"], report["machine"]
    console = Console(width=140)
    decode = report["decode_ms"]
    batches = list(next(iter(decode.values())))
    size = f"{model['parameters'] / 1e6:.1f} M parameters, {model['layers']} layers"
    load = f"load before {report['load_before']:.2f}, after {report['load_after']:.2f}"
    table = Table(title=f"decode step ms: {model['name']} ({size}), {machine['torch_threads']} threads; {load}")
    table.add_column("context")
    for batch in batches:
        table.add_column(f"batch {batch}", justify="right")
    table.add_column("tokens/s at the largest batch", justify="right")
    for context, row in decode.items():
        biggest = batches[-1]
        rate = int(biggest) * 1000.0 / row[biggest]
        table.add_row(context, *(f"{row[b]:.1f}" for b in batches), f"{rate:.0f}")
    console.print(table)
    prefill = Table(title="prefill chunk ms (from position 0)")
    prefill.add_column("chunk tokens")
    prefill.add_column("ms", justify="right")
    prefill.add_column("ms per token", justify="right")
    for chunk, ms in report["prefill_ms"].items():
        prefill.add_row(chunk, f"{ms:.1f}", f"{ms / int(chunk):.3f}")
    console.print(prefill)
    if "serve" in report:
        _print_serve(console, report["serve"])


def _print_serve(console: Console, serve: dict) -> None:
    for rps, policies in serve["by_rps"].items():
        title = f"{serve['requests']} requests, Poisson {rps} req/s, {serve['max_batch']} slots: arrival to finish"
        _print_policies(console, title, policies)


def _print_policies(console: Console, title: str, policies: dict) -> None:
    table = Table(title=title)
    columns = {
        "completion_tokens_per_s": "tokens/s",
        "latency_p50_ms": "p50 ms",
        "latency_p90_ms": "p90 ms",
        "latency_p99_ms": "p99 ms",
        "first_text_p50_ms": "first text p50 ms",
        "mean_decodes_per_step": "decodes/step",
        "prefill_tokens": "prefilled",
        "padding_tokens": "padding",
        "prefix_hit_rate": "prefix hits",
    }
    table.add_column("policy")
    for label in columns.values():
        table.add_column(label, justify="right")
    for name, row in policies.items():
        table.add_row(name, *(f"{row[c]:.2f}" if c == "prefix_hit_rate" else f"{row[c]:.0f}" for c in columns))
    console.print(table)


def _model_folder(settings: Settings, model: str) -> Path:
    """A configured model name (resolved against MODELS_DIR) or a folder."""
    return settings.model_path(model) if model in settings.models else Path(model)


@dataclass
class Arrival:
    at_s: float  # seconds from the start of the run
    job: Job


def _code_file(index: int, num_functions: int = 60) -> str:
    """A synthetic Python module: the served prompts are its prefixes."""
    parts = [f'"""Module {index}: numeric utilities."""\n\nimport math\n\n']
    for i in range(num_functions):
        name = f"step_{index}_{i}"
        parts.append(
            f"def {name}(values, scale={i + 1}):\n"
            f'    """Scale every value by {i + 1} and keep the positive ones."""\n'
            f"    result = [v * scale for v in values if v > {i % 7}]\n"
            f"    return sum(result) / max(1, len(result)) + math.sqrt({i})\n\n\n"
        )
    return "".join(parts)


def make_arrivals(engine: HFEngine, num_requests: int, rps: float, seed: int = 1) -> list[Arrival]:
    """Poisson arrivals of greedy completions: a prompt is a prefix of one of a few code files
    (64 tokens to three quarters of the context), max_tokens 8 to 64."""
    rng = random.Random(seed)
    files = [engine.tokenizer(_code_file(i), verbose=False).input_ids for i in range(SOURCE_FILES)]
    longest = min(min(len(f) for f in files), engine.max_context * 3 // 4)
    arrivals, at_s = [], 0.0
    for i in range(num_requests):
        at_s += rng.expovariate(rps)
        prompt = engine.decode_text(rng.choice(files)[: rng.randint(64, longest)])
        job = Job(
            id=f"w{i}",
            key=f"w{i}",
            model=engine.name,
            prompt=prompt,
            max_tokens=rng.randint(8, 64),
            gateway="bench",
            received_ms=0.0,
            deadline_ms=float("inf"),
        )
        arrivals.append(Arrival(at_s, job))
    return arrivals


def serve(engine: Engine, arrivals: list[Arrival]) -> dict[str, float]:
    """Feed `arrivals` to the engine in real time (each joins when a slot is free) and step it
    until all have finished: latency from arrival to the final output, and throughput."""
    pending, queued = deque(arrivals), deque[Arrival]()
    arrived_at = {a.job.id: a.at_s for a in arrivals}
    first_text: dict[str, float] = {}
    finished: dict[str, float] = {}
    tokens = 0
    start = time.perf_counter()
    while pending or queued or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and pending[0].at_s <= now:
            queued.append(pending.popleft())
        while queued and engine.free_slots() > 0:
            engine.add_request(queued.popleft().job)
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0].at_s - now) if pending else 0.0)
            continue
        for out in engine.step():
            now = time.perf_counter() - start
            if out.delta:
                first_text.setdefault(out.id, now)
            if out.is_finished:
                finished[out.id] = now
                tokens += out.completion_tokens
    duration = time.perf_counter() - start
    latency = [(finished[i] - arrived_at[i]) * 1000.0 for i in finished]
    first = [(first_text.get(i, finished[i]) - arrived_at[i]) * 1000.0 for i in finished]
    return {
        "requests": len(finished),
        "duration_s": duration,
        "completion_tokens_per_s": tokens / duration,
        "latency_p50_ms": _percentile(latency, 50),
        "latency_p90_ms": _percentile(latency, 90),
        "latency_p99_ms": _percentile(latency, 99),
        "first_text_p50_ms": _percentile(first, 50),
        "first_text_p99_ms": _percentile(first, 99),
    }


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def compare_policies(folder: Path, args: argparse.Namespace, rps: float) -> dict[str, dict[str, float]]:
    """The same arrivals through the static policy, the continuous one, and the continuous one
    without prefix reuse."""
    runs: list[tuple[str, Policy, int]] = [
        ("static", "static", PREFIX_CACHE_TOKENS),
        ("continuous", "continuous", PREFIX_CACHE_TOKENS),
        ("continuous_no_prefix_cache", "continuous", 0),
    ]
    results: dict[str, dict[str, float]] = {}
    arrivals: list[Arrival] | None = None
    for name, policy, cache_tokens in runs:
        engine = HFEngine(
            folder, max_batch=args.serve_batch, policy=policy, prefix_cache_tokens=cache_tokens, threads=args.threads
        )
        arrivals = arrivals or make_arrivals(engine, args.serve, rps)
        with torch.inference_mode():
            summary = serve(engine, arrivals)
        stats = engine.stats()
        decode_steps = max(1, stats["steps"])
        summary |= {
            "mean_decodes_per_step": stats["decode_tokens"] / decode_steps,
            "prefill_tokens": stats["prefill_tokens"],
            "padding_tokens": stats["padding_tokens"],
            "prefix_hit_rate": stats["prefix_hit_rate"],
            "step_ms": stats["step_ms"],
        }
        results[name] = summary
        engine.close()
    return results


def run_engine_bench(settings: Settings, args: argparse.Namespace) -> int:
    folder = _model_folder(settings, args.model)
    if not (folder / "config.json").exists():
        print(f"keybatch bench engine: no model in {folder} (config.json missing)")
        return 2
    batches = [int(b) for b in args.batches.split(",")]
    load_before = os.getloadavg()[0]
    engine = HFEngine(folder, max_batch=max(batches), threads=args.threads, prefix_cache_tokens=0)
    threads = torch.get_num_threads()
    report = {
        "model": describe(engine, folder),
        "machine": _machine(threads),
        "repeats": args.repeats,
        "load_before": load_before,
        "decode_ms": decode_curve(engine, batches, [int(c) for c in args.contexts.split(",")], args.repeats),
        "prefill_ms": prefill_curve(engine, [int(c) for c in args.chunks.split(",")], args.repeats),
    }
    engine.close()
    if args.serve:
        rates = [float(r) for r in args.serve_rps.split(",")]
        report["serve"] = {
            "requests": args.serve,
            "max_batch": args.serve_batch,
            "by_rps": {f"{rps:g}": compare_policies(folder, args, rps) for rps in rates},
        }
    report["load_after"] = os.getloadavg()[0]
    _print(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0

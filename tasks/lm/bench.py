"""`keybatch bench engine`: what a step of the torch engine costs, measured.

The decode step's time against batch size and context length, and a prefill chunk's
time against its size: the curve that replaces the fixed backend's one batch time. A
decode point fills the slot cache to the context length (its values do not change the
time) and runs the engine's own decode forward over that many rows; a prefill point runs
the engine's prefill forward from position 0.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from control.settings import Settings
from tasks.lm.engine import HFEngine

BATCHES = (1, 2, 4, 8, 16, 32, 64)
CONTEXTS = (128, 256, 512, 1024)
CHUNKS = (16, 32, 64, 128, 256, 512)


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
        "folder": str(folder),
        "parameters": sum(p.numel() for p in engine.model.parameters()),
        "hidden_size": config.hidden_size,
        "layers": config.num_hidden_layers,
        "heads": config.num_attention_heads,
        "kv_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        "context": engine.max_context,
        "vocab": config.vocab_size,
        "kv_cache_mb": engine.cache.nbytes / 2**20,
    }


def _machine(threads: int) -> dict[str, object]:
    return {
        "cpus": os.cpu_count(),
        "torch_threads": threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_avg_1m": os.getloadavg()[0],
    }


def _print(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

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


def _model_folder(settings: Settings, model: str) -> Path:
    """A configured model name (resolved against MODELS_DIR) or a folder."""
    return settings.model_path(model) if model in settings.models else Path(model)


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
        "load_after": os.getloadavg()[0],
    }
    engine.close()
    _print(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0

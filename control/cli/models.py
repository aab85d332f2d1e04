"""The local code models: `keybatch model build` and `keybatch model eval` (made and
measured), and which model folders `keybatch up` can serve.

Torch is imported inside the commands only, so the CLI starts without it. `keybatch up`
builds a missing small model in a child process (`keybatch model build`), so the
supervisor never imports torch; only the small one is built unasked (a few minutes on two
cores), the large one is left to `keybatch model build --name kb-large`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console
from rich.table import Table

from control.core.settings import Settings


def run_model(settings: Settings, args: argparse.Namespace) -> int:
    if args.model_command == "build":
        return build_models(settings, args)
    return eval_models(settings, args)


def build_models(settings: Settings, args: argparse.Namespace) -> int:
    """Build the named model, or every configured one (kb-small and kb-large), into MODELS_DIR."""
    from tasks.lm.train.build import BuildError, build, size_of

    names = [args.name] if args.name else list(settings.models)
    console = Console()
    try:
        for name in names:
            size_of(name)  # refuse a bad name before any work
    except BuildError as exc:
        print(f"keybatch model build: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    for name in names:
        console.print(f"[bold]{name}[/] -> {settings.models_dir / name}")
        folder = build(settings.models_dir, name, steps=args.steps, seed=args.seed)
        facts = json.loads((folder / "keybatch.json").read_text())
        console.print(
            f"  {facts['params'] / 1e6:.2f} M params, {facts['steps']} steps, {facts['tokens_seen']:,} tokens,"
            f" trained in {facts['train_s']:.0f} s (built in {facts['build_s']:.0f} s),"
            f" final loss {facts['final_loss']:.3f}, held-out loss {facts['held_out_loss']:.3f}"
        )
    console.print(f"done in {time.perf_counter() - started:.0f} s")
    return 0


def eval_models(settings: Settings, args: argparse.Namespace) -> int:
    """Score the named model, or every configured one, against its untrained twin."""
    from tasks.lm.train.quality import evaluate

    names = [args.name] if args.name else list(settings.models)
    missing = [name for name in names if not (settings.models_dir / name / "keybatch.json").exists()]
    if missing:
        where = settings.models_dir
        print(f"no built model {', '.join(missing)} in {where}: run `keybatch model build`", file=sys.stderr)
        return 2
    results = [evaluate(settings.models_dir / name, n=args.n, seed=args.seed) for name in names]
    Console().print(quality_table(results))
    if args.json:
        report = {
            "date": datetime.now(UTC).strftime("%Y-%m-%d"),
            "command": _eval_command(args),
            "results": results,
        }
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _eval_command(args: argparse.Namespace) -> str:
    name = f" --name {args.name}" if args.name else ""
    return f"keybatch model eval{name} -n {args.n} --seed {args.seed} --json {args.json}"


def quality_table(results: list[dict]) -> Table:
    """One row per model and per untrained twin."""
    n = results[0]["n"] if results else 0
    table = Table(title=f"next-line completion on {n} held-out prompts (greedy, up to the first newline)")
    columns = (
        "model",
        "params",
        "held-out loss",
        "exact match",
        "exact, outside encodings/",
        "edit sim.",
        "valid",
        "ended",
    )
    for column in columns:
        table.add_column(column, justify="left" if column == "model" else "right")
    for result in results:
        for kind in ("trained", "untrained"):
            scores = result[kind]
            loss = result["build"]["held_out_loss"] if kind == "trained" else None
            table.add_row(
                result["model"] if kind == "trained" else "  untrained twin",
                f"{result['params'] / 1e6:.1f} M",
                f"{loss:.2f}" if loss is not None else "",
                f"{scores['exact_match']:.1%}",
                f"{scores['exact_match_outside_encodings']:.1%}",
                f"{scores['edit_similarity']:.2f}",
                f"{scores['valid']:.1%}",
                f"{scores['ended']:.1%}",
            )
    if results:
        table.caption = f"valid: the true next lines score {results[0]['reference']['valid']:.1%} (docs/models.md)"
    return table


AUTO_BUILD_SUFFIX = "-small"


def is_built(settings: Settings, model: str) -> bool:
    return (settings.model_path(model) / "config.json").exists()


def ensure_models(settings: Settings, wanted: list[str]) -> list[str]:
    """The models to serve: those asked for (default: all configured) whose folders
    exist, after building a missing small one. Prints what it skips and why."""
    models = wanted or list(settings.models)
    unknown = [m for m in models if m not in settings.models]
    if unknown:
        return models  # the plan check names them
    for model in models:
        if not is_built(settings, model) and model.endswith(AUTO_BUILD_SUFFIX):
            print(f"keybatch up: building {model} (first run; a few minutes on two cores)", flush=True)
            cmd = [sys.executable, "-m", "control", "model", "build", "--name", model]
            if subprocess.call(cmd) != 0:
                print(f"keybatch up: building {model} failed", file=sys.stderr)
    served = [m for m in models if is_built(settings, m)]
    for model in models:
        if model not in served:
            print(
                f"keybatch up: {model} is not built ({settings.model_path(model)}); "
                f"serving without it (`keybatch model build --name {model}` adds it)",
                file=sys.stderr,
            )
    if not served:
        print("keybatch up: no model to serve (or `--backend fixed` for the simulated one)", file=sys.stderr)
    return served

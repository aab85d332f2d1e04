"""Arguments of the bench and load commands (kept apart so `keybatch` starts fast)."""

from __future__ import annotations

import argparse


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
    p.add_argument("--json", default=None, help="write all figures here")


def add_load_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--rps", type=float, required=True)
    p.add_argument("--duration", type=float, required=True, help="seconds")
    p.add_argument(
        "--profile",
        choices=["free", "mixed", "paid"],
        default="free",
        help="free: all free; mixed: 30%% paid; paid: all paid",
    )
    p.add_argument("--model", default="kb-small")
    p.add_argument("--paid-key", default=None)
    p.add_argument("--free-key", default=None)
    p.add_argument("--deadline-ms", type=float, default=None)
    p.add_argument("--json", default=None, help="write the summary and records here")

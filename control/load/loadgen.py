"""`keybatch load`: its arguments checked into a `LoadSpec`, the run, its report printed and written.

control/load/generator.py holds the open-loop generator, control/load/summary.py the figures,
control/load/printing.py the tables."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from urllib.parse import urlsplit

from control.load.generator import generate, generate_tenants
from control.load.printing import plot, print_models, print_statuses, print_summary
from control.load.spec import LoadSpec, TenantLoad, parse_mix, parse_tenant
from control.load.summary import report

_PROFILE_SHARES = {"free": 0.0, "mixed": 0.3, "paid": 1.0}


def spec_from_args(args: argparse.Namespace) -> LoadSpec:
    """The LoadSpec `keybatch load` runs; ValueError with the reason for bad arguments."""
    share = args.paid_fraction if args.paid_fraction is not None else _PROFILE_SHARES[args.profile]
    if args.api_key and (args.paid_key or args.free_key or args.paid_fraction is not None or args.profile != "free"):
        raise ValueError("--api-key sends one key for every request: it takes no --paid-key, --free-key or paid share")
    if urlsplit(args.url).scheme != "http":
        raise ValueError(f"--url must be an http:// base URL, not {args.url!r}")
    if args.shift_to is None and (args.shift_from_s is not None or args.shift_over_s is not None):
        raise ValueError("--shift-from-s and --shift-over-s need --shift-to")
    if args.window_s <= 0:
        raise ValueError("--window-s must be above 0")
    models = parse_mix(args.models) if args.models else None
    shift_to = parse_mix(args.shift_to) if args.shift_to else None
    if shift_to is not None and models is None:
        models = {args.model: 1.0}
    return LoadSpec(
        args.url,
        args.rps,
        args.duration,
        args.model,
        share,
        args.paid_key,
        args.free_key,
        max_tokens=args.max_tokens,
        seed=args.seed,
        deadline_ms=args.deadline_ms,
        arrivals=args.arrivals,
        models=models,
        shift_to=shift_to,
        shift_from_s=args.shift_from_s or 0.0,
        shift_over_s=args.shift_over_s or 0.0,
        keystrokes=args.keystrokes,
        pause_ms=args.pause_ms,
        api_key=args.api_key,
    )


def _run_tenants(args: argparse.Namespace, spec: LoadSpec, tenants: list[TenantLoad]) -> int:
    print(f"keybatch load: {len(tenants)} tenants for {spec.duration_s:g} s ...", file=sys.stderr)
    records = generate_tenants(spec, tenants)
    out = report(spec, records, args.window_s, args.slo_ms)
    who = "; ".join(f"{t.name} {t.rps:g} req/s" + (f" {t.deadline_ms:g} ms" if t.deadline_ms else "") for t in tenants)
    print_summary(f"keybatch load by tenant, {spec.duration_s:g} s: {who}", out["summary"], label="tenant")
    print_statuses(out["summary"])
    if args.plot:
        plot(out, args.plot, who)
    if args.json:
        with open(args.json, "w") as fh:
            tenants_json = [asdict(t) for t in tenants]
            json.dump(
                {"spec": asdict(spec), "tenants": tenants_json, **out, "records": [asdict(r) for r in records]}, fh
            )
    return 0


def run_load(args: argparse.Namespace) -> int:
    try:
        tenants = [parse_tenant(t) for t in args.tenant or []]
        if tenants and args.rps is not None:
            raise ValueError("--tenant gives each key its rate: it takes no --rps")
        if tenants:
            args.rps = sum(t.rps for t in tenants)
        elif args.rps is None:
            raise ValueError("--rps (or --tenant) is required")
        spec = spec_from_args(args)
    except ValueError as exc:
        print(f"keybatch load: {exc}", file=sys.stderr)
        return 2
    if tenants:
        return _run_tenants(args, spec, tenants)
    records = generate(spec)
    out = report(spec, records, args.window_s, args.slo_ms)
    mix = ", ".join(f"{m} {s:.0%}" for m, s in (spec.models or {spec.model: 1.0}).items())
    if spec.shift_to:
        to = ", ".join(f"{m} {s:.0%}" for m, s in spec.shift_to.items())
        mix += f" -> {to} from {spec.shift_from_s:g} s over {spec.shift_over_s:g} s"
    who = "one key" if spec.api_key else f"{spec.paid_share:.0%} paid"
    title = f"keybatch load: {spec.arrivals} {spec.rps:g} req/s for {spec.duration_s:g} s, {who}; {mix}"
    print_summary(title, out["summary"])
    print_models(out)
    if args.plot:
        plot(out, args.plot, title)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"spec": asdict(spec), **out, "records": [asdict(r) for r in records]}, fh)
    return 0

"""Which engine a replica runs: the fixed backend's simulated accelerator, or the torch
engine (imported only for the hf backend). Above both engines, so neither imports the
other."""

from __future__ import annotations

from control.core.settings import Settings
from control.core.vocab import Policy
from tasks.engine.contract import Engine
from tasks.engine.fixed import FixedLatencyEngine


def make_engine(settings: Settings, model: str, backend: str, policy: Policy) -> Engine:
    """The engine a replica of `model` runs (torch is imported only for the hf backend)."""
    if backend == "fixed":
        return FixedLatencyEngine(
            settings.max_batch,
            settings.batch_ms,
            settings.fixed_poison,
            settings.fixed_hang,
            continuous=policy == "continuous",
        )
    from tasks.lm.hf_engine import HFEngine

    return HFEngine(
        settings.model_path(model),
        max_batch=settings.max_batch,
        policy=policy,
        token_budget=settings.token_budget,
        prefill_chunk=settings.prefill_chunk,
        prefix_cache_tokens=settings.prefix_cache_tokens,
        threads=settings.engine_threads,
        name=f"hf:{model}",
    )

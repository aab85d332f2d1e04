"""Every knob of keybatch, read once at the edge (environment or a settings file)."""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from control.core.connect import check_url
from control.core.vocab import Policy, Tier

_MODEL_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")

MIN_PULSE_MS = 20  # PULSE_MS: shorter would send a replica's pulse more than 125 times a second


class Settings(BaseSettings):
    """One settings object (env prefix ``KEYBATCH_``), passed down to every part."""

    model_config = SettingsConfigDict(
        env_prefix="KEYBATCH_",
        env_file=".env",
        env_file_encoding="utf-8",
        extra="ignore",
    )

    # Broker and state. Without REDIS_URL, `keybatch up` starts an embedded Valkey.
    redis_url: str | None = Field(
        None,
        description="redis://, rediss://, unix:// or sentinel:// URL of the state server",
    )
    broker_url: str | None = Field(None, description="Celery broker URL (defaults to REDIS_URL)")
    cells: list[str] = Field(
        default_factory=list,
        description=(
            "broker URLs, one cell each (JSON list; a sentinel:// URL's host list has commas): a request's "
            "cell follows its key and session, each replica serves one cell; empty: one cell, REDIS_URL"
        ),
    )
    broker_maxmemory_mb: int = Field(
        1024, ge=16, description="embedded Valkey's memory limit; full, it refuses new work (503), evicts nothing"
    )
    secrets_dir: Path = Field(
        Path("~/.keybatch"),
        description="private folder where `keybatch up` leaves the operator's broker credentials for the tools",
    )

    # Gateway.
    bind: str = Field("127.0.0.1", description="the address the gateway listens on")
    port: int = 8000
    api_worker_class: Literal["gevent", "gthread"] = "gevent"
    api_processes: int = Field(2, ge=1, description="gateway worker processes (one per core)")
    api_threads: int = Field(256, ge=1, description="threads per process (gthread only)")
    api_keys: dict[str, Tier] = Field(default_factory=dict, description="API key -> tier")
    allow_anonymous: bool = True
    admin_token: str | None = Field(
        None,
        min_length=16,
        description=(
            "the embedded broker's operator password (ACL user `operator`), instead of a generated one: "
            "operator tools elsewhere act with redis://operator:TOKEN@host:port; the data path never holds it"
        ),
    )
    metrics_token: str | None = Field(
        None,
        description="bearer token /metrics requires when set; unset, /metrics is open only while anonymous access is",
    )
    max_prompt_chars: int = Field(32_768, ge=1)
    max_tokens_limit: int = Field(256, ge=1)
    header_timeout_s: float = Field(10.0, gt=0, description="a request line and header block arrive within this (408)")
    body_timeout_s: float = Field(10.0, gt=0, description="a request body arrives within this of its headers (408)")
    max_connections: int = Field(
        1000, ge=1, description="connections per gateway process before a request is known paid (docs/decisions/0017)"
    )
    paid_reserve_connections: int = Field(
        100, ge=0, description="more connections per gateway process, for those whose request is paid"
    )
    max_connections_per_address: int = Field(
        500, ge=0, description="connections one client address holds per gateway process (0: no cap)"
    )
    connection_cap_exempt: list[str] = Field(
        default_factory=list, description="addresses the per-address cap does not apply to (a front proxy; JSON list)"
    )
    first_byte_timeout_s: float = Field(3.0, gt=0, description="a new connection sends its first byte within this")
    send_timeout_s: float = Field(10.0, gt=0, description="each write of an answer completes within this (then closed)")
    max_header_bytes: int = Field(32_768, ge=1024, description="a request's header block, in all (431 beyond)")
    max_header_fields: int = Field(100, ge=1, description="fields in a request's header block (431 beyond)")

    # Models and replicas.
    models: dict[str, str] = Field(
        default_factory=lambda: {"kb-small": "kb-small", "kb-large": "kb-large"},
        description="model name -> model folder (relative to MODELS_DIR unless absolute)",
    )
    models_dir: Path = Path("models")
    max_batch: int = Field(64, ge=1)
    policy: Policy = Field(
        "static",
        description="how a replica batches: static (a batch runs to its end) or continuous (requests join others)",
    )
    batch_ms: float = Field(250.0, gt=0, description="fixed backend: time of any batch")
    fixed_poison: str | None = Field(
        None, description="fixed backend, fault injection: a prompt containing this fails in the engine"
    )
    fixed_hang: str | None = Field(
        None, description="fixed backend, fault injection: a batch with a prompt containing this hangs"
    )
    token_budget: int = Field(
        512, ge=1, description="hf continuous: tokens one step computes (decodes first, then prefill chunks)"
    )
    prefill_chunk: int = Field(256, ge=1, description="hf: the most prompt tokens of one request a step prefills")
    prefix_cache_tokens: int = Field(16_384, ge=0, description="hf: KV of shared prompt prefixes kept for reuse")
    engine_threads: int = Field(1, ge=1, description="hf: torch threads per replica")
    max_wait_ms: float = Field(20.0, ge=0, description="cap on how long a free replica waits to fill")
    paid_boost_ms: float = Field(
        300.0, ge=0, description="aging: a free request waiting this long ranks with a new paid one"
    )
    pull_lead_ms: float = Field(40.0, ge=0, description="a busy replica pulls its next batch this long before it frees")
    pull_early: bool = Field(
        False,
        description="a busy replica that frees before its peers pulls its next batch at once, not only "
        "PULL_LEAD_MS before it frees (off: what arrives earlier waits in the shared queue, paid ahead of free; "
        "docs/decisions/0031)",
    )
    deadline_margin_ms: float = Field(15.0, ge=0, description="slack kept for the trip back to the client")
    admit_phased: bool = Field(
        False,
        description="below capacity, admission counts the batch starts that the static replicas' launches, read "
        "every 50 ms, hold before a request's last start, where they hold more than the worst phase "
        "(docs/decisions/0032)",
    )
    admit_bump: bool = Field(
        False,
        description="a free request is admitted with no room kept for paid arrivals; a paid request waits behind "
        "paid ones only, and the first free request it would push past its last batch start is answered 429 "
        "(static replicas; docs/decisions/0034)",
    )
    admit_open: bool = Field(
        True,
        description="while a cell's demand over the last 5 s is below its static replicas' rate (no burst, 2 s of "
        "traffic seen, and fewer than half the free requests of the last half second past the limit), a free "
        "request is admitted as deep as the best phase of its budget allows (two batch slots beyond the worst "
        "phase's), still leaving room for paid arrivals, and a paid one up to a second after; the replicas "
        "answer 504 the few that then miss (docs/decisions/0039)",
    )
    single_listener: bool = Field(
        True,
        description="at most one idle replica of a model waits on its queue at a time, and hands that turn on "
        "when its batch starts, so idle replicas do not split arrivals into small batches that start together "
        "(static batching, native collector; docs/decisions/0033)",
    )
    lead_yields: bool = Field(
        True,
        description="with SINGLE_LISTENER, a busy replica in its lead pulls only while no idle replica listens "
        "for its model's arrivals: they go to the listener's batch, not into busy replicas' next ones "
        "(docs/decisions/0036)",
    )
    collector: Literal["native", "chord"] = Field(
        "native",
        description="native: a replica runs its batches itself; chord: each as a Celery chord (docs/decisions/0001)",
    )
    hand_back_pulls: bool = Field(
        True, description="a request a pull sent before the gate shut brings goes back to the front of its queue"
    )
    hand_back_rest: bool = Field(
        False,
        description="what a static batch leaves in its replica's buffer goes back to the front of its queue, "
        "for a peer's earlier start; urgency then looks three quarters of a slot ahead (docs/decisions/0030)",
    )

    # Deadlines and admission.
    deadline_ms: float = Field(600.0, gt=0, description="default budget when X-Deadline-Ms is absent")
    max_deadline_ms: float = Field(60_000.0, gt=0)
    max_queue_paid: int = Field(4096, ge=1, description="most paid requests waiting per model")
    max_queue_free: int = Field(2048, ge=1, description="most free requests waiting per model")
    # Per key (tenant), by tier: control/policy/admission.py.
    tenant_rate_paid: float = Field(0.0, ge=0, description="requests/s one paid key may have admitted (0: no limit)")
    tenant_rate_free: float = Field(0.0, ge=0, description="requests/s one free key may have admitted (0: no limit)")
    tenant_burst_paid: float = Field(0.0, ge=0, description="paid key's token bucket size (0: one second of its rate)")
    tenant_burst_free: float = Field(0.0, ge=0, description="free key's token bucket size (0: one second of its rate)")
    tenant_share_paid: float = Field(
        1.0, gt=0, le=1, description="share of a paid request's admissible queue one paid key may hold"
    )
    tenant_share_free: float = Field(
        0.5, gt=0, le=1, description="share of a free request's admissible queue one free key may hold"
    )
    tenant_fair_batches: float = Field(
        1.0,
        gt=0,
        description="a key's queued requests up to this many batches keep their place; the rest wait behind others",
    )
    max_message_kb_paid: int = Field(
        256, ge=1, description="most KiB one queued paid request may take in the broker (its task message; 413 beyond)"
    )
    max_message_kb_free: int = Field(
        64, ge=1, description="most KiB one queued free request may take in the broker (its task message; 413 beyond)"
    )

    # Replica registry.
    heartbeat_s: float = Field(1.0, gt=0)
    standby_replicas: int = Field(
        1,
        ge=0,
        description="replica processes `keybatch up` keeps booted with their engine loaded, waiting: one takes "
        "the place of a replica that dies after a healthy life at once, instead of a process that boots "
        "(docs/decisions/0037)",
    )
    host: str = Field(
        default_factory=socket.gethostname,
        description="the host a replica runs on: its registry entry and its name say it "
        "(`keybatch up --replicas-per-host` gives each group of replicas one)",
    )
    hedge: Literal["off", "paid", "all"] = Field(
        "all",
        description="free-slot hedging: a static batch's empty slots run second copies of requests running "
        "on another host (paid ones first), so a lost host's requests are answered by the copy; "
        "off, paid (paid requests only) or all",
    )
    hedge_idle: bool = Field(
        True,
        description="an idle replica that is not listening (any idle one without SINGLE_LISTENER), while two "
        "more of its model and half of them are idle, runs a batch of second copies of requests running on "
        "another host (HEDGE says which): at low load no batch runs that a copy could ride; while a quarter "
        "are idle, of paid requests only, gathered into a full batch unless one must start (docs/decisions/0035)",
    )
    replica_ttl_s: float = Field(3.0, gt=0)
    task_events: Literal["watched", "always", "off"] = Field(
        "watched",
        description="Celery task events (Flower): while a monitor asks for them (Flower's enable_events), "
        "always, or off; true and false read as always and off",
    )
    task_events_kept_s: float = Field(
        15.0, gt=0, description="watched task events stop this long after a monitor last asked (Flower: every 5 s)"
    )
    event_flush_ms: float = Field(100.0, gt=0, description="task events are published at most this often")

    # Failover and the broker.
    lease_ms: float = Field(
        300.0, gt=0, description="a replica whose batching loop is silent this long is presumed dead"
    )
    pulse_ms: int = Field(
        100,
        ge=0,
        description="a replica renews a key of this lifetime every 40% of it from a thread of its own; a gateway "
        "that finds it lapsed offers its waiting requests to RESCUE, which puts back what a stopped replica's "
        "outstanding pull took (the lease, slower, still decides what it held); 0: off",
    )
    stall_ms: float = Field(2000.0, gt=0, description="a batch this far past its expected time restarts the replica")
    broker_timeout_ms: float = Field(75.0, gt=0, description="bound on each broker call on the request path (then 503)")
    idempotency_window_s: float = Field(
        30.0, ge=0, description="a retry with the same X-Request-Id gets the stored answer this long"
    )
    reuse_window_s: float = Field(
        30.0,
        ge=0,
        description="a session's last completion is kept this long: a request of the session whose prompt "
        "only adds a start of it (the user typed what was suggested) is answered with the rest, without "
        "the model (`keybatch.reused`); 0: never",
    )
    max_clock_error_ms: float = Field(
        25.0, gt=0, description="a replica that cannot read the broker's clock this closely is not ready"
    )
    clock_skew_ms: float = Field(0.0, description="testing only: shift this process's wall clock")

    # Regions: a gateway that cannot serve a request forwards it to these, in order.
    region: str = Field("local", pattern=r"^[A-Za-z0-9_-]{1,32}$", description="this deployment's region name")
    peers: list[str] = Field(default_factory=list, description="peer regions' gateway base URLs (JSON list)")

    @field_validator("task_events", mode="before")
    @classmethod
    def _events_switch(cls, value: object) -> object:
        """The setting was a switch: true and false keep their meaning."""
        word = value.strip().lower() if isinstance(value, str) else value
        if value is True or word in ("true", "1", "yes", "on"):
            return "always"
        if value is False or word in ("false", "0", "no"):
            return "off"
        return value

    @field_validator("models")
    @classmethod
    def _check_model_names(cls, models: dict[str, str]) -> dict[str, str]:
        bad = [name for name in models if not _MODEL_NAME.fullmatch(name)]
        if bad:  # names go into broker keys that the failover scripts split on '|'
            raise ValueError(f"model names are 1-64 of A-Z a-z 0-9 . _ -: {', '.join(map(repr, bad))}")
        return models

    @field_validator("redis_url", "broker_url")
    @classmethod
    def _check_url(cls, url: str | None) -> str | None:
        if url is not None:
            check_url(url)
        return url

    @field_validator("pulse_ms")
    @classmethod
    def _check_pulse(cls, ms: int) -> int:
        if 0 < ms < MIN_PULSE_MS:
            raise ValueError(f"a pulse is renewed every 40% of its lifetime: 0 (off) or at least {MIN_PULSE_MS} ms")
        return ms

    @field_validator("cells")
    @classmethod
    def _check_cells(cls, urls: list[str]) -> list[str]:
        for url in urls:
            check_url(url)
        if len(set(urls)) != len(urls):
            raise ValueError("each cell needs its own broker: a URL appears twice")
        return urls

    @field_validator("secrets_dir")
    @classmethod
    def _expand_home(cls, path: Path) -> Path:
        return path.expanduser()

    @field_validator("peers")
    @classmethod
    def _check_peers(cls, urls: list[str]) -> list[str]:
        if any(not url.startswith(("http://", "https://")) for url in urls):
            raise ValueError("each peer must be an http:// or https:// base URL")
        return [url.rstrip("/") for url in urls]

    @model_validator(mode="after")
    def _check_limits(self) -> Settings:
        if self.deadline_ms > self.max_deadline_ms:
            raise ValueError("DEADLINE_MS is above MAX_DEADLINE_MS")
        return self

    @property
    def broker(self) -> str:
        url = self.broker_url or self.redis_url or next(iter(self.cells), None)
        if url is None:
            raise RuntimeError("no broker: set KEYBATCH_REDIS_URL or start with `keybatch up`")
        return url

    @property
    def state_url(self) -> str:
        url = self.redis_url or self.broker_url or next(iter(self.cells), None)
        if url is None:
            raise RuntimeError("no state server: set KEYBATCH_REDIS_URL or start with `keybatch up`")
        return url

    @property
    def cell_urls(self) -> list[str]:
        """The broker of each cell, in order: CELLS, else the one state server (a replica
        has one: its own cell's, REDIS_URL)."""
        return self.cells or [self.state_url]

    @property
    def max_body_bytes(self) -> int:
        """The largest request body: the largest prompt plus JSON quoting (413 beyond)."""
        return self.max_prompt_chars * 6 + 65_536

    def model_path(self, name: str) -> Path:
        path = Path(self.models[name])
        return path if path.is_absolute() else self.models_dir / path

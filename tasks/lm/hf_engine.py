"""The torch engine: a Hugging Face causal LM behind the `Engine` contract (tasks/engine/contract.py).

One step reads as its phases: schedule (tasks/policy/scheduler.py decides who joins and who
computes what), run (one decode forward over every decoding request, then the prefill
chunks, each its own forward), update (sample, detokenize, stop, finish), release.

The KV cache is allocated once, a row (slot) per running request (tasks/lm/slot_cache.py).
The rows of the decoding requests are kept at the front of the cache, so a decode forward
reads a view of the rows it needs, however many slots there are. When a request leaves,
the last row moves into its place; when a prefill ends, its row trades places with the
first prefilling one. A move copies only the positions a row holds.

Prompts share prefixes (completions from one file): full blocks of prompt keys and values
are kept in an LRU (tasks/lm/prefix_cache.py) and copied into a new request's slot, which
then prefills only the rest.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from control.core.protocol import Job
from control.core.vocab import Policy
from tasks.engine.contract import RequestError, RequestStatus, StepOutput
from tasks.lm import fim
from tasks.lm.prefix_cache import PrefixCache
from tasks.lm.slot_cache import SlotCache
from tasks.lm.textstream import TextStream
from tasks.policy.costs import StepCosts
from tasks.policy.scheduler import ContinuousScheduler, RunningRequest, SchedulerConfig, WaitingRequest

PREFIX_BLOCK = 32  # tokens per prefix-cache block
PREFIX_CACHE_TOKENS = 16_384  # default bound of the prefix cache: 16 full 1,024-token prompts
COMPLETION_PRIOR = 16  # tokens a request generates, until finished requests say otherwise (Job's default)
WARM_UP_RUNS = 3  # of each start-up forward: the cost model's medians start from warm runs


@dataclass
class _Request:
    job: Job
    prompt_ids: list[int]
    max_tokens: int  # clipped to what the context leaves
    arrival: int
    stream: TextStream
    generator: torch.Generator | None  # sampling; None for greedy
    status: RequestStatus = RequestStatus.WAITING
    num_computed: int = 0  # positions of its slot that hold keys and values
    num_cached: int = 0  # of those, how many came from the prefix cache
    output_ids: list[int] = field(default_factory=list)
    held: StepOutput | None = None  # static policy: the final output, sent when the batch ends

    @property
    def id(self) -> str:
        return self.job.id

    @property
    def num_prefill_left(self) -> int:
        return max(0, len(self.prompt_ids) - self.num_computed)

    @property
    def is_decoding(self) -> bool:
        """Its prompt is in the cache: it decodes (or, finished in a static batch, pads)."""
        return self.num_prefill_left == 0


def _request_seed(seed: int, request_id: str) -> int:
    digest = hashlib.sha256(f"{seed}:{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class HFEngine:
    """A Hugging Face causal LM folder served with a slot KV cache.

    `policy` "continuous": requests join and leave between steps. "static": requests join
    only an empty engine, and a batch runs (its finished requests as padded rows) and
    reports its finished requests when the last one finishes. `token_budget` caps the
    tokens one step computes (a decode is one, the rest are prefill chunks of at most
    `prefill_chunk`); `prefix_cache_tokens` bounds the prefix cache (0: none).
    """

    def __init__(
        self,
        path: str | Path,
        max_batch: int = 64,
        policy: Policy = "continuous",
        token_budget: int | None = None,
        prefill_chunk: int = 256,
        prefix_cache_tokens: int = PREFIX_CACHE_TOKENS,
        threads: int | None = None,
        seed: int = 0,
        name: str | None = None,
    ) -> None:
        if threads is not None:
            torch.set_num_threads(threads)
        folder = Path(path)
        self.name = name or f"hf:{folder.name}"
        self.max_batch = max_batch
        self.continuous = policy == "continuous"
        self.seed = seed
        budget = token_budget if token_budget is not None else max_batch + prefill_chunk
        self.config = SchedulerConfig(max_batch, budget, prefill_chunk, policy)
        self.scheduler = ContinuousScheduler(self.config)
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        # sdpa: the 4D boolean masks below are its format (eager attention adds float masks).
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
        self.model.eval()
        self.max_context = int(self.model.config.max_position_embeddings)
        with torch.inference_mode():
            self.cache = SlotCache(self.model.config, max_batch, self.max_context, torch.float32)
        self.prefix_cache: PrefixCache[torch.Tensor] = PrefixCache(prefix_cache_tokens, PREFIX_BLOCK)
        self._read_vocabulary()
        self.waiting: dict[str, _Request] = {}
        self.rows: list[_Request] = []  # rows[i] holds slot i; decoding requests first
        self._outbox: list[StepOutput] = []  # failures found by add_request, sent at the next step
        self._arrivals = itertools.count()
        self.costs = StepCosts(prompt_prior=prefill_chunk, completion_prior=COMPLETION_PRIOR)
        self.counters = dict.fromkeys(
            (
                "steps",
                "prefill_tokens",
                "decode_tokens",
                "padding_tokens",
                "prefix_query_tokens",
                "prefix_hit_tokens",
                "finished",
                "aborted",
                "errors",
            ),
            0,
        )
        # Time since the start, what a model of this engine is checked against (`keybatch
        # bench simcheck`): whole steps, their decode forwards and the rows those ran, and
        # their prefill chunks (a step's rest is scheduling, sampling, bookkeeping).
        self.times = dict.fromkeys(("step_ms", "decode_ms", "decode_forwards", "decode_rows", "prefill_ms"), 0.0)
        self._warm_up()

    def _read_vocabulary(self) -> None:
        tok = self.tokenizer
        eos = self.model.generation_config.eos_token_id
        candidates = [*(eos if isinstance(eos, list) else [eos]), tok.eos_token_id, self._token_id(fim.END_OF_TEXT)]
        self.eos_ids: set[int] = {i for i in candidates if isinstance(i, int)}
        end_of_text = self._token_id(fim.END_OF_TEXT)
        self.document_start: int = end_of_text if end_of_text is not None else min(self.eos_ids, default=0)
        pad = tok.pad_token_id
        self.pad_id: int = pad if isinstance(pad, int) else self.document_start
        fim_ids = [self._token_id(t) for t in (fim.FIM_PREFIX, fim.FIM_SUFFIX, fim.FIM_MIDDLE)]
        self.fim_ids: list[int] | None = [i for i in fim_ids if i is not None] if None not in fim_ids else None
        self.special_strings = [s for s in tok.all_special_tokens if s]
        bos = tok.bos_token_id
        self.bos_ids: list[int] = [bos] if isinstance(bos, int) and tok("a").input_ids[:1] == [bos] else []

    def _token_id(self, token: str) -> int | None:
        """The id of a token the vocabulary holds as one token, else None."""
        found = self.tokenizer.convert_tokens_to_ids(token)
        return found if isinstance(found, int) and found != self.tokenizer.unk_token_id else None

    def decode_text(self, token_ids: list[int]) -> str:
        """Text of generated tokens (special tokens are not text; code keeps its spaces)."""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return text if isinstance(text, str) else "".join(text)

    # The Engine contract.

    def expected_step_ms(self) -> float:
        """The next step: a decode over the decoding requests and prefill within the budget."""
        num_decodes = sum(r.is_decoding for r in self.rows)
        pending = sum(r.num_prefill_left for r in self.rows if not r.status.is_finished)
        pending += sum(len(r.prompt_ids) for r in self.waiting.values())
        prefill = min(pending, self.config.token_budget - num_decodes)
        return self.costs.step(max(1, num_decodes), prefill)

    def expected_batch_ms(self) -> float:
        """Join to finish of a typical request at the present load (a static batch: to its end)."""
        load = min(self.max_batch, len(self.rows) + len(self.waiting) + 1)
        return self.costs.request(load, self.config.prefill_chunk, static=not self.continuous)

    def add_request(self, job: Job) -> None:
        """Queue a request; raises `RequestError` for one that can never run here (a prompt
        that leaves no room in the context: 413). A prompt the tokenizer cannot read ends
        with a FINISHED_ERROR output at the next step."""
        if job.id in self.waiting or any(r.id == job.id for r in self.rows):
            raise ValueError(f"request {job.id} is already in the engine")
        if job.max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, not {job.max_tokens}")
        if job.suffix and self.fim_ids is None:
            raise RequestError(f"{self.name} has no fill-in-the-middle tokens; send no suffix", "fim_unsupported")
        try:
            prompt_ids = self.encode_prompt(job)
        except Exception as exc:  # this request's text, not the engine: the others run on
            self.counters["errors"] += 1
            self._outbox.append(self._error_output(job.id, f"the tokenizer failed: {exc}", "tokenizer_error", 422))
            return
        limit = self.max_context - 1
        if len(prompt_ids) > limit:
            raise RequestError(
                f"the prompt is {len(prompt_ids)} tokens; {self.name} holds {self.max_context} tokens of context "
                f"and must generate at least one, so a prompt may have at most {limit}",
                code="prompt_too_long",
                status=413,
            )
        generator = None
        if job.temperature > 0:
            generator = torch.Generator().manual_seed(_request_seed(self.seed, job.id))
        self.waiting[job.id] = _Request(
            job,
            prompt_ids,
            min(job.max_tokens, self.max_context - len(prompt_ids)),
            next(self._arrivals),
            TextStream(self.decode_text, job.stop),
            generator,
        )

    def abort_request(self, request_id: str) -> None:
        """Drop a request; its slot is free at once and it yields no more output."""
        self._outbox = [out for out in self._outbox if out.id != request_id]
        if self.waiting.pop(request_id, None) is not None:
            return
        for request in self.rows:
            if request.id == request_id:
                self.counters["aborted"] += 1
                with torch.inference_mode():
                    self._release([request])
                    self._arrange()
                return

    def free_slots(self) -> int:
        """Slots `add_request` can fill now (static: none while a batch runs)."""
        if not self.continuous and self.rows:
            return 0
        return max(0, self.max_batch - len(self.rows) - len(self.waiting))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.rows or self._outbox)

    def frees_after_step(self) -> int:
        """Decoding requests that the next step's token brings to their length (an end of
        text may finish others too): slots certainly free for the step after it."""
        return sum(1 for r in self.rows if r.is_decoding and len(r.output_ids) + 1 >= r.max_tokens)

    def step(self) -> list[StepOutput]:
        """Admit, decode, prefill, release: one iteration."""
        started = time.perf_counter()
        outputs, self._outbox = self._outbox, []
        with torch.inference_mode():
            outputs += self._release_finished()  # a static batch whose last running request was aborted
            self._join(self.scheduler.join(self._waiting_view(), len(self.rows)))
            plan = self.scheduler.plan(self._running_view())
            outputs += self._decode(plan.decodes)
            outputs += self._prefill(plan.prefills)
            outputs += self._release_finished()
            self._arrange()
        if plan.num_tokens:  # an idle step says nothing about the cost of work
            self.counters["steps"] += 1
            elapsed_ms = (time.perf_counter() - started) * 1000.0
            self.costs.record_step(elapsed_ms, sum(plan.prefills.values()))
            self.times["step_ms"] += elapsed_ms
        return outputs

    def close(self) -> None:
        """Drop every request and the cached prefixes."""
        self.waiting.clear()
        self.rows.clear()
        self._outbox.clear()
        self.prefix_cache.clear()

    def stats(self) -> dict[str, float]:
        """Counters and measured costs, for /metrics."""
        c = self.counters
        return {
            **c,
            **{f"total_{name}": round(value, 1) for name, value in self.times.items()},
            "running": len(self.rows),
            "waiting": len(self.waiting),
            "prefix_hit_rate": c["prefix_hit_tokens"] / c["prefix_query_tokens"] if c["prefix_query_tokens"] else 0.0,
            "prefix_cache_tokens": self.prefix_cache.num_tokens,
            "kv_cache_mb": self.cache.nbytes / 2**20,
            "step_ms": self.costs.step_ms or 0.0,
            "prefill_ms_per_token": self.costs.prefill_ms_per_token or 0.0,
            **{f"decode_ms_batch_{b}": ms for b, ms in sorted(self.costs.decode_ms.items())},
        }

    # Schedule.

    def _waiting_view(self) -> list[WaitingRequest]:
        return [WaitingRequest(r.id, r.job.tier, len(r.prompt_ids), r.arrival) for r in self.waiting.values()]

    def _running_view(self) -> list[RunningRequest]:
        return [
            RunningRequest(r.id, r.num_prefill_left, r.job.tier, r.arrival, r.status.is_finished) for r in self.rows
        ]

    def _join(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            request = self.waiting.pop(request_id)
            request.status = RequestStatus.RUNNING
            self.rows.append(request)
            self._reuse_prefix(request, len(self.rows) - 1)

    def _reuse_prefix(self, request: _Request, row: int) -> None:
        """Copy the longest cached prefix into the slot, leaving at least one token to compute."""
        prompt = request.prompt_ids
        blocks = self.prefix_cache.lookup(prompt, len(prompt) - 1)
        for index, block in enumerate(blocks):
            self.cache.write_block(row, index * PREFIX_BLOCK, block)
        request.num_computed = request.num_cached = len(blocks) * PREFIX_BLOCK
        self.counters["prefix_query_tokens"] += len(prompt)
        self.counters["prefix_hit_tokens"] += request.num_cached

    def _store_prefix(self, request: _Request, row: int) -> None:
        self.prefix_cache.store(
            request.prompt_ids, lambda index: self.cache.read_block(row, index * PREFIX_BLOCK, PREFIX_BLOCK)
        )

    # Run.

    def _decode(self, request_ids: list[str]) -> list[StepOutput]:
        """One forward over rows [0, len(request_ids)): each decoding request's last token."""
        if not request_ids:
            return []
        rows = self.rows[: len(request_ids)]
        if [r.id for r in rows] != request_ids:
            raise RuntimeError("the decoding requests are not the front rows of the cache")
        tokens = torch.tensor([self.pad_id if r.status.is_finished else r.output_ids[-1] for r in rows])
        # A finished row of a static batch pads: it writes over its last position and never grows.
        positions = torch.tensor([min(r.num_computed, self.max_context - 1) for r in rows])
        started = time.perf_counter()
        logits = self.forward_decode(tokens, positions)
        elapsed_ms = (time.perf_counter() - started) * 1000.0
        self.costs.record_decode(len(rows), elapsed_ms)
        self.times["decode_ms"] += elapsed_ms
        self.times["decode_forwards"] += 1
        self.times["decode_rows"] += len(rows)
        live = [i for i, r in enumerate(rows) if not r.status.is_finished]
        self.counters["decode_tokens"] += len(live)
        self.counters["padding_tokens"] += len(rows) - len(live)
        for i in live:
            rows[i].num_computed += 1
        chosen = self._sample([rows[i] for i in live], logits[live])
        return [out for i, token in zip(live, chosen, strict=True) if (out := self._accept(rows[i], token))]

    def _prefill(self, chunks: dict[str, int]) -> list[StepOutput]:
        """Each chunk its own forward; a prompt's last chunk yields its first token."""
        outputs = []
        for request_id, num_tokens in chunks.items():
            row = next(i for i, r in enumerate(self.rows) if r.id == request_id)
            request = self.rows[row]
            first = request.num_computed
            started = time.perf_counter()
            try:
                logits = self.forward_prefill(row, request.prompt_ids[first : first + num_tokens], first)
            except Exception as exc:  # this request fails, the batch runs on
                outputs.extend(self._fail(request, f"the model failed on this prompt: {exc!r}"))
                continue
            elapsed_ms = (time.perf_counter() - started) * 1000.0
            self.costs.record_prefill(num_tokens, elapsed_ms)
            self.times["prefill_ms"] += elapsed_ms
            self.counters["prefill_tokens"] += num_tokens
            request.num_computed += num_tokens
            if request.is_decoding:
                self._store_prefix(request, row)
                out = self._accept(request, self._sample([request], logits[None])[0])
                if out is not None:
                    outputs.append(out)
        return outputs

    def forward_decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab] of one token per row for rows [0, len(tokens)) at `positions`."""
        # tokens, positions: [rows]
        kv_len = self.cache.bind_decode(len(tokens), positions)
        mask = torch.arange(kv_len)[None, :] <= positions[:, None]  # [rows, kv_len]
        return self._forward(tokens[:, None], positions[:, None], mask[:, None, None, :])

    def forward_prefill(self, row: int, token_ids: list[int], first: int) -> torch.Tensor:
        """Logits [vocab] after `token_ids`, written into `row` from position `first`."""
        kv_len = self.cache.bind_prefill(row, first, len(token_ids))
        positions = torch.arange(first, kv_len)
        mask = torch.arange(kv_len)[None, :] <= positions[:, None]  # [q, kv_len]: causal, offset by `first`
        return self._forward(torch.tensor([token_ids]), positions[None], mask[None, None])[0]

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=mask,
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1]

    # Update.

    def _sample(self, requests: list[_Request], logits: torch.Tensor) -> list[int]:
        """Greedy (argmax) at temperature 0, else temperature and nucleus (top_p) sampling."""
        tokens = logits.argmax(dim=-1).tolist()
        for i, request in enumerate(requests):
            if request.generator is not None:
                tokens[i] = self._sample_one(logits[i], request.job.temperature, request.job.top_p, request.generator)
        return tokens

    @staticmethod
    def _sample_one(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
        probs = torch.softmax(logits / temperature, dim=-1)
        if top_p >= 1.0:
            return int(torch.multinomial(probs, 1, generator=generator))
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest set of most likely tokens whose mass reaches top_p (the first always).
        keep = (sorted_probs.cumsum(0) - sorted_probs) < top_p
        choice = torch.multinomial(sorted_probs * keep, 1, generator=generator)
        return int(order[choice])

    def _accept(self, request: _Request, token: int) -> StepOutput | None:
        """A new token of a request: finish it, or hand out the text it makes safe."""
        if token in self.eos_ids:
            return self._finish(request, RequestStatus.FINISHED_STOPPED)
        request.output_ids.append(token)
        request.stream.push(token)
        if request.stream.is_stopped:
            return self._finish(request, RequestStatus.FINISHED_STOPPED)
        if len(request.output_ids) >= request.max_tokens:
            return self._finish(request, RequestStatus.FINISHED_LENGTH)
        delta = request.stream.take()
        return self._output(request, RequestStatus.RUNNING, delta) if delta else None

    def _finish(self, request: _Request, status: RequestStatus) -> StepOutput | None:
        request.status = status
        out = self._output(request, status, request.stream.finish())
        self.counters["finished"] += 1
        self.costs.record_request(len(request.prompt_ids) - request.num_cached, len(request.output_ids))
        if self.continuous:
            return out
        request.held = out  # a static batch reports when its last request finishes
        return None

    def _fail(self, request: _Request, message: str) -> list[StepOutput]:
        self.counters["errors"] += 1
        request.status = RequestStatus.FINISHED_ERROR
        out = self._error_output(request.id, message, "engine_error", 500)
        if self.continuous:
            return [out]
        request.held = out
        return []

    def _output(self, request: _Request, status: RequestStatus, delta: str) -> StepOutput:
        text = request.stream.emitted_text
        return StepOutput(request.id, status, delta, text, len(request.prompt_ids), len(request.output_ids))

    @staticmethod
    def _error_output(request_id: str, message: str, code: str, status: int) -> StepOutput:
        return StepOutput(request_id, RequestStatus.FINISHED_ERROR, error=message, code=code, http_status=status)

    # Release.

    def _release_finished(self) -> list[StepOutput]:
        """Free the slots the scheduler releases; a static batch's held outputs go out now."""
        released = set(self.scheduler.release(self._running_view()))
        if not released:
            return []
        leaving = [r for r in self.rows if r.id in released]
        if not self.continuous and leaving:
            self.costs.record_batch(max(len(r.output_ids) for r in leaving))
        self._release(leaving)
        return [r.held for r in leaving if r.held is not None]

    def _release(self, leaving: list[_Request]) -> None:
        gone = {id(r) for r in leaving}
        kept = [r for r in self.rows if id(r) not in gone]
        holes = [i for i, r in enumerate(self.rows) if id(r) in gone and i < len(kept)]
        movers = [i for i in range(len(kept), len(self.rows)) if id(self.rows[i]) not in gone]
        # The last rows fill the holes, so slots [0, len(kept)) are the running requests.
        rows: list[_Request | None] = list(self.rows)
        for hole, mover in zip(holes, movers, strict=True):
            self.cache.copy_row(mover, hole, rows[mover].num_computed)  # type: ignore[union-attr]
            rows[hole], rows[mover] = rows[mover], None
        self.rows = [r for r in rows[: len(kept)] if r is not None]

    def _arrange(self) -> None:
        """Decoding requests to the front rows (a decode forward reads rows [0, decoding))."""
        num_decoding = sum(r.is_decoding for r in self.rows)
        late = [i for i in range(num_decoding, len(self.rows)) if self.rows[i].is_decoding]
        early = [i for i in range(num_decoding) if not self.rows[i].is_decoding]
        for a, b in zip(early, late, strict=True):
            self.cache.swap(a, b, self.rows[a].num_computed, self.rows[b].num_computed)
            self.rows[a], self.rows[b] = self.rows[b], self.rows[a]

    # Start-up and prompts.

    def _warm_up(self) -> None:
        """Seed the cost model from measurement: a prefill chunk, decodes of 1 and max_batch
        rows, each `WARM_UP_RUNS` times, so that the first, cold run of each is outvoted."""
        num_tokens = min(PREFIX_BLOCK, self.max_context - 1)
        with torch.inference_mode():
            for _ in range(WARM_UP_RUNS):
                started = time.perf_counter()
                self.forward_prefill(0, [self.pad_id] * num_tokens, 0)
                elapsed_ms = (time.perf_counter() - started) * 1000.0
                self.costs.record_prefill(num_tokens, elapsed_ms)
                self.times["prefill_ms"] += elapsed_ms
            for batch in sorted({1, self.max_batch}):
                positions = torch.full((batch,), num_tokens)
                for _ in range(WARM_UP_RUNS):
                    started = time.perf_counter()
                    self.forward_decode(torch.full((batch,), self.pad_id), positions)
                    self.costs.record_decode(batch, (time.perf_counter() - started) * 1000.0)

    def encode_prompt(self, job: Job) -> list[int]:
        """Prompt token ids; the FIM layout's markers as their single special tokens."""
        text = fim.format_prompt(job.prompt, job.suffix)
        user_text = job.prompt + (job.suffix or "")
        if not user_text:
            # Nothing before the cursor: generate as from the start of a document, which the
            # end-of-text separator begins in training (as OpenAI's completions do).
            return [self.document_start]
        if not any(s in user_text for s in self.special_strings):
            return list(self.tokenizer(text, verbose=False).input_ids)  # the context limit is checked here, not there
        # The user's code spells a special token: read it as plain text, so it cannot act as one.
        plain = [self._encode_plain(job.prompt)]
        if job.suffix and self.fim_ids is not None:
            prefix, suffix, middle = self.fim_ids
            plain = [[prefix], plain[0], [suffix], self._encode_plain(job.suffix), [middle]]
        return self.bos_ids + [token for piece in plain for token in piece]

    def _encode_plain(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True, verbose=False).input_ids)

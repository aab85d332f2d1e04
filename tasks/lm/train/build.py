"""Build a small code model from scratch on this machine: tokenizer, training, a Hugging Face folder.

`build(models_dir, "kb-small")` trains a byte-level BPE tokenizer on the standard library
(once per models folder; both sizes share it), then a Llama-shaped model on packed
sequences of the same text, half of its pieces in fill-in-the-middle order. The result
is an ordinary folder that `AutoModelForCausalLM` and `AutoTokenizer` load offline, plus
`keybatch.json` with the facts of the build. Torch is imported here; keep this module out
of processes that do not train or serve a model.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import random
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from tasks.lm.fim import END_OF_TEXT, FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX, PAD, SPECIAL_TOKENS
from tasks.lm.train import corpus

VOCAB_SIZE = 4096
CONTEXT = 1024  # max_position_embeddings: prompts up to ~3,000 characters
SEQ_LEN = 512  # training sequences: the quality prompts (<= 1,500 characters) fit in one
BATCH = 2  # sequences per step: at this few tokens, more updates beat larger batches (docs/models.md)
CHUNK_CHARS = 1500  # files are cut into pieces of whole lines this long; each piece is FIM or not
FIM_RATE = 0.5
SHUFFLE_POOL = 512  # sequences (~1 MB of text); consecutive sequences come from one file
TOKENIZER_DIR = ".tokenizer"
NUM_THREADS = 2


@dataclass(frozen=True)
class ModelSize:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    steps: int  # the default: fits the time budget on a 2-core machine with a margin (docs/models.md)
    lr: float


SIZES = {
    "small": ModelSize(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=688, steps=500, lr=3e-3),
    "large": ModelSize(hidden=384, layers=6, heads=6, kv_heads=2, intermediate=1024, steps=500, lr=2e-3),
}


class BuildError(ValueError):
    """A build that cannot start (an unknown size in the name)."""


def size_of(name: str) -> str:
    """The size a model name asks for: its ending, `-small` or `-large`."""
    for size in SIZES:
        if name.endswith(f"-{size}"):
            return size
    raise BuildError(f"model name {name!r} must end in one of: {', '.join('-' + s for s in SIZES)}")


def build(out_dir: Path, name: str, steps: int | None = None, seed: int = 0, progress: bool = True) -> Path:
    """Train model `name` and save it to `out_dir / name`; returns that folder.

    The model appears there only when complete (written to a temporary folder, then
    renamed). Same name, steps and seed on the same machine give the same weights.
    """
    size = SIZES[size_of(name)]
    steps = size.steps if steps is None else steps
    if steps < 1:
        raise BuildError("steps must be at least 1")
    started = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = shared_tokenizer(out_dir)
    torch.set_num_threads(NUM_THREADS)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(model_config(size, tokenizer))
    facts = _train(model, tokenizer, size, steps, seed, progress)
    facts.update(name=name, size=size_of(name), seed=seed, build_s=round(time.perf_counter() - started, 1))
    return _save(model, tokenizer, out_dir, name, facts)


# --- tokenizer ---------------------------------------------------------------------------


def shared_tokenizer(models_dir: Path) -> PreTrainedTokenizerFast:
    """The models folder's tokenizer, trained on first use and kept in `.tokenizer/`."""
    folder = models_dir / TOKENIZER_DIR
    stamp = _tokenizer_stamp()
    if _read_json(folder / "keybatch.json") != stamp:
        tmp = models_dir / f".tokenizer.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        train_tokenizer().save(str(tmp / "tokenizer.json"))
        (tmp / "keybatch.json").write_text(json.dumps(stamp))
        _replace_dir(tmp, folder)
    return hf_tokenizer(Tokenizer.from_file(str(folder / "tokenizer.json")))


def hf_tokenizer(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """`tok` with the roles of its special tokens, as `AutoTokenizer` will load it."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=END_OF_TEXT,
        eos_token=END_OF_TEXT,
        pad_token=PAD,
        extra_special_tokens=[FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE],
        model_max_length=CONTEXT,
        clean_up_tokenization_spaces=False,
    )


def train_tokenizer() -> Tokenizer:
    """Byte-level BPE over the training files. A newline is always a token of its own, so
    a prompt that ends at a line end splits as the training text did (no `\\n    ` merges)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\n"), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator((f.text for f in corpus.training_files()), trainer=trainer)
    return tok


def _tokenizer_stamp() -> dict[str, object]:
    """What the cached tokenizer was trained from; a different one is retrained."""
    listing = "\n".join(f"{f.path} {len(f.text)}" for f in corpus.training_files())
    return {
        "vocab_size": VOCAB_SIZE,
        "special_tokens": SPECIAL_TOKENS,
        "corpus": hashlib.sha256(listing.encode()).hexdigest()[:16],
    }


# --- model -------------------------------------------------------------------------------


def model_config(size: ModelSize, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    eot = token_id(tokenizer, END_OF_TEXT)
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        max_position_embeddings=CONTEXT,
        tie_word_embeddings=True,  # a 4k vocabulary's embedding is a large share of a small model
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=tokenizer.pad_token_id,
    )


# --- data --------------------------------------------------------------------------------


class TokenStream:
    """Training tokens in a seeded order: files shuffled, each cut into pieces of whole
    lines, each piece left to right or (with probability FIM_RATE) in PSM order."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, seed: int) -> None:
        self._tok: Tokenizer = tokenizer.backend_tokenizer
        self._rng = random.Random(seed)
        self._eot, self._pre, self._suf, self._mid = (
            token_id(tokenizer, t) for t in (END_OF_TEXT, FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE)
        )

    def batches(self, batch: int, seq_len: int) -> Iterator[torch.Tensor]:
        """[batch, seq_len] tensors of token ids, forever: the stream packed into sequences,
        drawn at random from a pool of SHUFFLE_POOL of them so a batch mixes many files."""
        pool: list[list[int]] = []
        rows: list[list[int]] = []
        for seq in self._sequences(seq_len):
            pool.append(seq)
            if len(pool) < SHUFFLE_POOL:
                continue
            pick = self._rng.randrange(len(pool))
            pool[pick], pool[-1] = pool[-1], pool[pick]
            rows.append(pool.pop())
            if len(rows) == batch:
                yield torch.tensor(rows)
                rows = []

    def _sequences(self, seq_len: int) -> Iterator[list[int]]:
        buffer: list[int] = []
        for ids in self._files():
            buffer.extend(ids)
            while len(buffer) >= seq_len:
                yield buffer[:seq_len]
                del buffer[:seq_len]

    def _files(self) -> Iterator[list[int]]:
        files = corpus.training_files()
        while True:
            order = list(range(len(files)))
            self._rng.shuffle(order)
            for index in order:
                yield self.file_ids(files[index].text)

    def file_ids(self, text: str) -> list[int]:
        """One file's tokens; plain pieces run on as the file does, FIM pieces stand alone."""
        ids: list[int] = []
        for piece in corpus.chunks(text, CHUNK_CHARS):
            if self._rng.random() < FIM_RATE:
                if ids and ids[-1] != self._eot:
                    ids.append(self._eot)
                ids.extend(self._fim_ids(corpus.fim_split(piece, self._rng)))
            else:
                ids.extend(self._encode(piece))
        if ids and ids[-1] != self._eot:
            ids.append(self._eot)
        return ids

    def _fim_ids(self, sample: corpus.FimSample) -> list[int]:
        # Encoding the parts apart is what the tokenizer does to format_prompt's string:
        # special tokens split the text before any merge.
        return [
            self._pre,
            *self._encode(sample.prefix),
            self._suf,
            *self._encode(sample.suffix),
            self._mid,
            *self._encode(sample.middle),
            self._eot,
        ]

    def _encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids if text else []


def token_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    """The id of one special token (the tokenizer's API also answers lists for lists)."""
    found = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(found, int):
        raise BuildError(f"the tokenizer has no single id for {token!r}")
    return found


def held_out_batch(tokenizer: PreTrainedTokenizerFast, num_seqs: int = 16) -> torch.Tensor:
    """`num_seqs` sequences spread evenly over the held-out files' tokens (left to right)."""
    tok: Tokenizer = tokenizer.backend_tokenizer
    eot = token_id(tokenizer, END_OF_TEXT)
    ids: list[int] = []
    for encoding in tok.encode_batch([f.text for f in corpus.held_out_files()], add_special_tokens=False):
        ids.extend(encoding.ids + [eot])
    stride = (len(ids) - SEQ_LEN) // num_seqs
    return torch.tensor([ids[i * stride : i * stride + SEQ_LEN] for i in range(num_seqs)])


# --- training ----------------------------------------------------------------------------


def _lr_at(step: int, steps: int, peak: float) -> float:
    """Linear warmup over the first 5% of steps, then cosine decay to a tenth of the peak."""
    warmup = max(1, steps // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _autocast() -> torch.autocast:
    """bf16 matmuls where the CPU has them (faster there, docs/models.md); fp32 weights either way."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=_has_bf16())


def _has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _train(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, size: ModelSize, steps: int, seed: int, progress: bool
) -> dict[str, object]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=size.lr, betas=(0.9, 0.95), weight_decay=0.1)
    batches = TokenStream(tokenizer, seed).batches(BATCH, SEQ_LEN)
    losses: list[float] = []
    model.train()
    started = time.perf_counter()
    with _progress_bar(steps, progress) as advance:
        for step in range(steps):
            for group in optimizer.param_groups:
                group["lr"] = _lr_at(step, steps, size.lr)
            losses.append(_train_step(model, optimizer, next(batches)))
            elapsed = time.perf_counter() - started
            advance(losses[-1], (step + 1) * BATCH * SEQ_LEN / elapsed)
    train_s = time.perf_counter() - started
    tail = losses[-max(1, steps // 10) :]
    return {
        "steps": steps,
        "params": sum(p.numel() for p in model.parameters()),
        "tokens_seen": steps * BATCH * SEQ_LEN,
        "train_s": round(train_s, 1),
        "final_loss": round(sum(tail) / len(tail), 4),  # mean over the last 10% of steps
        "held_out_loss": round(_held_out_loss(model, tokenizer), 4),
        "batch": BATCH,
        "seq_len": SEQ_LEN,
        "peak_lr": size.lr,
        "fim_rate": FIM_RATE,
        "bf16_autocast": _has_bf16(),
        "threads": NUM_THREADS,
        "config": asdict(size),
        "torch": torch.__version__,
        "machine": platform.machine(),
    }


def _train_step(model: LlamaForCausalLM, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> float:
    with _autocast():
        loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


@torch.inference_mode()
def _held_out_loss(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast) -> float:
    """Mean next-token loss on held-out text (nats per token)."""
    model.eval()
    batch = held_out_batch(tokenizer)
    with _autocast():
        return float(model(input_ids=batch, labels=batch).loss)


@contextmanager
def _progress_bar(steps: int, enabled: bool) -> Iterator[Callable[[float, float], None]]:
    """A rich bar (steps, loss, tokens/s, ETA); yields the function that advances it."""
    if not enabled:
        yield lambda loss, tok_s: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (
        TextColumn("training"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.3f}"),
        TextColumn("{task.fields[tok_s]:,.0f} tok/s"),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    )
    with Progress(*columns) as bar:
        task = bar.add_task("training", total=steps, loss=float("nan"), tok_s=0.0)
        yield lambda loss, tok_s: bar.update(task, advance=1, loss=loss, tok_s=tok_s)


# --- saving ------------------------------------------------------------------------------


def _save(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out_dir: Path, name: str, facts: dict[str, object]
) -> Path:
    tmp = out_dir / f".{name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # the rich bar is the build's only one
    try:
        model.save_pretrained(tmp)
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(tmp)
    (tmp / "keybatch.json").write_text(json.dumps(facts, indent=2) + "\n")
    final = out_dir / name
    _replace_dir(tmp, final)
    return final


def _replace_dir(tmp: Path, final: Path) -> None:
    """Move `tmp` to `final`, replacing an older `final`: a reader finds the old folder,
    none (for the instant between two renames), or the new one, never a mix."""
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None

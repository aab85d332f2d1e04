"""How good a built model is on code it never trained on, next to the same model untrained.

Prompts are cut from the held-out standard-library files (`corpus.prompt_cuts`): 300 to
1,500 characters ending at a line end. For each, the model greedily writes up to
GEN_TOKENS tokens, stopping at the first newline, and that line is scored:

- exact match: the line, stripped, equals the file's true next line, stripped;
- edit similarity: `difflib.SequenceMatcher`'s ratio of the two stripped lines, 0 to 1
  (CodeXGLUE's line-completion measure beside exact match): partial credit that tells a
  near miss from noise;
- valid: the model ended the line (a newline or end-of-text within GEN_TOKENS tokens),
  the line is not blank, and the file's text up to the cursor followed by the line, as
  written (indentation included), is still valid Python as far as it goes: it parses,
  or the parser's only complaint is that the input is incomplete (an open bracket, a
  block header waiting for its body, an open triple-quoted string). This is `codeop`'s
  test for interactive input with the parser's rules only, so a line the file's later
  lines would complete counts. The true next lines pass it every time (`reference`), so
  100% is the ceiling; a random model, which rarely ends a line, scores near 0.

The untrained model has the trained one's config and the random weights its build
started from (same seed). Generation is plain `model.generate` (greedy, batched with left
padding), in float32: an offline measurement, not the serving engine.
"""

from __future__ import annotations

import ast
import codeop
import difflib
import json
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from tasks.lm.train import corpus

GEN_TOKENS = 48
BATCH = 16
NUM_THREADS = 2
ENCODINGS = "encodings/"  # codecs, half of them generated charmap tables: a fifth of the held-out text, easy to predict
# The parser alone (an AST, no compile step), with the flags that make codeop's incomplete input an error
# that says so (codeop itself compiles, which would also reject a `return` outside a function).
_PARSE_FLAGS = ast.PyCF_ONLY_AST | codeop.PyCF_ALLOW_INCOMPLETE_INPUT | codeop.PyCF_DONT_IMPLY_DEDENT  # type: ignore[attr-defined]  # codeop's flags, not in typeshed


@dataclass(frozen=True)
class Line:
    text: str  # the completion up to its first newline
    ended: bool  # the model wrote a newline or end-of-text within GEN_TOKENS tokens


def evaluate(folder: Path, n: int = 200, seed: int = 0) -> dict[str, object]:
    """Score the model in `folder` and its untrained twin on `n` held-out prompts."""
    torch.set_num_threads(NUM_THREADS)
    folder = Path(folder)
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    trained = AutoModelForCausalLM.from_pretrained(folder)
    facts = json.loads((folder / "keybatch.json").read_text())
    cuts = corpus.prompt_cuts(n, seed)
    prompts = [cut.prompt for cut in cuts]
    untrained = untrained_twin(trained, facts["seed"])
    result: dict[str, object] = {
        "model": folder.name,
        "params": trained.num_parameters(),
        "build": {key: facts.get(key) for key in ("steps", "seed", "tokens_seen", "train_s", "held_out_loss")},
        "n": n,
        "seed": seed,
        "prompts_from_encodings": sum(cut.path.startswith(ENCODINGS) for cut in cuts),
        "trained": score(complete_lines(trained, tokenizer, prompts), cuts),
        "untrained": score(complete_lines(untrained, tokenizer, prompts), cuts),
        "reference": {"valid": score([Line(cut.next_line, True) for cut in cuts], cuts)["valid"]},
    }
    result["eval_s"] = round(time.perf_counter() - started, 1)
    return result


def untrained_twin(model: PreTrainedModel, seed: int) -> LlamaForCausalLM:
    """The model's shape with the random weights a build with `seed` starts from."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(model.config).eval()  # type: ignore[arg-type]  # a Llama folder's config is a LlamaConfig


def score(lines: list[Line], cuts: list[corpus.PromptCut]) -> dict[str, float]:
    """Exact match (all prompts, and those outside `encodings/`), edit similarity, valid, ended, blank."""
    texts = {f.path: f.text for f in corpus.held_out_files()}
    exact = [line.text.strip() == cut.next_line.strip() for line, cut in zip(lines, cuts, strict=True)]
    code = [hit for hit, cut in zip(exact, cuts, strict=True) if not cut.path.startswith(ENCODINGS)]
    return {
        "exact_match": _share(exact),
        "exact_match_outside_encodings": _share(code),
        "edit_similarity": _mean(_similarity(line.text, cut.next_line) for line, cut in zip(lines, cuts, strict=True)),
        "valid": _share(is_valid(texts[cut.path][: cut.cursor], line) for line, cut in zip(lines, cuts, strict=True)),
        "ended": _share(line.ended for line in lines),
        "blank": _share(not line.text.strip() for line in lines),
    }


def _similarity(line: str, truth: str) -> float:
    return difflib.SequenceMatcher(None, line.strip(), truth.strip(), autojunk=False).ratio()


def is_valid(before: str, line: Line) -> bool:
    """Whether `line`, written after the code `before` (ending at a line end), keeps it valid
    Python so far (the module docstring has the definition)."""
    return line.ended and bool(line.text.strip()) and is_valid_start(before + line.text)


def is_valid_start(source: str) -> bool:
    """Python that parses, or whose only fault is that it stops before its end."""
    with warnings.catch_warnings():  # a literal the compiler warns about is still valid code
        warnings.simplefilter("ignore")
        try:
            compile(source, "<completion>", "exec", _PARSE_FLAGS, dont_inherit=True)
            return True
        except SyntaxError:
            pass
        try:  # as codeop does: complete with one more newline, or incomplete input
            compile(source + "\n", "<completion>", "exec", _PARSE_FLAGS, dont_inherit=True)
            return True
        except SyntaxError as exc:
            return "incomplete input" in str(exc)


@torch.inference_mode()
def complete_lines(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str]) -> list[Line]:
    """Each prompt's greedy continuation up to its first newline (at most GEN_TOKENS tokens)."""
    model.eval()
    stops = [tokenizer.eos_token_id, *_newline_ids(tokenizer)]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # like lengths batch with little padding
    lines = [Line("", False)] * len(prompts)
    for start in range(0, len(order), BATCH):
        chunk = order[start : start + BATCH]
        inputs = tokenizer([prompts[i] for i in chunk], return_tensors="pt", padding=True)
        out = model.generate(  # type: ignore[operator]  # PreTrainedModel.generate, typed as a module attribute
            **inputs,
            max_new_tokens=GEN_TOKENS,
            do_sample=False,
            eos_token_id=stops,
            pad_token_id=tokenizer.pad_token_id,
        )  # out: [B, prompt + new]
        new = out[:, inputs["input_ids"].shape[1] :]
        texts = tokenizer.batch_decode(new, skip_special_tokens=True)
        ended = torch.isin(new, torch.tensor(stops)).any(dim=1).tolist()
        for i, text, done in zip(chunk, texts, ended, strict=True):
            lines[i] = Line(text.split("\n", 1)[0], done)
    return lines


def _newline_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Every token whose text holds a newline: generation stops at any of them."""
    return [i for i in range(len(tokenizer)) if "\n" in tokenizer.decode([i])]


def _share(flags: Iterable[bool]) -> float:
    return _mean(float(flag) for flag in flags)


def _mean(values: Iterable[float]) -> float:
    numbers = list(values)
    return round(sum(numbers) / len(numbers), 4) if numbers else 0.0

"""How good a built model is on code it never trained on, next to the same model untrained.

Prompts are cut from the held-out standard-library files (`corpus.prompt_cuts`): 300 to
1,500 characters ending at a line end. For each the model greedily writes up to
GEN_TOKENS tokens, stopping at the first newline, and its first line is scored:

- exact match: the line, stripped, equals the file's true next line, stripped;
- parses: the line, its indentation removed, is Python that the parser accepts as a
  line of code: a complete statement, or the start of one that more lines could
  complete (an open bracket, a block header ending in `:`, an open triple-quoted
  string), checked as `codeop` checks interactive input but with only the parser's
  rules, so `return x` or `yield` count as they would inside the function the prompt
  is in. A clause that continues a compound statement (`else:`, `elif`, `except`,
  `finally`, `case`) is checked after a minimal statement it can follow. An empty line
  does not count. The true next lines get the same check (`reference`), which is the
  ceiling: a line inside a docstring or a multi-line call fails it wherever it comes from.

The untrained model has the trained one's config and the random weights its build
started from (same seed). Generation is plain `model.generate` (greedy, batched with left
padding), in float32: an offline measurement, not the serving engine.
"""

from __future__ import annotations

import ast
import codeop
import json
import time
import warnings
from collections.abc import Iterable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from tasks.lm import corpus

GEN_TOKENS = 48
BATCH = 16
NUM_THREADS = 2
CODEC_TABLES = "encodings/"  # generated charmap tables: a fifth of the held-out text, easy to predict
# The parser alone (an AST, no compile step), and codeop's flags that make incomplete input an error
# that says so: codeop's own check compiles, which rejects `return` outside a function.
_PARSE_FLAGS = ast.PyCF_ONLY_AST | codeop.PyCF_ALLOW_INCOMPLETE_INPUT | codeop.PyCF_DONT_IMPLY_DEDENT
_CLAUSE_OPENERS = {
    "else": "if x:\n    pass\n",
    "elif": "if x:\n    pass\n",
    "except": "try:\n    pass\n",
    "finally": "try:\n    pass\n",
    "case": "match x:\n    ",
}


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
        "build": {key: facts.get(key) for key in ("steps", "seed", "tokens_seen", "train_s", "final_loss")},
        "n": n,
        "seed": seed,
        "prompts_from_codec_tables": sum(cut.path.startswith(CODEC_TABLES) for cut in cuts),
        "trained": score(first_lines(trained, tokenizer, prompts), cuts),
        "untrained": score(first_lines(untrained, tokenizer, prompts), cuts),
        "reference": {"parses": _share(parses(cut.next_line) for cut in cuts)},
    }
    result["eval_s"] = round(time.perf_counter() - started, 1)
    return result


def untrained_twin(model: PreTrainedModel, seed: int) -> LlamaForCausalLM:
    """The model's shape with the random weights a build with `seed` starts from."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(model.config).eval()


def score(lines: list[str], cuts: list[corpus.PromptCut]) -> dict[str, float]:
    """Exact match (all prompts, and those outside the codec tables), parse rate, empty lines."""
    exact = [line.strip() == cut.next_line.strip() for line, cut in zip(lines, cuts, strict=True)]
    code = [hit for hit, cut in zip(exact, cuts, strict=True) if not cut.path.startswith(CODEC_TABLES)]
    return {
        "exact_match": _share(exact),
        "exact_match_outside_codec_tables": _share(code),
        "parses": _share(parses(line) for line in lines),
        "empty": _share(not line.strip() for line in lines),
    }


def parses(line: str) -> bool:
    """Whether `line` is a valid line of Python (the module docstring has the definition)."""
    source = line.strip()
    if not source:
        return False
    opener = _CLAUSE_OPENERS.get(source.split(maxsplit=1)[0].rstrip(":"), "")
    return _is_valid_start(opener + source)


def _is_valid_start(source: str) -> bool:
    with warnings.catch_warnings():  # a literal the compiler warns about is still valid code
        warnings.simplefilter("ignore")
        try:
            compile(source, "<line>", "exec", _PARSE_FLAGS, dont_inherit=True)
            return True
        except SyntaxError:
            pass
        try:  # as codeop does: complete with one more newline, or incomplete input
            compile(source + "\n", "<line>", "exec", _PARSE_FLAGS, dont_inherit=True)
            return True
        except SyntaxError as exc:
            return "incomplete input" in str(exc)


@torch.inference_mode()
def first_lines(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str]) -> list[str]:
    """Each prompt's greedy continuation up to its first newline (at most GEN_TOKENS tokens)."""
    model.eval()
    stops = [tokenizer.eos_token_id, *_newline_ids(tokenizer)]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # like lengths batch with little padding
    lines = [""] * len(prompts)
    for start in range(0, len(order), BATCH):
        chunk = order[start : start + BATCH]
        inputs = tokenizer([prompts[i] for i in chunk], return_tensors="pt", padding=True)
        out = model.generate(
            **inputs,
            max_new_tokens=GEN_TOKENS,
            do_sample=False,
            eos_token_id=stops,
            pad_token_id=tokenizer.pad_token_id,
        )  # out: [B, prompt + new]
        texts = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        for i, text in zip(chunk, texts, strict=True):
            lines[i] = text.split("\n", 1)[0]
    return lines


def _newline_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Every token whose text holds a newline: generation stops at any of them."""
    return [i for i in range(len(tokenizer)) if "\n" in tokenizer.decode([i])]


def _share(flags: Iterable[bool]) -> float:
    values = list(flags)
    return round(sum(values) / len(values), 4) if values else 0.0

"""A tiny random-weight Llama folder for the engine tests: real tokenizer, real model code."""

from __future__ import annotations

from pathlib import Path

from tasks.lm.fim import END_OF_TEXT, PAD, SPECIAL_TOKENS

# A few kB of Python for the tokenizer to learn merges from (trained in well under a second).
_CORPUS = '''
def add(a, b):
    """Return the sum of a and b."""
    return a + b


class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()


def fib(n: int) -> int:
    if n < 2:
        return n
    return fib(n - 1) + fib(n - 2)


for i in range(10):
    print(i, fib(i))

import os
import sys
from pathlib import Path

def read_lines(path):
    with open(path) as fh:
        return [line.rstrip("\\n") for line in fh]

result = {key: value for key, value in zip("abc", range(3))}
print("héllo wörld — ✓ 日本")
'''


def build_tiny_llama(folder: Path, max_position_embeddings: int = 256) -> Path:
    """Train a byte-level BPE on `_CORPUS` and save it with a 2-layer random Llama."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=END_OF_TEXT, pad_token=PAD)
    fast.add_special_tokens({"additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in (END_OF_TEXT, PAD)]})
    fast.save_pretrained(folder)

    config = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=max_position_embeddings,
        vocab_size=len(fast),
        bos_token_id=None,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        # Wide random weights spread the logits, so float rounding between batch shapes
        # cannot flip an argmax and the greedy comparisons test the engine, not luck.
        initializer_range=0.3,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder

"""Fill-in-the-middle: the special tokens and the prompt layout the models are trained on.

Prefix-suffix-middle order (as StarCoder and Code Llama use): the model reads the code
before the cursor, then the code after it, and writes what goes between.
"""

from __future__ import annotations

END_OF_TEXT = "<|endoftext|>"
FIM_PREFIX = "<fim_prefix>"
FIM_SUFFIX = "<fim_suffix>"
FIM_MIDDLE = "<fim_middle>"
PAD = "<pad>"
SPECIAL_TOKENS = [END_OF_TEXT, FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE, PAD]


def format_prompt(prompt: str, suffix: str | None) -> str:
    """The model's input for a completion at the cursor (FIM when there is a suffix)."""
    if not suffix:
        return prompt
    return f"{FIM_PREFIX}{prompt}{FIM_SUFFIX}{suffix}{FIM_MIDDLE}"

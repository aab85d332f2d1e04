"""Reuse of the keys and values of prompt prefixes that earlier requests computed.

Completions from one file share long prefixes. The prompt is cut into blocks of
`block_size` tokens; a block is keyed by a hash chain (its tokens and the key of the
block before), so a key names the whole prefix up to the block's end, and a lookup walks
the chain from the start until the first block it does not hold. Blocks are evicted
least recently used first, within `max_tokens`. What a block holds (the engine stores
its keys and values) is opaque here, so the policy needs no torch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

Payload = TypeVar("Payload")


@dataclass
class _Block(Generic[Payload]):
    tokens: tuple[int, ...]  # checked on a hit, so a hash collision cannot serve another prefix
    payload: Payload


class PrefixCache(Generic[Payload]):
    """An LRU of prefix blocks, bounded by the number of tokens they hold."""

    def __init__(self, max_tokens: int, block_size: int = 32) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, not {block_size}")
        self.max_tokens = max(0, max_tokens)
        self.block_size = block_size
        self._blocks: OrderedDict[int, _Block[Payload]] = OrderedDict()

    @property
    def max_blocks(self) -> int:
        return self.max_tokens // self.block_size

    @property
    def num_tokens(self) -> int:
        return len(self._blocks) * self.block_size

    def _chain(self, token_ids: Sequence[int], num_blocks: int) -> list[tuple[int, tuple[int, ...]]]:
        """(key, tokens) of the first `num_blocks` full blocks."""
        chain, key = [], 0
        for start in range(0, num_blocks * self.block_size, self.block_size):
            tokens = tuple(token_ids[start : start + self.block_size])
            key = hash((key, tokens))
            chain.append((key, tokens))
        return chain

    def lookup(self, token_ids: Sequence[int], max_tokens: int) -> list[Payload]:
        """Payloads of the longest cached prefix of `token_ids` no longer than `max_tokens`."""
        found: list[tuple[int, Payload]] = []
        for key, tokens in self._chain(token_ids, max(0, max_tokens) // self.block_size):
            block = self._blocks.get(key)
            if block is None or block.tokens != tokens:
                break
            found.append((key, block.payload))
        self._touch([key for key, _ in found])
        return [payload for _, payload in found]

    def store(self, token_ids: Sequence[int], make_payload: Callable[[int], Payload]) -> int:
        """Keep every full block of `token_ids` not yet held; `make_payload(i)` gives block i's
        payload. Returns how many blocks were added."""
        if self.max_blocks == 0:
            return 0
        chain = self._chain(token_ids, min(len(token_ids) // self.block_size, self.max_blocks))
        added = 0
        for index, (key, tokens) in enumerate(chain):
            if key not in self._blocks:
                self._blocks[key] = _Block(tokens, make_payload(index))
                added += 1
        self._touch([key for key, _ in chain])
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)
        return added

    def _touch(self, keys: list[int]) -> None:
        # Deepest block first, so a prefix's first blocks are the most recent and a chain is
        # evicted from its end (a lost first block would strand all the blocks after it).
        for key in reversed(keys):
            self._blocks.move_to_end(key)

    def clear(self) -> None:
        self._blocks.clear()

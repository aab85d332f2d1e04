"""A KV cache with one row (slot) per running request, as a `transformers` Cache.

Everything this project knows about transformers' cache interface lives here (its
contract test is tests/lm/test_hf_engine.py): the Llama forward calls
`cache.update(keys, values, layer_idx)` in every attention layer and attends over what it
returns. `SlotLayer.update` writes each row's new keys and values at that row's positions
and returns the rows of this forward up to the longest position, as a view of the slot
tensors (no copy): the engine keeps the rows of a decode forward at the front of the
cache, so a step with three requests reads three rows, not `max_batch`.

The tensors are allocated once: [rows, kv_heads, context, head_dim] per layer, with one
spare row that `swap` uses as scratch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.configuration_utils import PreTrainedConfig


@dataclass
class Window:
    """Which rows and positions the next forward reads and writes."""

    start: int = 0  # first row of the forward
    stop: int = 0  # one past its last row
    rows: torch.Tensor | None = None  # decode: [rows] the row indices, start..stop
    positions: torch.Tensor | None = None  # decode: [rows] the position each row writes
    first: int = 0  # prefill (one row): the position of the chunk's first token
    kv_len: int = 0  # the forward attends over positions [0, kv_len)


class SlotLayer(CacheLayerMixin):
    """One attention layer's keys and values for every slot."""

    is_sliding = False

    def __init__(self, shape: tuple[int, int, int, int], dtype: torch.dtype, window: Window) -> None:
        super().__init__()
        self.key_slots = torch.zeros(shape, dtype=dtype)
        self.value_slots = torch.zeros(shape, dtype=dtype)
        self.keys, self.values = self.key_slots, self.value_slots  # what transformers' own code reads
        self.device = self.key_slots.device
        self.is_initialized = True
        self.window = window

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocated up front; nothing to do."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states, value_states: [rows, kv_heads, q_len, head_dim]
        w = self.window
        for cache, new in ((self.key_slots, key_states), (self.value_slots, value_states)):
            if w.rows is None:  # a prefill chunk of one row at consecutive positions
                cache[w.start, :, w.first : w.first + new.shape[2]] = new[0]
            else:  # a decode: one token per row, each at its own position
                cache[w.rows, :, w.positions] = new[:, :, 0]
        return self.key_slots[w.start : w.stop, :, : w.kv_len], self.value_slots[w.start : w.stop, :, : w.kv_len]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.window.kv_len, 0

    def get_seq_length(self) -> int:
        return self.window.kv_len

    def get_max_length(self) -> int:
        return self.key_slots.shape[2]


class SlotCache(Cache):
    """The KV cache of an engine: `num_slots` rows of `max_len` positions in every layer."""

    def __init__(self, config: PreTrainedConfig, num_slots: int, max_len: int, dtype: torch.dtype) -> None:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.window = Window()
        self.num_slots = num_slots
        self.max_len = max_len
        shape = (num_slots + 1, kv_heads, max_len, head_dim)  # the last row is scratch for swaps
        self.slot_layers = [SlotLayer(shape, dtype, self.window) for _ in range(config.num_hidden_layers)]
        super().__init__(layers=list(self.slot_layers))

    @property
    def nbytes(self) -> int:
        return sum(layer.key_slots.nbytes + layer.value_slots.nbytes for layer in self.slot_layers)

    def bind_decode(self, num_rows: int, positions: torch.Tensor) -> int:
        """The next forward decodes rows [0, num_rows), row i writing at positions[i]."""
        w = self.window
        w.start, w.stop, w.rows, w.positions = 0, num_rows, torch.arange(num_rows), positions
        w.kv_len = int(positions.max()) + 1
        return w.kv_len

    def bind_prefill(self, row: int, first: int, num_tokens: int) -> int:
        """The next forward prefills `num_tokens` tokens of `row` from position `first`."""
        w = self.window
        w.start, w.stop, w.rows, w.positions = row, row + 1, None, None
        w.first, w.kv_len = first, first + num_tokens
        return w.kv_len

    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Row `dst` gets the first `length` positions of row `src`."""
        if src == dst or length <= 0:
            return
        for layer in self.slot_layers:
            layer.key_slots[dst, :, :length] = layer.key_slots[src, :, :length]
            layer.value_slots[dst, :, :length] = layer.value_slots[src, :, :length]

    def swap(self, a: int, b: int, len_a: int, len_b: int) -> None:
        """Rows `a` and `b` trade places (through the scratch row)."""
        scratch = self.num_slots
        self.copy_row(a, scratch, len_a)
        self.copy_row(b, a, len_b)
        self.copy_row(scratch, b, len_a)

    def read_block(self, row: int, start: int, length: int) -> torch.Tensor:
        """A copy of positions [start, start + length) of `row`: [layers, 2, kv_heads, length, head_dim]."""
        end = start + length
        return torch.stack(
            [
                torch.stack((layer.key_slots[row, :, start:end], layer.value_slots[row, :, start:end]))
                for layer in self.slot_layers
            ]
        )

    def write_block(self, row: int, start: int, block: torch.Tensor) -> None:
        """Put a block from `read_block` at positions [start, ...) of `row`."""
        end = start + block.shape[3]
        for layer, kv in zip(self.slot_layers, block, strict=True):
            layer.key_slots[row, :, start:end] = kv[0]
            layer.value_slots[row, :, start:end] = kv[1]

"""The prefix cache's policy on plain payloads (no model)."""

from __future__ import annotations

from tasks.lm.prefix_cache import PrefixCache


def store(cache: PrefixCache[str], tokens: list[int], tag: str) -> int:
    return cache.store(tokens, lambda i: f"{tag}{i}")


def test_the_longest_cached_prefix_comes_back_block_by_block() -> None:
    cache: PrefixCache[str] = PrefixCache(max_tokens=100, block_size=4)
    assert store(cache, list(range(10)), "a") == 2  # two full blocks; the last two tokens are no block
    assert cache.lookup(list(range(10)), max_tokens=9) == ["a0", "a1"]
    assert cache.lookup([0, 1, 2, 3, 9, 9, 9, 9, 9], max_tokens=8) == ["a0"]  # diverges in block 1
    assert cache.lookup([9, 1, 2, 3, 4, 5, 6, 7], max_tokens=8) == []


def test_a_lookup_leaves_what_the_caller_must_compute() -> None:
    cache: PrefixCache[str] = PrefixCache(max_tokens=100, block_size=4)
    store(cache, list(range(8)), "a")
    # An 8-token prompt must compute at least its last token: one block, not two.
    assert cache.lookup(list(range(8)), max_tokens=7) == ["a0"]


def test_a_block_stands_for_its_whole_prefix() -> None:
    cache: PrefixCache[str] = PrefixCache(max_tokens=100, block_size=2)
    store(cache, [1, 2, 3, 4], "a")
    # Same tokens as block 1 of the stored prompt, after another first block: no hit.
    assert cache.lookup([7, 7, 3, 4, 5], max_tokens=4) == []


def test_blocks_already_held_are_not_stored_again() -> None:
    cache: PrefixCache[str] = PrefixCache(max_tokens=100, block_size=2)
    assert store(cache, [1, 2, 3, 4], "a") == 2
    assert store(cache, [1, 2, 3, 4, 5, 6], "b") == 1
    assert cache.lookup([1, 2, 3, 4, 5, 6, 0], max_tokens=6) == ["a0", "a1", "b2"]


def test_least_recently_used_goes_first_and_a_chain_loses_its_end() -> None:
    cache: PrefixCache[str] = PrefixCache(max_tokens=8, block_size=2)  # four blocks
    store(cache, [1, 1, 2, 2, 3, 3], "a")
    store(cache, [9, 9, 8, 8], "b")  # five blocks: a's last block is the oldest
    assert cache.num_tokens == 8
    assert cache.lookup([1, 1, 2, 2, 3, 3, 0], max_tokens=6) == ["a0", "a1"]
    assert cache.lookup([9, 9, 8, 8, 0], max_tokens=4) == ["b0", "b1"]


def test_no_room_means_no_cache() -> None:
    cache: PrefixCache[str] = PrefixCache(max_tokens=0, block_size=2)
    assert store(cache, [1, 2, 3, 4], "a") == 0
    assert cache.lookup([1, 2, 3, 4], max_tokens=4) == []

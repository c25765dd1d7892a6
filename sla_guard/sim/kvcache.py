"""Prefix cache keyed by block hashes (the traces' ``hash_ids``), LRU, with an optional CPU tier.

A block is reusable only as part of a prefix: a lookup counts leading blocks present. Evicted GPU
blocks go to the CPU tier (when configured), from which a later hit is restored at a cost instead
of being recomputed ("Serving GLM-5.2 for Agentic Workloads on llm-d": "restoring saved context is faster
than recomputing it").
"""

from __future__ import annotations

from collections.abc import Sequence


class LRUBlocks:
    """Ordered set of block hashes with a capacity; oldest evicted first."""

    __slots__ = ("_d", "capacity")

    def __init__(self, capacity: int) -> None:
        self.capacity = max(0, int(capacity))
        self._d: dict[int, None] = {}

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, h: int) -> bool:
        return h in self._d

    def prefix_len(self, hashes: Sequence[int], start: int = 0) -> int:
        """Leading blocks of ``hashes[start:]`` present (no LRU update)."""
        d = self._d
        n = 0
        for h in hashes[start:]:
            if h not in d:
                break
            n += 1
        return n

    def touch(self, hashes: Sequence[int]) -> None:
        d = self._d
        for h in hashes:
            if h in d:
                del d[h]
            d[h] = None

    def remove(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self._d.pop(h, None)

    def insert(self, hashes: Sequence[int], limit: int | None = None) -> list[int]:
        """Insert/refresh; returns the evicted hashes (oldest first)."""
        self.touch(hashes)
        return self.trim(self.capacity if limit is None else limit)

    def trim(self, limit: int) -> list[int]:
        d = self._d
        over = len(d) - max(0, limit)
        if over <= 0:
            return []
        it = iter(d)
        victims = [next(it) for _ in range(over)]
        for h in victims:
            del d[h]
        return victims


class PrefixCache:
    """GPU prefix cache with an optional CPU tier. Capacities are in blocks."""

    __slots__ = ("cpu", "gpu")

    def __init__(self, gpu_blocks: int, cpu_blocks: int = 0) -> None:
        self.gpu = LRUBlocks(gpu_blocks)
        self.cpu = LRUBlocks(cpu_blocks) if cpu_blocks > 0 else None

    def peek(self, hashes: Sequence[int]) -> int:
        """Leading blocks available in any tier (routing estimate)."""
        n = self.gpu.prefix_len(hashes)
        if self.cpu is not None and n < len(hashes):
            n += self.cpu.prefix_len(hashes, n)
        return n

    def lookup(self, hashes: Sequence[int]) -> tuple[int, int]:
        """(GPU-hit blocks, CPU-restored blocks) for this prefix; restored blocks move to the GPU tier."""
        g = self.gpu.prefix_len(hashes)
        c = 0
        if self.cpu is not None and g < len(hashes):
            c = self.cpu.prefix_len(hashes, g)
            if c:
                self.cpu.remove(hashes[g:g + c])
        self.gpu.touch(hashes[:g + c])
        return g, c

    def insert(self, hashes: Sequence[int], gpu_limit: int | None = None) -> None:
        evicted = self.gpu.insert(hashes, gpu_limit)
        if evicted and self.cpu is not None:
            self.cpu.insert(evicted)

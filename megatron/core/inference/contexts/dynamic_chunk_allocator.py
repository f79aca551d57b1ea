"""`ChunkAllocator`: the free list of the dynamic context's key/value memory chunks.

A stack of chunk ids: allocation pops from the top, release pushes back. The last chunk of the buffer is a
dummy (padding rows of the chunk table point at it) and is never handed out. A "safe" allocation (the
prompt of a new request) must leave `gtd_chunk_count` chunks free, the reserve that lets running
requests keep growing.
"""
from typing import List, Optional


class ChunkAllocator:
    """Free-list of chunk ids `0 .. chunk_count_total - 2` (the last id is the dummy chunk)."""

    def __init__(self, chunk_count_total: int, gtd_chunk_count: int):
        if chunk_count_total < 2:
            raise ValueError(f"the dynamic inference buffer holds {chunk_count_total} chunk(s); at least 2 are "
                             "needed (one is a dummy): raise --inference-dynamic-batching-buffer-size-gb")
        self.chunk_count_total = chunk_count_total
        self.gtd_chunk_count = gtd_chunk_count
        self.dummy_chunk_idx = chunk_count_total - 1
        self.reset()

    @property
    def chunk_count_avail(self) -> int:
        """Chunks free now."""
        return len(self._free)

    def reset(self) -> None:
        """Every chunk free again."""
        self._free = list(range(self.chunk_count_total - 2, -1, -1))

    def is_memory_available(self, num_chunks: int, safe: bool = False) -> bool:
        """Whether `num_chunks` can be taken (keeping the guaranteed reserve when `safe`)."""
        reserve = self.gtd_chunk_count if safe else 0
        return self.chunk_count_avail >= num_chunks + reserve

    def allocate_memory_chunks(self, num_chunks: int = 1, safe: bool = False) -> Optional[List[int]]:
        """`num_chunks` chunk ids, or None when not available."""
        if not self.is_memory_available(num_chunks, safe):
            return None
        taken = self._free[len(self._free) - num_chunks:][::-1]
        del self._free[len(self._free) - num_chunks:]
        return taken

    def release_memory_chunks(self, chunks: List[int]) -> None:
        """Give chunks back."""
        self._free.extend(reversed(chunks))


__all__ = ["ChunkAllocator"]

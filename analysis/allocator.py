"""PyTorch's CUDA caching allocator, replayed on the step's allocations and frees.

The rules are those of ``c10/cuda/CUDACachingAllocator.cpp`` (``round_size``, ``get_pool``,
``get_allocation_size``, ``get_free_block``, ``should_split``, ``free_block``, ``release_cached_blocks``,
``try_allocate_expandable_block``), with its default configuration:

* every request is rounded up to 512 bytes (``kMinBlockSize``); a request of 0 bytes allocates nothing;
* requests of at most 1 MiB (``kSmallSize``) come from the small pool, carved out of 2 MiB segments
  (``kSmallBuffer``); larger ones from the large pool: below 10 MiB (``kMinLargeAlloc``) out of 20 MiB
  segments (``kLargeBuffer``), from 10 MiB on out of a segment of their own rounded up to 2 MiB
  (``kRoundLarge``);
* a request takes the smallest free block of its pool that fits (best fit, lowest address on ties) and
  splits it only if the remainder is at least 512 bytes (small pool) or more than 1 MiB (large pool);
  an unsplit block is handed out whole, and ``max_memory_allocated`` counts the whole block;
* a freed block merges with free neighbours of its segment and stays cached: memory goes back to the driver
  only when a ``cudaMalloc`` fails (then every cached segment with no block in use is released and the
  allocation retried) or when ``torch.cuda.empty_cache`` is called (``empty_cache``; ``torch.cuda.graph``
  calls it before each CUDA graph capture, so a ``generate()`` whose decoding is compiled does too);
* free blocks of equal size are told apart by their address (``BlockComparatorSize``), so which segment a
  request splits depends on where ``cudaMalloc`` put the segments; the model gives each new segment an
  address below all earlier ones, as the driver mostly did (see ``CachingAllocator``), or the address the
  caller's ``addresses`` says;
* with ``expandable_segments:True`` each pool is one growing virtual segment mapped in pages of 2 MiB (small
  pool) or 20 MiB (large pool), and blocks split whenever 512 bytes or more remain.

Not modelled: ``max_split_size_mb``, ``roundup_power2_divisions`` and ``garbage_collection_threshold``
(off by default), and blocks kept for other streams by ``record_stream`` (a CUDA graph's private pool is a
stream of its own here, which ``empty_cache`` may be told to keep: analysis/cudagraphs.py); with
expandable segments, an allocation that fails releases only the free pages at the end of each segment.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

from tracer.cuda.caching_allocator import MIN_BLOCK_SIZE

MIB = 1024**2
SMALL_SIZE = 1 * MIB  # kSmallSize: largest request served by the small pool
SMALL_BUFFER = 2 * MIB  # kSmallBuffer: small pool segments (and expandable small-pool pages)
LARGE_BUFFER = 20 * MIB  # kLargeBuffer: segments for 1-10 MiB requests (and expandable large-pool pages)
MIN_LARGE_ALLOC = 10 * MIB  # kMinLargeAlloc: requests from here on get a segment of their own
ROUND_LARGE = 2 * MIB  # kRoundLarge: granularity of those segments


def block_size(nbytes: int) -> int:
    """Bytes the allocator hands out for a request of ``nbytes`` when it splits a block (``round_size``)."""
    if nbytes <= 0:
        return 0
    return -(-nbytes // MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE


def segment_size(size: int) -> int:
    """Bytes ``cudaMalloc`` is asked for when no cached block fits a rounded request (``get_allocation_size``)."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass(frozen=True)
class AllocatorConfig:
    expandable_segments: bool = False
    # What cudaMalloc can give before it fails (GPU memory less the CUDA context); None: it never fails.
    capacity: int | None = None


class OutOfMemory(Exception):
    """The allocation fails even after every cached segment was released, as CUDA's OOM error would."""

    def __init__(self, requested: int, allocated: int, reserved: int) -> None:
        super().__init__(f"out of memory allocating {requested} bytes ({allocated} allocated, {reserved} reserved)")
        self.requested = requested
        self.allocated = allocated
        self.reserved = reserved


@dataclass(eq=False, slots=True)
class Block:
    address: int
    size: int
    segment: Segment
    allocated: bool = False
    requested: int = 0
    prev: Block | None = None
    next: Block | None = None

    @property
    def key(self) -> tuple[int, int]:
        return (self.size, self.address)


@dataclass(eq=False, slots=True)
class Segment:
    address: int
    small: bool
    stream: int
    mapped: int = 0  # bytes backed by device memory: the whole segment, or an expandable one's mapped pages
    expandable: bool = False
    first: Block | None = None

    def blocks(self) -> list[Block]:
        found, block = [], self.first
        while block is not None:
            found.append(block)
            block = block.next
        return found


@dataclass
class _Pool:
    """Free blocks of one pool and stream, ordered as ``BlockComparatorSize`` orders them."""

    keys: list[tuple[int, int]] = field(default_factory=list)
    blocks: dict[tuple[int, int], Block] = field(default_factory=dict)

    def add(self, block: Block) -> None:
        bisect.insort(self.keys, block.key)
        self.blocks[block.key] = block

    def remove(self, block: Block) -> None:
        key = block.key
        del self.keys[bisect.bisect_left(self.keys, key)]
        del self.blocks[key]

    def take_best_fit(self, size: int) -> Block | None:
        """Remove and return the smallest block of at least ``size`` bytes, the lowest-addressed of that size."""
        position = bisect.bisect_left(self.keys, (size, -1))
        if position == len(self.keys):
            return None
        return self.blocks.pop(self.keys.pop(position))


class CachingAllocator:
    """One device's caching allocator: ``malloc`` and ``free`` as tensors come and go, with the statistics
    ``torch.cuda.memory_stats`` reports (``allocated``, ``reserved`` and their peaks).

    ``addresses(nbytes)``, when given, says where ``cudaMalloc`` puts a new segment of ``nbytes`` (None: let
    the model choose). The address matters: a request takes the free block of the smallest size that fits and,
    among blocks of that size, the one at the lowest address (``BlockComparatorSize`` orders a pool by stream,
    size, then pointer; ``get_free_block`` takes ``lower_bound`` of a key with a null pointer), so equal-size
    blocks in different segments are chosen by their segments' addresses. The model's own addresses grow
    downward: on the 104 steps measured on an H200 (driver 580, benchmarks/ground_truth/data/nvidia-h200),
    ``cudaMalloc`` put most new segments below every segment already held (the driver reserves virtual address
    space from the top), so among equal-size free blocks the newest segment's is taken. Growing upward instead
    took the oldest segment's and put the reserved peak of 10 of those steps off by 0.5 % to 2.6 %."""

    def __init__(
        self,
        config: AllocatorConfig = AllocatorConfig(),
        addresses: Callable[[int], int | None] | None = None,
    ) -> None:
        self.config = config
        self.allocated = 0
        self.reserved = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.retries = 0  # failed cudaMallocs that released the cache and retried (num_alloc_retries) since reset_peak
        self.segments: list[Segment] = []
        self._pools: dict[tuple[bool, int], _Pool] = {}
        self._addresses = addresses
        self._next_address = 1 << 47  # a made-up device address space, taken from the top down

    def empty_cache(self, keep_streams: frozenset[int] = frozenset()) -> None:
        """``torch.cuda.empty_cache`` (``emptyCache``): ``release_cached_blocks``, every segment with no block in
        use goes back to the driver; the peaks keep what they saw. The segments of ``keep_streams`` stay: a CUDA
        graph's private pool, which ``release_cached_blocks`` frees only once no graph uses it."""
        self._release_cached(keep_streams)

    def reset_peak(self) -> None:
        """``torch.cuda.reset_peak_memory_stats``: peaks restart from the current values, and the retries from 0."""
        self.peak_allocated = self.allocated
        self.peak_reserved = self.reserved
        self.retries = 0

    def malloc(self, nbytes: int, stream: int = 0) -> Block | None:
        if nbytes <= 0:
            return None
        size = block_size(nbytes)
        small = size <= SMALL_SIZE
        pool = self._pools.get((small, stream)) or self._pool(small, stream)
        block = pool.take_best_fit(size)
        if block is None:
            block = self._new_block(size, small, stream)
        block = self._split(block, size, pool)
        block.allocated = True
        block.requested = nbytes
        self.allocated += block.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        return block

    def free(self, block: Block) -> None:
        block.allocated = False
        self.allocated -= block.size
        segment = block.segment
        pool = self._pools[segment.small, segment.stream]
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated and self._in_pool(neighbour, pool):
                pool.remove(neighbour)
                block = self._merge(block, neighbour)
        pool.add(block)

    # -- internals -----------------------------------------------------------------------------------------

    def _pool(self, small: bool, stream: int) -> _Pool:
        pool = self._pools.get((small, stream))
        if pool is None:
            pool = self._pools[small, stream] = _Pool()
        return pool

    @staticmethod
    def _in_pool(block: Block, pool: _Pool) -> bool:
        """False for a block being handed out or grown, which is free but not cached."""
        return pool.blocks.get(block.key) is block

    def _split(self, block: Block, size: int, pool: _Pool) -> Block:
        remaining = block.size - size
        if block.segment.small or block.segment.expandable:
            split = remaining >= MIN_BLOCK_SIZE
        else:
            split = remaining > SMALL_SIZE
        if not split:
            return block
        rest = Block(block.address + size, remaining, block.segment, prev=block, next=block.next)
        if block.next is not None:
            block.next.prev = rest
        block.next = rest
        block.size = size
        pool.add(rest)
        return block

    @staticmethod
    def _merge(block: Block, neighbour: Block) -> Block:
        first, second = (block, neighbour) if block.address < neighbour.address else (neighbour, block)
        first.size += second.size
        first.next = second.next
        if second.next is not None:
            second.next.prev = first
        return first

    def _new_block(self, size: int, small: bool, stream: int) -> Block:
        if self.config.expandable_segments:
            return self._expand(size, small, stream)
        wanted = segment_size(size)
        if not self._can_reserve(wanted):
            self._release_cached()
            self.retries += 1
            if not self._can_reserve(wanted):
                raise OutOfMemory(wanted, self.allocated, self.reserved)
        segment = Segment(self._take_addresses(wanted), small, stream, mapped=wanted)
        segment.first = Block(segment.address, wanted, segment)
        self.segments.append(segment)
        self._reserve(wanted)
        return segment.first

    def _expand(self, size: int, small: bool, stream: int) -> Block:
        """Map pages at the end of the pool's expandable segment until its free tail holds ``size``."""
        page = SMALL_BUFFER if small else LARGE_BUFFER
        segment = next((s for s in self.segments if s.expandable and s.small == small and s.stream == stream), None)
        if segment is None:
            segment = Segment(self._take_addresses(1 << 36), small, stream, expandable=True)
            self.segments.append(segment)
        pool = self._pool(small, stream)
        blocks = segment.blocks()
        tail = blocks[-1] if blocks and not blocks[-1].allocated else None
        have = tail.size if tail is not None else 0
        more = -(-(size - have) // page) * page
        if not self._can_reserve(more):
            self._release_cached()
            self.retries += 1
            if not self._can_reserve(more):
                raise OutOfMemory(more, self.allocated, self.reserved)
            return self._expand(size, small, stream)
        self._reserve(more)
        if tail is not None:
            pool.remove(tail)
            tail.size += more
        else:
            tail = Block(segment.address + segment.mapped, more, segment, prev=blocks[-1] if blocks else None)
            if tail.prev is not None:
                tail.prev.next = tail
            else:
                segment.first = tail
        segment.mapped += more
        return tail

    def _can_reserve(self, nbytes: int) -> bool:
        return self.config.capacity is None or self.reserved + nbytes <= self.config.capacity

    def _reserve(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def _release_cached(self, keep_streams: frozenset[int] = frozenset()) -> None:
        """``release_cached_blocks``: give back every segment none of whose memory is in use."""
        kept = []
        for segment in self.segments:
            if segment.stream in keep_streams:
                kept.append(segment)
                continue
            pool = self._pool(segment.small, segment.stream)
            blocks = segment.blocks()
            if segment.expandable:
                tail = blocks[-1] if blocks and not blocks[-1].allocated else None
                page = SMALL_BUFFER if segment.small else LARGE_BUFFER
                if tail is not None:
                    unmapped = tail.size // page * page
                    pool.remove(tail)
                    tail.size -= unmapped
                    segment.mapped -= unmapped
                    self.reserved -= unmapped
                    if tail.size:
                        pool.add(tail)
                    elif tail.prev is not None:
                        tail.prev.next = None
                    else:
                        segment.first = None
                kept.append(segment)
            elif len(blocks) == 1 and not blocks[0].allocated:
                pool.remove(blocks[0])
                self.reserved -= segment.mapped
            else:
                kept.append(segment)
        self.segments = kept

    def _take_addresses(self, nbytes: int) -> int:
        address = self._addresses(nbytes) if self._addresses is not None else None
        if address is None:
            self._next_address -= -(-nbytes // ROUND_LARGE) * ROUND_LARGE
            address = self._next_address
        return address

"""Rules of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp).

``max_memory_allocated`` counts blocks, not tensor bytes: every request is rounded up to a multiple of
``kMinBlockSize`` (512 bytes), and a request of 0 bytes allocates nothing.
"""

MIN_BLOCK_SIZE = 512  # kMinBlockSize in CUDACachingAllocator.cpp


def block_size(nbytes: int) -> int:
    """Bytes the allocator hands out for a request of ``nbytes`` (``round_size``)."""
    if nbytes <= 0:
        return 0
    return -(-nbytes // MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE

"""The CUDA caching allocator's request granularity: every allocation is rounded up to it.

The allocator itself (pools, segments, splitting) is modelled in ``analysis/allocator.py``; this one constant
lives here because the trace states it among its assumptions.
"""

MIN_BLOCK_SIZE = 512  # kMinBlockSize in c10/cuda/CUDACachingAllocator.cpp

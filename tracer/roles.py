"""What a storage is for. One role per storage; the breakdown at the peak sums bytes by role."""

from enum import Enum


class Role(str, Enum):
    PARAMETER = "parameters"
    BUFFER = "buffers"
    GRADIENT = "gradients"
    OPTIMIZER_STATE = "optimizer_states"
    INPUT = "inputs"
    ACTIVATION = "activations"
    TEMPORARY = "temporaries"
    WORKSPACE = "workspaces"
    COMMUNICATION = "communication"  # collective buffers: all-gather, reduce-scatter, all-reduce, DDP buckets
    KV_CACHE = "kv_cache"  # keys and values kept for generation (inference)
    # Not a storage's role: bytes of blocks the CUDA caching allocator hands out whole, beyond the rounded
    # requests (an unsplit cached block is counted in full by max_memory_allocated; analysis/allocator.py).
    ALLOCATOR_SLACK = "allocator_slack"


class Phase(str, Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    PREFILL = "prefill"  # inference: the forward over the prompt
    DECODE = "decode"  # inference: one new token, with the cache at its longest

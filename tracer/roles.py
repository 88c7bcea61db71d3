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


class Phase(str, Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    PREFILL = "prefill"  # inference: the forward over the prompt
    DECODE = "decode"  # inference: one new token, with the cache at its longest

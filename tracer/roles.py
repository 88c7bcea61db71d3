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


class Phase(str, Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"

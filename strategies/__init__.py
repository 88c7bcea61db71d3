"""Parallel layouts as transforms of one traced step: each takes the single-GPU step graph and returns the
step graph of one rank, with sharded storages resized, buffers of the runtime's collectives inserted, and
lifetimes moved to where the runtime allocates and frees."""

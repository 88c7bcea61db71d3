"""``generate()`` whose decoding is compiled into CUDA graphs, as the caching allocator sees it.

transformers (5.17 to 5.24, generation/utils.py) runs the decode steps of ``generate()`` through
``get_compiled_call``: ``torch.compile(self.__call__, mode="reduce-overhead")`` (``CompileConfig``'s default) when
``_valid_auto_compile_criteria`` holds: the model is on a CUDA device, its cache ``is_compileable`` and is not a
``DynamicCache`` (a ``StaticCache``), no quantizer that refuses compilation, no device map that offloads; Llama 4
is never compiled there. The prefill stays eager. Mode "reduce-overhead" runs inductor's code under CUDA graph
trees (torch/_inductor/cudagraph_trees.py, torch 2.11), whose effects on the allocator are, in the order they
happen in the process's first ``generate()``:

1. The first compiled call creates the device's ``CUDAGraphTreeManager``, whose ``__init__`` enters an empty
   ``torch.cuda.graph`` capture to create its private memory pool; ``torch.cuda.graph.__enter__``
   (torch/cuda/graphs.py) calls ``torch.cuda.empty_cache()``: every cached segment with no block in use (the
   prefill's activations) goes back to the driver, so the next ``generate()``'s prefill allocates them anew.
2. That call is the function's warm-up (``CUDAWarmupNode.run``) and the next one its recording
   (``CUDAGraphNode._record``); both run under ``_use_cuda_memory_pool_manager``, which sends every allocation of
   the calling thread to the private pool, and under ``clear_cublas_manager``, which frees the thread's cuBLAS
   workspace before and after, so the compiled matmuls take a workspace of their own inside the pool. The
   recording's ``torch.cuda.graph`` empties the cache again; the private pool is kept (``release_cached_blocks``
   frees a private pool only once no graph uses it). Graph replays allocate nothing; the pool's segments stay
   reserved as long as the model's compiled call lives: through every later ``generate()``.
3. In the warm-up, each Triton kernel with more than one config autotunes at its first launch
   (``CachingAutotuner.benchmark_all_configs``): ``InductorBenchmarker.benchmark_gpu``
   (torch/_inductor/runtime/benchmarking.py) allocates a buffer of the device's ``L2_cache_size`` to flush the
   L2 cache between timings, and a kernel that writes into one of its inputs (the cache update) first clones that
   input (``clone_args``, [Note: clone mutated buffers] in triton_heuristics.py). All of it inside the pool.

Which kernels inductor makes and which of them autotune is only known once it compiled them, on the GPU. The
model takes every op of the compiled forward as a kernel launch that may autotune: the pool must hold, beside
that op's live blocks, the flush buffer and a copy of what the op writes in place. On an H200 (torch 2.11,
benchmarks/ground_truth/data/nvidia-h200/*generate-static.trace.json.gz) the pool held a 32 MiB segment for the
cuBLAS workspace, one of ``L2_cache_size`` (60 MiB) for the flush buffer, a 20 MiB one for GPT-2's cloned
3.37 MiB cache layer, a second 60 MiB one for Qwen2.5's flush buffer once a 3.9 MiB block of repeated keys
had split the first, and 2 MiB ones for the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from tracer.gpus import Gpu
from tracer.graph import StepGraph
from tracer.roles import Phase
from tracer.training import Target, TrainingSetup

# The allocator's key for the private pool (analysis/replay.py gives each stream name a pool of its own)
CUDA_GRAPH_POOL = "cuda graph pool"
# transformers' cache implementations whose layers are compileable (cache_utils.StaticLayer.is_compileable)
COMPILED_CACHES = ("static",)


@dataclass(frozen=True)
class CompiledDecode:
    """What the allocator replay needs to know of a ``generate()`` whose decode steps run as CUDA graphs."""

    l2_cache_bytes: int | None  # the autotuner's flush buffer (the GPU's L2 cache); None: not known, not modelled


def compiled_decode(setup: TrainingSetup, gpu: Gpu, model_class: str) -> CompiledDecode | None:
    """``_valid_auto_compile_criteria`` and ``get_compiled_call`` for this setup: None where generate() stays eager.
    Offloaded static caches and quantized weights are left eager here (not modelled)."""
    if setup.mode != "inference" or setup.target is not Target.CUDA or setup.max_new_tokens < 2:
        return None
    if setup.cache not in COMPILED_CACHES or setup.quantize or setup.device_map:
        return None
    if "llama4" in model_class.lower():  # get_compiled_call returns the eager call for Llama 4
        return None
    return CompiledDecode(l2_cache_bytes=gpu.l2_cache_bytes)


def compiled_span(step: StepGraph) -> range | None:
    """The ops of the decode step's compiled call: from the first decode op inside a submodule of the model (the
    input embedding) to the last (the output head). generate()'s own ops around it (the inputs it prepares, the
    float32 copy of the logits, the token choice) stay eager."""
    inside = [op.index for op in step.ops if op.phase is Phase.DECODE and op.module]
    return range(inside[0], inside[-1] + 1) if inside else None


def writes_in_place(target: str) -> bool:
    """An ATen op that writes into its first argument (``aten.index_copy_.default``): its overload name ends
    in an underscore."""
    parts = target.split(".")
    return len(parts) >= 2 and parts[1].endswith("_") and not parts[1].startswith("_")

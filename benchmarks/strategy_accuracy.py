"""Per-rank estimates of parallel layouts against PyTorch's own runtimes run for that rank.

    python -m benchmarks.strategy_accuracy [--markdown]

Each case traces the single-GPU step once, transforms it for the layout and rank (``strategies.layout.prepare``), and
compares the peak with the runtime's: DDP and ZeroRedundancyOptimizer on real CPU tensors, FSDP2 and DTensor
tensor parallelism under FakeTensorMode, one rank of a fake process group, measured by PyTorch's memory
trackers (``torch.distributed._tools``). Tensor bytes as the trackers count them (``--target cpu``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import transformers
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from runtimes import runtime_peak
from tiny_models import EXPERTS_DOMINATE, LATENT_ATTENTION_DOMINATES, LATENT_ATTENTION_SHAPE, tiny_model

from analysis.peak import find_peak, timeline
from strategies.layout import Layout, Rank, prepare
from tracer.graph import build_graph
from tracer.tracing import trace_step
from tracer.training import LoraSetup, Target, TrainingSetup

SPLITTABLE = {"num_attention_heads": 8, "num_key_value_heads": 8}
WIDE = {"vocab_size": 4096, "hidden_size": 512, "num_hidden_layers": 6}  # several DDP buckets
UNEVEN = {"vocab_size": 250}  # rows that do not split evenly
# Eight layers and a vocabulary of 32: the peak falls in backward, where gradients and gradient buffers live.
BACKWARD_PEAK = SPLITTABLE | {"num_hidden_layers": 8, "vocab_size": 32}


def cases() -> list[tuple[str, Layout, Rank, dict, dict]]:
    """(family, layout, rank, config overrides, setup options)."""
    found = []
    for family in ("llama", "gpt2", "falcon", "opt"):
        found.append((family, Layout(gpus=4), Rank(), WIDE, {}))
        found.append((family, Layout(gpus=4, zero=1), Rank(dp=3), WIDE, {}))
    for family in ("llama", "gpt2", "falcon"):
        for world in (2, 4, 8):
            found.append((family, Layout(gpus=world, zero=3), Rank(), {}, {}))
        found.append((family, Layout(gpus=4, zero=2), Rank(), {}, {}))
        found.append((family, Layout(gpus=4, zero=3), Rank(), {}, {"mixed_precision": "bf16"}))
    found.append(("gpt2", Layout(gpus=8, zero=3), Rank(dp=7), UNEVEN, {}))
    for family in ("llama", "qwen2", "gemma2", "gpt_neox"):
        for degree in (2, 4):
            for output in ("parallel", "gathered"):
                found.append((family, Layout(gpus=degree, tp=degree, tp_output=output), Rank(), SPLITTABLE, {}))
    for family in ("llama", "qwen2", "gpt_neox"):
        for degree in (2, 4):
            layout = Layout(gpus=degree, tp=degree, sequence_parallel=True)
            found.append((family, layout, Rank(), SPLITTABLE, {}))
    found.append(("llama", Layout(gpus=4, tp=4), Rank(tp=3), SPLITTABLE | UNEVEN, {}))
    found.append(("llama", Layout(gpus=2, tp=2), Rank(), SPLITTABLE, {"mixed_precision": "bf16"}))
    found.append(("llama", Layout(gpus=4, tp=2, zero=3), Rank(), SPLITTABLE, {}))
    found.append(("qwen2", Layout(gpus=4, tp=2, zero=2, tp_output="gathered"), Rank(1, 1), SPLITTABLE, {}))
    found.append(("gemma2", Layout(gpus=4, tp=2, zero=3, tp_output="gathered"), Rank(1, 1), SPLITTABLE, {}))
    found.append(("gpt_neox", Layout(gpus=8, tp=4, zero=3), Rank(1, 3), SPLITTABLE, {}))
    found.append(("llama", Layout(gpus=4, tp=2, zero=3, sequence_parallel=True), Rank(1, 1), SPLITTABLE, {}))
    found.append(("llama", Layout(gpus=4, tp=2, zero=3), Rank(1, 1), SPLITTABLE, {"mixed_precision": "bf16"}))
    # MoE experts under transformers' own styles, the rest of the plan DTensor's, at 2 x 64 tokens
    experts, shape = {family: SPLITTABLE | overrides for family, overrides in EXPERTS_DOMINATE.items()}, {"seq_len": 64}
    for family in experts:
        for degree in (2, 4):
            found.append((family, Layout(gpus=degree, tp=degree), Rank(), experts[family], shape))
    for family, layout, rank, options in (
        ("qwen3_moe", Layout(gpus=4, tp=4, tp_output="gathered"), Rank(tp=3), {}),
        ("qwen3_moe", Layout(gpus=2, tp=2), Rank(tp=1), {"grad_checkpointing": "full"}),
        ("mixtral", Layout(gpus=2, tp=2), Rank(), {"grad_checkpointing": "full", "mixed_precision": "bf16"}),
        ("glm4_moe", Layout(gpus=2, tp=2, tp_output="gathered"), Rank(), {"grad_accum": 2}),
        ("qwen3_moe", Layout(gpus=8, tp=4, zero=3), Rank(1, 3), {}),
        ("mixtral", Layout(gpus=4, tp=2, zero=3), Rank(1, 1), {"grad_checkpointing": "full"}),
        ("glm4_moe", Layout(gpus=4, tp=2, zero=2, tp_output="gathered"), Rank(0, 1), {}),
        ("glm4_moe", Layout(gpus=4, tp=2, zero=3), Rank(1, 1), {"mixed_precision": "bf16"}),
        ("deepseek_v3", Layout(gpus=4, tp=2, zero=3), Rank(1, 0), {"mixed_precision": "bf16"}),
        ("qwen3_moe", Layout(gpus=4, pp=2, tp=2, microbatches=4), Rank(pp=0), {}),
        ("qwen3_moe", Layout(gpus=4, pp=2, tp=2, microbatches=4), Rank(pp=1), {}),
        ("qwen3_moe", Layout(gpus=4, cp=2, tp=2, zero=3), Rank(), {}),
    ):
        found.append((family, layout, rank, experts[family], shape | options))
    fused = SPLITTABLE | {"vocab_size": 32, "num_hidden_layers": 4}  # Phi-3's gathered projections
    for layout, rank, options in (
        (Layout(gpus=2, tp=2), Rank(), {}),
        (Layout(gpus=4, tp=4, tp_output="gathered"), Rank(tp=3), {"grad_checkpointing": "full"}),
        (Layout(gpus=2, tp=2), Rank(), {"mixed_precision": "bf16"}),
        (Layout(gpus=4, tp=2, zero=3), Rank(1, 1), {}),
        (Layout(gpus=4, tp=2, zero=2), Rank(0, 1), {"mixed_precision": "bf16", "grad_checkpointing": "full"}),
        (Layout(gpus=4, pp=2, tp=2, microbatches=4), Rank(pp=1), {}),
        (Layout(gpus=4, cp=2, tp=2, zero=3), Rank(), {}),
    ):
        found.append(("phi3", layout, rank, fused, shape | options))
    found.append(("qwen3_next", Layout(gpus=2, tp=2), Rank(), experts["qwen3_moe"], shape))  # gathered linear attention
    for layout, rank, options in (  # DeepSeek-V2's latent attention split by its plan (mla_kv_a_proj), where it peaks
        (Layout(gpus=2, tp=2), Rank(), {}),
        (Layout(gpus=4, tp=4), Rank(tp=3), {}),
        (Layout(gpus=2, tp=2), Rank(), {"grad_checkpointing": "full", "mixed_precision": "bf16"}),
        (Layout(gpus=4, tp=2, zero=3), Rank(1, 1), {}),
    ):
        found.append(("deepseek_v2", layout, rank, LATENT_ATTENTION_DOMINATES, LATENT_ATTENTION_SHAPE | options))
    adapters = LoraSetup(r=4, alpha=8, targets=("q_proj", "v_proj"))
    for layout, options in (
        (Layout(gpus=4, zero=3), {"lora": adapters}),
        (Layout(gpus=4, zero=3), {"lora": adapters, "mixed_precision": "bf16"}),
        (Layout(gpus=4, zero=3), {"lora": adapters, "grad_checkpointing": "full", "reentrant": True}),
        (Layout(gpus=4, zero=3), {"lora": adapters, "mixed_precision": "bf16", "grad_checkpointing": "full"}),
        (Layout(gpus=4, zero=2), {"lora": adapters, "mixed_precision": "bf16"}),
        (Layout(gpus=4), {"lora": adapters, "grad_checkpointing": "full"}),
        (Layout(gpus=4, zero=3), {"grad_accum": 2}),
        (Layout(gpus=4, zero=3), {"grad_accum": 3, "mixed_precision": "bf16", "grad_checkpointing": "full"}),
        (Layout(gpus=4, zero=2), {"lora": adapters, "grad_accum": 2}),
        (Layout(gpus=2, tp=2), {"grad_accum": 2}),
        (Layout(gpus=2, tp=2, sequence_parallel=True), {"grad_accum": 2, "grad_checkpointing": "full"}),
        (Layout(gpus=4, tp=2, zero=3), {"grad_accum": 2}),
    ):
        found.append(("llama", layout, Rank(), BACKWARD_PEAK, options))
    for rank in range(4):  # ZeroRedundancyOptimizer partitions the adapters alone
        found.append(("llama", Layout(gpus=4, zero=1), Rank(dp=rank), BACKWARD_PEAK, {"lora": adapters}))
    for stages, schedule, microbatches, options in (
        (2, "1f1b", 4, {}),
        (4, "1f1b", 8, {}),
        (4, "gpipe", 4, {}),
        (3, "gpipe", 2, {}),
        (4, "gpipe", 4, {"lora": adapters, "grad_checkpointing": "full"}),
        (2, "1f1b", 4, {"dtype": "bf16", "quantize": "nf4", "lora": adapters}),
    ):
        layout = Layout(gpus=stages, pp=stages, pp_schedule=schedule, microbatches=microbatches)
        for stage in range(stages):
            found.append(("llama", layout, Rank(pp=stage), {"num_hidden_layers": 8, "vocab_size": 32}, options))
    for layout, options in (  # each stage under the data- and tensor-parallel runtimes, as torchtitan composes them
        (Layout(gpus=4, pp=2, zero=0, microbatches=4), {"mixed_precision": "bf16"}),
        (Layout(gpus=4, pp=2, zero=1, microbatches=4), {"grad_checkpointing": "full"}),
        (Layout(gpus=4, pp=2, zero=2, microbatches=4), {"mixed_precision": "bf16"}),
        (Layout(gpus=4, pp=2, zero=3, microbatches=4), {"mixed_precision": "bf16"}),
        (Layout(gpus=8, pp=4, zero=3, pp_schedule="gpipe", microbatches=4), {}),
        (Layout(gpus=6, pp=2, zero=2, pp_schedule="gpipe", microbatches=2), {}),
        (
            Layout(gpus=4, pp=2, zero=3, microbatches=4),
            {"lora": adapters, "mixed_precision": "bf16", "grad_checkpointing": "full"},
        ),
        (Layout(gpus=4, pp=2, tp=2, microbatches=4), {}),
        (Layout(gpus=4, pp=2, tp=2, tp_output="gathered", microbatches=4), {}),
        (Layout(gpus=8, pp=2, tp=2, zero=2, microbatches=4), {}),
        (Layout(gpus=8, pp=2, tp=2, zero=3, microbatches=4), {"mixed_precision": "bf16"}),
        (Layout(gpus=3, pp=3, pp_split=(1, 3, 4), microbatches=3), {}),
    ):
        for stage in range(layout.pp):
            found.append(("llama", layout, Rank(pp=stage), BACKWARD_PEAK, options))
    interleaved = {"pp_schedule": "interleaved-1f1b"}
    for layout, options in (  # ScheduleInterleaved1F1B: every rank holds stages r, r + P, ...
        (Layout(gpus=2, pp=2, microbatches=4, **interleaved), {}),
        (Layout(gpus=4, pp=4, microbatches=8, **interleaved), {}),
        (Layout(gpus=2, pp=2, microbatches=3, pp_stages_per_rank=3, **interleaved), {}),
        (Layout(gpus=2, pp=2, microbatches=4, **interleaved), {"lora": adapters, "grad_checkpointing": "full"}),
        (Layout(gpus=4, pp=2, microbatches=4, **interleaved), {"mixed_precision": "bf16"}),
        (Layout(gpus=4, pp=2, zero=1, microbatches=4, **interleaved), {}),
        (Layout(gpus=4, pp=2, zero=2, microbatches=4, **interleaved), {}),
        (Layout(gpus=4, pp=2, zero=3, microbatches=4, **interleaved), {"mixed_precision": "bf16"}),
        (Layout(gpus=8, pp=2, tp=2, zero=3, microbatches=4, **interleaved), {"mixed_precision": "bf16"}),
        (
            Layout(gpus=4, pp=2, zero=3, microbatches=4, pp_stages_per_rank=4, **interleaved),
            {"batch_size": 1, "seq_len": 8},
        ),
    ):
        for stage in range(layout.pp):
            found.append(("llama", layout, Rank(pp=stage), BACKWARD_PEAK, options))
    context = {"num_hidden_layers": 4, "vocab_size": 32}  # the ring's buffers in the layers
    for layout, options in (  # the first rank, the busiest, against torch's ring attention (tests/cp_runtime.py)
        (Layout(gpus=2, cp=2), {}),
        (Layout(gpus=4, cp=4), {}),
        (Layout(gpus=2, cp=2), {"mixed_precision": "bf16"}),
        (Layout(gpus=4, cp=4), {"mixed_precision": "bf16"}),
        (Layout(gpus=2, cp=2, zero=3), {}),
        (Layout(gpus=4, cp=2, zero=2), {"mixed_precision": "bf16"}),
        (Layout(gpus=4, cp=4, zero=3), {"mixed_precision": "bf16"}),
        (Layout(gpus=4, cp=2), {}),
        (Layout(gpus=4, cp=2), {"grad_checkpointing": "full"}),
        (Layout(gpus=4, cp=2, zero=3), {"mixed_precision": "bf16", "grad_checkpointing": "full"}),
    ):
        found.append(("llama", layout, Rank(), context, options))
    for layout, options in (  # pipeline stages on each rank's share of the sequences, torchtitan's pp x dp x cp mesh
        (Layout(gpus=4, pp=2, cp=2, microbatches=4), {}),
        (Layout(gpus=4, pp=2, cp=2, zero=2, microbatches=4), {"mixed_precision": "bf16"}),
        (Layout(gpus=4, pp=2, cp=2, zero=3, microbatches=4, pp_schedule="interleaved-1f1b"), {}),
        (Layout(gpus=8, pp=2, cp=4, zero=2, pp_schedule="gpipe", microbatches=2), {}),
    ):
        for stage in range(layout.pp):
            found.append(("llama", layout, Rank(pp=stage), BACKWARD_PEAK, options))
    for layout, options in (  # with tensor parallelism, torchtitan's cp x tp mesh under FSDP2
        (Layout(gpus=4, cp=2, tp=2, zero=3), {}),
        (Layout(gpus=4, cp=2, tp=2, zero=2), {"mixed_precision": "bf16"}),
        (Layout(gpus=8, cp=2, tp=4, zero=3), {"mixed_precision": "bf16"}),
        (Layout(gpus=8, cp=4, tp=2, zero=3), {}),
        (Layout(gpus=8, cp=2, tp=2, zero=2), {}),
        (Layout(gpus=4, cp=2, tp=2, zero=3), {"grad_checkpointing": "full"}),
    ):
        found.append(("llama", layout, Rank(), context | SPLITTABLE, options))
    titan_adapters = LoraSetup(r=4, alpha=8, targets=("wq", "wv"))
    for layout, overrides, options in (
        (Layout(gpus=4, zero=3), {}, {"lora": titan_adapters, "grad_checkpointing": "full"}),
        (Layout(gpus=4, zero=3), {}, {"mixed_precision": "bf16", "grad_checkpointing": "op"}),
        (Layout(gpus=4, zero=3), {"vocab_size": 4096}, {}),
        (Layout(gpus=4, zero=2), {}, {"grad_accum": 2}),
        (Layout(gpus=4, zero=1), {}, {"lora": titan_adapters, "grad_checkpointing": "full"}),
        (Layout(gpus=2, tp=2), {}, {"grad_checkpointing": "full"}),
        (Layout(gpus=4, tp=2, zero=3), {}, {}),
    ):
        found.append((CUSTOM, layout, Rank(), overrides, options))
    return found


# examples/custom_module.py's torchtitan-style Llama, four blocks, vocabulary 32 (a CustomModel, not a transformers id)
CUSTOM = "titan-llama (custom)"


def _model(family: str, overrides: dict):
    if family != CUSTOM:
        return tiny_model(family, **overrides)
    from custom_module import LlamaArgs, titan_llama

    shape = {"dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 32, "ffn_dim": 128} | overrides
    return titan_llama(LlamaArgs(max_seq_len=64, **shape))


def estimate(family: str, layout: Layout, rank: Rank, overrides: dict, setup: TrainingSetup) -> int:
    model = _model(family, overrides)
    prepared = prepare(layout, setup, model.config)
    step = prepared.rank_step(build_graph(trace_step(model, prepared.traced)), rank)
    return find_peak(timeline(step, rounded=False)).bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print a GitHub markdown table")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    rows, errors, start = [], [], time.time()
    for family, layout, rank, overrides, options in cases():
        setup = TrainingSetup(**({"target": Target.CPU, "batch_size": 2, "seq_len": 32} | options))
        runtime = runtime_peak(_model(family, overrides), setup, layout, rank)
        predicted = estimate(family, layout, rank, overrides, setup)
        error = (predicted - runtime) / runtime
        errors.append(abs(error))
        shown = overrides | options | ({"lora": f"r{options['lora'].r}"} if "lora" in options else {})
        options_text = ", ".join(f"{k}={v}" for k, v in shown.items() if k != "num_key_value_heads")
        stages = ",".join(map(str, layout.rank_stages(rank)))
        where = f"dp {rank.dp}, tp {rank.tp}" + (f", stage {stages}" if layout.pp > 1 else "")
        rows.append((layout.describe(), family, where, options_text, runtime, predicted, f"{100 * error:+.3f}%"))
    headers = ["layout", "model", "rank", "config", "runtime bytes", "estimate bytes", "error"]
    print(tabulate(rows, headers=headers, tablefmt="github" if args.markdown else "simple"))
    print(
        f"\n{len(rows)} cases: max |error| {100 * max(errors):.3f}%, mean {100 * statistics.mean(errors):.3f}%"
        f" ({time.time() - start:.0f} s)"
    )


if __name__ == "__main__":
    main()

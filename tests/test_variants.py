"""Fine-tuning variants: checkpointing, LoRA, gradient accumulation and optimizers against eager execution on
CPU (storage tracking), and the quantized storage against bitsandbytes itself."""

from __future__ import annotations

import pytest
import torch
from runtimes import fully_shard_takes_integer_parameters, runtime_peak
from tiny_models import FAMILIES, tiny_model

from analysis.estimate import analyze
from analysis.measure import measure
from analysis.peak import find_peak, timeline
from strategies.layout import Layout, Rank, prepare
from tracer.errors import UserError
from tracer.graph import build_graph
from tracer.optimizers import AdamW8bit
from tracer.quantization import Linear4bit, Linear8bitLt, quantize_base_weights
from tracer.tracing import trace_step
from tracer.training import LoraSetup, Target, TrainingSetup

TOLERANCE = 0.001  # against eager execution
STRATEGY_TOLERANCE = 0.01  # against the parallel runtimes, as for the strategies alone
# Module names that cover every family's attention projections (peft adapts those that exist).
ATTENTION = ("q_proj", "v_proj", "c_attn", "query_key_value", "qkv_proj", "Wqkv")


def _check(family: str, **options) -> None:
    setup = TrainingSetup(target=Target.CPU, **({"batch_size": 2, "seq_len": 32} | options))
    measured = measure(tiny_model(family), setup).peak_bytes
    estimated = analyze(tiny_model(family), setup).peak_bytes
    assert abs(estimated - measured) / measured <= TOLERANCE, (estimated, measured)


@pytest.mark.parametrize("kind", ["full", "full-reentrant", "selective"])
@pytest.mark.parametrize("family", ["llama", "gpt2", "falcon"])
def test_checkpointing(family, kind):
    """The recomputation is traced as it runs in backward, not derived from a formula."""
    _check(family, grad_checkpointing=kind.removesuffix("-reentrant"), reentrant=kind.endswith("reentrant"))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["full", "selective"])
@pytest.mark.parametrize("family", FAMILIES)
def test_checkpointing_every_family(family, kind):
    if (family, kind) == ("qwen3_next", "selective"):  # its linear-attention layers hold no attention module
        with pytest.raises(UserError, match="no attention module found in Qwen3Next"):
            _check(family, grad_checkpointing=kind)
        return
    _check(family, grad_checkpointing=kind)


@pytest.mark.parametrize(
    "options", [{}, {"dtype": "bf16"}, {"mixed_precision": "bf16"}, {"grad_checkpointing": "full"}]
)
@pytest.mark.parametrize("family", ["llama", "gpt2", "opt", "gpt_neox"])
def test_lora(family, options):
    _check(family, lora=LoraSetup(r=4, alpha=8, targets=ATTENTION, dropout=0.1), **options)


def test_lora_with_peft_default_targets():
    _check("llama", lora=LoraSetup())


@pytest.mark.parametrize("micro_steps", [2, 3])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_gradient_accumulation(family, micro_steps):
    """Two traced micro-steps stand for any number: every micro-step after the first is the same."""
    _check(family, grad_accum=micro_steps)


@pytest.mark.parametrize(
    "options", [{}, {"mixed_precision": "bf16"}, {"grad_checkpointing": "full"}, {"grad_accum": 2}]
)
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_loop_that_keeps_its_outputs(family, options):
    """``outputs = model(**batch)`` held until the next forward returns: the previous step's logits and key/value
    cache live into this step's forward, and this step's through backward."""
    _check(family, keep_outputs=True, **options)


def test_kept_outputs_of_a_checkpointed_forward_hold_no_cache():
    """transformers turns the key/value cache off in a checkpointed forward only when autograd records it
    (transformers 5.24): the previous step's outputs hold logits alone. They die when the forward returns, so
    the forward's peak is compared, at the loss of a model of eight layers and a vocabulary of 4,096."""
    model = tiny_model("llama", num_hidden_layers=8, vocab_size=4096)
    setup = TrainingSetup(target=Target.CPU, batch_size=2, seq_len=32, keep_outputs=True, grad_checkpointing="full")
    estimated, measured = analyze(model, setup).phase_peaks["forward"], measure(model, setup).phase_peaks["forward"]
    assert abs(estimated - measured) / measured <= TOLERANCE, (estimated, measured)


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt"])
def test_adafactor(family):
    _check(family, optimizer="adafactor")


@pytest.mark.parametrize("implementation", ["foreach", "fused", "for-loop"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_optimizer_implementations(optimizer, implementation):
    _check("llama", optimizer=optimizer, optimizer_impl=implementation)


@pytest.mark.parametrize("shape", [(64, 64), (128, 256), (96, 100), (16, 16)])
def test_adamw8bit_states_are_bitsandbytes(shape):
    bnb = pytest.importorskip("bitsandbytes")
    ours = _states_bytes(AdamW8bit, shape)
    theirs = _states_bytes(bnb.optim.AdamW8bit, shape)
    assert ours == theirs


def _states_bytes(optimizer_class, shape) -> int:
    param = torch.nn.Parameter(torch.randn(shape))
    param.grad = torch.randn(shape)
    optimizer = optimizer_class([param], lr=1e-3)
    optimizer.step()
    storages = {
        value.untyped_storage()._cdata: value.untyped_storage().nbytes()
        for value in optimizer.state[param].values()
        if isinstance(value, torch.Tensor)
    }
    return sum(storages.values())


@pytest.mark.parametrize("shape", [(64, 64), (256, 128), (96, 160)])
def test_nf4_storage_is_bitsandbytes(shape):
    functional = pytest.importorskip("bitsandbytes.functional")
    weight = torch.randn(shape, dtype=torch.bfloat16)
    packed, state = functional.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4")
    theirs = [packed, state.absmax, state.state2.absmax, state.offset, state.code, state.state2.code]
    ours = Linear4bit(torch.nn.Linear(shape[1], shape[0], bias=False, dtype=torch.bfloat16))
    assert sum(t.nbytes for t in ours.parameters()) + sum(t.nbytes for t in ours.buffers()) == sum(
        t.nbytes for t in theirs
    )


@pytest.mark.parametrize("shape", [(64, 64), (256, 128)])
def test_int8_storage_is_bitsandbytes(shape):
    bnb = pytest.importorskip("bitsandbytes")
    weight = torch.randn(shape, dtype=torch.float16)
    quantized, scales, _ = bnb.functional.int8_vectorwise_quant(weight)
    ours = Linear8bitLt(torch.nn.Linear(shape[1], shape[0], bias=False, dtype=torch.float16))
    assert sum(t.nbytes for t in ours.parameters()) + sum(t.nbytes for t in ours.buffers()) == (
        quantized.nbytes + scales.nbytes
    )


@pytest.mark.parametrize("family", ["llama", "gpt2", "falcon"])
@pytest.mark.parametrize("quantize", ["nf4", "int8"])
def test_quantized_base_runs_and_keeps_the_adapters_trainable(family, quantize):
    """The quantized layers' byte arithmetic is checked above against bitsandbytes; here the whole step
    runs through them, and only the adapters train."""
    setup = TrainingSetup(
        target=Target.CPU, batch_size=2, seq_len=32, dtype="bf16", quantize=quantize, lora=LoraSetup()
    )
    report = analyze(tiny_model(family), setup)
    assert 0 < report.trainable_parameter_count < report.parameter_count / 5
    assert report.breakdown["gradients"] < report.breakdown["parameters"]


@pytest.mark.parametrize("family", ["llama4_text", "gpt2", "qwen3_moe"])
def test_quantized_modules_are_those_transformers_converts(family):
    """transformers' own replace_with_bnb_linear picks the layers: exactly nn.Linear (Llama 4's router, an
    nn.Linear subclass returning a tuple, and the MoE experts' 3-D weights stay) and GPT-2's Conv1D."""
    from transformers import BitsAndBytesConfig
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear
    from transformers.quantizers.base import get_keys_to_not_convert

    setup = TrainingSetup(dtype="bf16")
    ours = tiny_model(family).build(setup)
    quantize_base_weights(ours, "nf4")
    with torch.device("meta"):
        theirs = tiny_model(family).build(setup)
    config = BitsAndBytesConfig(load_in_4bit=True)
    replace_with_bnb_linear(theirs, get_keys_to_not_convert(theirs), config)

    def quantized(model: torch.nn.Module) -> set[str]:
        return {name for name, module in model.named_modules() if "4bit" in type(module).__name__}

    assert quantized(ours) == quantized(theirs) != set()


@pytest.mark.parametrize(
    ("family", "layout", "options"),
    [
        ("llama", Layout(gpus=4, zero=3), {"grad_checkpointing": "full"}),
        ("gpt2", Layout(gpus=4, zero=2), {"grad_checkpointing": "full", "reentrant": True}),
        pytest.param("falcon", Layout(gpus=4, zero=3), {"grad_checkpointing": "selective"}, marks=pytest.mark.slow),
        ("llama", Layout(gpus=4, zero=3), {"lora": LoraSetup(targets=ATTENTION)}),
        ("gpt2", Layout(gpus=4), {"lora": LoraSetup(targets=ATTENTION), "grad_checkpointing": "full"}),
        ("llama", Layout(gpus=4, zero=1), {"grad_checkpointing": "selective"}),
        ("llama", Layout(gpus=4), {"grad_accum": 2}),
        ("llama", Layout(gpus=2, tp=2), {"grad_checkpointing": "full"}),
        pytest.param(
            "gpt_neox",
            Layout(gpus=2, tp=2, sequence_parallel=True),
            {"grad_checkpointing": "full"},
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "llama",
            Layout(gpus=2, tp=2, sequence_parallel=True),
            {"grad_checkpointing": "selective"},
            marks=pytest.mark.slow,
        ),
        ("llama", Layout(gpus=4, tp=2, zero=3), {"grad_checkpointing": "full"}),
    ],
    ids=lambda value: value.describe() if isinstance(value, Layout) else str(value),
)
def test_variants_compose_with_the_parallel_runtimes(family, layout, options):
    """Against the runtimes, as in tests/test_strategy_*.py: the recomputation runs inside the sharded step."""
    model = tiny_model(family, num_attention_heads=8, num_key_value_heads=8)
    setup = TrainingSetup(target=Target.CPU, batch_size=2, seq_len=32, **options)
    runtime = runtime_peak(model, setup, layout, Rank())
    prepared = prepare(layout, setup, model.config)
    step = prepared.rank_step(build_graph(trace_step(model, prepared.traced)), Rank())
    estimate = find_peak(timeline(step, rounded=False))
    assert abs(estimate.bytes - runtime) / runtime <= STRATEGY_TOLERANCE, (estimate.bytes, runtime)


# Eight layers and a vocabulary of 32: the peak falls in backward, where the layers' gradients and the
# runtimes' gradient buffers are live (with a large vocabulary it sits at the loss and hides them).
BACKWARD_PEAK = {"num_hidden_layers": 8, "vocab_size": 32, "num_attention_heads": 8, "num_key_value_heads": 8}
ADAPTERS = LoraSetup(r=4, alpha=8, targets=("q_proj", "v_proj"))
QLORA = {"dtype": "bf16", "quantize": "nf4", "lora": ADAPTERS}  # FSDP2 shards the packed weights too


@pytest.mark.parametrize(
    ("layout", "options"),
    [
        (Layout(gpus=4, zero=3), {"lora": ADAPTERS}),
        (
            Layout(gpus=4, zero=3),
            {"lora": ADAPTERS, "mixed_precision": "bf16", "grad_checkpointing": "full", "reentrant": True},
        ),
        (Layout(gpus=4, zero=3), {"grad_accum": 2}),
        (Layout(gpus=4, zero=3), QLORA | {"grad_checkpointing": "full", "reentrant": True}),
        *(
            pytest.param(layout, options, marks=pytest.mark.slow)
            for layout, options in (
                (Layout(gpus=4, zero=3), {"lora": ADAPTERS, "mixed_precision": "bf16"}),
                (Layout(gpus=4, zero=2), {"lora": ADAPTERS, "mixed_precision": "bf16"}),
                (Layout(gpus=4), {"lora": ADAPTERS, "grad_checkpointing": "full"}),
                (Layout(gpus=4, zero=3), {"lora": ADAPTERS, "grad_checkpointing": "full", "reentrant": True}),
                (Layout(gpus=4, zero=3), {"grad_accum": 3, "mixed_precision": "bf16", "grad_checkpointing": "full"}),
                (Layout(gpus=4, zero=2), {"lora": ADAPTERS, "grad_accum": 2}),
                (Layout(gpus=2, tp=2), {"grad_accum": 2}),
                (Layout(gpus=2, tp=2, sequence_parallel=True), {"grad_accum": 2, "grad_checkpointing": "full"}),
                (Layout(gpus=4, tp=2, zero=3), {"grad_accum": 2}),
                (Layout(gpus=4, zero=3), QLORA),
                (Layout(gpus=4, zero=2), QLORA | {"quantize": "int8", "grad_accum": 2}),
                (Layout(gpus=4, zero=1), QLORA),
                (Layout(gpus=4), QLORA | {"quantize": "int8"}),
            )
        ),
    ],
    ids=lambda value: value.describe() if isinstance(value, Layout) else str(value),
)
def test_compositions_where_the_peak_is_in_backward(layout, options):
    """FSDP2 reduce-scatters only the gradients that exist (the adapters'), its MixedPrecisionPolicy computes
    the adapters in the low dtype too (peft keeps them fp32 only in a low-precision model), and with
    gradient accumulation it reduce-scatters every micro-step and adds into the sharded gradients. QLoRA and
    LLM.int8() weights are frozen parameters like others: sharded and gathered packed."""
    if options.get("quantize") == "int8" and layout.zero >= 2 and not fully_shard_takes_integer_parameters():
        pytest.skip(
            f"torch {torch.__version__}'s fully_shard cannot shard integer parameters (it makes each shard require a "
            "gradient), and LLM.int8() weights have no floating-point storage: FSDP2 over them does not run here"
        )
    model = tiny_model("llama", **BACKWARD_PEAK)
    setup = TrainingSetup(target=Target.CPU, batch_size=2, seq_len=32, **options)
    runtime = runtime_peak(model, setup, layout, Rank())
    prepared = prepare(layout, setup, model.config)
    step = prepared.rank_step(build_graph(trace_step(model, prepared.traced)), Rank())
    estimate = find_peak(timeline(step, rounded=False))
    assert abs(estimate.bytes - runtime) / runtime <= STRATEGY_TOLERANCE, (estimate.bytes, runtime)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"mixed_precision": "bf16"},
        pytest.param({"lora": LoraSetup(r=4, alpha=8, targets=ATTENTION)}, marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize("family", ["llama", pytest.param("gpt2", marks=pytest.mark.slow)])
def test_torchtitan_op_checkpointing(family, options):
    """torchtitan's per-op policy, run by torch's selective checkpoint contexts: matmul and attention outputs
    saved but every second matmul of a layer, the rest recomputed."""
    _check(family, grad_checkpointing="op", **options)

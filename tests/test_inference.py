"""Inference against ``model.generate()`` itself, run eagerly on CPU with storage tracking (``measure``), the
quantized storage against bitsandbytes, and the command line's inference and sweep options."""

from __future__ import annotations

import json
from contextlib import contextmanager
from unittest.mock import PropertyMock, patch

import pytest
import torch
from runtimes import EP_SIZE_MISSING, TRANSFORMERS_EP_SIZE, transformers_tp_generate_peak
from tiny_models import FAMILIES as TINY
from tiny_models import LONGROPE, tiny_model
from transformers.generation.utils import GenerationMixin

from analysis.cli import EXIT_USER_ERROR, main
from analysis.estimate import analyze
from analysis.measure import measure
from analysis.report import MemoryReport
from analysis.sweep import parse_sweep
from strategies.layout import Layout
from strategies.tensor_parallel import gathers_uneven_outputs
from tracer.errors import UserError
from tracer.inference import DECODES_WITH_BATCHED_MM
from tracer.quantization import Linear4bit
from tracer.training import LoraSetup, Target, TrainingSetup

# The bar. generate() also makes a 0-dim tensor of each special token id (``_prepare_special_tokens``)
# and a few scalars for its checks, which the trace does not repeat: about 2 KiB (512-byte blocks), 0.3% of
# these tiny fp32 models, 0.7% of the bf16 quantized ones, nothing at real sizes.
TOLERANCE = 0.01
# Grouped-query (llama, mistral with a sliding window, gemma2 with alternating sliding layers),
# multi-query (falcon, gpt_bigcode) and multi-head (gpt2) attention; every other family in the slow tier.
FAMILIES = ["llama", "mistral", "gemma2", "gpt2", "falcon", "gpt_bigcode"]
ALL_FAMILIES = FAMILIES + [pytest.param(family, marks=pytest.mark.slow) for family in TINY if family not in FAMILIES]
# A long prompt puts the peak in the prefill; a short one and many new tokens in the decode step with the
# cache at its longest.
PREFILL_PEAK = {"seq_len": 48, "max_new_tokens": 8}
DECODE_PEAK = {"seq_len": 16, "max_new_tokens": 200}


def _inference(**options) -> TrainingSetup:
    return TrainingSetup(target=Target.CPU, mode="inference", **({"batch_size": 2} | options))


def _check(family: str, setup: TrainingSetup, **overrides) -> MemoryReport:
    measured = measure(tiny_model(family, **overrides), setup)
    estimated = analyze(tiny_model(family, **overrides), setup)
    error = abs(estimated.peak_bytes - measured.peak_bytes) / measured.peak_bytes
    assert error <= TOLERANCE, (estimated.peak_bytes, measured.peak_bytes)
    assert estimated.breakdown["kv_cache"] > 0
    return estimated


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_prefill_peak_matches_generate(family, cache):
    assert _check(family, _inference(cache=cache, **PREFILL_PEAK)).peak_phase == "prefill"


# Each decode case runs generate() for 200 tokens with every op recorded, so the fast tier keeps grouped-query
# (llama), alternating sliding-window (gemma2) and multi-query (gpt_bigcode) attention with the dynamic cache.
DECODE_FAMILIES = [
    family if family in ("llama", "gemma2", "gpt_bigcode") else pytest.param(family, marks=pytest.mark.slow)
    for family in TINY
]


@pytest.mark.parametrize("cache", ["dynamic", pytest.param("static", marks=pytest.mark.slow)])
@pytest.mark.parametrize("family", DECODE_FAMILIES)
def test_decode_peak_matches_generate(family, cache):
    report = _check(family, _inference(cache=cache, **DECODE_PEAK))
    config = tiny_model(family).config
    windowed = getattr(config, "sliding_window", None) and not getattr(config, "layer_types", None)
    # A static cache is as large in the prefill, a window never grows, and among the slow tier's families
    # some (chunked attention) keep the peak in the prefill
    if cache == "dynamic" and family in FAMILIES and not windowed:
        assert report.peak_phase == "decode"


@pytest.mark.parametrize(
    ("quantize", "dtype"),
    [("nf4", "bf16")]
    + [
        pytest.param(quantize, dtype, marks=pytest.mark.slow)
        for quantize in ("nf4", "fp4", "int8")
        for dtype in ("bf16", "fp16")
        if (quantize, dtype) != ("nf4", "bf16")
    ],
)
def test_quantized_inference_matches_eager(quantize, dtype):
    """Through the emulated bitsandbytes layers (their storage is checked against bitsandbytes below): the
    dequantizing path in the prefill, the fused kernel in the decode step."""
    _check("llama", _inference(dtype=dtype, quantize=quantize, **PREFILL_PEAK))
    _check("llama", _inference(dtype=dtype, quantize=quantize, **DECODE_PEAK))


@pytest.mark.parametrize(("family", "kv_heads"), [("llama", 2), ("falcon", 1), ("gpt_bigcode", 1), ("gpt2", 4)])
def test_kv_cache_is_sized_as_transformers_stores_it(family, kv_heads):
    """When the last decode step starts, the cache holds keys and values of every layer for the prompt and the
    tokens decoded before it (the prefill gave the first of the ``new``, each decode step one more): kv heads x
    head_dim per token, in the model's dtype (multi-query models: one kv head)."""
    batch, prompt, new = 2, 48, 9
    config = tiny_model(family).config
    head_dim = config.hidden_size // config.num_attention_heads
    tensor = batch * kv_heads * (prompt + new - 2) * head_dim * 2  # bf16 keys (or values) of one layer
    expected = config.num_hidden_layers * 2 * (-(-tensor // 512) * 512)  # each in its 512-byte allocator blocks
    setup = _inference(dtype="bf16", seq_len=prompt, max_new_tokens=new)
    assert _decode_cache_bytes(family, setup) == expected


def _decode_cache_bytes(family: str, setup: TrainingSetup) -> int:
    """Bytes of the KV cache live during the decode step of the estimate."""
    from analysis.liveness import lifetimes
    from tracer.graph import build_graph
    from tracer.roles import Phase, Role
    from tracer.tracing import trace_step

    step = build_graph(trace_step(tiny_model(family), setup))
    decode = next(op.index for op in step.ops if op.phase is Phase.DECODE)
    return sum(
        span.bytes for span in lifetimes(step) if span.role is Role.KV_CACHE and span.first <= decode <= span.last
    )


def test_logits_to_keep_shrinks_the_prefill():
    """With a vocabulary large enough for the logits to set the prefill's peak."""
    vocab = 8192
    everything = _check("llama", _inference(**PREFILL_PEAK | {"logits_to_keep": 0}), vocab_size=vocab)
    last = _check("llama", _inference(**PREFILL_PEAK), vocab_size=vocab)  # generate()'s own choice
    assert last.phase_peaks["prefill"] < everything.phase_peaks["prefill"]


def test_static_cache_is_allocated_for_the_whole_generation():
    dynamic = analyze(tiny_model("llama"), _inference(**PREFILL_PEAK))
    static = analyze(tiny_model("llama"), _inference(cache="static", **PREFILL_PEAK))
    assert static.breakdown["kv_cache"] > dynamic.breakdown["kv_cache"]


@pytest.mark.parametrize("shape", [(64, 64), (96, 160)])
def test_fp4_storage_is_bitsandbytes(shape):
    functional = pytest.importorskip("bitsandbytes.functional")
    weight = torch.randn(shape, dtype=torch.bfloat16)
    packed, state = functional.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="fp4")
    theirs = [packed, state.absmax, state.state2.absmax, state.offset, state.code, state.state2.code]
    ours = Linear4bit(torch.nn.Linear(shape[1], shape[0], bias=False, dtype=torch.bfloat16))
    assert sum(t.nbytes for t in [*ours.parameters(), *ours.buffers()]) == sum(t.nbytes for t in theirs)


def test_four_bit_storage_follows_the_documented_layout():
    """bitsandbytes' NF4/FP4 layout (functional.quantize_4bit with compress_statistics): two values per
    byte, one uint8 absmax per block of 64, those quantized again in blocks of 256 with a float32 absmax
    each, a float32 offset, and two float32 code books of 16 and 256 entries."""
    rows, columns = 4096, 4096
    values = rows * columns
    blocks = values // 64
    expected = values // 2 + blocks + (blocks // 256) * 4 + 4 + 16 * 4 + 256 * 4
    ours = Linear4bit(torch.nn.Linear(columns, rows, bias=False, dtype=torch.bfloat16, device="meta"))
    assert sum(t.nbytes for t in [*ours.parameters(), *ours.buffers()]) == expected


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lora": LoraSetup()}, "training only"),
        ({"mixed_precision": "bf16"}, "--dtype bf16"),
        ({"grad_accum": 2}, "training only"),
        ({"keep_outputs": True}, "--keep-outputs: training only"),
        ({"max_new_tokens": 0}, "--max-new-tokens"),
        ({"logits_to_keep": -1}, "--logits-to-keep"),
        ({"quantize": "nf4"}, "--quantize computes in --dtype bf16"),
    ],
)
def test_inference_refuses_training_options(options, message):
    with pytest.raises(UserError, match=message):
        _inference(**options)


# Heads that leave each rank two key/value heads: with one, repeat_kv's copy is a view on the runtime (limits.md).
TP_HEADS = {
    2: {"num_attention_heads": 8, "num_key_value_heads": 4},
    4: {"num_attention_heads": 16, "num_key_value_heads": 8},
}
TP_FAMILIES = ["llama", "gemma2", "gpt_neox", "qwen3", "qwen3_moe"]


def tp_heads(family: str, degree: int) -> dict[str, int]:
    """Heads for ``degree`` ranks; latent attention (DeepSeek-V2 and V3) has as many key/value heads as query heads."""
    heads = TP_HEADS[degree]
    if family in ("deepseek_v2", "deepseek_v3"):
        return {**heads, "num_key_value_heads": heads["num_attention_heads"]}
    return heads


def _tensor_parallel_estimate(
    family: str, setup: TrainingSetup, degree: int, rank: int = 0, expert_parallel: bool = False, **overrides
) -> MemoryReport:
    model = tiny_model(family, **(tp_heads(family, degree) | overrides))
    layout = Layout(gpus=degree, tp=degree, ep=degree if expert_parallel else 1)
    return next(report for report in analyze(model, setup, layout).ranks if report.rank.tp == rank)


def _check_tensor_parallel(
    family: str, setup: TrainingSetup, degree: int, rank: int = 0, expert_parallel: bool = False, **overrides
) -> MemoryReport:
    model = tiny_model(family, **(tp_heads(family, degree) | overrides))
    runtime = transformers_tp_generate_peak(model, setup, degree, rank, expert_parallel)
    estimated = _tensor_parallel_estimate(family, setup, degree, rank, expert_parallel, **overrides)
    assert abs(estimated.peak_bytes - runtime) / runtime <= TOLERANCE, (estimated.peak_bytes, runtime)
    return estimated


@pytest.mark.parametrize("cache", ["dynamic", pytest.param("static", marks=pytest.mark.slow)])
@pytest.mark.parametrize("shape", [PREFILL_PEAK, DECODE_PEAK], ids=["prefill-peak", "decode-peak"])
@pytest.mark.parametrize(
    "family",
    [f if f != "gpt_neox" else pytest.param(f, marks=pytest.mark.slow) for f in TP_FAMILIES]
    + [
        pytest.param(f, marks=pytest.mark.slow)
        for f in ("mistral", "qwen2", "gemma3_text", "smollm3", "codegen", "mixtral", "glm4_moe", "qwen3_next")
    ],
)
def test_tensor_parallel_generate_matches_transformers(family, shape, cache, request):
    """transformers' own tensor parallelism (from_pretrained(tp_plan="auto")), generate() on rank 0 of 2."""
    if (family, shape, cache) == ("gemma3_text", PREFILL_PEAK, "static"):
        reason = "CPU flash attention's own scratch buffers, outside the dispatcher's view: 7.5 KiB (1.6%) (limits.md)"
        request.applymarker(pytest.mark.xfail(strict=True, reason=reason))
    _check_tensor_parallel(family, _inference(cache=cache, **shape), 2)


@pytest.mark.parametrize("shape", [PREFILL_PEAK, DECODE_PEAK], ids=["prefill-peak", "decode-peak"])
def test_tensor_parallel_gathered_projections(shape):
    """Phi-3's plan: the fused qkv and gate_up projections gathered (colwise_gather_output), the o and down
    projections slicing their whole input (rowwise_split_input); every rank caches every key/value head. A wide
    MLP puts the prefill's peak at the gate_up gather."""
    _check_tensor_parallel("phi3", _inference(**shape), 2, intermediate_size=1024)


def test_tensor_parallel_generate_across_the_longrope_switch():
    """Phi-3's generate() drops its cache at the token past original_max_position_embeddings (32) and runs the
    whole sequence again, each rank gathering its fused projections meanwhile."""
    factors = LONGROPE["rope_scaling"]
    halved = {name: factors[name][:4] for name in ("short_factor", "long_factor")}  # tp_heads' head dim of 8
    overrides = LONGROPE | {"rope_scaling": factors | halved}
    _check_tensor_parallel("phi3", _inference(seq_len=24, max_new_tokens=24), 2, intermediate_size=1024, **overrides)


@pytest.mark.parametrize("shape", [PREFILL_PEAK, DECODE_PEAK], ids=["prefill-peak", "decode-peak"])
@pytest.mark.parametrize("degree", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_tensor_parallel_experts_stored_input_first(degree, shape):
    """Llama 4's experts are stored experts x in x out and run through bmm: its plan swaps the styles of their
    weights (packed_rowwise on gate_up_proj: the gate and up features of its last dimension; colwise on down_proj:
    its input features), each rank running every expert on its slice of the intermediate size, the outputs
    all-reduced in place. Eight experts on every token in every layer, their weights most of the model."""
    experts = {"num_local_experts": 8, "intermediate_size": 128, "interleave_moe_layer_step": 1}
    _check_tensor_parallel("llama4_text", _inference(**shape), degree, **experts)


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_tensor_parallel_moe_without_attention_plan(cache):
    """DeepSeek-V3's plan splits its experts, shared experts and dense MLP, not its latent attention: every rank
    caches every head. Decode-bound: its prefill peaks in CPU's math attention, whose _safe_softmax allocates a
    mask of the scores' size inside the kernel, outside the dispatcher's view (limits.md)."""
    _check_tensor_parallel("deepseek_v3", _inference(cache=cache, **DECODE_PEAK), 2)


@pytest.mark.parametrize("cache", ["dynamic", pytest.param("static", marks=pytest.mark.slow)])
def test_tensor_parallel_latent_attention(cache):
    """DeepSeek-V2's plan splits the latent attention's heads (q and kv_b column-wise, o row-wise) and joins its
    latent projection's output anew (MlaKvAProjParallel's torch.cat); every rank caches the whole compressed latent.
    Decode-bound, as DeepSeek-V3 (limits.md)."""
    _check_tensor_parallel("deepseek_v2", _inference(cache=cache, **DECODE_PEAK), 2)


@pytest.mark.slow
@pytest.mark.parametrize("family", TP_FAMILIES)
def test_tensor_parallel_generate_over_four_ranks(family):
    """Four ranks, and the last of them holding a shorter slice of a vocabulary they do not divide (transformers 5.24;
    5.17 refuses to gather such an lm_head's output, and so does the estimate)."""
    setup = _inference(**DECODE_PEAK)
    _check_tensor_parallel(family, setup, 4)
    if gathers_uneven_outputs():
        _check_tensor_parallel(family, setup, 4, rank=3, vocab_size=253)
        return
    model = tiny_model(family, **(tp_heads(family, 4) | {"vocab_size": 253}))
    with pytest.raises(ValueError, match=r"\(253\) must be divisible by the tensor parallel size \(4\)"):
        transformers_tp_generate_peak(model, setup, 4, 3)
    with pytest.raises(UserError, match="refuses to gather the lm_head's 253 outputs over 4 GPUs"):
        analyze(model, setup, Layout(gpus=4, tp=4))


@pytest.mark.parametrize("shape", [PREFILL_PEAK, DECODE_PEAK], ids=["prefill-peak", "decode-peak"])
@pytest.mark.parametrize(
    "family",
    ["qwen3_moe", *(pytest.param(f, marks=pytest.mark.slow) for f in ("gpt_oss", "mixtral", "glm4_moe", "qwen3_next"))],
)
@pytest.mark.skipif(not TRANSFORMERS_EP_SIZE, reason=EP_SIZE_MISSING)
def test_expert_parallel_generate_matches_transformers(family, shape):
    """DistributedConfig(tp_size=2, ep_size=2): attention as the tp_plan splits it (gpt-oss's plan leaves it whole),
    each rank half the experts, run on the whole batch with the other rank's routes masked (AllReduceEP)."""
    _check_tensor_parallel(family, _inference(**shape), 2, expert_parallel=True)


@pytest.mark.slow
@pytest.mark.skipif(not TRANSFORMERS_EP_SIZE, reason=EP_SIZE_MISSING)
def test_expert_parallel_over_four_ranks_with_static_cache():
    """One expert per rank; DeepSeek-V3 keeps its latent attention whole (decode-bound: limits.md)."""
    _check_tensor_parallel("qwen3_moe", _inference(cache="static", **PREFILL_PEAK), 4, expert_parallel=True)
    setup = _inference(cache="static", **DECODE_PEAK)
    _check_tensor_parallel("deepseek_v3", setup, 4, expert_parallel=True)


@contextmanager
def _generate_as_on_a_gpu():
    """transformers' own generate(), whose decode loop asks the model's device whether to run grouped_mm experts as
    batched_mm (``_optimize_model_for_decode``): the question answered as on a GPU, everything else on the CPU."""
    ask = GenerationMixin._optimize_model_for_decode

    @contextmanager
    def on_a_gpu(self):
        with patch.object(type(self), "device", new_callable=PropertyMock, return_value=torch.device("cuda")):
            decoding = ask(self)
            decoding.__enter__()  # the question is asked here, and only here
        try:
            yield
        finally:
            decoding.__exit__(None, None, None)

    with patch.object(GenerationMixin, "_optimize_model_for_decode", on_a_gpu):
        yield


# Wide experts, each family by its own fields, so that a batch of 4 puts the decode peak at batched_mm's copies
WIDE_EXPERTS = {
    "qwen3_moe": {"num_experts": 8, "moe_intermediate_size": 256},
    "mixtral": {"num_local_experts": 8, "intermediate_size": 256},
    "deepseek_v3": {"n_routed_experts": 8, "moe_intermediate_size": 256},
    "gpt_oss": {"num_local_experts": 8, "intermediate_size": 256},
}


@pytest.mark.skipif(not DECODES_WITH_BATCHED_MM, reason="this transformers' generate() keeps grouped_mm throughout")
@pytest.mark.parametrize(
    "family", ["qwen3_moe", *(pytest.param(f, marks=pytest.mark.slow) for f in ("mixtral", "deepseek_v3", "gpt_oss"))]
)
def test_moe_decode_on_a_gpu_matches_generate(family):
    """On a GPU generate() decodes with batched_mm, which copies each routed token's experts' weights. The estimate's
    GPU decision (the target) is checked against an H200 (docs/accuracy.md); here both sides take it, and the memory
    of what follows is compared."""
    overrides = WIDE_EXPERTS[family]
    setup = _inference(batch_size=4, **DECODE_PEAK)
    with _generate_as_on_a_gpu():
        measured = measure(tiny_model(family, **overrides), setup)
    with patch("tracer.inference.decodes_with_batched_mm", lambda setup: True):
        estimated = analyze(tiny_model(family, **overrides), setup)
    on_the_cpu = analyze(tiny_model(family, **overrides), setup)
    assert abs(estimated.peak_bytes - measured.peak_bytes) <= TOLERANCE * measured.peak_bytes
    assert estimated.peak_phase == "decode" and estimated.peak_bytes > on_the_cpu.peak_bytes * 1.05
    assert "batched_mm" not in on_the_cpu.assumptions["moe_experts"]


EP_SLOW = [pytest.mark.slow, pytest.mark.skipif(not TRANSFORMERS_EP_SIZE, reason=EP_SIZE_MISSING)]


@pytest.mark.skipif(not DECODES_WITH_BATCHED_MM, reason="this transformers' generate() keeps grouped_mm throughout")
@pytest.mark.parametrize(
    ("family", "expert_parallel"),
    [
        pytest.param("qwen3_moe", False, id="qwen3_moe-tp"),
        pytest.param("mixtral", False, id="mixtral-tp", marks=pytest.mark.slow),
        *(
            pytest.param(family, True, id=f"{family}-ep", marks=EP_SLOW)
            for family in ("qwen3_moe", "mixtral", "gpt_oss")
        ),
    ],
)
def test_tensor_parallel_moe_decode_on_a_gpu_matches_generate(family, expert_parallel):
    """The decode switch to batched_mm with the experts split: tp_plan's expert styles (each copy a rank's slice of
    each routed expert) and DistributedConfig's ep_size (each rank copying its own experts for every routed token,
    the other rank's masked). transformers' own tensor-parallel generate() on rank 0 of 2, asked as on a GPU."""
    overrides = WIDE_EXPERTS[family]
    setup = _inference(batch_size=4, **DECODE_PEAK)
    # the runtime asked as on a GPU, the estimate made for one: neither context reaches the other's side
    with _generate_as_on_a_gpu(), patch("tracer.inference.decodes_with_batched_mm", lambda setup: True):
        estimated = _check_tensor_parallel(family, setup, 2, expert_parallel=expert_parallel, **overrides)
    on_the_cpu = _tensor_parallel_estimate(family, setup, 2, expert_parallel=expert_parallel, **overrides)
    assert estimated.peak_phase == "decode" and estimated.peak_bytes > on_the_cpu.peak_bytes * 1.05


def test_moe_report_says_how_the_experts_run():
    """The routing does not move the estimate: transformers' default grouped_mm runs every routed token once."""
    assert (
        "does not depend on how the router" in analyze(tiny_model("qwen3_moe"), _inference()).assumptions["moe_experts"]
    )
    assert "moe_experts" not in analyze(tiny_model("llama"), _inference()).assumptions


@pytest.mark.parametrize(
    ("family", "layout", "mode", "message"),
    [
        ("qwen3_moe", Layout(gpus=2, tp=2, ep=2), "train", "--tp or --pp in training"),
        ("qwen3_moe", Layout(gpus=2, tp=1, ep=2), "inference", "must equal --tp 1"),
        ("llama", Layout(gpus=2, tp=2, ep=2), "inference", "no expert-parallel plan for Llama"),
        ("qwen3_moe", Layout(gpus=8, tp=8, ep=8), "inference", "--ep 8 must divide the 4 experts"),
    ],
)
def test_expert_parallel_refusals(family, layout, mode, message):
    setup = _inference() if mode == "inference" else TrainingSetup(target=Target.CPU, seq_len=16)
    with pytest.raises(UserError, match=message):
        analyze(tiny_model(family, num_attention_heads=8, num_key_value_heads=8), setup, layout)


def test_inference_refuses_data_parallel_layouts():
    with pytest.raises(UserError, match="one GPU, or tensor parallel"):
        analyze(tiny_model("llama"), _inference(), Layout(gpus=2))
    with pytest.raises(UserError, match="--quantize"):
        analyze(tiny_model("llama"), _inference(quantize="nf4", dtype="bf16"), Layout(gpus=2, tp=2))
    with pytest.raises(UserError, match=r"--pp .* --device-map auto"):
        analyze(tiny_model("llama"), _inference(), Layout(gpus=4, pp=2, tp=2))


def test_sweep_parsing():
    assert parse_sweep(["seq-len=2048,512", "batch-size=8,1,8"], "inference") == {
        "seq-len": (512, 2048),
        "batch": (1, 8),
    }
    for bad in (["seq-len"], ["depth=2"], ["batch=0"], ["batch=a"], ["batch=1", "batch=2"]):
        with pytest.raises(UserError):
            parse_sweep(bad, "inference")
    with pytest.raises(UserError, match="inference"):
        parse_sweep(["max-new-tokens=1,2"], "train")


def test_sweep_table_marks_what_fits(capsys, tmp_path):
    """The sweep's points are the estimates of their own setups, and what fits is read off them."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny_model("llama").config.to_dict()))
    argv = ["analyze", str(config), "--mode", "inference", "--quiet", "--sweep", "seq-len=16,32", "batch=1,2"]
    assert main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [(p["seq-len"], p["batch"]) for p in result["points"]] == [(16, 1), (16, 2), (32, 1), (32, 2)]
    cli_defaults = dict(dtype="bf16", logits_to_keep=1)  # inference in bf16, last-position logits as generate()
    single = analyze(str(config), TrainingSetup(mode="inference", seq_len=32, batch_size=2, **cli_defaults))
    assert result["points"][-1]["peak_bytes"] == single.peak_bytes
    assert all(p["fits"] for p in result["points"])
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "fits h100" in text and "largest seq-len that fits at batch 2: 32" in text


def test_sweep_reports_none_that_fits(monkeypatch, capsys):
    import analysis.budget

    monkeypatch.setattr(analysis.budget.MemoryBudget, "usable_bytes", 0)  # nothing fits in no memory
    assert main(["analyze", "gpt2", "--mode", "inference", "--quiet", "--sweep", "batch=1,2"]) == 0
    assert "largest batch that fits: none of 1, 2" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["--mode", "inference", "--gpus", "2"],
        ["--mode", "inference", "--gpus", "2", "--tp", "2", "--zero", "3"],
        ["--mode", "inference", "--lora-r", "8"],
        ["--mode", "inference", "--quantize", "nf4", "--dtype", "fp32"],
        ["--mode", "inference", "--cache", "paged"],
        ["--sweep", "max-new-tokens=2"],
        ["--sweep", "seq-len=0"],
    ],
)
def test_cli_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(["analyze", "gpt2", "--quiet", *argv]))
    assert exit_info.value.code == EXIT_USER_ERROR
    assert "Traceback" not in capsys.readouterr().err


def test_cli_inference_report(capsys):
    argv = ["analyze", "gpt2", "--mode", "inference", "--dtype", "bf16", "--quantize", "int4", "--quiet"]
    assert main([*argv, "--seq-len", "128", "--max-new-tokens", "16"]) == 0
    out = capsys.readouterr().out
    assert "inference (prefill of 128 tokens, decode up to 16 more)" in out
    assert "kv_cache" in out and "optimizer" not in out


def test_generation_runs_in_eval_mode():
    """generate() runs a model in eval mode: GPT-2's dropout (p=0.1 by default) allocates nothing."""
    from tracer.tracing import trace_step

    trace = trace_step(tiny_model("gpt2", resid_pdrop=0.1, attn_pdrop=0.1, embd_pdrop=0.1), _inference())
    assert not [op.target for op in trace.ops if "dropout" in op.target or "bernoulli" in op.target]

"""generate() as users configure it: sampling with transformers' own logits processors, the FP8 quantized cache
(both against ``generate()`` itself on CPU with every storage counted), and the offloaded caches (against
``generate()`` on a GPU a CPU stands in for, where host memory is told from device memory:
tests/generate_runtimes.py)."""

from __future__ import annotations

import pytest
import torch
from generate_runtimes import allocator_phase_peaks, generate_peaks
from test_inference import PREFILL_PEAK, TOLERANCE
from tiny_models import deep_tiny_model, tiny_model
from torch.profiler import ProfilerActivity, profile

from analysis.cli import EXIT_USER_ERROR, main
from analysis.estimate import analyze
from analysis.measure import measure
from tracer.errors import UserError
from tracer.inference import FP8_CACHE, _multinomial
from tracer.training import Sampling, Target, TrainingSetup

# A vocabulary large enough for the processors' batch x vocabulary float32 tensors to set the decode step's peak
SAMPLING_VOCAB = 8192
# A short generation: each phase's peak is compared on its own, so the decode steps need not set the whole peak
DECODING = {"seq_len": 16, "max_new_tokens": 12}


def _inference(**options) -> TrainingSetup:
    return TrainingSetup(target=Target.CPU, mode="inference", **({"batch_size": 2} | options))


def _against_generate(model, setup: TrainingSetup, reference=measure):
    """The estimate's peak in each phase against generate()'s: the prefill (with what generate() does before it),
    and the largest of the decode steps."""
    estimated = analyze(model, setup)
    if reference is measure:
        measured = measure(model, setup).phase_peaks
        measured["prefill"] = max(measured.pop("forward", 0), measured["prefill"])
    else:
        measured = reference(model, setup)
    for phase, peak in measured.items():
        error = (estimated.phase_peaks[phase] - peak) / peak
        assert abs(error) <= TOLERANCE, (phase, estimated.phase_peaks[phase], peak)
    return estimated


@pytest.mark.parametrize(
    "sampling",
    [Sampling(), pytest.param(Sampling(temperature=0.7, top_k=0, top_p=0.9), marks=pytest.mark.slow)],
    ids=["defaults", "temperature-top-p"],
)
@pytest.mark.parametrize(
    "shape", [pytest.param(PREFILL_PEAK, marks=pytest.mark.slow), DECODING], ids=["prefill-peak", "decoding"]
)
def test_sampling_matches_generate(sampling, shape):
    """generate(do_sample=True): the warpers' batch x vocabulary float32 tensors, the softmax and the sampled
    tokens, held from one iteration to the next as ``_sample`` holds them, put the decode step's peak in the
    processors. Against the CPU allocator, which also sees the exponential sample torch.multinomial allocates
    inside itself (a dispatch-level count of generate() does not)."""
    model = tiny_model("llama", vocab_size=SAMPLING_VOCAB)
    report = _against_generate(model, _inference(sampling=sampling, **shape), allocator_phase_peaks)
    assert "TopKLogitsWarper(top_k=50" in report.assumptions["logits_processors"] or sampling.top_k == 0
    greedy = analyze(model, _inference(**shape))
    assert greedy.assumptions["logits_processors"] == "none"
    assert report.peak_bytes > greedy.peak_bytes


def test_multinomial_allocates_its_exponential_sample():
    """torch.multinomial draws one sample through an exponential tensor of the probabilities' size, allocated inside
    the kernel (what the trace's ``_multinomial`` allocates): the CPU allocator sees it."""
    probs = torch.softmax(torch.randn(2, 4096), dim=-1)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        torch.multinomial(probs, num_samples=1)
    allocated = [e.nbytes() for e in profiler.profiler.kineto_results.events() if e.name() == "[memory]"]
    assert probs.nbytes in allocated
    assert _multinomial(probs).shape == (2, 1)


@pytest.mark.parametrize(
    ("family", "dtype", "shape"),
    [
        pytest.param("llama", "fp32", PREFILL_PEAK, marks=pytest.mark.slow),
        ("llama", "fp32", DECODING),
        pytest.param("llama", "bf16", DECODING, marks=pytest.mark.slow),
        pytest.param("gpt2", "fp32", DECODING, marks=pytest.mark.slow),
        pytest.param("qwen3", "bf16", PREFILL_PEAK, marks=pytest.mark.slow),
    ],
)
@pytest.mark.skipif(not FP8_CACHE, reason="this transformers has no FP8 QuantizedCache")
def test_fp8_quantized_cache_matches_generate(family, dtype, shape):
    """QuantizedCache(backend="fp8"): one byte per cached value and a scale per layer, each layer dequantized whole
    through float32 at every update."""
    setup = _inference(cache="quantized", cache_backend="fp8", dtype=dtype, **shape)
    report = _against_generate(tiny_model(family), setup)
    assert (
        report.breakdown["kv_cache"]
        < analyze(tiny_model(family), _inference(dtype=dtype, **shape)).breakdown["kv_cache"]
    )


@pytest.mark.parametrize(
    ("cache", "shape"),
    [
        pytest.param("offloaded", PREFILL_PEAK, marks=pytest.mark.slow),
        ("offloaded", DECODING),
        ("offloaded_static", DECODING),
        pytest.param("offloaded_static", PREFILL_PEAK, marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize("family", ["llama", pytest.param("gemma2", marks=pytest.mark.slow)])
def test_offloaded_cache_matches_generate_on_a_gpu(family, cache, shape):
    """transformers' offloading: every layer's keys and values in host memory but the one being updated and the next,
    prefetched. The reference tells host memory from the GPU's: generate() on a GPU a CPU stands in for, eager
    attention (SDPA's kernel choice on a device the CPU stands in for is its math path, not the CPU's)."""
    model = deep_tiny_model(family, 4)
    setup = _inference(cache=cache, attn="eager", **shape)
    estimated = analyze(model, setup).phase_peaks
    for phase, (reference,) in generate_peaks(model, setup).items():
        assert abs(estimated[phase] - reference) / reference <= TOLERANCE, (phase, estimated[phase], reference)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"cache": "quantized"}, "--cache-backend fp8"),
        ({"cache": "quantized", "cache_backend": "quanto"}, "optimum-quanto"),
        ({"cache": "static", "cache_backend": "fp8"}, "--cache quantized only"),
        ({"sampling": {"temperature": 0.0}}, "--temperature must be positive"),
        ({"sampling": {"top_p": 1.5}}, "--top-p"),
        ({"sampling": {"top_k": -1}}, "--top-k"),
    ],
)
def test_generation_options_refused(options, message):
    with pytest.raises(UserError, match=message):
        if "sampling" in options:
            Sampling(**options["sampling"])
        _inference(**options)


def test_caches_transformers_refuses_for_sliding_window_models():
    """QuantizedCache takes full-attention layers only; StaticCache(offloading=True) offloads only those, and its
    first prefetch finds none. A transformers without the FP8 backend is named as what to change."""
    with pytest.raises(UserError, match="only full attention" if FP8_CACHE else "upgrade transformers"):
        analyze(tiny_model("mistral"), _inference(cache="quantized", cache_backend="fp8"))
    with pytest.raises(UserError, match="has none"):
        analyze(tiny_model("mistral"), _inference(cache="offloaded_static"))


def test_offloaded_cache_is_not_measured_on_a_cpu():
    with pytest.raises(UserError, match="--target cuda"):
        measure(tiny_model("llama"), _inference(cache="offloaded"))


@pytest.mark.parametrize(
    "argv",
    [
        ["--mode", "inference", "--temperature", "0.7"],
        ["--mode", "inference", "--do-sample", "--top-p", "1.5"],
        ["--do-sample"],
        ["--mode", "inference", "--cache", "quantized"],
        ["--mode", "inference", "--cache", "quantized", "--cache-backend", "hqq"],
    ],
)
def test_cli_refuses_generation_flags(argv, capsys):
    assert main(["analyze", "gpt2", "--quiet", *argv]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err


def test_cli_sampling_report(capsys):
    argv = ["analyze", "gpt2", "--mode", "inference", "--do-sample", "--top-p", "0.9", "--quiet"]
    assert main([*argv, "--seq-len", "64", "--max-new-tokens", "4", "--cache", "offloaded"]) == 0
    out = capsys.readouterr().out
    assert "do_sample=True, temperature=1, top_k=50, top_p=0.9" in out
    assert "TopPLogitsWarper(top_p=0.9" in out and "offloading=True" in out

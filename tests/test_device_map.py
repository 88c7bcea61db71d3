"""Inference over accelerate's device map: the placement against transformers' and accelerate's own
``infer_auto_device_map`` on a meta model, and each GPU's memory against ``generate()`` run with accelerate's own
``dispatch_model`` on GPUs a CPU stands in for (tests/generate_runtimes.py)."""

from __future__ import annotations

import json

import pytest
import torch
from accelerate.utils import infer_auto_device_map as accelerate_device_map
from generate_runtimes import auto_device_map, generate_peaks
from test_inference import PREFILL_PEAK, TOLERANCE
from tiny_models import LONGROPE, LONGROPE_DECODE_APART, deep_tiny_model, tiny_model
from transformers.integrations import accelerate as hf_accelerate

from analysis.cli import EXIT_USER_ERROR, main
from analysis.device_map import estimate_device_map
from analysis.estimate import analyze
from tracer.device_map import free_memory, place_modules
from tracer.errors import UserError
from tracer.gpus import find_gpu
from tracer.resolve import resolve_model
from tracer.training import DeviceMap, Target, TrainingSetup

DECODING = {"seq_len": 16, "max_new_tokens": 12}
FREE = free_memory(find_gpu("h100"))


def _inference(gpus: int, strategy: str = "auto", **options) -> TrainingSetup:
    options = {"batch_size": 2, "attn": "eager"} | options
    return TrainingSetup(target=Target.CPU, mode="inference", device_map=DeviceMap(strategy, gpus), **options)


@pytest.mark.parametrize("strategy", ["auto", "balanced_low_0", "sequential"])
@pytest.mark.parametrize(
    ("model", "gpus", "free"),
    [
        ("meta-llama/Llama-3.1-8B", 4, FREE),
        ("google/gemma-2-9b", 3, FREE),  # the embedding tied to the lm_head
        ("meta-llama/Llama-3.1-70B", 4, 48 * 2**30),  # GPUs it nearly fills
    ],
)
def test_placement_is_infer_auto_device_map(model, gpus, free, strategy):
    """What from_pretrained(device_map=...) runs on the meta model in transformers 5.24: its own
    get_balanced_memory (a buffer of 1.25 times the largest decoder layer or leaf module on every GPU but the last),
    then infer_auto_device_map with the model's _no_split_modules. accelerate's own infer_auto_device_map places
    the same given that memory; accelerate's own get_balanced_memory, which from_pretrained no longer calls, sizes
    its buffer from the mean module instead."""
    setup = TrainingSetup(mode="inference", dtype="bf16")
    with torch.device("meta"):
        net = resolve_model(model).build(setup)
    max_memory = dict.fromkeys(range(gpus), free) | {"cpu": 2**60}
    placed = place_modules(net, DeviceMap(strategy, gpus), free)
    if strategy != "sequential":
        low_zero = strategy == "balanced_low_0"
        max_memory = hf_accelerate.get_balanced_memory(
            net, max_memory, no_split_module_classes=net._no_split_modules, low_zero=low_zero
        )
    for infer_auto_device_map in (hf_accelerate.infer_auto_device_map, accelerate_device_map):
        assert placed == dict(
            infer_auto_device_map(net, max_memory=dict(max_memory), no_split_module_classes=net._no_split_modules)
        )
    if strategy == "auto":
        assert set(placed.values()) == set(range(gpus))


def test_model_that_does_not_fit_is_refused():
    with torch.device("meta"):
        net = tiny_model("llama").build(TrainingSetup(mode="inference"))
    with pytest.raises(UserError, match=r"offload .* to the host, which is not modelled"):
        place_modules(net, DeviceMap("auto", 2), free_bytes=4096)


def _against_dispatch(model, setup: TrainingSetup):
    """Each GPU's peak, and its peaks in the prefill and over the decode steps, against generate() on accelerate's
    dispatched model. The trace's decode step is the last; a prompt longer than a sliding window keeps the prefill's
    keys alive into the first decode step (limits.md), so then only the prefill and the whole are compared."""
    result = estimate_device_map(model, setup)
    placed = auto_device_map(model, setup, setup.device_map.strategy, [FREE] * setup.device_map.gpus)
    reference = generate_peaks(model, setup, placed)
    reference["step"] = [max(by_phase) for by_phase in zip(*reference.values(), strict=True)]
    window = getattr(model.config, "sliding_window", None)
    if window and setup.seq_len > window:
        del reference["decode"]
    for phase, peaks in reference.items():
        for report, peak in zip(result.report.ranks, peaks, strict=False):
            estimated = report.peak_bytes if phase == "step" else report.phase_peaks[phase]
            assert abs(estimated - peak) <= TOLERANCE * peak, (phase, report.rank.pp, estimated, peak)
    return result


@pytest.mark.parametrize("cache", ["dynamic", pytest.param("static", marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "shape", [pytest.param(PREFILL_PEAK, marks=pytest.mark.slow), DECODING], ids=["prefill-peak", "decoding"]
)
@pytest.mark.parametrize(
    "family", ["llama", *(pytest.param(f, marks=pytest.mark.slow) for f in ("gemma2", "gpt2", "falcon", "phi3"))]
)
def test_each_gpu_matches_dispatched_generate(family, shape, cache):
    """Four layers over three GPUs: the embedding and the first layer on GPU 0, the lm_head on the last; the hidden
    states, positions and rotary tables each layer's hook copies to its GPU; the cache of each layer on its GPU."""
    result = _against_dispatch(deep_tiny_model(family, 4), _inference(3, cache=cache, **shape))
    assert len(result.report.ranks) == 3
    assert all(report.breakdown["kv_cache"] > 0 for report in result.report.ranks)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["balanced_low_0", "sequential"])
def test_other_strategies_match_dispatched_generate(strategy):
    """balanced_low_0 leaves the first GPU without weights (and, generate() running on the embedding's GPU, unused);
    sequential fills the first GPU first."""
    _against_dispatch(deep_tiny_model("llama", 4), _inference(3, strategy, **DECODING))


@LONGROPE_DECODE_APART
def test_generate_across_the_longrope_switch_over_a_device_map():
    """Phi-3 drops its cache at the token past original_max_position_embeddings (32) and runs the whole sequence
    again: the new cache's layers on their GPUs, the old ones alive meanwhile."""
    _against_dispatch(deep_tiny_model("phi3", 4, **LONGROPE), _inference(3, seq_len=24, max_new_tokens=24))


def test_sampling_and_offloading_over_a_device_map():
    """generate()'s logits on the first GPU, the offloaded cache's layers each prefetched to their own GPU."""
    setup = _inference(2, cache="offloaded", **DECODING)
    _against_dispatch(deep_tiny_model("llama", 4), setup)


def test_a_single_estimate_refuses_a_device_map():
    with pytest.raises(UserError, match="estimate_device_map"):
        analyze(tiny_model("llama"), _inference(2))


def test_quantized_weights_are_refused():
    """transformers' quantizer sizes what it places: not modelled."""
    with pytest.raises(UserError, match="drop --quantize"):
        estimate_device_map(tiny_model("llama"), _inference(2, dtype="bf16", quantize="nf4"))


@pytest.mark.parametrize(
    "argv",
    [
        ["--device-map", "auto", "--gpus", "2"],
        ["--mode", "inference", "--device-map", "auto"],
        ["--mode", "inference", "--device-map", "auto", "--gpus", "4", "--tp", "2"],
        ["--mode", "inference", "--device-map", "everywhere", "--gpus", "2"],
    ],
)
def test_cli_refuses_device_maps_that_do_not_apply(argv, capsys):
    assert main(["analyze", "gpt2", "--quiet", *argv]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    assert main(["compare", "gpt2", "--quiet", "--mode", "inference", "--device-map", "auto", "--gpus", "2"]) == 2


def test_cli_reports_every_gpu(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(deep_tiny_model("llama", 4).config.to_dict()))
    argv = ["analyze", str(config), "--mode", "inference", "--gpus", "3", "--device-map", "auto", "--quiet"]
    assert main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [rank["rank"]["pp_stage"] for rank in result["ranks"]] == [0, 1, 2]
    assert result["layout"] == {"gpus": 3, "device_map": "auto"}
    assert result["setup"]["placement"].startswith("GPU 0: model.embed_tokens, model.layers.0; GPU 1:")
    assert main(argv) == 0
    assert 'accelerate device_map="auto"' in capsys.readouterr().out

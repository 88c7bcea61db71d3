"""``serve --engine sglang``: SGLang's pool arithmetic worked by hand from the rules analysis/sglang.py cites, the
published start-up logs staying within the error benchmarks/sglang_published.py reports, and bad input."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from test_cli import _assert_user_error, _run
from tiny_models import tiny_model
from transformers import AutoModelForCausalLM

from analysis.sglang import SglangSetup, default_mem_fraction_static, sglang_startup
from tracer.resolve import resolve_model
from tracer.units import GIB, MIB

sys.path.insert(0, str(Path(__file__).parents[1]))  # the benchmarks, beside the installed packages
from benchmarks.sglang_published import CASES, run_case


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_pool_is_what_the_fraction_leaves_after_the_weights(tp):
    config = tiny_model("llama").config
    setup = SglangSetup(gpu_memory_bytes=GIB, tensor_parallel_size=tp, dtype=torch.bfloat16)
    startup = sglang_startup(config, setup)
    head = config.hidden_size // config.num_attention_heads
    cell = max(1, config.num_key_value_heads // tp) * head * config.num_hidden_layers * 2 * 2
    fraction = default_mem_fraction_static(tp)
    rest = GIB - startup.loaded_bytes - int(GIB * (1 - fraction))
    assert startup.cell_bytes == cell
    assert startup.max_total_num_tokens == rest // cell


def test_loading_takes_whole_segments():
    """Llama-3.1-8B worked by hand: every weight matrix is a multiple of 2 MiB, so each fills a segment of its own
    (q, k and v fused into one of 48 MiB, gate and up into one of 224 MiB); the rotary embedding's three 32 MiB
    temporaries (131,072 positions x 64 float32) are freed into segments the next three o_proj weights (32 MiB)
    take whole; its float32 cache keeps 64 MiB; the norms and the small temporaries share one 2 MiB segment."""
    model = resolve_model("meta-llama/Llama-3.1-8B")
    startup = sglang_startup(model.config, SglangSetup(gpu_memory_bytes=80 * GIB))
    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(model.config, dtype=torch.bfloat16)
    matrices = sum(p.numel() * 2 for p in net.parameters() if p.dim() == 2)
    assert startup.weights.rotary_bytes == 64 * MIB
    assert startup.loaded_bytes == matrices + 64 * MIB + 2 * MIB


def test_default_fraction_follows_the_tensor_parallel_degree():
    assert [default_mem_fraction_static(tp) for tp in (1, 2, 3, 4, 8, 16)] == [0.88, 0.87, 0.87, 0.85, 0.81, 0.79]


# the |error| each published case has in `python -m benchmarks.sglang_published`, rounded up
BOUNDS_PCT = {"meta-llama/Meta-Llama-3.1-8B-Instruct": 0.2, "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B": 0.8,
              "Qwen/QwQ-32B": 0.1, "Qwen/Qwen2.5-0.5B-Instruct": 0.2}  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[case.served for case in CASES])
def test_published_logs_stay_within_the_reported_error(case):
    row = run_case(case)
    assert abs(row["tokens"] - case.tokens) <= case.tokens * BOUNDS_PCT[case.served] / 100


def test_bad_input_is_refused_by_name(capsys):
    code, _, err = _run(capsys, "serve", "google/gemma-3-1b-it", "--engine", "sglang")
    _assert_user_error(code, err, "sliding-window")
    code, _, err = _run(capsys, "serve", "Qwen/Qwen3-8B", "--mem-fraction-static", "0.8")
    _assert_user_error(code, err, "--gpu-memory-utilization")
    code, _, err = _run(capsys, "serve", "Qwen/Qwen3-8B", "--engine", "sglang", "--kv-cache-dtype", "fp8")
    _assert_user_error(code, err, "fp8_e4m3")

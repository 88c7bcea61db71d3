"""The ground-truth matrix and the collector's rules (benchmarks/ground_truth/): what a lent GPU measures first,
and which failures it measures again alone."""

from __future__ import annotations

from benchmarks.ground_truth.cases import matrix
from benchmarks.ground_truth.collect import _short_of_memory
from tracer.resolve import resolve_model


def test_the_full_matrix_starts_with_the_quick_cases_and_names_each_once():
    quick, full = matrix("quick"), matrix("full")
    assert full[: len(quick)] == quick
    assert len({case.name for case in full}) == len(full)


def test_no_case_runs_a_sequence_past_the_models_positions():
    """GPT-2's learned position embeddings stop at 1024: a longer sequence indexes past them (a device-side
    assert on the GPU), so the matrix leaves those shapes out."""
    for model in {case.model for case in matrix("full")}:
        config = resolve_model(model).config
        positions = getattr(config, "n_positions", None) or config.max_position_embeddings
        assert all(case.seq_len <= positions for case in matrix("full") if case.model == model), model


def test_cases_short_of_memory_beside_others_are_told_apart():
    assert _short_of_memory("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    assert _short_of_memory("UserError: Measuring needs about 9.3 GiB but only 9.2 GiB is free on this machine's cuda.")
    assert not _short_of_memory("RuntimeError: CUDA error: device-side assert triggered")

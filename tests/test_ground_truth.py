"""The ground-truth matrix and the collector's rules (benchmarks/ground_truth/): what a lent GPU measures first,
and which failures it measures again alone."""

from __future__ import annotations

from benchmarks.ground_truth.cases import matrix
from benchmarks.ground_truth.collect import CONTEXT_ALLOWANCE, _short_of_memory, _waves
from tracer.resolve import resolve_model
from tracer.units import GIB


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
    assert _short_of_memory("RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
    assert not _short_of_memory("RuntimeError: CUDA error: device-side assert triggered")


def test_capacity_cases_end_the_full_matrix_and_run_in_waves_that_fit_the_gpu_together():
    """Their out-of-memory errors are results: no neighbour may be what fills the GPU."""
    capped = matrix("capacity")
    assert capped and matrix("full")[-len(capped) :] == capped
    assert all(case.allocator_capacity for case in capped)
    device = 80 * GIB
    waves = _waves(capped, device, jobs=4)
    assert [case for wave in waves for case in wave] == capped
    for wave in waves:
        assert len(wave) <= 4
        assert len(wave) == 1 or sum(case.allocator_capacity + CONTEXT_ALLOWANCE for case in wave) <= device
    assert all(len(wave) == 1 for wave in _waves(capped, 0, jobs=4))  # no GPU: one at a time

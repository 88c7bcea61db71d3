"""The timeline files, the memory_viz snapshot, the per-module table and the comparison, checked by content."""

from __future__ import annotations

import csv
import itertools
import json
import pickle

import pytest
from torch.cuda import _memory_viz

from analysis.cli import main
from analysis.estimate import allocator_config, estimate
from analysis.export import ROLE_COLOURS, column_maxima, memory_snapshot, timeline_rows
from analysis.modules import module_table
from tests.tiny_models import tiny_model
from tracer.roles import Role
from tracer.training import TrainingSetup

SETUP = TrainingSetup(batch_size=2, seq_len=32)


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "config.json"
    tiny_model("llama").config.to_json_file(path)
    return str(path)


@pytest.fixture(scope="module")
def result():
    return estimate(tiny_model("llama"), SETUP)


def test_csv_live_bytes_at_the_peak_row_equal_the_peak(config_path, tmp_path, capsys):
    out = tmp_path / "t.csv"
    assert main(["timeline", config_path, "--batch-size", "2", "--seq-len", "32", "-o", str(out), "--quiet"]) == 0
    rows = list(csv.DictReader(out.open()))
    assert main(["analyze", config_path, "--batch-size", "2", "--seq-len", "32", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    peak_row = rows[report["peak_op_index"]]
    assert int(peak_row["live"]) == report["peak_bytes"] == max(int(row["live"]) for row in rows)
    assert {"index", "phase", "op", "module", "allocated", "freed", "parameters"} <= set(peak_row)


def test_rows_account_for_every_allocation_and_free(result):
    rows = timeline_rows(result.step, result.line)
    for before, after in itertools.pairwise(rows):
        assert after["live"] == before["live"] - before["freed"] + after["allocated"] + (
            after["allocator_slack"] - before["allocator_slack"]
        )


def test_snapshot_replays_to_the_peak_in_pytorchs_viewer_functions(result, tmp_path):
    snapshot = memory_snapshot(result.step, allocator_config(SETUP))
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickle.dumps(snapshot))
    data = pickle.loads(path.read_bytes())
    assert "Active Memory Timeline" in _memory_viz.trace_plot(data)
    assert "Allocator State History" in _memory_viz.segment_plot(data)
    text = _memory_viz.trace(data)
    assert f"{len(data['device_traces'][0])} entries" in text
    assert "Summary of segments" in _memory_viz.segsum(data)
    live = peak = 0
    for event in data["device_traces"][0]:
        live += (
            event["size"]
            if event["action"] == "alloc"
            else -event["size"]
            if event["action"] == "free_completed"
            else 0
        )
        peak = max(peak, live)
    assert peak == result.report.peak_bytes
    reserved = sum(segment["total_size"] for segment in data["segments"])
    assert reserved == result.report.reserved_bytes


def test_png_html_and_json_are_written(config_path, tmp_path):
    for suffix in ("png", "html", "json"):
        out = tmp_path / f"t.{suffix}"
        assert main(["timeline", config_path, "--seq-len", "32", "-o", str(out), "--quiet"]) == 0
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (tmp_path / "t.html").read_text()
    assert "<canvas" in page and "http" not in page.split("<script>")[1]
    data = json.loads((tmp_path / "t.json").read_text())
    assert max(row["live"] for row in data["ops"]) == data["summary"]["peak_bytes"]


def test_timeline_refuses_unknown_suffixes(config_path, tmp_path, capsys):
    assert main(["timeline", config_path, "-o", str(tmp_path / "t.txt")]) == 2
    assert "suffix picks the format" in capsys.readouterr().err


def test_module_table_splits_the_peak_by_module(result):
    table = module_table(result.step, result.report.peak_op_index, depth=3)
    slack = result.report.breakdown["allocator_slack"]
    assert sum(entry["bytes"] for entry in table["modules"]) + slack == result.report.peak_bytes
    assert any(entry["module"].startswith("model.layers.") for entry in table["modules"])
    assert len(table["largest_storages"]) == 10


def test_compare_prints_every_formula(config_path, capsys):
    assert main(["compare", config_path, "--seq-len", "32", "--quiet"]) == 0
    out = capsys.readouterr().out
    for name in ("16 B/param", "DeepSpeed", "accelerate", "LLMem", "Korthikanti"):
        assert name in out
    assert "Fits the NVIDIA H100 80GB" in out  # every report that knows its GPU gives the verdict


def test_each_pixel_column_draws_its_largest_op(result):
    """A one-op spike survives the PNG's downsampling: each column is the op with the most live memory."""
    rows = timeline_rows(result.step, result.line)
    columns = len(rows) // 7
    drawn = column_maxima(rows, columns)
    assert len(drawn) == columns < len(rows)
    assert max(row["live"] for row in drawn) == max(row["live"] for row in rows) == result.report.peak_bytes
    assert column_maxima(rows, len(rows)) == rows


def test_a_category_has_one_colour_in_every_plot(config_path, tmp_path):
    assert set(ROLE_COLOURS) == set(Role) and len(set(ROLE_COLOURS.values())) == len(Role)
    out = tmp_path / "t.html"
    argv = ["timeline", config_path, "--seq-len", "32", "--batch-size", "2", "-o", str(out), "--quiet"]
    assert main(argv) == 0
    page = out.read_text()
    data = json.loads(page.split("const data=")[1].split(";const rows=")[0])
    assert data["colours"] == [ROLE_COLOURS[Role(role)] for role in data["roles"]]
    assert "batch 2 x 32 tokens, fp32 + bf16 autocast, adamw" in page.split("<title>")[1]  # the setup titles it

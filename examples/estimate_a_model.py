"""Estimate the peak memory of fine-tuning a bundled model, and show what is live at the peak."""

from analysis.estimate import analyze
from tracer.training import TrainingSetup
from tracer.units import format_bytes

report = analyze(
    "meta-llama/Llama-3.2-1B",
    TrainingSetup(batch_size=8, seq_len=2048, mixed_precision="bf16", optimizer="adamw"),
)
print(
    f"peak {format_bytes(report.peak_bytes)} at {report.peak_op} in {report.peak_module or 'the model'}"
    f" ({report.peak_phase})"
)
for category, nbytes in report.breakdown.items():
    if nbytes:
        print(f"  {category:18s} {format_bytes(nbytes)}")
for group in report.largest_at_peak[:5]:
    print(f"  {format_bytes(group['bytes']):>12} {group['count']:>4} x {group['role']} from {group['made_by']}")

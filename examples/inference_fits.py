"""How long a context fits for 4-bit inference of a bundled model on a 24 GB GPU, at a few batch sizes."""

from analysis.sweep import render_sweep, run_sweep
from strategies.layout import Layout
from tracer.gpus import find_gpu
from tracer.resolve import resolve_model
from tracer.training import TrainingSetup

model = resolve_model("meta-llama/Llama-3.2-3B")
setup = TrainingSetup(mode="inference", dtype="bf16", quantize="nf4", max_new_tokens=256, logits_to_keep=1)
axes = {"seq-len": (4096, 16384, 65536), "batch": (1, 4)}
print(render_sweep(run_sweep(model, setup, Layout(), axes, find_gpu("rtx4090")), model.model_id))

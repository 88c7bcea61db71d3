"""Compare the estimate with a real step on this machine's CPU, for a config made in code."""

from transformers import AutoConfig

from analysis.estimate import analyze
from analysis.measure import measure
from tracer.resolve import ResolvedModel
from tracer.training import Target, TrainingSetup

config = AutoConfig.for_model(
    "llama",
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1000,
)
model = ResolvedModel("tiny-llama", config, "made in code")
setup = TrainingSetup(batch_size=4, seq_len=128, mixed_precision="bf16", target=Target.CPU)
estimated, measured = analyze(model, setup).peak_bytes, measure(model, setup).peak_bytes
print(f"estimated {estimated:,} bytes, measured {measured:,} bytes, error {(estimated - measured) / measured:+.3%}")

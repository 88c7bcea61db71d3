"""Predict the GPU memory of one fine-tuning step by tracing it under FakeTensorMode."""

"""Benchmarks: our methods vs autoregressive vs transformers' own generate, side by side."""

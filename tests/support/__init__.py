"""Helpers that tests of several areas share: the fake runner, tiny random models, tokenizers built
locally, `aioinfer serve` as a subprocess, simulated CUDA memory counters and bfloat16 parity."""

"""Benchmarks of torch_memory_saver: both hook modes side by side, every figure as a
ratio to a limit this machine measures itself. Entry point: `python -m benchmarks.run`."""

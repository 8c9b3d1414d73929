"""Benchmarks of torch_memory_saver, one tool: `python -m benchmarks <suite>` (see benchmarks/__main__.py); every
figure is set beside a limit the same run measures on the same machine."""

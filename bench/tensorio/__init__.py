"""tensorio benchmarks: `python -m bench.tensorio` (CPU) and `python bench/tensorio/gpu.py`."""

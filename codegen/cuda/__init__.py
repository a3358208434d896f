"""The CUDA C printer (backend="cupy"): pointwise kernels (pointwise.py) and reductions (reduction.py)."""

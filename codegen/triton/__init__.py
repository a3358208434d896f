"""The Triton printer: pointwise kernels (pointwise.py) and reduction kernels (reduction.py)."""

"""Hand-written kernel code that codegen uses (gjit.kernels): the Triton helpers that generated
reductions call (triton_helpers.py) and the CUDA C prelude every CUDA kernel starts with
(cuda_prelude.py). Matmul and attention templates with fused prologues and epilogues land here.
"""

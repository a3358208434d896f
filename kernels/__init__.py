"""Hand-written Triton kernel templates that codegen fills in (gjit.kernels).

Empty in this version: matmul and convolution run as ATen externs. Templates with fused
epilogues land here with their own tests.
"""

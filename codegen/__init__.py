"""Codegen: fused regions -> kernel source (gjit.codegen). generate.py is the entry; common.py holds what
both printers share (KernelSource, names, headers helpers); triton/ and cuda/ print; toolchain/ builds."""

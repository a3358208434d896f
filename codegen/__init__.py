"""Codegen: fused regions -> kernel source (gjit.codegen)."""

"""Lowering: ATen FX graph -> loop IR. registry.py (the registry and shared helpers), the op modules
(pointwise, copies, views, reductions, spatial, indexing) and graph.py (the walk over the FX graph)."""

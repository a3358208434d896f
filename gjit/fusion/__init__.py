"""Fusion: loop IR -> regions (one kernel each) in a schedule. regions.py is the entry (`fuse`: the
regions, their order, `verify_schedule`) over spaces.py (a reduction's or template's iteration
space); then the passes between fusion and codegen, in the driver's order: statistics.py, rows.py,
products.py, which move regions into matmul templates over schedule.py's view of the steps."""

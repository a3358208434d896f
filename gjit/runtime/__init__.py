"""Runtime: the compiled graph and its eager fallback (graph.py), CUDA C launch (cuda.py), the on-disk
compile cache (disk_cache.py), Triton-interpreter support (interpret.py) and the host emulation of
CUDA C (host_emulation.py, host_runtime.py), and the two extern calls a GPU wrapper makes otherwise
(padded_mm.py, attention_masks.py)."""

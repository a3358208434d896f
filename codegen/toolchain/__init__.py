"""From kernel source to something that runs: content-addressed source files and their import
(files.py), Triton builds for sm_90 without a GPU (compile_only.py), NVRTC for CUDA C (nvrtc.py)."""

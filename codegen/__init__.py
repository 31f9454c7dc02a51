"""Code generators: numpy loops (CPU) and CUDA C for CuPy (GPU)."""

"""Run the CUDA backend's kernels on the CPU (a test helper, not a product feature).

`emulate(module, inputs)` compiles the generated CUDA source as C++ together with
`cuda_emu.h`, which models a thread block as threads and `__syncthreads()` as a barrier, loads
it with ctypes and launches every kernel in order, as the CuPy launcher would.
`race_check(module)` runs the same source under ThreadSanitizer, which reports a missing
`__syncthreads()` as a data race.  `fake_cupy(module)` is a numpy stand-in for `cupy` on which
the generated launcher runs unchanged.  Read the header's comment for what this cannot show.
"""

from .harness import build, emulate, fake_cupy, race_check

__all__ = ["build", "emulate", "fake_cupy", "race_check"]

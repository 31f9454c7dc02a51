"""How much memory `bbrules run` needs, estimated before anything is allocated.

A program's sizes are the user's to choose, and `dim q = 4294967296 / 4294967296` asks for a
terabyte: `run` estimates its peak first and refuses a program over its budget (`--memory`)
with a message instead of failing inside numpy, or swapping the machine to a halt.

The estimate is an upper bound of the order of magnitude, not an accounting: every global
tensor of the block program (float32, as the backends hold them), every tensor of the dense
reference (float64) and of the plain float32 evaluation the verdict's baseline comes from,
with the four float64 arrays per output its comparison makes, and the tiles a backend holds at
once: `TILES_LIVE` of a kernel's largest, a node's tile over every grid block (a contraction's
operands and product, never all their axes at once: magika's convolution was estimated at 16
GiB that way), or of the numpy backend's coarsened tiles (`COARSE_TILE` elements), whichever
is larger.
"""

from __future__ import annotations

import os
from math import prod

from .codegen.numpy_plan import COARSE_TILE
from .ir import BlockProgram, TileType, postorder, type_of
from .program import Program

TILES_LIVE = 4  # tiles of a kernel's full grid a backend holds at once, at most (a guess)


def default_budget() -> int:
    """Half the machine's physical memory (8 GiB where it cannot be read)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def run_bytes(program: BlockProgram, reference: Program | None) -> int:
    """An upper estimate of the peak bytes of running `program` and comparing it with the dense
    evaluation of `reference`."""
    total = sum(4 * _elements(program.dims, t.axes) for t in program.tensors.values()
                if t.role != "view")
    if reference is not None:
        total += sum((8 + 4) * _elements(reference.dims, t.axes)
                     for t in reference.tensors.values())
        total += sum(4 * 8 * _elements(program.dims, program.tensors[o].axes)
                     for o in program.outputs)
    tiles = 4 * COARSE_TILE
    for kernel in program.kernels:
        blocked = program.in_kernel(kernel)
        for n in {n for k in kernel.stores for n in postorder(k.value)}:
            if isinstance(t := type_of(n), TileType):  # a grid axis' blocks all at once
                tile = prod((blocked.blocks(a) if a in t.deps and a in kernel.grid else 1) *
                            (blocked.block(a) if a in t.shape else 1) for a in t.deps | t.shape)
                tiles = max(tiles, 4 * tile)
    return total + TILES_LIVE * tiles


def _elements(dims: dict, axes: tuple[str, ...]) -> int:
    return prod(dims[a].extent for a in axes)

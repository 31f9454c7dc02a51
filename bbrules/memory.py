"""How much memory `bbrules run` needs, estimated before anything is allocated.

A program's sizes are the user's to choose, and `dim q = 4294967296 / 4294967296` asks for a
terabyte: `run` estimates its peak first and refuses a program over its budget (`--memory`)
with a message instead of failing inside numpy, or swapping the machine to a halt.

The estimate is an upper bound of the order of magnitude, not an accounting: every global
tensor of the block program (float32, as the backends hold them), every tensor of the dense
reference (float64) and of the plain float32 evaluation the verdict's baseline comes from,
with the four float64 arrays per output its comparison makes, and per
kernel the tiles a backend holds at once (every grid block, one block of each other axis:
`TILES_LIVE` of them).
"""

from __future__ import annotations

import os
from math import prod

from .ir import BlockProgram, Load, postorder
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
    tiles = 0
    for kernel in program.kernels:
        blocked = program.in_kernel(kernel)
        for k in kernel.stores:
            others = {a for n in postorder(k.value) if isinstance(n, Load) for a in n.axes}
            others -= set(k.axes)
            tile = prod(blocked.extent(a) for a in k.axes) * \
                prod(blocked.block(a) for a in others)
            tiles = max(tiles, TILES_LIVE * 4 * tile)
    return total + tiles


def _elements(dims: dict, axes: tuple[str, ...]) -> int:
    return prod(dims[a].extent for a in axes)

"""Block programs: kernels (stores) over declared dimensions and global tensors."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterator

import numpy as np

from .kinds import Sort, _cached_hash, _dag_eq, kind_of, postorder
from .monoid import Monoid, monoids_used
from .nodes import Load, Node, Var
from .typecheck import sched_deps, tile_type, type_of
from .types import Axis, IRError, TileType


@dataclass(frozen=True)
class Dim:
    """An axis of the iteration space: `extent` elements in blocks of `block`.

    A block that does not divide the extent leaves the last block *ragged*: global tensors are
    laid out over `padded` elements along the axis (whole blocks), the padding zero in inputs
    and never read back unmasked (lowering masks every reduction over a ragged axis with its
    identity beyond `extent`), and outputs are returned at `extent`."""

    name: str
    extent: int
    block: int

    @property
    def blocks(self) -> int:
        return -(-self.extent // self.block)

    @property
    def padded(self) -> int:
        return self.blocks * self.block

    @property
    def ragged(self) -> bool:
        return self.extent % self.block != 0


class DimError(ValueError):
    """Sizes that make no dimension; `part` ("extent" or "block") is the number at fault."""

    def __init__(self, part: str, message: str):
        super().__init__(message)
        self.part = part


MAX_EXTENT = 2 ** 53


def checked_dim(name: str, extent: float, block: float | None, of: str | None = None) -> Dim:
    """Dimension `name`: `extent` elements in blocks of `block` (one block when None).

    Every way of writing sizes (a program's `dim`, a block program's, a check's `with`, the
    command line's `--dim`) comes here, so they all accept the same sizes: positive integers
    at most `MAX_EXTENT` (sizes are read as floats, which are integers up to there; inf and
    nan are refused too), the block at most the extent (a block that does not divide it
    leaves a ragged last block).  `of` names the dimension in the message (default
    "dimension 'name'").
    """
    for part, what, v in (("extent", "a dimension's extent", extent),
                          ("block", "a block size", block)):
        if v is not None and not -MAX_EXTENT <= v <= MAX_EXTENT:
            raise DimError(part, f"{what} must be at most 2**53, got {v:g}")
        if v is not None and v != int(v):
            raise DimError(part, f"{what} must be a positive integer, got '{v:g}'")
        if v is not None and v < 1:
            raise DimError(part, f"{what} must be positive, got {v:g}")
    whole = int(extent)
    size = whole if block is None else int(block)
    if size > whole:
        raise DimError("block", f"block size {size} is larger than the extent {whole} of "
                                f"{of or f'dimension {name!r}'}")
    return Dim(name, whole, size)


DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "i32": 4}

# Dtypes of whole numbers (token ids, indices), which inputs may declare: every stage computes
# them as f32 values, which hold each whole number up to WHOLE_LIMIT in magnitude exactly, and
# the GPU launchers pass them as f32.  A value past the limit, or not whole, is refused where
# inputs enter (`check_whole`), not rounded to another id.
WHOLE_DTYPES = frozenset({"i32"})
WHOLE_LIMIT = 2 ** 24


def check_whole(name: str, values: object) -> None:
    """Raise ValueError unless `values` (an input declared whole) are whole numbers of
    magnitude at most `WHOLE_LIMIT`."""
    given = np.asarray(values)
    if given.size == 0 or given.dtype.kind in "biuf" and \
            -WHOLE_LIMIT <= given.min() and given.max() <= WHOLE_LIMIT and \
            (given.dtype.kind != "f" or (np.floor(given) == given).all()):
        return  # (a NaN fails the comparisons; few numpy calls: a module checks every run)
    x = given.astype(np.float64)
    bad = ~(np.isfinite(x) & (np.floor(x) == x) & (np.abs(x) <= WHOLE_LIMIT))
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"input '{name}' is declared i32 but holds {given[at].item()!r} at "
                         f"{list(at)}: expected whole numbers of magnitude at most "
                         f"{WHOLE_LIMIT} (2^24), which f32 holds exactly")


@dataclass(frozen=True)
class TensorDecl:
    """A global tensor.  `role` is `input`, `output`, `temp` (a materialised intermediate) or
    `view`: the memory of tensor `base` read under other axes, row-major, as numpy's `reshape`
    does (a split reduction reads K[h, k, d] as K[h, chunk, k_in, d]).  A view is never
    stored and owns no memory; it is read after its base is written."""

    name: str
    axes: tuple[Axis, ...]
    dtype: str = "f32"
    role: str = "temp"
    base: str = ""  # the viewed tensor, for role `view`

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def storage(self) -> str:
        """The tensor whose memory this one is."""
        return self.base or self.name


@dataclass(frozen=True, eq=False)
class Store:
    """L -> G: materialise `value` into `tensor` for every block of `axes`.  One kernel."""

    __hash__ = _cached_hash
    __eq__ = _dag_eq

    tensor: str
    axes: tuple[Axis, ...]
    value: Node


@dataclass(frozen=True, eq=False)
class Kernel:
    """One launch: a processor per block of the `grid` axes, each making every store.

    A store's axes that are not grid axes are *map loops* inside the kernel: the processor
    walks their blocks in order and stores one block per iteration.  What a store computes
    without depending on a map loop's axis is computed once per grid point, before the loop,
    and shared by every store of the kernel: so a softmax over a blocked row computes its
    statistics once and then normalises block by block, and a sibling reduction and map loop
    over one axis (`c = a + b` with `d = rowsum(b)`) load `b` once.  A store never reads a
    tensor that its own kernel stores.
    """

    __hash__ = _cached_hash  # extraction looks kernel costs up by value thousands of times
    __eq__ = _dag_eq

    grid: tuple[Axis, ...]
    stores: tuple[Store, ...]
    # Block sizes of this kernel's own, by axis: tensors live whole in global memory between
    # kernels, so a kernel may tile an axis finer or coarser than the program's default.
    blocks: tuple[tuple[Axis, int], ...] = ()

    @staticmethod
    def of(store: Store) -> Kernel:
        """The kernel of one store over its own axes (one processor per stored block)."""
        return Kernel(store.axes, (store,))

    @property
    def name(self) -> str:
        """The tensors it stores, joined by '_' (what a generated kernel is called after)."""
        return "_".join(s.tensor for s in self.stores)

    @property
    def tensors(self) -> tuple[str, ...]:
        return tuple(s.tensor for s in self.stores)

    def map_axes(self, store: Store) -> tuple[Axis, ...]:
        """The map loops of `store`, outermost first: its axes that are not grid axes."""
        return tuple(a for a in store.axes if a not in self.grid)


@dataclass(frozen=True)
class BlockProgram:
    """Kernels in execution order, over declared dims and tensors."""

    dims: dict[str, Dim]
    tensors: dict[str, TensorDecl]
    kernels: tuple[Kernel, ...]
    outputs: tuple[str, ...]

    def __hash__(self) -> int:
        return hash(self.kernels)

    @staticmethod
    def of_stores(dims: dict[str, Dim], tensors: dict[str, TensorDecl],
                  stores: tuple[Store, ...] | list[Store], outputs: tuple[str, ...]
                  ) -> BlockProgram:
        """A program of one kernel per store, each over the store's own axes."""
        return BlockProgram(dims, tensors, tuple(Kernel.of(s) for s in stores), outputs)

    @property
    def stores(self) -> tuple[Store, ...]:
        """Every store of every kernel, in execution order."""
        return tuple(s for k in self.kernels for s in k.stores)

    @property
    def monoids(self) -> dict[str, Monoid]:
        """The definitions of every non-builtin monoid the kernels use (what a block file
        writes out, so that a program is self-contained)."""
        return monoids_used(self.stores)

    @property
    def inputs(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors.values() if t.role == "input")

    def in_kernel(self, kernel: Kernel) -> BlockProgram:
        """The program as `kernel` sees it: its own block sizes in place of the defaults."""
        if not kernel.blocks:
            return self
        dims = dict(self.dims)
        for a, b in kernel.blocks:
            dims[a] = Dim(a, dims[a].extent, b)
        return BlockProgram(dims, self.tensors, self.kernels, self.outputs)

    def blocks(self, axis: Axis) -> int:
        return self.dims[axis].blocks

    def block(self, axis: Axis) -> int:
        return self.dims[axis].block

    def extent(self, axis: Axis) -> int:
        return self.dims[axis].extent

    def padded(self, axis: Axis) -> int:
        """The elements global memory holds along `axis`: its extent, in whole blocks."""
        return self.dims[axis].padded

    def tensor_axes_dim(self, load: Load) -> Iterator[tuple[Axis, Axis]]:
        """(declared axis, use axis) pairs of a load."""
        return zip(self.tensors[load.tensor].axes, load.axes)


def validate(p: BlockProgram) -> None:
    """Check every invariant of a block program; raise IRError naming the first violation.

    Run on every program the tool produces: a bug in a rule or in extraction must never reach
    a code generator.
    """
    p.monoids  # two different monoids of one name cannot be written to one file
    for t in p.tensors.values():
        if t.role == "view":
            check_view(p.dims, p.tensors, t)
        elif t.dtype in WHOLE_DTYPES and t.role != "input":
            raise IRError(f"{t.role} '{t.name}' is {t.dtype}: only inputs hold whole numbers "
                          f"(values are computed in f32)")
    written: set[str] = set()
    for kernel in p.kernels:
        _check_blocks(p, kernel)
        _check_kernel(p.in_kernel(kernel), kernel, written)
        written.update(kernel.tensors)
    for o in p.outputs:
        if o not in written:
            raise IRError(f"output '{o}' is never stored")


def whole_inputs_as_f32(p: BlockProgram) -> BlockProgram:
    """`p` with each whole-number input, and each view of one, declared f32: how the GPU
    backends take them, their launchers converting the caller's integers."""
    if not any(t.dtype in WHOLE_DTYPES for t in p.tensors.values()):
        return p
    return replace(p, tensors={n: replace(t, dtype="f32") if t.dtype in WHOLE_DTYPES else t
                               for n, t in p.tensors.items()})


def check_view(dims: dict[str, Dim], tensors: dict[str, TensorDecl], t: TensorDecl) -> None:
    """Is view `t` a reshape of its base: the same elements, the same dtype?"""
    base = tensors.get(t.base)
    if base is None or base.role == "view":
        raise IRError(f"view '{t.name}' of '{t.base}', which is not a declared tensor")
    for a in t.axes:
        if a not in dims:
            raise IRError(f"view '{t.name}': unknown axis '{a}'")
    if any(dims[a].ragged for a in (*t.axes, *base.axes)):
        raise IRError(f"view '{t.name}' of '{t.base}' over a ragged axis")
    size = math.prod(dims[a].extent for a in t.axes)
    if size != math.prod(dims[a].extent for a in base.axes) or base.dtype != t.dtype:
        raise IRError(f"view {t.name}{list(t.axes)} : {t.dtype} is not a reshape of "
                      f"{base.name}{list(base.axes)} : {base.dtype}")


def _check_blocks(p: BlockProgram, kernel: Kernel) -> None:
    for a, b in kernel.blocks:
        if a not in p.dims:
            raise IRError(f"kernel {kernel.name}: a block size for unknown axis '{a}'")
        if b < 1 or p.extent(a) % b or p.dims[a].ragged:
            raise IRError(f"kernel {kernel.name}: block size {b} does not divide the extent "
                          f"{p.extent(a)} of '{a}'" + (" (a ragged axis keeps the program's "
                                                        "blocks)" if p.dims[a].ragged else ""))
    if len({a for a, _ in kernel.blocks}) != len(kernel.blocks):
        raise IRError(f"kernel {kernel.name}: two block sizes for one axis")


def _check_kernel(p: BlockProgram, kernel: Kernel, written: set[str]) -> None:
    if not kernel.stores:
        raise IRError("a kernel that stores nothing")
    if len(set(kernel.tensors)) != len(kernel.stores):
        raise IRError(f"kernel {kernel.name} stores one tensor twice")
    for a in kernel.grid:
        if a not in p.dims:
            raise IRError(f"kernel {kernel.name}: unknown grid axis '{a}'")
    if len(set(kernel.grid)) != len(kernel.grid):
        raise IRError(f"kernel {kernel.name}: repeated grid axis")
    for k in kernel.stores:
        if k.tensor in written:
            raise IRError(f"tensor '{k.tensor}' is stored twice")
        decl = p.tensors.get(k.tensor)
        if decl is None:
            raise IRError(f"store into undeclared tensor '{k.tensor}'")
        if decl.role in ("input", "view"):
            raise IRError(f"store into {decl.role} tensor '{k.tensor}'")
        if k.axes != decl.axes:
            raise IRError(f"store {k.tensor}{list(k.axes)} does not match its declaration "
                          f"{k.tensor}{list(decl.axes)}")
        t = type_of(k.value)
        if not isinstance(t, TileType):
            raise IRError(f"kernel {k.tensor}: cannot store a tuple")
        want = frozenset(k.axes)
        if t.shape != want or t.deps != want:
            raise IRError(f"kernel {k.tensor}: a store needs shape == deps == {sorted(want)}, "
                          f"the value has shape {sorted(t.shape)}, deps {sorted(t.deps)}")
        # An axis of one block has one block index, so needing it needs no iteration (a
        # split fold's row maximum is computed beside the head-dim-wide accumulator).
        needed = {a for a in sched_deps(k.value) - want if a not in p.dims or p.blocks(a) > 1}
        if needed:
            raise IRError(f"kernel {k.tensor}: a loop in it needs axes {sorted(needed)} that "
                          f"the kernel does not iterate over")
        if not set(kernel.grid) <= want:
            raise IRError(f"kernel {kernel.name}: grid axes {sorted(set(kernel.grid) - want)} "
                          f"are not axes of {k.tensor}")
        for n in postorder(k.value):
            if isinstance(n, Load) and n.tensor in kernel.tensors:
                raise IRError(f"kernel {kernel.name}: {k.tensor} reads '{n.tensor}', which "
                              f"the same kernel stores")
            _check_node(p, n, written, k.tensor)


def _check_node(p: BlockProgram, n: Node, written: set[str], kernel: str) -> None:
    from .show import show_node
    for a in tile_type(n).deps if isinstance(type_of(n), TileType) else ():
        if a not in p.dims:
            raise IRError(f"kernel {kernel}: unknown axis '{a}' in {show_node(n)}")
    match n:
        case Load(name, axes):
            decl = p.tensors.get(name)
            if decl is None:
                raise IRError(f"kernel {kernel}: load of undeclared tensor '{name}'")
            if len(axes) != len(decl.axes):
                raise IRError(f"kernel {kernel}: {show_node(n)} has {len(axes)} axes, "
                              f"'{name}' has {len(decl.axes)}")
            for declared, used in zip(decl.axes, axes):
                # Only extents must agree: a tensor in global memory has no blocking.
                a, b = p.dims[declared], p.dims[used]
                if a.extent != b.extent:
                    raise IRError(f"kernel {kernel}: {show_node(n)} renames '{declared}' "
                                  f"(extent {a.extent}) to '{used}' (extent {b.extent})")
            storage = p.tensors[decl.storage]  # a view reads its base's memory
            if storage.role != "input" and storage.name not in written:
                raise IRError(f"kernel {kernel}: loads '{name}' before any kernel stores it")
        case Var(name):
            raise IRError(f"kernel {kernel}: free variable '{name}'")
    kind = kind_of(n)
    for f in kind.attr_fields:
        if kind.sort_of(f) is Sort.AXIS and n.__dict__[f] not in p.dims:
            raise IRError(f"kernel {kernel}: unknown axis '{n.__dict__[f]}' in {show_node(n)}")

"""The CUDA backend: a block program becomes CUDA C for CuPy, one `__global__` per kernel.

Why it looks the way it does:

- *One thread block per grid point.*  `blockIdx.x` linearises the block indices of the kernel's
  grid axes (a kernel with no grid axes is one thread block); every loop of the schedule runs
  sequentially inside the thread block.
- *A kernel makes several stores*, each stored tensor a parameter of its own.  A store's axes
  that are not grid axes are *map loops*: a loop over the axis' blocks, with no accumulator or
  merged with sibling reductions over the same axis, whose body writes the current block of
  the store; what does not depend on the loop's axis is computed once, before it, and shared
  by every store.  Map loops nest (a store outside the grid on two axes walks both), and a
  write is emitted where the schedule places it (`plan.WritePlan`), reading the current block
  of every map loop around it.
- *Everything but the text comes from the kernel's plan* (`bbrules.plan`), the plan the cost
  model prices: its loops (merged sibling reductions share one loop carrying several
  accumulators), what is inlined, materialised, accumulated in place or resident, and every
  buffer at its offset.  The dynamic shared memory is the plan's footprint, and a kernel is
  refused exactly when the plan does not fit.
- *Every tile operation is cooperative*: the threads stride over the tile's elements, and
  `__syncthreads()` separates a step that writes shared memory from the steps that read it (and
  a read from a later overwrite of the same storage).  Nothing relies on warps executing in
  lockstep, so the same source also runs in the test emulator (`tests/cuda_emu`), which only
  has a barrier.  In-tile reductions and contractions split the reduced axis over the threads
  that have no output element of their own, so they are correct for any block size and any
  number of threads.
- *The thread count is a compile-time constant on the device* (`BB_THREADS` in
  `cuda_prelude.cuh`, the plan's launch width, which `__launch_bounds__` repeats): the strided
  loops have constant trip counts, so nvcc unrolls them and folds their index arithmetic.  The
  emulator runs the same text with the launch's thread count, so the tests still check that
  every count computes the same values.
- *Elementwise chains are not materialised* (the plan inlines them): a chain like
  `exp(S - M) / L` becomes one strided loop.  A materialised scalar is a register.  Resident
  slabs are loaded once, before the first step.
- *Monoids are data.*  Identity, combine and finalize are emitted from the monoid's expressions,
  never special-cased by name: online softmax and Welford need no code of their own.  A combine
  must read the *old* state of every component, so components are updated in groups of equal
  shape (one thread updates every component of one element) ordered so that a group reading
  another group's old state runs first; if no such order exists, through temporaries (the
  plan's `Accumulation.groups`).  An accumulator that only its own combine reads inside the
  loop stays in registers while the loop runs (each thread owns the same elements every
  iteration) and is stored to its shared-memory buffer once, after the loop
  (`_register_states`).
- *Tiles are copied from global memory 16 bytes at a time* where their rows along the
  tensor's contiguous axis are whole, aligned vectors (`_vector_width`), element by element
  otherwise; the launcher passes every tensor 16-byte aligned.
- *Values are f32 in registers and shared memory*; f16/bf16 tensors are converted on load and
  store by the hardware's conversion instructions (no CUDA headers; the emulator rounds the
  same way in portable bit arithmetic), and 16-bit tiles stay 16-bit in shared memory.
"""

from __future__ import annotations

import inspect
import math
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bbrules.errors import UsageError
from bbrules.ir import (ELEMENTWISE_KINDS, BlockProgram, BlockReduce, Const, Dot, Get, IRError,
                        KindTable, Load, Node, Pos, Reduce, Tuple, Unary, Var, Where, children,
                        is_elementwise, operator, postorder, validate, whole_inputs_as_f32)
from bbrules.masking import CAlgebra, may_hold
from bbrules.ops import BINARY, TILE_REDUCE
from bbrules.plan import (MAX_THREADS, Accumulation, BlockIndex, Buffer, KernelPlan, LoopPlan,
                          MicroTile, Op, Value, WritePlan, plan_for)
from bbrules.targets import Target, get_target

__all__ = ["MAX_THREADS", "CompileError", "CudaModule", "KernelInfo", "compile_check",
           "from_storage", "generate", "to_storage"]


# --------------------------------------------------------------------------------------------
# Storage formats of global tensors


@dataclass(frozen=True)
class _Format:
    ctype: str  # element type of the global array
    to_float: str  # C expression template reading one element as float
    from_float: str  # C expression template converting a float to the element type
    itemsize: int


FORMATS: dict[str, _Format] = {
    "f32": _Format("float", "{}", "{}", 4),
    "f16": _Format("unsigned short", "bb_h2f({})", "bb_f2h({})", 2),
    "bf16": _Format("unsigned short", "bb_b2f({})", "bb_f2b({})", 2),
}

# Definitions every generated source starts with (BB_THREADS, the 16-bit converters, the
# vector loads), kept as a C++ file of their own so that both of their branches, device and
# emulator, read as code.
PRELUDE = Path(__file__).with_name("cuda_prelude.cuh")

# Accumulator elements one thread may keep in registers across a reduction loop (with the
# 16 of a 4 x 4 contraction micro-tile and its operands, well under the 255 registers a thread
# can have at 256 threads per block, so that nothing spills).
STATE_REGISTERS = 32


def to_storage(x, dtype: str, xp=np):
    """An array as the kernels store a tensor of `dtype`: f32, f16, or bf16 bits in uint16.

    `xp` is numpy or cupy; bf16 rounds to nearest even, as the kernels' `bb_f2b` does.
    """
    if dtype == "f32":
        return xp.ascontiguousarray(xp.asarray(x, dtype=xp.float32))
    if dtype == "f16":
        return xp.ascontiguousarray(xp.asarray(x, dtype=xp.float16))
    u = xp.ascontiguousarray(xp.asarray(x, dtype=xp.float32)).view(xp.uint32)
    rounded = (u + xp.uint32(0x7FFF) + ((u >> 16) & xp.uint32(1))) >> 16
    quiet_nan = (u >> 16) | xp.uint32(0x40)
    nan = (u & xp.uint32(0x7FFFFFFF)) > xp.uint32(0x7F800000)
    return xp.where(nan, quiet_nan, rounded).astype(xp.uint16)


def from_storage(x, dtype: str, xp=np):
    """The float32 values of an array stored as `dtype` (the inverse of `to_storage`)."""
    if dtype == "f32":
        return x
    if dtype == "f16":
        return x.astype(xp.float32)
    return (x.astype(xp.uint32) << 16).view(xp.float32)


# --------------------------------------------------------------------------------------------
# The result


@dataclass(frozen=True)
class KernelInfo:
    """One `__global__` function and how to launch it."""

    name: str
    tensors: tuple[str, ...]  # the tensors it stores, in store order
    grid: int  # thread blocks: one per grid point
    threads: int  # threads per block: the count the kernel is compiled for
    shared_bytes: int  # dynamic shared memory per block
    params: tuple[str, ...]  # tensors passed, in argument order (the stored ones first)
    signature: tuple[str, ...]  # the C type of each parameter


@dataclass(frozen=True)
class TensorInfo:
    """A tensor in device memory: `shape` in whole blocks (padded along ragged axes), of
    which the program's tensor is the leading `extent`."""

    shape: tuple[int, ...]
    dtype: str
    role: str
    extent: tuple[int, ...]

    def padding(self) -> list[tuple[int, int]]:
        return [(0, p - n) for n, p in zip(self.extent, self.shape)]


@dataclass(frozen=True)
class CudaModule:
    """CUDA C source, a CuPy launcher for it (Python source), and what the launcher knows."""

    source: str
    launcher: str
    kernels: tuple[KernelInfo, ...]
    tensors: dict[str, TensorInfo]
    outputs: tuple[str, ...]

    @property
    def inputs(self) -> tuple[str, ...]:
        return tuple(n for n, t in self.tensors.items() if t.role == "input")

    def runner(self) -> Callable[..., dict]:
        """The launcher's `run(**inputs)` (needs CuPy and a GPU)."""
        namespace: dict = {}
        exec(compile(self.launcher, "<bbrules cuda launcher>", "exec"), namespace)
        return namespace["run"]


def generate(p: BlockProgram, target: Target | str | None = None) -> CudaModule:
    """CUDA C for every kernel of `p`, refusing kernels whose tiles exceed `target`'s shared
    memory (default: the H100's 227 KiB)."""
    validate(p)
    p = whole_inputs_as_f32(p)
    if target is None or isinstance(target, str):
        target = get_target(target or "h100")
    kernels, bodies = [], []
    for i, kernel in enumerate(p.kernels):
        plan = plan_for(p, kernel, target.local_capacity)
        if not plan.fits:
            raise UsageError(
                f"kernel {kernel.name}: its tiles need {plan.footprint} bytes of shared "
                f"memory, more than the {target.local_capacity} a thread block has on "
                f"{target.name}; choose smaller blocks or a less fused program")
        gen = _KernelGen(p.in_kernel(kernel), plan, f"k{i}_{_c_name(kernel.name)}")
        info, body = gen.emit()
        kernels.append(info)
        bodies.append(body)
    prelude = [f"// Generated by bbrules: {len(kernels)} kernel(s), launched in order.",
               PRELUDE.read_text()]
    source = "\n".join(prelude + bodies)
    tensors = {t.name: TensorInfo(tuple(p.padded(a) for a in t.axes), t.dtype, t.role,
                                  tuple(p.extent(a) for a in t.axes))
               for t in p.tensors.values() if t.role != "view"}  # a view is its base's memory
    kernels_t = tuple(kernels)
    return CudaModule(source, _launcher(source, kernels_t, tensors, p.outputs), kernels_t,
                      tensors, p.outputs)


def _c_name(name: str) -> str:
    return re.sub(r"\W", "_", name)


def _literal(v: float) -> str:
    v32 = float(np.float32(v))
    if math.isnan(v32):
        return "BB_NAN"
    if math.isinf(v32):
        return "BB_INF" if v32 > 0 else "(-BB_INF)"
    s = repr(v32)
    if "." not in s and "e" not in s:
        s += ".0"
    return f"({s}f)" if v32 < 0 else f"{s}f"


# --------------------------------------------------------------------------------------------
# One kernel: its plan (`bbrules.plan`) says what is computed where, what is materialised, and
# every buffer's offset; this writes the text.


class _Writer:
    """Indented C text."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.depth = 1

    def __call__(self, line: str) -> None:
        self.lines.append("    " * self.depth + line)

    @contextmanager
    def block(self, head: str, brace: bool = True) -> Iterator[None]:
        self(head + " {" if brace else head)
        self.depth += 1
        yield
        self.depth -= 1
        self("}")


@dataclass
class _Elem:
    """The body of a loop over tile elements: coordinate variables and computed temporaries."""

    w: _Writer
    coords: dict[str, str]
    memo: dict[Value, str] = field(default_factory=dict)


_IDENTITY = {"sum": "0.0f", "max": "(-BB_INF)", "min": "BB_INF"}


class _Reader:
    """What `EXPR` needs to write one node's expression: its operands' code, a monoid
    variable's, a loaded element's, a reduction result's."""

    def __init__(self, child: Callable[[int], str] = None, var: Callable[[str], str] = None,
                 element: Callable[[], str] = None):
        self.child, self.var, self.element = child, var, element


# The C expression of one node's operation on its operands: a value computed inline (or
# materialised), or a monoid's identity, combine or finalize.
EXPR = KindTable("cuda expression", exempt={
    BlockReduce: "a contraction is a step of its own (_contract), never an expression",
    Dot: "a contraction is a step of its own (_contract), never an expression",
    Tuple: "tuples are never read as a tile; their components are"})


@EXPR.on(Const)
def _(n: Const, r: _Reader) -> str:
    return _literal(n.value)


@EXPR.on(Var)
def _(n: Var, r: _Reader) -> str:
    return r.var(n.name)


@EXPR.on(*ELEMENTWISE_KINDS)
def _(n: Node, r: _Reader) -> str:
    operands = "xyz"[:len(children(n))]
    return operator(n).cuda.format(**{v: r.child(i) for i, v in enumerate(operands)})


@EXPR.on(Load, Pos, Get, Reduce)
def _(n: Node, r: _Reader) -> str:
    return r.element()


class _KernelGen:
    """The text of one kernel from its plan."""

    def __init__(self, p: BlockProgram, plan: KernelPlan, name: str):
        self.p = p
        self.plan = plan
        self.kernel = plan.kernel
        self.name = name
        self.counter = 0  # for fresh C names
        self.regs: dict[Value, str] = {}  # register values: their C names
        self.state_regs: dict[Buffer, str] = {}  # accumulators kept in registers: their arrays
        self.dirty = False  # while emitting: has a register step or a write read shared
        # memory since the last barrier?
        self.known: dict[Node, float] = {}  # predicates true on every element of the block
        self.grid_vars = {a: f"bb_g_{_c_name(a)}" for a in plan.grid}

    def _block_var(self, b: BlockIndex, axis: str) -> str:
        if b == "grid":
            return self.grid_vars[axis]
        return "0" if b is None else f"bb_b{b}"

    # -- text

    def emit(self) -> tuple[KernelInfo, str]:
        stored = self.kernel.tensors
        params = list(stored) + list(dict.fromkeys(
            self.p.tensors[x.node.tensor].storage for x in self.plan.values
            if x.kind == "load"))
        signature = []
        for t in params:
            fmt = FORMATS[self.p.tensors[t].dtype]
            signature.append(fmt.ctype + "*" if t in stored
                             else f"const {fmt.ctype}*")
        w = _Writer()
        w("const int bb_tid = threadIdx.x;")
        w(f"const int bb_nthr = BB_THREADS({self.plan.threads});")
        if self.plan.footprint:
            w("extern __shared__ float bb_smem[];")
        if any(b.itemsize == 2 for b in self.plan.buffers):
            w("unsigned short* bb_smem16 = reinterpret_cast<unsigned short*>(bb_smem);")
        self._decode_grid(w)
        self._resident(w)
        self._ops(w, self.plan.body)
        args = ", ".join(f"{ct} __restrict__ g_{_c_name(t)}" for t, ct in zip(params, signature))
        text = "\n".join([f'extern "C" __global__ void __launch_bounds__({self.plan.threads}) '
                          f"{self.name}({args}) {{", *w.lines, "}", ""])
        grid = math.prod(self.p.blocks(a) for a in self.plan.grid)
        info = KernelInfo(self.name, stored, grid, self.plan.threads,
                          self.plan.footprint, tuple(params), tuple(signature))
        return info, text

    def _decode_grid(self, w: _Writer) -> None:
        axes = tuple(a for a in self.plan.grid if self.p.blocks(a) > 1)
        for a in self.plan.grid:
            if self.p.blocks(a) == 1:
                w(f"const int {self.grid_vars[a]} = 0;")
        if len(axes) == 1:
            w(f"const int {self.grid_vars[axes[0]]} = blockIdx.x;")
            return
        if axes:
            w("int bb_rest = blockIdx.x;")
        for i, a in enumerate(reversed(axes)):
            if i == len(axes) - 1:
                w(f"const int {self.grid_vars[a]} = bb_rest;")
            else:
                w(f"const int {self.grid_vars[a]} = bb_rest % {self.p.blocks(a)};")
                w(f"bb_rest /= {self.p.blocks(a)};")

    def _fresh(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def _barrier(self, w: _Writer) -> None:
        w("__syncthreads();")
        self.dirty = False

    def _before_write(self, w: _Writer) -> None:
        """A register step or a write may still be reading storage that this step overwrites:
        wait for it."""
        if self.dirty:
            self._barrier(w)

    def _ops(self, w: _Writer, ops: list[Op]) -> None:
        for op in ops:
            if isinstance(op, LoopPlan):
                self._loop_text(w, op)
            elif isinstance(op, WritePlan):
                self._write(w, op)
            elif op.mode == "register":
                self.regs[op] = self._fresh("r")
                e = _Elem(w, {})
                w(f"const float {self.regs[op]} = {self._compute(op, e)};")
                self.dirty = True
            elif op.kind in ("breduce", "dot"):
                self._contract(w, op)
            elif op.mode == "local" and op.node not in self.known:
                self._before_write(w)
                if op.kind == "load" and (n := self._vector_width(op)) > 1:
                    self._copy_vectors(w, op, n)
                else:
                    self._each(w, op.buffer.order, lambda e, x=op: self._materialise(x, e))
                self._barrier(w)

    def _materialise(self, x: Value, e: _Elem) -> None:
        if x.buffer.itemsize == 2:
            e.w(f"{self._at(x.buffer, e.coords)} = {self._global(x, e.coords)};")
        else:
            e.w(f"{self._at(x.buffer, e.coords)} = {self._compute(x, e)};")

    def _vector_width(self, x: Value) -> int:
        """Elements per 16-byte global load in the copy of load `x`'s tile, or 1 (scalar loads).

        Vectors run along the tensor's contiguous last axis: the tile's rows along it must be
        whole vectors, and every other axis' stride a whole number of vectors, so that each
        vector starts 16-byte aligned once the tensor's base pointer is.
        """
        load = x.node
        decl = self.p.tensors[load.tensor]
        n = 16 // decl.itemsize
        extents = [self.p.padded(a) for a in decl.axes]
        strides = [math.prod(extents[j + 1:]) for j in range(len(extents))]
        if not load.axes or set(x.buffer.order) != set(load.axes) \
                or self.p.block(load.axes[-1]) % n or any(s % n for s in strides[:-1]):
            return 1
        return n

    def _copy_vectors(self, w: _Writer, x: Value, n: int) -> None:
        """Copy load `x`'s tile into shared memory, each thread taking `n` consecutive elements
        along the tensor's last axis with one 16-byte load (`_vector_width`).

        The launcher passes every tensor 16-byte aligned (`_aligned`).  The kernel does not
        test it: a branch on a kernel argument is loop-invariant, and nvcc unswitches the key
        loop of fused attention on it, doubling its body and its registers.
        """
        load, buf = x.node, x.buffer
        last = load.axes[-1]
        fmt = FORMATS[self.p.tensors[load.tensor].dtype]
        pointer = f"g_{_c_name(self.p.tensors[load.tensor].storage)}"
        blocks = {a: self._block_var(b, a) for a, b in x.blocks.items()}
        sizes = tuple(self.p.block(a) // (n if a == last else 1) for a in buf.order)
        vector = "bb_f32x4" if fmt.itemsize == 4 else "bb_u16x8"
        with self._strided(w, math.prod(sizes), "bb_i"):
            coords = self._decode(w, buf.order, "bb_i", sizes)  # the vector along `last`
            first = f"{coords[last]} * {n}"
            offset = self._global_offset(load.tensor, load.axes, blocks, {**coords, last: first})
            w(f"const {vector} bb_v = bb_load_{vector[3:]}(&{pointer}[{offset}]);")
            for j in range(n):
                element = f"bb_v.v[{j}]"
                value = element if buf.itemsize == 2 else fmt.to_float.format(element)
                at = self._at(buf, {**coords, last: f"{first} + {j}" if j else first})
                w(f"{at} = {value};")

    @contextmanager
    def _strided(self, w: _Writer, size: int | str, var: str,
                 unroll: bool = False) -> Iterator[None]:
        """The threads' loop over `size` items; the body reads its item as `var`.

        Thread t takes items t, t + bb_nthr, ...: neighbouring threads touch neighbouring
        elements.  On the device `bb_nthr` is a constant (`BB_THREADS`), so the trip count is
        one too: nvcc unrolls the loop, folds each trip's index arithmetic, and drops the bound
        test where the threads divide `size`.  The emulator runs the same text at any width.
        `unroll` makes the unrolling certain (a register array indexed by the trip count
        `bb_r` is only registers when every index is a constant).
        """
        if unroll:
            w("BB_UNROLL")
        with w.block(f"for (int bb_r = 0; bb_r < ({size} + bb_nthr - 1) / bb_nthr; ++bb_r)"):
            w(f"const int {var} = bb_tid + bb_r * bb_nthr;")
            with w.block(f"if ({size} % bb_nthr == 0 || {var} < {size})"):
                yield

    def _each(self, w: _Writer, order: tuple[str, ...], body: Callable[[_Elem], None],
              unroll: bool = False) -> None:
        """A strided loop of the threads over the elements of a tile with axes `order`."""
        with self._strided(w, math.prod(self.p.block(a) for a in order), "bb_i", unroll):
            body(_Elem(w, self._decode(w, order, "bb_i")))

    def _decode(self, w: _Writer, order: tuple[str, ...], var: str,
                sizes: tuple[int, ...] | None = None) -> dict[str, str]:
        """Coordinates of element `var` of a tile with axes `order` (of `sizes`, blocks by
        default), row-major."""
        coords = {}
        sizes = [self.p.block(a) for a in order] if sizes is None else list(sizes)
        for j, a in enumerate(order):
            inner = math.prod(sizes[j + 1:])
            expr = var if inner == 1 else f"{var} / {inner}"
            if sizes[j] == 1:
                expr = "0"
            elif j > 0:
                expr = f"({expr}) % {sizes[j]}"
            name = f"e_{_c_name(a)}"
            w(f"const int {name} = {expr};")
            coords[a] = name
        return coords

    def _at(self, buf: Buffer, coords: dict[str, str]) -> str:
        index = " + ".join(coords[a] if stride == 1 else f"{coords[a]} * {stride}"
                           for a, stride in zip(buf.order, buf.strides)) or "0"
        if buf.itemsize == 2:
            return f"bb_smem16[{buf.offset // 2} + {index}]"
        return f"bb_smem[{buf.offset // 4} + {index}]"

    def _global_offset(self, tensor: str, axes: tuple[str, ...], blocks: dict[str, str],
                       coords: dict[str, str]) -> str:
        decl = self.p.tensors[tensor]
        extents = [self.p.padded(a) for a in decl.axes]
        wide = "(long long)" if math.prod(extents) >= 2**31 else ""  # offsets past int range
        terms = []
        for j, a in enumerate(axes):
            stride = math.prod(extents[j + 1:])
            pos = coords[a] if blocks[a] == "0" else \
                f"{blocks[a]} * {self.p.block(a)} + {coords[a]}"
            terms.append(pos if stride == 1 else f"{wide}({pos}) * {stride}")
        return " + ".join(terms) or "0"

    def _global(self, x: Value, coords: dict[str, str]) -> str:
        load = x.node
        blocks = {a: self._block_var(b, a) for a, b in x.blocks.items()}
        offset = self._global_offset(load.tensor, load.axes, blocks, coords)
        return f"g_{_c_name(self.p.tensors[load.tensor].storage)}[{offset}]"

    def _local(self, x: Value, coords: dict[str, str]) -> str:
        """Element `coords` of a value held in local memory, as a float."""
        buf = x.buffer
        if x.mode == "resident":  # the slab spans every block of the non-grid axes
            coords = {a: coords[a] if x.blocks[a] in ("grid", None) else
                      f"({self._block_var(x.blocks[a], a)} * {self.p.block(a)} + {coords[a]})"
                      for a in x.node.axes}
        at = self._at(buf, coords)
        if buf.itemsize == 2:
            return FORMATS[self.p.tensors[x.node.tensor].dtype].to_float.format(at)
        return at

    def _resident(self, w: _Writer) -> None:
        """Load every resident slab once, before anything reads it."""
        slabs = [v for v in self.plan.values if v.mode == "resident"]
        done: set[int] = set()
        for v in slabs:
            buf = v.buffer
            if id(buf) in done:
                continue
            done.add(id(buf))
            load = v.node
            blocks = {a: self.grid_vars[a] if a in self.grid_vars else "0" for a in load.axes}
            size = buf.elements if not buf.order else math.prod(buf.sizes)
            with self._strided(w, size, "bb_i"):
                coords = self._decode(w, buf.order, "bb_i", buf.sizes)
                offset = self._global_offset(load.tensor, load.axes, blocks, coords)
                value = f"g_{_c_name(self.p.tensors[load.tensor].storage)}[{offset}]"
                if buf.itemsize == 4:
                    value = FORMATS[self.p.tensors[load.tensor].dtype].to_float.format(value)
                w(f"{self._at(buf, coords)} = {value};")
        if done:
            self._barrier(w)

    def _val(self, x: Value, e: _Elem) -> str:
        """An expression for element `e.coords` of `x`, emitting temporaries into `e`.

        Every inline value under `x` not yet in `e` gets its temporary first, operands before
        the values that use them (an explicit stack), so `_compute` only ever reads operands
        that are named already: the nesting of the C code does not follow the expression's.
        """
        if x.kind == "const":
            return _literal(x.node.value)
        if x.node in self.known:
            return _literal(self.known[x.node])
        if x.mode in ("local", "resident"):
            return self._local(x, e.coords)
        if x.mode == "register":
            return self.regs[x]
        stack = [(x, False)]
        while stack:
            v, ready = stack.pop()
            if v in e.memo:
                continue
            if ready:
                name = self._fresh("v")
                e.w(f"const float {name} = {self._compute(v, e)};")
                e.memo[v] = name
                continue
            stack.append((v, True))
            if v.kind not in ("result", "get", "load"):
                args = v.args
                if isinstance(v.node, Where) and v.node.c in self.known:  # one branch read
                    args = (args[1] if self.known[v.node.c] else args[2],)
                stack.extend((a, False) for a in reversed(args) if a.kind != "const"
                             and a.node not in self.known
                             and a.mode not in ("local", "resident", "register"))
        return e.memo[x]

    def _compute(self, x: Value, e: _Elem) -> str:
        """The expression of `x`'s own operation on its (possibly materialised) operands."""
        if x.kind in ("result", "get"):
            i = x.node.index if x.kind == "get" else 0
            return self._finalize(x.acc, i, e)
        if isinstance(x.node, Where) and x.node.c in self.known:  # the mask of a whole block
            return self._val(x.args[1] if self.known[x.node.c] else x.args[2], e)
        return EXPR(x.node, _Reader(child=lambda i: self._val(x.args[i], e),
                                    element=lambda: self._load_element(x, e)))

    def _load_element(self, x: Value, e: _Elem) -> str:
        if x.kind == "pos":
            a = x.node.axis
            block = self._block_var(x.blocks[a], a)
            at = e.coords[a] if block == "0" else f"{block} * {self.p.block(a)} + {e.coords[a]}"
            return f"(float)({at})"
        dtype = self.p.tensors[x.node.tensor].dtype
        return FORMATS[dtype].to_float.format(self._global(x, e.coords))

    def _finalize(self, acc: Accumulation, i: int, e: _Elem) -> str:
        env = {c: (lambda b=b: self._at(b, e.coords)) for c, b in zip(acc.monoid.state, acc.states)}
        return self._expr(acc.monoid.finalize[i], env)

    def _expr(self, root: Node, env: dict[str, Callable[[], str]]) -> str:
        """A monoid expression (elementwise over Vars) as C, built bottom-up."""
        text: dict[Node, str] = {}
        for n in postorder(root):
            if not (isinstance(n, (Var, Const)) or is_elementwise(n)):
                raise IRError(f"monoid expressions must be elementwise, found {n!r}")
            kids = children(n)
            text[n] = EXPR(n, _Reader(child=lambda i: text[kids[i]],
                                      var=lambda name: env[name]()))
        return text[root]

    def _contract(self, w: _Writer, x: Value) -> None:
        """An in-tile reduction or a contraction, the reduced axis split over spare threads.

        With more threads than output elements, `bb_p` threads share each output element: each
        folds every `bb_p`-th element of the reduced axis, and one of them folds the partial
        results.  The split is capped by the scratch space, so any thread count is correct; on
        the device, where the thread count is a constant, so is `bb_p`, and nvcc keeps one path.
        """
        axis = x.node.axis
        k = self.p.block(axis)
        n_out = math.prod(self.p.block(a) for a in x.shape)
        kvar = f"e_{_c_name(axis)}"
        if x.kind == "dot":
            fold, ident = BINARY["add"].cuda, "0.0f"
        else:
            fold, ident = TILE_REDUCE[x.node.op].cuda, _IDENTITY[x.node.op]
        out = x.buffer if x.into is None else x.into[0].states[x.into[1]]

        def write(coords: dict[str, str]) -> None:
            target = self._at(out, coords)
            w(f"{target} = {fold.format(x=target, y='bb_acc') if x.into else 'bb_acc'};")

        def partial(part: str, parts: str) -> dict[str, str]:
            """Fold one share of the reduced axis into bb_acc; the output coordinates."""
            coords = self._decode(w, x.order, "bb_o")
            w(f"float bb_acc = {ident};")
            with w.block(f"for (int {kvar} = {part}; {kvar} < {k}; {kvar} += {parts})"):
                e = _Elem(w, {**coords, axis: kvar})
                term = self._val(x.args[0], e)
                if x.kind == "dot":
                    term = f"{term} * {self._val(x.args[1], e)}"
                w(f"bb_acc = {fold.format(x='bb_acc', y=term)};")
            return coords

        self._before_write(w)
        scratch = x.scratch
        if x.micro is not None:  # the plan's register micro-tile (`plan.micro_tile`)
            self._dot_tiled(w, x, out, x.micro)
            self._barrier(w)
            return
        if scratch is None:
            with self._strided(w, n_out, "bb_o"):
                write(partial("0", "1"))
            self._barrier(w)
            return
        cap, base = scratch.elements // n_out, scratch.offset // 4
        with w.block("{", brace=False):
            w(f"int bb_p = bb_nthr / {n_out};")
            w(f"bb_p = bb_p < {min(k, cap)} ? bb_p : {min(k, cap)};")
            w("bb_p = bb_p > 0 ? bb_p : 1;")
            with self._strided(w, f"{n_out} * bb_p", "bb_i"):
                if n_out > 1:
                    w("const int bb_o = bb_i / bb_p;")
                coords = partial("bb_i % bb_p", "bb_p")
                with w.block("if (bb_p == 1)"):
                    write(coords)
                with w.block("else"):
                    w(f"bb_smem[{base} + bb_i] = bb_acc;")
            with w.block("if (bb_p > 1)"):
                w("__syncthreads();")
                with self._strided(w, n_out, "bb_o"):
                    w(f"float bb_acc = bb_smem[{base} + bb_o * bb_p];")
                    with w.block("for (int bb_j = 1; bb_j < bb_p; ++bb_j)"):
                        part = f"bb_smem[{base} + bb_o * bb_p + bb_j]"
                        w(f"bb_acc = {fold.format(x='bb_acc', y=part)};")
                    write(self._decode(w, x.order, "bb_o"))
        self._barrier(w)

    def _dot_tiled(self, w: _Writer, x: Value, out: Buffer, micro: MicroTile) -> None:
        """A dot in which every thread accumulates a ri x rj micro-tile in registers.

        A thread's outputs are interleaved (i + r * blocks/ri), so neighbouring threads still
        read neighbouring elements.
        """
        ri, rj = micro.ri, micro.rj
        order, axis = x.order, x.node.axis
        i_ax, j_ax = micro.i, micro.j
        steps = {a: self.p.block(a) // (ri if a == i_ax else rj if a == j_ax else 1)
                 for a in order}
        n_tiles = math.prod(steps.values())
        kvar = f"e_{_c_name(axis)}"
        with self._strided(w, n_tiles, "bb_t"):
            base: dict[str, str] = {}
            for j, a in enumerate(order):
                inner = math.prod(steps[b] for b in order[j + 1:])
                expr = "bb_t" if inner == 1 else f"bb_t / {inner}"
                if j > 0:
                    expr = f"({expr}) % {steps[a]}"
                base[a] = "0" if steps[a] == 1 else expr
            for a in order:
                if a not in (i_ax, j_ax):
                    w(f"const int e_{_c_name(a)} = {base[a]};")
            cells = [(p, q) for p in range(ri) for q in range(rj)]

            def coords(p: int, q: int) -> dict[str, str]:
                c = {a: f"e_{_c_name(a)}" for a in order if a not in (i_ax, j_ax)}
                if i_ax is not None:
                    c[i_ax] = f"e_{_c_name(i_ax)}_{p}"
                c[j_ax] = f"e_{_c_name(j_ax)}_{q}"
                return c

            for r in range(ri if i_ax is not None else 0):
                w(f"const int e_{_c_name(i_ax)}_{r} = {base[i_ax]} + {r * steps[i_ax]};")
            for r in range(rj):
                w(f"const int e_{_c_name(j_ax)}_{r} = {base[j_ax]} + {r * steps[j_ax]};")
            for p, q in cells:
                w(f"float bb_acc_{p}_{q} = 0.0f;")
            with w.block(f"for (int {kvar} = 0; {kvar} < {self.p.block(axis)}; ++{kvar})"):
                for p, q in cells:
                    e = _Elem(w, {**coords(p, q), axis: kvar})
                    product = f"{self._val(x.args[0], e)} * {self._val(x.args[1], e)}"
                    w(f"bb_acc_{p}_{q} += {product};")
            for p, q in cells:
                target = self._at(out, coords(p, q))
                value = f"{target} + bb_acc_{p}_{q}" if x.into else f"bb_acc_{p}_{q}"
                w(f"{target} = {value};")

    def _loop_text(self, w: _Writer, op: LoopPlan) -> None:
        inits = [(ident, buf) for red in op.accs
                 for c, (ident, buf) in enumerate(zip(red.monoid.identity, red.states))
                 if c not in red.aliases]
        in_regs = self._register_states(op) if self._has_work(op) else []
        shared = [(ident, buf) for ident, buf in inits if buf not in in_regs]
        for ident, buf in inits:
            if buf in in_regs:
                name = self.state_regs[buf] = self._fresh("bb_s")
                size = math.prod(self.p.block(a) for a in buf.order)  # as `_each` counts
                w(f"float {name}[BB_PER_THREAD({size}, {self.plan.threads})];")
                with self._strided(w, size, "bb_i", unroll=True):
                    w(f"{name}[bb_r] = {self._expr(ident, {})};")
        if shared:
            self._before_write(w)
            for ident, buf in shared:
                self._each(w, buf.order, lambda e, b=buf, i=ident: e.w(
                    f"{self._at(b, e.coords)} = {self._expr(i, {})};"))
            self._barrier(w)
        if not self._has_work(op):
            return
        with w.block(f"for (int bb_b{op.id} = 0; bb_b{op.id} < {op.trips}; "
                     f"++bb_b{op.id})"):
            if op.skip is not None:
                w(f"if (!{self._may_hold(op, op.skip)}) continue;  // every element masked")
            if not op.masks_cut_blocks_only:
                self._loop_body(w, op)
            else:
                # A block the predicate holds on everywhere runs the body without the mask.
                # The test is the same for every thread, so each branch's barriers are uniform.
                before, outer = self.dirty, self.known
                with w.block(f"if (!{self._may_hold(op, Unary('not', op.skip))})"):
                    self.known = {**outer, op.skip: 1.0}
                    self._loop_body(w, op)
                    self.known, whole = outer, self.dirty
                self.dirty = before
                with w.block("else"):
                    self._loop_body(w, op)
                self.dirty = self.dirty or whole
        if in_regs:  # what reads the reduction's results reads shared memory
            self._before_write(w)
            for buf in in_regs:
                self._each(w, buf.order, lambda e, b=buf: e.w(
                    f"{self._at(b, e.coords)} = {self._state(b, e.coords)};"), unroll=True)
            self._barrier(w)

    def _loop_body(self, w: _Writer, op: LoopPlan) -> None:
        self._ops(w, op.body)
        for red in op.accs:
            self._combine(w, red)
        if self.dirty:
            self._barrier(w)

    def _register_states(self, op: LoopPlan) -> list[Buffer]:
        """The accumulators of `op` to keep in registers while it runs.

        A component qualifies when, inside the loop, only its own combine reads it: that step
        visits its elements with the same threads every iteration (`_strided`), so each thread
        keeps the elements it owns in registers (a fully unrolled array) instead of a
        read-modify-write of shared memory per iteration, and stores them once, after the loop,
        for whatever reads the reduction's results.  A component another group's combine reads
        (as the output of an online softmax reads the running maximum) is read at other
        elements, one a contraction adds into in place or that a tile holds is not the
        combine's own, and temporaries (`via_tmp`) are shared memory; those stay where they are.
        At most `STATE_REGISTERS` values per thread are taken, first come first served.
        """
        out, taken = [], 0
        for red in op.accs:
            if red.via_tmp:
                continue
            m = red.monoid
            for group in red.groups:
                for c in group:
                    buf = red.states[c]
                    reads = {f"a.{m.state[c]}"}
                    others = [m.combine[o] for g in red.groups if g is not group for o in g]
                    size = math.prod(self.p.block(a) for a in buf.order)
                    per_thread = -(-size // self.plan.threads)
                    if c in red.in_place or c in red.aliases \
                            or buf.order != red.states[group[0]].order \
                            or any(isinstance(n, Var) and n.name in reads
                                   for e in others for n in postorder(e)) \
                            or taken + per_thread > STATE_REGISTERS:
                        continue
                    out.append(buf)
                    taken += per_thread
        return out

    def _state(self, buf: Buffer, coords: dict[str, str]) -> str:
        """Element `coords` of an accumulator: its slot in this thread's registers inside a
        strided loop over the accumulator's elements, or its place in shared memory."""
        if buf in self.state_regs:
            return f"{self.state_regs[buf]}[bb_r]"
        return self._at(buf, coords)

    def _may_hold(self, op: LoopPlan, p: Node) -> str:
        """C for: may `p` (over the positions the loop's skip predicate reads) hold anywhere on
        the current block?  The same test for every thread of the block, so skipping keeps
        barriers uniform."""
        bounds = {}
        for a, b in op.skip_blocks.items():
            start = f"(float)({self._block_var(b, a)} * {self.p.block(a)})"
            bounds[a] = (start, f"({start} + {float(self.p.block(a) - 1)!r}f)")
        return may_hold(p, bounds, CAlgebra())

    def _has_work(self, op: LoopPlan) -> bool:
        """Does the loop's body do anything (a one-trip loop over aliased tiles does not)?"""
        return any(len(red.in_place) < red.monoid.arity for red in op.accs) or any(
            isinstance(o, (LoopPlan, WritePlan)) or o.mode in ("local", "register", "accumulate")
            for o in op.body)

    def _combine(self, w: _Writer, red: Accumulation) -> None:
        """Fold one iteration's contributions into a reduction's state, group by group (see
        `_phases`), or through temporaries when the groups cannot be ordered; first the
        factors that the combine of a larger component reads from smaller ones (the plan's
        `Accumulation.factors`: the online softmax's rescale once per row, not per element)."""
        m = red.monoid
        targets = red.tmps if red.via_tmp else red.states
        combines, factors = red.combines, red.factors

        def env_of(e: _Elem) -> dict[str, Callable[[], str]]:
            env: dict[str, Callable[[], str]] = {}
            for j, (c, buf) in enumerate(zip(m.state, red.states)):
                env[f"a.{c}"] = lambda b=buf: self._state(b, e.coords)
                env[f"b.{c}"] = lambda x=red.contribs[j]: self._val(x, e)
            for k, (_, buf) in enumerate(factors):
                env[f"f.{k}"] = lambda b=buf: self._at(b, e.coords)
            return env

        if factors:
            self._before_write(w)
            for n, buf in factors:  # iterated as the state of its shape, in registers or not
                state = next(b for b in red.states if b.order == buf.order)
                self._each(w, buf.order, lambda e, n=n, buf=buf: e.w(
                    f"{self._at(buf, e.coords)} = {self._expr(n, env_of(e))};"),
                    unroll=state in self.state_regs)
            self._barrier(w)
        for g in red.groups:
            comps = [c for c in g if c not in red.in_place]
            if not comps:
                continue
            in_regs = all(targets[c] in self.state_regs for c in comps)
            if not in_regs:
                self._before_write(w)

            def update(e: _Elem, comps: list[int] = comps) -> None:
                env = env_of(e)
                news = []
                for c in comps:
                    news.append(self._fresh("bb_n"))
                    e.w(f"const float {news[-1]} = {self._expr(combines[c], env)};")
                for c, new in zip(comps, news):
                    e.w(f"{self._state(targets[c], e.coords)} = {new};")

            self._each(w, red.states[comps[0]].order, update,
                       unroll=any(red.states[c] in self.state_regs for c in comps))
            if in_regs:  # it only read shared memory: a later write waits for it
                self.dirty = True
            else:
                self._barrier(w)
        if red.via_tmp:
            for tmp, state in zip(red.tmps, red.states):
                self._each(w, state.order, lambda e, t=tmp, s=state:
                           e.w(f"{self._at(s, e.coords)} = {self._at(t, e.coords)};"))
            self._barrier(w)

    def _write(self, w: _Writer, op: WritePlan) -> None:
        """Store the current block of `op.store`: the grid's block, each enclosing map loop's.

        It only reads shared memory, so the next step that overwrites any of it (the next
        iteration of a map loop, a later buffer placed over a dead one) waits at a barrier.
        """
        s = op.store
        fmt = FORMATS[self.p.tensors[s.tensor].dtype]
        blocks = {a: self._block_var(b, a) for a, b in op.blocks.items()}

        def write(e: _Elem) -> None:
            offset = self._global_offset(s.tensor, s.axes, blocks, e.coords)
            target = f"g_{_c_name(s.tensor)}[{offset}]"
            e.w(f"{target} = {fmt.from_float.format(self._val(op.result, e))};")

        self._each(w, s.axes, write)
        self.dirty = True


# --------------------------------------------------------------------------------------------
# The CuPy launcher


_LAUNCHER = '''\
"""CuPy launcher for a bbrules program (generated): compiles the kernels once, allocates every
stored tensor, and launches the kernels in order."""

import cupy as cp

SOURCE = {source!r}

# name -> (shape in whole blocks, dtype, role, extent)
TENSORS = {tensors!r}
OUTPUTS = {outputs!r}
# (function, grid, threads per block, dynamic shared memory bytes, tensor arguments, stored
# tensors)
KERNELS = {kernels!r}

_functions = {{}}


{to_storage}

{from_storage}

def _aligned(x):
    """`x`, copied unless its device memory starts on a 16-byte boundary: the kernels load
    tiles 16 bytes at a time.  cupy allocates aligned memory, but an input may be a view into a
    larger array.  (Host arrays, which have no CUDA pointer, are the tests' stand-in for cupy.)"""
    interface = getattr(x, "__cuda_array_interface__", None)
    return x.copy() if interface is not None and interface["data"][0] % 16 else x


def _function(name, shared_bytes):
    if name not in _functions:
        if not _functions:
            _functions["__module__"] = cp.RawModule(code=SOURCE)
        fn = _functions["__module__"].get_function(name)
        if shared_bytes > 48 * 1024:
            fn.max_dynamic_shared_size_bytes = shared_bytes
        _functions[name] = fn
    return _functions[name]


def run(**inputs):
    """Run the program on `inputs` (arrays by tensor name); every stored tensor, as float32
    (float16 for f16 tensors)."""
    memory = {{}}
    for name, (shape, dtype, role, extent) in TENSORS.items():
        if role == "input":
            if name not in inputs:
                raise ValueError(f"missing input '{{name}}'")
            x = to_storage(inputs[name], dtype, cp)
            if x.shape != extent:
                raise ValueError(f"input '{{name}}' has shape {{x.shape}}, expected {{extent}}")
            if shape != extent:  # zeros after a ragged axis's extent
                x = cp.pad(x, [(0, p - n) for n, p in zip(extent, shape)])
            memory[name] = _aligned(x)
    for name, grid, threads, shared_bytes, params, _ in KERNELS:
        for t in params:
            if t not in memory:
                shape, dtype, _, _ = TENSORS[t]
                memory[t] = cp.empty(shape, dtype=cp.float32 if dtype == "f32" else
                                     cp.float16 if dtype == "f16" else cp.uint16)
        _function(name, shared_bytes)((grid,), (threads,), tuple(memory[t] for t in params),
                                      shared_mem=shared_bytes)
    stored = dict.fromkeys(t for k in KERNELS for t in k[5])
    out = {{t: memory[t] if TENSORS[t][1] == "f16" else from_storage(memory[t], TENSORS[t][1], cp)
           for t in stored}}
    return {{t: x[tuple(slice(0, n) for n in TENSORS[t][3])] for t, x in out.items()}}
'''


def _launcher(source: str, kernels: tuple[KernelInfo, ...], tensors: dict[str, TensorInfo],
              outputs: tuple[str, ...]) -> str:
    return _LAUNCHER.format(
        source=source,
        tensors={n: (t.shape, t.dtype, t.role, t.extent) for n, t in tensors.items()},
        outputs=outputs,
        kernels=[(k.name, k.grid, k.threads, k.shared_bytes, k.params, k.tensors)
                 for k in kernels],
        to_storage=inspect.getsource(to_storage).replace("xp=np", "xp=cp"),
        from_storage=inspect.getsource(from_storage).replace("xp=np", "xp=cp"))


# --------------------------------------------------------------------------------------------
# nvcc


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reports for one kernel.  Tiles live in dynamic shared memory, which ptxas
    cannot see: their size is `KernelInfo.shared_bytes`."""

    registers: int
    static_shared_bytes: int
    stack_bytes: int
    spill_bytes: int


class CompileError(Exception):
    """nvcc rejected the source (or warned: generated code must compile cleanly)."""


_ENTRY = re.compile(r"Compiling entry function '(\w+)'")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def compile_check(source: str, arch: str = "sm_90") -> dict[str, KernelResources]:
    """Compile `source` to a cubin with nvcc, treating warnings as errors; ptxas's resource
    usage per kernel.  Raises `UsageError` without nvcc, `CompileError` with nvcc's message."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise UsageError("nvcc is not on PATH: cannot compile CUDA source")
    with tempfile.TemporaryDirectory(prefix="bbrules-nvcc-") as tmp:
        cu = Path(tmp) / "kernels.cu"
        cu.write_text(source)
        proc = subprocess.run([nvcc, "-cubin", f"-arch={arch}", "--resource-usage",
                               "-Werror", "all-warnings", "-o", str(Path(tmp) / "kernels.cubin"),
                               str(cu)], capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise CompileError(f"nvcc failed:\n{log.strip()}")
    out: dict[str, KernelResources] = {}
    name = None
    frame = (0, 0, 0)
    for line in log.splitlines():
        if (m := _ENTRY.search(line)) is not None:
            name = m.group(1)
        elif (m := _FRAME.search(line)) is not None:
            frame = tuple(int(g) for g in m.groups())
        elif (m := _USED.search(line)) is not None and name is not None:
            smem = _SMEM.search(line)
            out[name] = KernelResources(int(m.group(1)), int(smem.group(1)) if smem else 0,
                                        frame[0], frame[1] + frame[2])
            name, frame = None, (0, 0, 0)
    return out

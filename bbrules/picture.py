"""Pictures of block programs: Graphviz DOT in the spirit of the Blockbuster paper's figures.

What fusion changes is which data crosses global memory, so that is what the picture shows.
Each kernel is a cluster labelled with its grid; inside it, the loops that its schedule runs
(`bbrules.schedule`: the loops the cost model prices and the backends emit) are nested
clusters labelled with their axis, their trip count and the monoids they carry; loads from
global memory and stores to it are nodes of their own shapes, with an edge from each load to
the stores it feeds.  The global tensors stand outside every kernel, with edges tensor -> load
and store -> tensor: a path store -> tensor -> load between two kernels is an intermediate
written and read back through global memory, what a fused program no longer has.

Output is deterministic (everything is emitted in program and schedule order) and every label
and identifier is quoted and escaped, so programs compare as text and any name draws.
"""

from __future__ import annotations

import math
import shutil
import subprocess
from dataclasses import dataclass, field

from .cost import fmt_bytes
from .errors import UsageError
from .ir import BlockProgram, Kernel, Load, Monoid, Store, postorder, show_node
from .plan import loop_predicate
from .schedule import Compute, Loop, Step, Write, schedule_kernel

# Fill colours by tensor role: what the program reads, what it returns, and the intermediates
# that a kernel boundary forces through global memory.
ROLE_COLOURS = {"input": "#cfe2f3", "output": "#d9ead3", "temp": "#fce5cd", "view": "#ffffff"}
LOAD_SHAPE = "invhouse"  # points down into the kernel
STORE_SHAPE = "house"  # points up, out to global memory


def quote(text: str) -> str:
    """`text` as a DOT quoted string: backslashes and quotes escaped, newlines as centred
    line breaks."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + escaped.replace("\n", "\\n") + '"'


def to_dot(p: BlockProgram, title: str = "") -> str:
    """The picture of `p` as a DOT digraph; `title` labels the whole graph."""
    lines = ["digraph bbrules {",
             f"  graph [label={quote(title)}, labelloc=t, fontname=Helvetica, fontsize=12, "
             f"newrank=true];",
             "  node [fontname=Helvetica, fontsize=10];",
             "  edge [color=\"#555555\", fontname=Helvetica, fontsize=9];"]
    for t in p.tensors.values():
        label = quote(_tensor_label(p, t.name))
        lines.append(f"  {quote(_tensor_id(t.name))} [shape=box, style=\"filled,rounded\", "
                     f"fillcolor={quote(ROLE_COLOURS[t.role])}, label={label}];")
    edges: list[str] = []
    for i, kernel in enumerate(p.kernels, start=1):
        picture = _KernelPicture(p.in_kernel(kernel), kernel, i)
        lines += picture.lines()
        edges += picture.edges
    for t in p.tensors.values():
        if t.role == "view":
            edges.append(f"  {quote(_tensor_id(t.base))} -> {quote(_tensor_id(t.name))} "
                         f"[style=dashed, arrowhead=none, label=\"view\"];")
    return "\n".join(lines + edges + ["}"]) + "\n"


def graphviz() -> str:
    """The path of Graphviz's `dot`; a `UsageError` saying how to get it where it is not
    installed (a picture as DOT needs no Graphviz)."""
    exe = shutil.which("dot")
    if exe is None:
        raise UsageError("drawing SVG needs Graphviz's `dot` program, which is not on PATH: "
                         "install Graphviz (e.g. `apt-get install graphviz` or `brew install "
                         "graphviz`), or print DOT with --dot and render it elsewhere")
    return exe


def to_svg(dot: str) -> str:
    """DOT text drawn as SVG by Graphviz's `dot`."""
    done = subprocess.run([graphviz(), "-Tsvg"], input=dot, capture_output=True, text=True)
    if done.returncode != 0:
        raise UsageError(f"Graphviz's dot failed (exit {done.returncode}): "
                         f"{done.stderr.strip()}")
    return done.stdout


def _tensor_id(name: str) -> str:
    return f"tensor {name}"


def _tensor_label(p: BlockProgram, name: str) -> str:
    t = p.tensors[name]
    head = f"{name}[{', '.join(t.axes)}]"
    if t.role == "view":  # its base's memory: no size of its own
        return f"{head}\nview of {t.base}, {t.dtype}"
    size = math.prod(p.padded(a) for a in t.axes) * t.itemsize
    return f"{head}\n{t.role}, {t.dtype}, {fmt_bytes(size)}"


def _lines(parts: list[str]) -> str:
    return "\n".join(parts)


def _monoid_label(m: Monoid) -> str:
    return m.name if len(m.state) == 1 else f"{m.name}({', '.join(m.state)})"


@dataclass
class _KernelPicture:
    """One kernel's cluster (`lines`) and its edges to and from global tensors (`edges`).

    `p` is the program at the kernel's own block sizes, so trip counts are the kernel's."""

    p: BlockProgram
    kernel: Kernel
    index: int
    edges: list[str] = field(default_factory=list)
    _loads: list[tuple[str, Load]] = field(default_factory=list)
    _loops: int = 0

    def lines(self) -> list[str]:
        trips = {a: d.blocks for a, d in self.p.dims.items()}
        schedule = schedule_kernel(self.kernel, trips)
        points = math.prod(trips[a] for a in self.kernel.grid)
        label = [f"kernel {self.index}: {self.kernel.name}",
                 f"grid [{', '.join(self.kernel.grid)}]: {points} "
                 f"block{'s' * (points != 1)}"]
        if self.kernel.blocks:
            label += [f"{a} in blocks of {b}" for a, b in self.kernel.blocks]
        out = [f"  subgraph cluster_k{self.index} {{",
               f"    label={quote(_lines(label))}; style=rounded; color=\"#3c78d8\";"]
        out += self._steps(schedule.body, trips, "    ")
        out.append("  }")
        return out

    def _steps(self, steps: tuple[Step, ...], trips: dict[str, int], indent: str) -> list[str]:
        out: list[str] = []
        for step in steps:
            match step:
                case Compute(Load() as load):
                    out.append(self._load(load, indent))
                case Write(store):
                    out.append(self._store(store, indent))
                case Loop(axis, _, body) if trips[axis] <= 1:
                    out += self._steps(body, trips, indent)  # one block: no loop runs
                case Loop(axis, reduces, body):
                    self._loops += 1
                    label = [f"loop over {axis}: {trips[axis]} blocks"]
                    if reduces:
                        monoids = dict.fromkeys(_monoid_label(r.monoid) for r in reduces)
                        label.append(f"carries {', '.join(monoids)}")
                    if (skip := loop_predicate(step)) is not None:
                        label.append(f"visits blocks where {show_node(skip)}")
                    out += [f"{indent}subgraph cluster_k{self.index}_loop{self._loops} {{",
                            f"{indent}  label={quote(_lines(label))}; style=dashed; "
                            f"color=\"#999999\";"]
                    out += self._steps(body, trips, indent + "  ")
                    out.append(f"{indent}}}")
        return out

    def _load(self, load: Load, indent: str) -> str:
        node = f"k{self.index} load {len(self._loads) + 1}"
        self._loads.append((node, load))
        self.edges.append(f"  {quote(_tensor_id(load.tensor))} -> {quote(node)};")
        label = f"load {load.tensor}[{', '.join(load.axes)}]"
        return f"{indent}{quote(node)} [shape={LOAD_SHAPE}, label={quote(label)}];"

    def _store(self, store: Store, indent: str) -> str:
        node = f"k{self.index} store {store.tensor}"
        reads = {n for n in postorder(store.value) if isinstance(n, Load)}
        self.edges += [f"  {quote(load_node)} -> {quote(node)} [style=dotted];"
                       for load_node, load in self._loads if load in reads]
        self.edges.append(f"  {quote(node)} -> {quote(_tensor_id(store.tensor))};")
        label = f"store {store.tensor}[{', '.join(store.axes)}]"
        return f"{indent}{quote(node)} [shape={STORE_SHAPE}, style=bold, label={quote(label)}];"

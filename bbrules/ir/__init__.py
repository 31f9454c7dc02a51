"""The block-program IR: values in a global tier (tensors) and a local tier (tiles).

- `kinds`: how a node kind is declared, and the generic operations derived from declarations;
- `nodes`: the value-node kinds, each declared once with its type rule;
- `types`: tile types (shape, dependencies);  `typecheck`: `type_of`, `sched_deps`, `loops_under`;
- `monoid`: monoids as data, held by the reductions that use them;
- `program`: dims, tensors, stores, kernels (a grid and its stores), block programs and
  `validate`;
- `axes`: renaming axes in terms;  `show`: the block syntax printer.
"""

from .axes import axes_named, rename_axes
from .kinds import (KINDS, Kind, KindTable, Sort, attrs, build, children, is_elementwise, is_node,
                    kind_of, map_attrs, operator, postorder, rebuild, transform)
from .monoid import BUILTIN_MONOIDS, MAX, MIN, SUM, Monoid, monoids_used, var_names
from .nodes import (ELEMENTWISE_KINDS, MAX_COMPONENTS, Binary, BlockReduce, Const, Dot, Get,
                    Load, Node, Pos, Reduce, Tuple, Unary, Var, Where)
from .program import (DTYPE_BYTES, WHOLE_DTYPES, WHOLE_LIMIT, BlockProgram, Dim, DimError,
                      Kernel, Store, TensorDecl, check_view, check_whole, checked_dim, validate,
                      whole_inputs_as_f32)
from .show import fmt_number, show_kernel, show_monoid, show_node, show_program
from .typecheck import deps, loops_under, sched_deps, shape, tile_type, type_of
from .types import SCALAR, Axis, AxisSet, IRError, TileType, Type, union


__all__ = [name for name in dir() if not name.startswith("_")]

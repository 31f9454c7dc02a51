"""The e-graph engine: rules compiled to egglog, saturated in budgeted stages.

- `terms`: the egglog encoding of IR terms, written (`TermWriter`) and read back (`decode`);
- `compile`: a rule pack as one egglog program (`compile_pack`);
- `graph`: the saturated e-graph as e-classes of e-nodes (`ClassGraph`);
- `saturate`: staged, budgeted saturation with back-off (`Saturator`);
- `checks`: a pack's check cases (`run_checks`).
"""

from .checks import CHECK_BUDGET, CheckFailure, run_checks
from .compile import CompiledPack, compile_pack, rule_of, size_facts
from .graph import ClassGraph
from .saturate import Budget, Progress, Saturator, StageStats
from .terms import TERM_CONSTRUCTORS, ENode, TermWriter, enode_key, node_text

__all__ = ["CHECK_BUDGET", "CheckFailure", "run_checks", "CompiledPack", "compile_pack",
           "rule_of", "size_facts", "ClassGraph", "Budget", "Progress", "Saturator",
           "StageStats", "TERM_CONSTRUCTORS", "ENode", "TermWriter", "enode_key", "node_text"]

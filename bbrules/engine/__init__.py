"""The e-graph engine: rules compiled to egglog, saturated in budgeted stages.

- `terms`: the egglog encoding of IR terms, written (`TermWriter`) and read back (`decode`);
- `compile`: a rule pack as one egglog program (`compile_pack`);
- `graph`: the saturated e-graph as e-classes of e-nodes (`ClassGraph`);
- `saturate`: staged, budgeted saturation with back-off (`Saturator`);
- `checks`: a pack's check cases (`run_checks`).
"""

from ..options import Budget, Options
from .checks import CheckFailure, run_checks
from .compile import CompiledPack, Provenance, compile_pack, rule_of, size_facts
from .graph import ClassGraph, Firing
from .saturate import Progress, RuleStats, Saturator, StageStats
from .terms import CONSTRUCTORS, TERM_CONSTRUCTORS, ENode, TermWriter, enode_key, node_text

__all__ = ["Budget", "Options", "CheckFailure", "run_checks", "CompiledPack", "Provenance",
           "compile_pack", "rule_of", "size_facts", "ClassGraph", "Firing", "Progress",
           "RuleStats", "Saturator", "StageStats", "CONSTRUCTORS", "TERM_CONSTRUCTORS", "ENode",
           "TermWriter",
           "enode_key", "node_text"]

"""The verdict of `bbrules run`: does a program's output agree with the dense evaluation?

The reference is the dense evaluation in float64 (`bbrules.dense`), so its own rounding is
negligible and the whole error is the program's.  The error of an output is norm-wise,
`||got - ref||_2 / ||ref||_2` over its entries, because an element-wise relative error is
meaningless where the reference is near zero (a correct layernorm + matmul output has entries
of 1e-4 next to entries of 100, and every reordering of a sum moves the small ones most).
Entries that are equal, infinities of the same sign included, and entries that are NaN in both
count as agreeing; a NaN or infinity on one side only is a failure whatever the norms say.

The tolerance grows with the rounding of the output's storage type and with how many terms the
output's sums add (float32 rounding errors of a sum of K terms grow like sqrt(K)):

    tolerance = C * (eps(dtype) + eps(f32) * sqrt(K)),  C = 16

An output whose sums cancel (terms of 0.3 adding up to 0.004) has a relative error far above
that in any float32 evaluation, however correct: the problem is ill-conditioned, not the
program wrong.  So the plain float32 dense evaluation of the same source on the same inputs is
measured too, and an output also passes when its error is at most B = 4 times that baseline:
a fused program may not be less accurate than the unfused arithmetic by more than a small
factor.

where eps is the unit roundoff spacing at 1 (f32 2^-23, f16 2^-10, bf16 2^-7; the backends
compute in float32 whatever the storage type) and K, the reduction length, counts the terms
that the statements the output depends on add up: the extent of every reduction, plus one for
every elementwise addition or subtraction (a 1,500-term sum written out with `+` rounds like a
reduction over 1,500 elements), at least 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .program import Apply, Expr, Program, Reduction, Ref

C = 16
B = 4
EPS = {"f32": 2.0 ** -23, "f16": 2.0 ** -10, "bf16": 2.0 ** -7}
RULE = ("||got - ref|| / ||ref|| <= max(16 * (eps(dtype) + eps(f32) * sqrt(K)), "
        "4 * the plain float32 evaluation's error)")
HELP = ("The reference is the dense evaluation of the source program in float64.  An output "
        "passes when its norm-wise error ||got - ref|| / ||ref|| is at most 16 * (eps(dtype) + "
        "eps(f32) * sqrt(K)), where eps is 2^-23 for f32, 2^-10 for f16 and 2^-7 for bf16 "
        "outputs, and K is the summed extent of every reduction the output depends on, plus its "
        "elementwise additions and subtractions; or, for outputs whose sums cancel, when it is "
        "at most 4 times the error of the source's plain float32 dense evaluation.  "
        "Entries that are NaN in both or equal infinities agree; a NaN or infinity on one side "
        "only fails.  Exit status 1 if an output fails.")


def _reductions(e: Expr, program: Program) -> tuple[int, set[str]]:
    """The terms `e` adds up (its reductions' extents, its additions and subtractions) and
    the tensors it reads."""
    total, reads = 0, set()
    stack = [e]
    while stack:
        match stack.pop():
            case Ref(tensor, _):
                reads.add(tensor)
            case Apply(op, args):
                total += op in ("add", "sub")
                stack.extend(args)
            case Reduction(_, axis, body):
                total += program.dims[axis].extent
                stack.append(body)
    return total, reads


def reduction_length(program: Program, output: str) -> int:
    """K of the tolerance rule: the terms added up by the statements `output` depends on."""
    statements = {s.target: s for s in program.statements}
    seen, todo, total = set(), [output], 0
    while todo:
        name = todo.pop()
        if name in seen or name not in statements:
            continue
        seen.add(name)
        length, reads = _reductions(statements[name].expr, program)
        total += length
        todo.extend(reads)
    return max(total, 1)


def tolerance(dtype: str, k: int) -> float:
    return C * (EPS[dtype] + EPS["f32"] * math.sqrt(k))


@dataclass(frozen=True)
class Comparison:
    """One output against its float64 reference."""

    error: float  # norm-wise relative error over the entries that do not agree exactly
    tolerance: float
    reduction_length: int
    mismatched: int  # entries NaN or infinite on one side only (or infinities of unlike sign)
    worst: tuple[int, ...]  # the index of the entry farthest from its reference
    got: float
    expected: float
    baseline: float | None = None  # the plain float32 evaluation's error, where measured

    @property
    def ok(self) -> bool:
        bound = max(self.tolerance, B * (self.baseline or 0.0))
        return self.mismatched == 0 and self.error <= bound

    @staticmethod
    def of(got: np.ndarray, ref: np.ndarray, dtype: str, k: int,
           plain: np.ndarray | None = None) -> Comparison:
        """`got` against the float64 `ref`; `plain`, the source's float32 dense evaluation,
        gives the baseline error of unfused arithmetic."""
        baseline = None if plain is None else Comparison.of(plain, ref, dtype, k).error
        got, ref = got.astype(np.float64), ref.astype(np.float64)
        with np.errstate(invalid="ignore", over="ignore"):
            same = (got == ref) | (np.isnan(got) & np.isnan(ref))
            finite = np.isfinite(got) & np.isfinite(ref)
            diff = np.where(same | ~finite, 0.0, got - ref)
            mismatched = int(np.count_nonzero(~same & ~finite))
            scale = float(np.linalg.norm(np.where(finite, ref, 0.0)))
            norm = float(np.linalg.norm(diff))
            error = norm / scale if scale > 0 else (0.0 if norm == 0 else math.inf)
            distance = np.where(same, 0.0, np.where(finite, np.abs(diff), np.inf))
        worst = np.unravel_index(int(np.argmax(distance)), got.shape) if got.size else ()
        return Comparison(error, tolerance(dtype, k), k, mismatched,
                          tuple(int(i) for i in worst),
                          float(got[worst]) if got.size else 0.0,
                          float(ref[worst]) if got.size else 0.0,
                          baseline if baseline is None or math.isfinite(baseline) else None)

    def line(self, name: str) -> str:
        verdict = "ok" if self.ok else "FAILED"
        nonfinite = (f", {self.mismatched} entries NaN or infinite on one side only"
                     if self.mismatched else "")
        where = ", ".join(map(str, self.worst))
        plain = (f", {B}x plain float32 {B * self.baseline:.3g}"
                 if self.baseline is not None and B * self.baseline > self.tolerance else "")
        return (f"{name}: norm-wise error {self.error:.3g} (tolerance {self.tolerance:.3g}, "
                f"K = {self.reduction_length}{plain}){nonfinite}; worst {name}[{where}] = "
                f"{self.got:.7g}, expected {self.expected:.7g}: {verdict}")

    def to_json(self) -> dict:
        def finite(x: float) -> float | None:
            return x if math.isfinite(x) else None
        return {"error": finite(self.error), "tolerance": self.tolerance,
                "plain_float32_error": self.baseline,
                "reduction_length": self.reduction_length, "mismatched_nonfinite": self.mismatched,
                "worst": {"index": list(self.worst), "got": finite(self.got),
                          "expected": finite(self.expected)},
                "ok": self.ok}

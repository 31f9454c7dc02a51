"""The GPU kit: kernels generated on a CPU machine, checked and timed on a bare GPU machine.

A GPU machine lent for a few minutes has CUDA, torch, triton, cupy and numpy, but no egglog,
no lark and no network, so nothing there can parse or fuse a program.  `prepare` does all of
that here: for each case (attention in f32 and bf16, one and 32 heads, 1k to 16k tokens, causal
or not; decode attention over long caches; matmul-shaped kernels) it writes the fused program's
Triton module (for each key-block variant) and, for the smaller cases, its CUDA C launcher,
with the modeled time and traffic.  `runner.py`, copied beside them, needs only torch, triton,
cupy and numpy: one command on the GPU machine checks every kernel against torch and times it
against `torch.nn.functional.scaled_dot_product_attention` or cuBLAS, writing three files
(`results.json`, `results.md`, `run.log`) within a time limit.

    bbrules gpukit DIR [--quick]          # here
    python DIR/runner.py --out RESULTS    # there
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from .codegen import cuda_gen, triton_gen
from .cost import cost_program
from .errors import UsageError
from .frontend import parse_program
from .fuse import fuse
from .lower import lower
from .packs import load_packs
from .targets import Target, get_target

TARGET = "h200"  # the GPU machine
RUNNER = Path(__file__).parent / "codegen" / "gpu_runner.py"
# Above this many modeled bytes the CUDA C kernels (CUDA cores, no tensor cores) are not run:
# they would spend the machine's minutes where the Triton kernels are the subject.
CUDA_MAX_BYTES = 1 << 30
# torch's f32 attention and matmul do not use TF32 by default: the f32 cases are compared at
# (about) the same accuracy, except one TF32 matmul that measures the rate the targets price
# f32 contractions at.
F32_PRECISION = "tf32x3"


@dataclass(frozen=True)
class Case:
    """One program the kit checks and times, and the torch computation it is compared with."""

    kind: str  # attention, decode, matmul, rmsnorm_matmul
    dtype: str  # f32, f16, bf16
    heads: int = 1
    queries: int = 1
    keys: int = 1
    head_dim: int = 64
    causal: bool = False
    width: int = 0  # matmul-shaped: m = n = e = width
    precision: str = F32_PRECISION  # of f32 contractions (triton_gen.PRECISIONS)

    @property
    def name(self) -> str:
        if self.kind in ("matmul", "rmsnorm_matmul"):
            own = self.dtype == "f32" and self.precision != F32_PRECISION
            return f"{self.kind}-{self.dtype}{f'-{self.precision}' if own else ''}-{self.width}"
        mask = "-causal" if self.causal else ""
        return f"{self.kind}{mask}-{self.dtype}-bh{self.heads}-n{self.keys}"

    def source(self, blocks: tuple[int, ...]) -> str:
        """The case as a .bbp program in `blocks`: rows and columns (queries and keys), and
        for the matmul-shaped kinds the contracted axis's block (64 where not given)."""
        bm, bn, be = (*blocks, 64)[:3]
        t = self.dtype
        scale = self.head_dim ** -0.5
        if self.kind == "attention":
            mask = ("where(k <= q, sum[d] Q[h, q, d] * K[h, k, d] * {s}, -inf)" if self.causal
                    else "sum[d] Q[h, q, d] * K[h, k, d] * {s}").format(s=scale)
            return (f"dim h = {self.heads} / 1\ndim q = {self.queries} / {bm}\n"
                    f"dim k = {self.keys} / {bn}\ndim d = {self.head_dim}\n"
                    f"input Q[h, q, d], K[h, k, d], V[h, k, d] : {t}\n"
                    f"S[h, q, k] = {mask}\nM[h, q] = max[k] S[h, q, k]\n"
                    "E[h, q, k] = exp(S[h, q, k] - M[h, q])\nL[h, q] = sum[k] E[h, q, k]\n"
                    "O[h, q, d] = sum[k] E[h, q, k] * V[h, k, d] / L[h, q]\noutput O\n")
        if self.kind == "decode":
            return (f"dim h = {self.heads} / 1\ndim k = {self.keys} / {bn}\n"
                    f"dim d = {self.head_dim}\ninput Q[h, d], K[h, k, d], V[h, k, d] : {t}\n"
                    f"S[h, k] = sum[d] Q[h, d] * K[h, k, d] * {scale}\nM[h] = max[k] S[h, k]\n"
                    "E[h, k] = exp(S[h, k] - M[h])\nL[h] = sum[k] E[h, k]\n"
                    "O[h, d] = sum[k] E[h, k] * V[h, k, d] / L[h]\noutput O\n")
        w = self.width
        head = f"dim m = {w} / {bm}\ndim e = {w} / {be}\ndim n = {w} / {bn}\n"
        if self.kind == "matmul":
            return head + (f"input A[m, e], B[e, n] : {t}\nC[m, n] = sum[e] A[m, e] * B[e, n]\n"
                           "output C\n")
        return head + (f"input X[m, e], G[e], W[e, n] : {t}\n"
                       f"SS[m] = sum[e] square(X[m, e]) * {1.0 / w}\n"
                       "XN[m, e] = X[m, e] * rsqrt(SS[m] + 1e-6) * G[e]\n"
                       "Y[m, n] = sum[e] XN[m, e] * W[e, n]\noutput Y\n")


def cases(quick: bool = False) -> list[Case]:
    """The kit's cases; `quick`: one of each kind at small sizes (a dry run)."""
    if quick:
        return [Case("attention", "bf16", 1, 1024, 1024, causal=True),
                Case("decode", "f32", 8, 1, 1024, head_dim=128),
                Case("matmul", "bf16", width=1024)]
    # The cases the README's goals name come first, so that a run cut short still has them.
    out = [Case("attention", "bf16", bh, n, n, causal=causal)
           for causal in (False, True) for bh in (32, 1) for n in (4096, 1024, 16384)]
    out += [Case("decode", dtype, 32, 1, n, head_dim=128)
            for dtype in ("bf16", "f32") for n in (4096, 32768)]
    out += [Case(kind, dtype, width=4096) for kind in ("matmul", "rmsnorm_matmul")
            for dtype in ("bf16", "f32")]
    out += [Case("matmul", "f32", width=4096, precision="tf32")]
    out += [Case("attention", "f16", 32, 4096, 4096, causal=True)]
    out += [Case("attention", "f32", bh, n, n, causal=causal)
            for causal in (False, True) for bh in (32, 1) for n in (4096, 1024, 16384)]
    return out


def variants(case: Case) -> list[tuple[int, ...]]:
    """Blockings to try (rows x columns, and the contracted axis of a matmul-shaped case):
    the key block is tuned on the GPU among these.  An f32 matmul steps through the
    contraction 32 wide as well as 64: its tiles take twice a bf16 tile's shared memory per
    pipeline stage."""
    if case.kind == "decode":
        return [(1, 64), (1, 128)]
    if case.kind == "attention":  # f32's 128 x 128 tiles fit no configuration of an H200
        return [(64, 64), (128, 64)] + ([] if case.dtype == "f32" else [(128, 128)])
    if case.dtype == "f32":
        return [(128, 128, 32), (128, 128, 64)]
    return [(128, 128), (64, 128)]


def target_fields(t: Target) -> dict[str, float]:
    """`t` in a target file's units: what the runner writes a measured target from, keeping
    the figures it does not measure."""
    return {"global_bandwidth": t.global_bandwidth / 1e9,
            "local_capacity": t.local_capacity // 1024, "processors": t.processors,
            "peak_flops": t.peak_flops / 1e12,
            "peak_flops_f16": t.peak_flops_f16 / 1e12,
            "peak_flops_dot_f32": t.peak_flops_dot_f32 / 1e12,
            "special_rate": t.special_rate / 1e12, "launch_cost": t.launch_cost * 1e6,
            "resolution": t.resolution, "block_granularity": t.block_granularity}


def prepare(folder: str | Path, quick: bool = False,
            progress: Callable[[str], None] | None = None) -> dict:
    """Write the kit into `folder` (which must not exist or be empty); its manifest."""
    root = Path(folder)
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise UsageError(f"{root}: not an empty folder; the kit is written into a new one")
    (root / "kernels").mkdir(parents=True, exist_ok=True)
    pack, target = load_packs([]), get_target(TARGET)
    manifest: dict = {"target": TARGET, "target_file": target_fields(target), "cases": []}
    for case in cases(quick):
        entry = {"name": case.name, **asdict(case), "variants": []}
        for blocks in variants(case):
            label = "x".join(map(str, blocks))
            program = lower(parse_program(case.source(blocks), f"<{case.name}>"))
            fused = fuse(program, pack, target).program
            cost = cost_program(fused, target)
            stem = f"{case.name}-{label}"
            (root / "kernels" / f"{stem}.triton.py").write_text(
                triton_gen.generate(fused, target, case.precision).source)
            cuda = None
            if cost.traffic <= CUDA_MAX_BYTES and blocks == variants(case)[0]:
                cuda = f"kernels/{stem}.cuda.py"
                (root / cuda).write_text(cuda_gen.generate(fused, target).launcher)
            entry["variants"].append({
                "label": label, "triton": f"kernels/{stem}.triton.py", "cuda": cuda,
                "kernels": len(fused.kernels), "modeled_time_s": cost.time,
                "modeled_bytes": cost.traffic, "modeled_flops": cost.flops})
            if progress:
                progress(f"{stem}: {len(fused.kernels)} kernel(s), modeled "
                         f"{cost.time * 1e6:.1f} us")
        manifest["cases"].append(entry)
    (root / "cases.json").write_text(json.dumps(manifest, indent=1))
    shutil.copyfile(RUNNER, root / "runner.py")
    return manifest

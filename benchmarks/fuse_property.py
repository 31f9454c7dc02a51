"""The fusion property test at scale: `fuse()` on many random programs agrees with the dense
evaluation, through the interpreter and the numpy backend (numpy code and native code).

The test suite runs 20 examples per CI run (tests/test_random_programs.py); this runs the same
check on as many as asked, with a seed, and reports the time per example.  A failure prints
the program, the fused program and the verdict, and exits 1.

    python benchmarks/fuse_property.py [--examples 250] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from hypothesis import HealthCheck, given, seed, settings

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from strategies import programs  # noqa: E402
from test_random_programs import check_fused_agrees  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=250)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    ran: list[str] = []

    @seed(args.seed)
    @settings(max_examples=args.examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(programs())
    def property_holds(source: str) -> None:
        ran.append(source)
        check_fused_agrees(source)

    start = time.perf_counter()
    try:
        property_holds()
    except AssertionError as failure:
        print(failure)
        print(f"FAILED after {len(ran)} examples")
        return 1
    elapsed = time.perf_counter() - start
    print(f"{len(ran)} random programs fused, each agreeing with the dense evaluation through "
          f"the interpreter, numpy code and native code: {elapsed:.1f} s "
          f"({elapsed / max(len(ran), 1):.2f} s an example)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

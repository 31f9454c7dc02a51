"""Do the budgets bound `bbrules apply`?  Wall time against `--seconds`.

For every example, the one-line `zero_ss` program (benchmarks/programs/zero_ss.bbp, whose
saturation once grew 12x past the node budget in one iteration) and a 12-term chain under an
explosive pack (tests/programs/chain12.bbp with tests/packs/explosive), this runs
`python -m bbrules apply PROGRAM --seconds S` as a fresh process for each S and reports its
wall time, its peak resident memory, what stopped each phase (from the text report), and

    ratio = (wall time - start-up) / S

where start-up is the time of a process that only imports the CLI and loads the standard
pack.  The budgets promise a
ratio under about 1.5.

    python benchmarks/bench_budgets.py [--seconds 1,2,5] [--json PATH]

Nothing here is asserted (tests/test_budgets.py checks the budgets with small ones).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = [(p.stem, [str(p)]) for p in sorted((ROOT / "examples").glob("*.bbp"))] + [
    ("zero_ss", [str(ROOT / "benchmarks" / "programs" / "zero_ss.bbp")]),
    ("chain12+explosive", [str(ROOT / "tests" / "programs" / "chain12.bbp"),
                           "--rules", str(ROOT / "tests" / "packs" / "explosive")]),
]


_STARTUP = "import bbrules.cli; from bbrules.packs import load_packs; load_packs([])"


def _stops(report: str) -> list[str]:
    """The budgets the text report says stopped a phase."""
    if "saturation:" not in report:
        return ["no report"]
    out = []
    for line in report.splitlines():
        words = line.split()
        if len(words) > 9 and words[2] == "iterations" and words[-1] != "saturated" \
                and "iteration" not in words[-2:]:
            out.append(f"{words[0]}: {' '.join(words[9:])}")
        elif line.startswith("read-back:"):
            out.append("read-back: " + line.split("the ")[1].split(" cut")[0])
        elif line.startswith("extraction:") and "stopped by the " in line:
            out.append("extraction: " + line.split("stopped by the ")[1])
    return out


def timed(args: list[str]) -> tuple[float, float, str]:
    """Wall seconds, peak resident MiB and stdout of one `python ARGS` process."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    out = proc.stdout.read() if proc.stdout else ""
    _, _, usage = os.wait4(proc.pid, 0)
    proc.returncode = 0
    return time.perf_counter() - start, usage.ru_maxrss / 1024, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", default="1,2,5", help="comma-separated --seconds budgets")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    startup = min(timed(["-c", _STARTUP])[0] for _ in range(3))
    print(f"start-up (import bbrules.cli, load the standard pack): {startup:.2f} s")
    print(f"{'program':20} {'budget':>6} {'wall':>7} {'ratio':>6} {'MiB':>6}  stopped by")
    rows = []
    for seconds in (float(s) for s in args.seconds.split(",")):
        for name, prog in CASES:
            wall, mib, out = timed(["-m", "bbrules", "apply", *prog,
                                    "--seconds", str(seconds)])
            stops = _stops(out)
            ratio = (wall - startup) / seconds
            rows.append({"program": name, "seconds": seconds, "wall": wall, "ratio": ratio,
                         "mib": mib, "stops": stops})
            print(f"{name:20} {seconds:6.1f} {wall:7.2f} {ratio:6.2f} {mib:6.0f}  "
                  f"{'; '.join(stops) or '-'}")
    print(f"worst ratio: {max(r['ratio'] for r in rows):.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"startup": startup, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Per-call cost of the Python sandbox's isolation layer: the same `df.mean()` call on a DABench table, run
under bubblewrap (the default) and without isolation (the warned opt-out), interleaved in one process so that
load from other work hits both alike. Reports the median and mean wall time per call, and the CPU time the
children used (bwrap's own setup included). Goal: isolated / unisolated median <= 1.3.

    .venv/bin/python benchmarks/sandbox_isolation.py [--runs 15]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time
import warnings
from pathlib import Path

from tools.sandbox import SandboxIsolationWarning, run_python

TABLE = Path(__file__).resolve().parents[1] / "examples" / "data" / "dabench" / "tables" / "test_ave.csv"
CODE = "print(df.mean(numeric_only=True).round(3).to_dict())"


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15, help="calls per variant (after one warm-up each)")
    args = parser.parse_args()
    warnings.simplefilter("ignore", SandboxIsolationWarning)  # the opt-out warns on every call, by design
    variants = ("bwrap", "none")
    walls: dict[str, list[float]] = {v: [] for v in variants}
    cpus: dict[str, list[float]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as root:
        outputs = {v: run_python(CODE, table_path=TABLE, root=Path(root), isolation=v) for v in variants}  # warm-up
        for variant, result in outputs.items():
            assert result.ok, f"{variant}: {result.error}"
        assert outputs["bwrap"].stdout == outputs["none"].stdout, "the two variants disagree on df.mean()"
        for i in range(args.runs):
            for variant in variants if i % 2 == 0 else variants[::-1]:  # alternate which goes first
                cpu, start = children_cpu(), time.perf_counter()
                result = run_python(CODE, table_path=TABLE, root=Path(root), isolation=variant)
                walls[variant].append(time.perf_counter() - start)
                cpus[variant].append(children_cpu() - cpu)
                assert result.ok, f"{variant}: {result.error}"
    print(f"df.mean() on {TABLE.name}, {args.runs} calls per variant, interleaved")
    print(f"{'variant':<12}{'median s':>10}{'mean s':>10}{'min s':>10}{'CPU s/call':>12}")
    for variant in variants:
        wall = walls[variant]
        print(f"{variant:<12}{statistics.median(wall):>10.3f}{statistics.mean(wall):>10.3f}{min(wall):>10.3f}"
              f"{statistics.mean(cpus[variant]):>12.3f}")
    ratio = statistics.median(walls["bwrap"]) / statistics.median(walls["none"])
    cpu_ratio = statistics.mean(cpus["bwrap"]) / statistics.mean(cpus["none"])
    print(f"isolated / unisolated: median wall {ratio:.3f}x (goal <= 1.3x), CPU {cpu_ratio:.3f}x, "
          f"extra per call {statistics.median(walls['bwrap']) - statistics.median(walls['none']):+.3f} s")


if __name__ == "__main__":
    main()

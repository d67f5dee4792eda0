"""`make bench`: runs every benchmarks/bench_*.py module's `run()` and reports.

Prints one table and writes results.json (+ ratios.png) under --out. Needs a GPU.
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import traceback

from benchmarks.harness import print_table, write_report


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default="benchmarks/out")
  parser.add_argument("--only", nargs="*", help="module names, e.g. bench_indexing")
  args = parser.parse_args()
  names = sorted(p.stem for p in pathlib.Path(__file__).parent.glob("bench_*.py"))
  rows, failed = [], []
  for name in names:
    if args.only and name not in args.only:
      continue
    try:
      rows += importlib.import_module(f"benchmarks.{name}").run()
    except Exception:  # one broken benchmark must not hide the others' figures
      failed.append(name)
      traceback.print_exc()
  print_table(rows)
  write_report(rows, args.out)
  if failed:
    raise SystemExit(f"benchmarks failed: {failed}")


if __name__ == "__main__":
  main()

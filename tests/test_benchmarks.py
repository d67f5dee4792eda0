"""`make bench` on a machine without a GPU, and `make bench-smoke` (the CPU suite only)."""

import pathlib
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.cpu_only  # on a GPU, `make bench` runs the real thing


def test_bench_without_gpu_says_so_in_one_line():
  t0 = time.monotonic()
  proc = subprocess.run([sys.executable, "-m", "benchmarks.run"], cwd=ROOT,
                        capture_output=True, text=True, timeout=60)
  took = time.monotonic() - t0
  assert proc.returncode != 0
  lines = (proc.stdout + proc.stderr).strip().splitlines()
  assert len(lines) == 1 and "needs a GPU" in lines[0], lines
  assert took < 10, took


def test_bench_smoke_runs_every_module(tmp_path):
  proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--smoke", "--out",
                         str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
  modules = sorted(p.stem for p in (ROOT / "benchmarks").glob("bench_*.py"))
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
  assert f"from {len(modules)} of {len(modules)} modules" in proc.stdout
  assert (tmp_path / "results.json").exists()

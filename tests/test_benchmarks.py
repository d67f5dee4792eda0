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


def test_paged_side_by_side_reaches_the_seed_launcher(monkeypatch):
  """bench_paged_attention's side-by-side rows with a stand-in for the seed launcher
  (benchmarks/seed_paged_peer.py needs torch's Triton on a GPU): the launcher gets every
  set's arrays as torch tensors in the seed's order, with the row's scales, sinks and
  window; its output is checked against ours before both are timed."""
  pytest.importorskip("torch")
  from benchmarks import bench_paged_attention, harness, seed_paged_peer
  from jax_mla.paged import paged_attention
  from torch_bridge import to_jax, to_torch

  seen = []

  def launch(q, kc, vc, bt, sl, *, scale, k_scale, v_scale, sinks=None, sliding_window=0):
    seen.append((tuple(kc.shape), tuple(vc.shape), sinks is not None, sliding_window, k_scale))
    out = to_torch(paged_attention(
        to_jax(q), to_jax(kc), to_jax(vc), to_jax(bt), to_jax(sl), scale=scale,
        k_scale=k_scale, v_scale=v_scale, sinks=None if sinks is None else to_jax(sinks),
        sliding_window=sliding_window, implementation="xla"))
    return lambda: out

  monkeypatch.setattr(seed_paged_peer, "load", lambda: launch)
  monkeypatch.setattr(harness, "SMOKE", True)
  w = bench_paged_attention.Workload("stand-in", 2, 64, window=32, sinks=True)
  rows = list(bench_paged_attention.run([w], only_side_by_side=True))
  assert [r.op for r in rows] == ["paged_attention vs seed"] * 2
  assert {r.anchor_name for r in rows} == {seed_paged_peer.NAME}
  assert seen and all(s == ((8, 8, 16, 16, 8), (8, 8, 128, 16), True, 32, 1.0) for s in seen)


def test_gpu_busy_time_is_the_union_of_the_intervals():
  """The side-by-side GPU time counts each microsecond the device works once: kernels
  that overlap (two streams) count once, waits for the host not at all."""
  from benchmarks.harness import busy_us
  assert busy_us([]) == 0
  assert busy_us([(0, 10), (30, 35)]) == 15  # a 20 us wait for the host left out
  assert busy_us([(5, 20), (0, 10), (8, 12), (30, 31)]) == 21  # overlapping, nested, unsorted


def test_side_by_side_pass_length_from_the_environment(monkeypatch):
  """``JAX_MLA_BENCH_CALLS_PER_PASS`` sets the side-by-side pass (16 by default); a
  value that is not a positive integer is refused by name."""
  from benchmarks import harness
  monkeypatch.delenv("JAX_MLA_BENCH_CALLS_PER_PASS", raising=False)
  assert harness._calls_per_pass() == 16
  monkeypatch.setenv("JAX_MLA_BENCH_CALLS_PER_PASS", "64")
  assert harness._calls_per_pass() == 64
  for bad in ("0", "-4", "x"):
    monkeypatch.setenv("JAX_MLA_BENCH_CALLS_PER_PASS", bad)
    with pytest.raises(ValueError, match="JAX_MLA_BENCH_CALLS_PER_PASS"):
      harness._calls_per_pass()


@pytest.mark.parametrize("row", ["sparse decode", "sparse prefill", "dense decode"])
def test_flashmla_side_by_side_times_the_bridge_beside_both(monkeypatch, row):
  """The FlashMLA side-by-side rows with our own FlashMLA drop-ins (torch_bridge.ops)
  standing in for FlashMLA: each row's FlashMLA calls (padded to 64 heads where FlashMLA
  needs them) and the same calls on the bridge are compared with ours, then all three are
  timed; the bridge's rows say so in their label and keep FlashMLA as the anchor."""
  pytest.importorskip("torch")
  from benchmarks import bench_mla_decode, bench_sparse_mla, flashmla_peer, harness
  from torch_bridge import ops

  monkeypatch.setattr(harness, "SMOKE", True)
  if row == "dense decode":
    case = bench_mla_decode.Case("stand-in", 2, 1, 16, 128, 64, None, "TB/s")
    sets = bench_mla_decode._case_sets(case)[0]
    rows = bench_mla_decode.side_by_side(ops, case, sets, lambda us: 1 / us)
  else:
    if row == "sparse decode":
      spec = bench_sparse_mla.Decode("fp8_ds_mla", 2, 1, 16, 64, 64, None, None, 128, None)
      sets, flop = bench_sparse_mla._decode_sets(spec)
    else:
      spec = bench_sparse_mla.Prefill(8, 16, 64, 576, 128, True, None)
      sets, flop = bench_sparse_mla._prefill_sets(spec)
    rows = bench_sparse_mla.side_by_side(ops, "stand-in", spec, sets, flop)
  labels = [r.op.split(" vs FlashMLA")[1] for r in rows]
  assert labels == ["", " (torch bridge)"]  # no GPU time on the CPU
  assert {r.anchor_name for r in rows} == {flashmla_peer.NAME}


def test_wall_clock_stops_before_the_outputs_are_freed(monkeypatch):
  """time_calls_us stops its clock at the sync's return; the pass's outputs are freed
  after it (deleting jax.Arrays is host work a caller's next calls hide)."""
  from benchmarks import harness
  log = []

  class Output:
    def __del__(self):
      log.append("free")

  ticks = iter(range(1000))
  monkeypatch.setattr(harness.time, "perf_counter", lambda: log.append("clock") or next(ticks))
  harness.time_calls_us([Output, Output], lambda outs: log.append("sync"), reps=3)
  timed = log[log.index("clock"):]  # the warm-up passes come first
  assert timed == ["clock", "sync", "clock", "free", "free"] * 3, timed

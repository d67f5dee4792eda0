"""`make bench`: every benchmarks/bench_*.py module's ``run()``, then one table.

  python -m benchmarks.run [--only bench_sparse_mla ...] [--out benchmarks/out]
  python -m benchmarks.run --smoke     # tiny shapes on the CPU: checks the harness

Each module runs in its own process under a time budget (``BUDGET_S``, plus what
earlier modules left unused; the whole run stays under ``TOTAL_S``), so one slow or
broken module cannot hold up or hide the others. A module cut at its budget keeps
the rows it had handed over (a ``run()`` that yields rows hands each one over as it
is measured). Progress prints per module (name, elapsed, rows). At the end: the
table, ``results.json`` and, with matplotlib, ``ratios.png`` under ``--out``. The
exit status is non-zero if a module failed or ran out of time.

Without a GPU, ``make bench`` says so in one line and exits 1 before importing JAX.
``--smoke`` runs every module on the CPU with tiny shapes (Triton kernels in the
Pallas interpreter where the module times a kernel, else the jax.numpy reference),
two input sets and one repetition: the figures mean nothing, the point is that the
harness works end to end.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

TOTAL_S = 590
# Seconds per module on the GPU, process start and compilation included. Sum <= TOTAL_S.
BUDGET_S = {
    "bench_bridge_model_loop": 50,
    "bench_bridge_overhead": 35,
    "bench_cache": 55,
    "bench_deepseek_v4": 90,
    "bench_indexing": 25,
    "bench_mla_decode": 60,
    "bench_mla_prefill": 60,
    "bench_paged_attention": 60,
    "bench_sharding": 45,
    "bench_sparse_mla": 110,
}
DEFAULT_BUDGET_S = 60  # a new module until it gets its own entry
SMOKE_BUDGET_S = 120

ROOT = pathlib.Path(__file__).resolve().parent.parent


def no_gpu_reason(python: str) -> str | None:
  """Why ``make bench`` cannot run here, or None. Device files first (no JAX import);
  then, only where a GPU is present, whether this python's JAX can use it."""
  platforms = os.environ.get("JAX_PLATFORMS", "")
  if platforms and not any(p in platforms for p in ("cuda", "gpu", "rocm")):
    return f"make bench needs a GPU, and JAX_PLATFORMS={platforms} hides it."
  if not (glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd")):
    return ("make bench needs a GPU and this machine has none (no /dev/nvidia* or /dev/kfd); "
            "`make bench-smoke` runs a tiny CPU version that checks the harness.")
  probe = subprocess.run([python, "-c", "import jax; print(jax.default_backend())"],
                         capture_output=True, text=True, timeout=120)
  backend = probe.stdout.strip().splitlines()[-1] if probe.stdout.strip() else "none"
  if probe.returncode or backend != "gpu":
    return (f"make bench needs a GPU: one is present but {python}'s JAX cannot use it "
            f"(backend {backend!r}); install jax with CUDA, e.g. pip install 'jax[cuda13]'.")
  return None


# ---------------------------------------------------------------------------------------
# --smoke: how to call each module's run() on tiny shapes.


def _interpret(module, *names: str) -> None:
  """Makes ``module``'s calls of these public ops with a GPU implementation run the
  Triton kernel in the Pallas interpreter (its ``run()`` names the implementation
  itself and has no ``interpret`` argument)."""
  for name in names:
    op = getattr(module, name)

    def call(*args, op=op, **kwargs):
      if kwargs.get("implementation") in ("pallas", "triton"):
        kwargs["interpret"] = True
      return op(*args, **kwargs)

    setattr(module, name, call)


def _smoke_bridge_model_loop(m):
  return m.run(batches=(2,))


def _smoke_bridge_overhead(m):
  return m.run(impl="xla", calls=10, reps=1)


def _smoke_cache(m):
  _interpret(m, "concat_and_cache_mla")
  return m.run(configs=[("fp8_ds_mla", 16, 8), ("fp8_model1", 16, 8)], impls=("triton", "xla"))


def _smoke_deepseek_v4(m):
  return m.run([m.Case(name="smoke decode", decode=True, num_reqs=2, query_len=2, context=254,
                       num_heads=16, index_topk=32, anchor=1.0),
                m.Case(name="smoke prefill", decode=False, num_reqs=1, query_len=8, context=248,
                       num_heads=16, index_topk=32, anchor=1.0)])


def _smoke_indexing(m):
  return m.run(implementation="xla")


def _smoke_mla_decode(m):
  _interpret(m, "mla_decode_paged")
  return m.run([m.Case(name="smoke b2 h16 len128", b=2, s_q=1, h_q=16, seqlen=128,
                       block_size=64, anchor=1.0, unit="TFLOP/s")])


def _smoke_mla_prefill(m):
  _interpret(m, "mla_prefill")
  return m.run([m.Case(name="smoke 2 seqs", len_q=(48, 16), len_k=(48, 16), causal=True,
                       heads=2)], anchor=False)


def _smoke_mla_prefill_grad(m):
  _interpret(m, "mla_prefill")
  small = m.Case(name="smoke 2 seqs", len_q=(40, 9), len_k=(40, 17), causal=True, heads=2)
  return m.run([small], check_case=small, anchor=False)


def _smoke_paged_attention(m):
  return m.run([m.Workload(name="smoke bf16", num_seqs=2, seq_len=64, seed_us=1.0)])


def _smoke_sharding(m):
  m.SPARSE_DECODE = dict(b=2, s_q=1, h=16, topk=32, bs=64, nb=4)
  m.DENSE_DECODE = dict(b=2, s_q=1, h=16, seqlen=128, bs=64)
  m.SPARSE_PREFILL = dict(s_q=8, h=16, topk=32, s_kv=256)
  return m.run(implementation="xla")


def _smoke_sparse_mla(m):
  _interpret(m, "sparse_mla_prefill", "sparse_mla_decode")
  return m.run({
      "smoke prefill": m.Prefill(s_q=8, h_q=16, topk=32, d_qk=576, s_kv=256, sink=True,
                                 anchor=1.0),
      "smoke decode": m.Decode(dtype="fp8_ds_mla", b=2, s_q=1, h_q=16, topk=32, block_size=64,
                               extra=None, extra_block_size=None, seqlen=128, anchor=1.0),
      "smoke decode v4.1": m.Decode(dtype="fp8_v41", b=2, s_q=1, h_q=16, topk=32, block_size=64,
                                    extra=16, extra_block_size=16, seqlen=128, anchor=None,
                                    extra_dtype="fp4_v41"),
  })


def _smoke_sparse_mla_grad(m):
  _interpret(m, "sparse_mla_prefill")
  return m.run({"smoke s_q8 h16 topk32": m.Shape(s_q=8, h_q=16, topk=32, d_qk=576, s_kv=256)},
               impl="triton")


SMOKE = {
    "bench_bridge_model_loop": _smoke_bridge_model_loop,
    "bench_bridge_overhead": _smoke_bridge_overhead,
    "bench_cache": _smoke_cache,
    "bench_deepseek_v4": _smoke_deepseek_v4,
    "bench_indexing": _smoke_indexing,
    "bench_mla_decode": _smoke_mla_decode,
    "bench_mla_prefill": _smoke_mla_prefill,
    "bench_mla_prefill_grad": _smoke_mla_prefill_grad,
    "bench_paged_attention": _smoke_paged_attention,
    "bench_sharding": _smoke_sharding,
    "bench_sparse_mla": _smoke_sparse_mla,
    "bench_sparse_mla_grad": _smoke_sparse_mla_grad,
}


# ---------------------------------------------------------------------------------------


def worker(name: str, rows_file: str, smoke: bool) -> None:
  """In the module's own process: its ``run()`` (or smoke recipe), one JSON line per row
  appended to ``rows_file`` as soon as the module hands it over (a ``run()`` that yields
  its rows keeps the finished ones when the budget cuts it short)."""
  module = importlib.import_module(f"benchmarks.{name}")
  if smoke and name not in SMOKE:
    raise SystemExit(f"{name}: no smoke recipe in benchmarks/run.py (SMOKE)")
  with open(rows_file, "a") as f:
    for row in SMOKE[name](module) if smoke else module.run():
      f.write(json.dumps(dataclasses.asdict(row)) + "\n")
      f.flush()


def run_module(name: str, budget: float, smoke: bool, env: dict) -> tuple[list, str]:
  """Runs ``name`` in a child process; returns (row dicts, "" or what went wrong)."""
  with tempfile.TemporaryDirectory() as tmp:
    rows_file = os.path.join(tmp, "rows.jsonl")
    cmd = [sys.executable, "-m", "benchmarks.run", "--worker", name, "--rows-file", rows_file]
    proc = subprocess.Popen(cmd + (["--smoke"] if smoke else []), cwd=ROOT, env=env,
                            start_new_session=True)
    try:
      rc = proc.wait(timeout=budget)
      problem = f"failed (exit {rc})" if rc else ""
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, signal.SIGKILL)  # the child and anything it started
      proc.wait()
      problem = f"stopped at its {budget:.0f} s budget"
    rows = []
    if os.path.exists(rows_file):
      with open(rows_file) as f:
        rows = [json.loads(line) for line in f if line.endswith("\n")]
    if not rows and not problem:  # e.g. a run() that reports its failing cases and goes on
      problem = "no rows"
    return rows, problem


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default=None, help="default: benchmarks/out (smoke: .../smoke)")
  parser.add_argument("--only", nargs="*", help="module names, e.g. bench_indexing")
  parser.add_argument("--smoke", action="store_true", help="tiny CPU run of every module")
  parser.add_argument("--worker", help=argparse.SUPPRESS)
  parser.add_argument("--rows-file", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    worker(args.worker, args.rows_file, args.smoke)
    return 0

  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
  if args.smoke:
    env.update(JAX_PLATFORMS="cpu", JAX_MLA_BENCH_SMOKE="1", XLA_FLAGS=(
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip())
  else:
    reason = no_gpu_reason(sys.executable)
    if reason:
      print(reason)
      return 1

  names = sorted(p.stem for p in (ROOT / "benchmarks").glob("bench_*.py"))
  if args.only:
    unknown = set(args.only) - set(names)
    if unknown:
      parser.error(f"unknown modules {sorted(unknown)}; there are {names}")
    names = [n for n in names if n in args.only]
  start = time.monotonic()
  rows, problems = [], []
  saved = 0.0  # budget seconds earlier modules left unused, passed on to later ones
  for i, name in enumerate(names, 1):
    left = TOTAL_S - (time.monotonic() - start)
    own = SMOKE_BUDGET_S if args.smoke else BUDGET_S.get(name, DEFAULT_BUDGET_S)
    budget = min(own + saved, left)
    if budget < 5:
      problems.append(f"{name}: not run (the {TOTAL_S} s total was spent)")
      print(f"[{i}/{len(names)}] {name}: not run, no time left", flush=True)
      continue
    print(f"[{i}/{len(names)}] {name} (budget {budget:.0f} s) ...", flush=True)
    t0 = time.monotonic()
    got, problem = run_module(name, budget, args.smoke, env)
    took = time.monotonic() - t0
    saved = max(0.0, budget - took) if not args.smoke else 0.0
    print(f"[{i}/{len(names)}] {name}: {len(got)} rows{', ' + problem if problem else ''}, "
          f"{took:.1f} s (total {time.monotonic() - start:.0f} s)", flush=True)
    rows += got
    if problem:
      problems.append(f"{name}: {problem}")

  from benchmarks.harness import Row, print_table, write_report  # imports JAX
  rows = [Row(**r) for r in rows]
  print_table(rows)
  out = args.out or ("benchmarks/out/smoke" if args.smoke else "benchmarks/out")
  write_report(rows, out)
  print(f"{len(rows)} rows from {len(names) - len(problems)} of {len(names)} modules in "
        f"{time.monotonic() - start:.0f} s; results in {out}/")
  for p in problems:
    print(f"  {p}")
  return 1 if problems else 0


if __name__ == "__main__":
  sys.exit(main())

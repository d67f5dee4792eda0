"""Shared timing and reporting for the GPU benchmarks: the median of many timed
repetitions after warm-up, over rotating input sets so L2 does not flatter us.

With ``JAX_MLA_BENCH_SMOKE=1`` (``python -m benchmarks.run --smoke``) timing runs two
input sets once each: the figures mean nothing, the point is that every module runs.
``JAX_MLA_BENCH_CALLS_PER_PASS`` sets the side-by-side timers' calls a pass (default
16; :data:`MIN_CALLS_PER_PASS`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import numpy as np

from jax_mla import set_l2_fetch_granularity
from jax_mla.testing import rel_err

SMOKE = os.environ.get("JAX_MLA_BENCH_SMOKE") == "1"


@dataclasses.dataclass
class Row:
  """One measured benchmark row and its anchor (FlashMLA, a seed kernel, copy bandwidth:
  benchmarks/RESULTS.md says where each anchor comes from)."""
  op: str
  config: str
  time_us: float
  metric: float  # the row's headline figure, in `unit`
  unit: str  # "TFLOP/s", "TB/s" or "us"
  anchor: float | None = None  # the anchor's figure in the same unit
  anchor_name: str = ""
  device: str = ""

  @property
  def ratio(self) -> float | None:
    if self.anchor is None:
      return None
    # For times, smaller is better: report anchor / ours so > 1 means faster.
    return self.anchor / self.metric if self.unit == "us" else self.metric / self.anchor


def device_name() -> str:
  d = jax.devices()[0]
  return getattr(d, "device_kind", str(d))


def add_l2_fetch_option(parser) -> None:
  """``--l2-fetch-granularity`` on a benchmark's command line (:func:`apply_l2_fetch`)."""
  parser.add_argument("--l2-fetch-granularity", type=int, default=None,
                      help="set the process's CUDA L2 fetch granularity first (32, 64, 128 "
                           "bytes; jax_mla.set_l2_fetch_granularity)")


def apply_l2_fetch(args) -> None:
  """Sets the L2 fetch granularity that :func:`add_l2_fetch_option` read, if given."""
  if args.l2_fetch_granularity is not None:
    set_l2_fetch_granularity(args.l2_fetch_granularity)
    print(f"L2 fetch granularity: {args.l2_fetch_granularity} bytes", flush=True)


def check_close(name: str, out, ref, tol: float = 1e-2) -> float:
  """Raises AssertionError when ``rel_err(out, ref) >= tol`` (a benchmark of a wrong
  result is no figure); returns the error."""
  err = rel_err(out, ref)
  if not err < tol:
    raise AssertionError(f"{name}: rel err {err:.2e} vs the XLA reference (tol {tol:.0e})")
  return err


def time_us(fn, arg_sets, *, reps: int = 30) -> float:
  """Median device time of one ``fn(*args)`` in microseconds.

  JAX runs on its own CUDA stream, so torch/triton event timers do not bracket
  its work, and one dispatch per timed call would add the host's launch latency
  (tens of us) to small kernels. Instead one jitted program runs ``fn`` once on
  each of the distinct input sets (distinct, so XLA cannot merge calls, and
  rotating, so L2 does not flatter us); its median wall time over the number of
  sets is the per-call time. The program's one dispatch stays in the figure,
  spread over the sets.
  """
  batched = jax.jit(lambda sets: [fn(*a) for a in sets])
  calls = list(arg_sets)
  if SMOKE:
    calls, reps = calls[:2], 1
  for _ in range(2):  # compile, then warm up
    jax.block_until_ready(batched(calls))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    outs = jax.block_until_ready(batched(calls))
    times.append(time.perf_counter() - t0)
    del outs  # freed once the clock has stopped, as in time_calls_us
  return 1e6 * float(np.median(times)) / len(calls)


def time_calls_us(calls, sync, *, reps: int = 10) -> float:
  """Median wall time per call of ``calls`` (one zero-argument callable per input set),
  dispatched back to back and synchronised once per pass; the clock runs from the first
  dispatch to the sync's return (the pass's outputs are freed after it).

  The side-by-side timer: the same for a jitted JAX op and a torch op. Both dispatch
  asynchronously, so for kernels longer than a dispatch the figure is GPU time.
  """
  if SMOKE:
    calls, reps = calls[:2], 1
  for _ in range(2):
    sync([c() for c in calls])
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    outs = [c() for c in calls]
    sync(outs)
    times.append(time.perf_counter() - t0)
    # Freed once the clock has stopped: deleting 16 calls' jax.Arrays took 87-183 us on
    # the H100 machine's host, 5-12 us a call, which a caller's next calls hide behind
    # the GPU's work (RESULTS.md, session 39).
    del outs
  return 1e6 * float(np.median(times)) / len(calls)


@dataclasses.dataclass(frozen=True)
class SideBySide:
  """Per-call times of one row for jax-mla and its peer, in microseconds: wall clock by
  :func:`time_calls_us`, GPU time by :func:`gpu_pass_us` (None where it cannot be read),
  both over passes of ``calls``. ``bridge``, ``bridge_gpu``: jax-mla's op called as the
  peer is, from torch through :mod:`torch_bridge` (the same timers; None where not
  timed)."""
  ours: float
  peer: float
  ours_gpu: float | None
  peer_gpu: float | None
  calls: int
  bridge: float | None = None
  bridge_gpu: float | None = None

  def measures(self) -> list[tuple[str, float, float]]:
    """``(label, ours, peer)``: the wall clock (label ""), then the GPU time (label
    " (GPU time)") where it was read, then the same two through the torch bridge
    (" (torch bridge)", " (torch bridge, GPU time)") where timed."""
    out = [("", self.ours, self.peer)]
    if self.ours_gpu is not None and self.peer_gpu is not None:
      out.append((" (GPU time)", self.ours_gpu, self.peer_gpu))
    if self.bridge is not None:
      out.append((" (torch bridge)", self.bridge, self.peer))
    if self.bridge_gpu is not None and self.peer_gpu is not None:
      out.append((" (torch bridge, GPU time)", self.bridge_gpu, self.peer_gpu))
    return out

  def summary(self, peer: str) -> str:
    """Both libraries' times and ``peer``'s time over ours, by each measure."""
    parts = [f"{label.strip(' ()') or 'wall'}: ours {ours:.1f} us, {peer} {theirs:.1f} us, "
             f"{peer}/ours {theirs / ours:.3f}" for label, ours, theirs in self.measures()]
    return (f"{self.calls} calls a pass; " + "; ".join(parts)
            + ("" if self.ours_gpu is not None else "; GPU time not read"))


def _calls_per_pass() -> int:
  value = os.environ.get("JAX_MLA_BENCH_CALLS_PER_PASS", "16")
  if not value.isdigit() or int(value) < 1:
    raise ValueError(f"JAX_MLA_BENCH_CALLS_PER_PASS must be a positive integer; got {value!r}")
  return int(value)


# Calls in a side-by-side pass at the least. A pass carries the host's latency once (on
# the H100 machine about 300-450 us for a jitted JAX op, 150-200 for a torch one), and
# the prefill rows have 4 input sets: over 4 calls that latency was 80-100 us of a 600 us
# JAX call (RESULTS.md, session 36). The longer the pass, the less of it a call carries
# (RESULTS.md, session 38).
MIN_CALLS_PER_PASS = _calls_per_pass()


def time_side_by_side(ours, peer, *, bridged=None, gpu_passes: int = 3) -> SideBySide:
  """Times ``ours`` (zero-argument jitted JAX calls, one per input set), ``peer`` (the
  same calls of a torch library) and, where given, ``bridged`` (ours called as the peer
  is, torch tensors through :mod:`torch_bridge`) with the same timers:
  :func:`time_calls_us`, then the median over ``gpu_passes`` of :func:`gpu_pass_us`, the
  contenders' passes taken in turn so that a drifting clock weighs on all alike. A pass
  takes the sets in turn, at least :data:`MIN_CALLS_PER_PASS` calls (the sets again from
  the first where there are fewer), so the latency a pass carries weighs alike on every
  row. The bridged calls run on torch's runtime and are synchronised as the peer's: the
  two wall clocks of ours differ by the runtimes' latencies (RESULTS.md, session 39)."""
  turns = -(-MIN_CALLS_PER_PASS // len(ours))
  contenders = [(list(ours) * turns, sync_jax), (list(peer) * turns, sync_torch)]
  if bridged is not None:
    contenders.append((list(bridged) * turns, sync_torch))
  wall = [time_calls_us(calls, sync) for calls, sync in contenders]
  spans = [[] for _ in contenders]
  for _ in range(gpu_passes):
    for times, (calls, sync) in zip(spans, contenders, strict=True):
      times.append(gpu_pass_us(calls, sync))
  gpu = [None if None in times else float(np.median(times)) for times in spans]
  if gpu[0] is None or gpu[1] is None:
    gpu = [None] * len(contenders)
  return SideBySide(*wall[:2], *gpu[:2], len(contenders[0][0]), *wall[2:], *gpu[2:])


def gpu_pass_us(calls, sync) -> float | None:
  """GPU time per call of one pass of ``calls`` dispatched back to back, as in
  :func:`time_calls_us`: the time the device spent on the pass's work (the union of its
  kernels', copies' and sets' intervals), read from a CUPTI trace through torch.profiler,
  over the number of calls. None without a CUDA torch, or where the trace holds fewer
  kernels than calls.

  The wall timer also holds the host's latency once a pass: dispatch to the first
  kernel, and the last kernel to the sync's return. For a jitted JAX op on the H100
  machine's host that came to 20-40 us a call at 16 calls a pass, against about 10 for
  a torch op (RESULTS.md, session 35); this figure leaves it out for both. So it does
  the gaps where the device waits for the host within the pass: under the trace a
  JAX op's dispatch slows, and the span of a pass (session 35's figure) read 200 us a
  call for a 124 us op (fp8_model1 h16, RESULTS.md, session 36).
  """
  import tempfile

  import torch
  if SMOKE or not torch.cuda.is_available():
    return None
  sync([c() for c in calls])  # an untraced pass first, as time_calls_us warms up
  with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    sync([c() for c in calls])
  with tempfile.NamedTemporaryFile(suffix=".json") as f:
    prof.export_chrome_trace(f.name)
    with open(f.name) as trace:
      events = [e for e in json.load(trace)["traceEvents"] if e.get("ph") == "X"
                and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
  if sum(e["cat"] == "kernel" for e in events) < len(calls):
    return None
  return busy_us([(e["ts"], e["ts"] + e["dur"]) for e in events]) / len(calls)


def busy_us(intervals) -> float:
  """The length of the union of ``(start, end)`` intervals."""
  total, reach = 0.0, float("-inf")
  for start, end in sorted(intervals):
    if end > reach:
      total += end - max(start, reach)
      reach = end
  return total


def sync_jax(outs):
  jax.block_until_ready(outs)


def sync_torch(outs):
  del outs
  import torch
  if torch.cuda.is_available():  # CPU tensors (the smoke run) are done when returned
    torch.cuda.synchronize()


def n_sets(bytes_per_set: int, l2_bytes: int = 50 << 20, lo: int = 16, hi: int = 32) -> int:
  """How many distinct input sets to rotate: enough to amortise one dispatch and to
  overflow L2 twice, within [lo, hi]."""
  if SMOKE:
    return 2
  return max(lo, min(hi, -(-2 * l2_bytes // max(bytes_per_set, 1))))


def print_table(rows: list[Row]) -> None:
  print(f"{'op':<34} {'config':<58} {'time us':>9} {'figure':>16} {'anchor':>16} {'ratio':>6}")
  for r in rows:
    anchor = "" if r.anchor is None else f"{r.anchor:.3g} {r.unit}"
    ratio = "" if r.ratio is None else f"{r.ratio:.2f}"
    print(f"{r.op:<34} {r.config:<58} {r.time_us:>9.1f} {r.metric:>9.3g} {r.unit:<6} "
          f"{anchor:>16} {ratio:>6}")


def write_report(rows: list[Row], out_dir: str) -> None:
  """Writes results.json and, where matplotlib exists, ratios.png under ``out_dir``."""
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "results.json"), "w") as f:
    json.dump([dict(dataclasses.asdict(r), ratio=r.ratio) for r in rows], f, indent=1)
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return
  with_anchor = [r for r in rows if r.ratio is not None]
  if not with_anchor:
    return
  fig, ax = plt.subplots(figsize=(10, 0.4 * len(with_anchor) + 1.5))
  ax.barh([f"{r.op}: {r.config}"[:70] for r in with_anchor], [r.ratio for r in with_anchor])
  ax.axvline(1.0, color="k", lw=0.8)
  ax.set_xlabel("jax-mla / anchor (>1 is better)")
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, "ratios.png"), dpi=100)

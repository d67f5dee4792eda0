"""Building blocks of Mosaic GPU kernels written lane by lane (``plgpu.inline_mgpu``):
each thread's own loads, stores, shuffles and arithmetic, as MLIR values.

Used where a kernel's access pattern has no tile layout Mosaic GPU knows (one warp
per token in :mod:`jax_mla.cache.mosaic`; vLLM's paged blocks in
:mod:`jax_mla.paged.mosaic`). Call these while an ``inline_mgpu`` body is being
built: they need its MLIR context and insertion point. Byte addresses are LLVM
global pointers (:func:`global_ptr`, :func:`at`); the PTX runs as written.
"""

from __future__ import annotations


def _ir():
  from jax._src.lib.mlir import ir
  return ir


def int_type(bits: int = 32):
  return _ir().IntegerType.get_signless(bits)


def f32_type():
  return _ir().F32Type.get()


def const(value: int, bits: int = 32):
  """An integer constant of ``bits`` bits."""
  from jax.experimental.mosaic import gpu as mgpu
  return mgpu.c(value, int_type(bits))


def fconst(value: float):
  """A float32 constant."""
  from jax.experimental.mosaic import gpu as mgpu
  return mgpu.c(value, f32_type())


def asm(ty, text: str, constraints: str, *args, effects: bool = False):
  """Inline PTX returning one value of type ``ty`` (``!llvm.void``: nothing)."""
  from jax._src.lib.mlir.dialects import llvm
  return llvm.inline_asm(ty, list(args), text, constraints, has_side_effects=effects)


def struct(*types: str):
  """An LLVM struct type of inline PTX with several results, e.g. ``struct("i32", "i32")``."""
  return _ir().Type.parse(f"!llvm.struct<({', '.join(types)})>")


def fields(value, ty, count: int):
  """The ``count`` fields of an inline PTX struct result, each of type ``ty``."""
  from jax._src.lib.mlir.dialects import llvm
  return [llvm.extractvalue(ty, value, [k]) for k in range(count)]


def void():
  return _ir().Type.parse("!llvm.void")


def global_ptr(ref):
  """The address of a GMEM memref's first element, as an LLVM global pointer."""
  from jax._src.lib.mlir.dialects import llvm
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  return llvm.addrspacecast(llvm.PointerType.get(address_space=1), mgpu_utils.memref_ptr(ref))


def at(base, offset):
  """Byte address ``base + offset`` (``offset`` an i64 value)."""
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  return mgpu_utils.getelementptr(base, [offset], int_type(8))


def wide(v):
  """An i32 value zero-extended to i64 (byte offsets of large arrays)."""
  from jax._src.lib.mlir.dialects import arith
  return arith.extui(int_type(64), v)


def load_words(ptr, count: int, hint: str = ""):
  """``count`` (1, 2 or 4) b32 words from ``ptr`` through the read-only path;
  ``hint``: a cache qualifier such as ``".L1::no_allocate"``."""
  if count == 1:
    return [asm(int_type(), f"ld.global.nc{hint}.b32 $0, [$1];", "=r,l", ptr)]
  regs = ", ".join(f"${k}" for k in range(count))
  words = asm(struct(*["i32"] * count), f"ld.global.nc{hint}.v{count}.b32 {{{regs}}}, [${count}];",
              ",".join(["=r"] * count + ["l"]), ptr)
  return fields(words, int_type(), count)


def load_f32(ptr):
  """One float32 from ``ptr`` through the read-only path."""
  return asm(f32_type(), "ld.global.nc.f32 $0, [$1];", "=f,l", ptr)


def store_words(ptr, words, ok=None):
  """Stores ``words`` (1, 2 or 4 b32 values) at ``ptr`` where ``ok`` (i32) is not 0;
  always when ``ok`` is None."""
  n = len(words)
  regs = "$1" if n == 1 else "{" + ", ".join(f"${k + 1}" for k in range(n)) + "}"
  vec = f".v{n}" if n > 1 else ""
  store = f"st.global{vec}.b32 [$0], {regs};"
  if ok is None:
    asm(void(), store, ",".join(["l"] + ["r"] * n), ptr, *words, effects=True)
    return
  asm(void(), f"{{.reg .pred p; setp.ne.b32 p, ${n + 1}, 0; @p {store}}}",
      ",".join(["l"] + ["r"] * (n + 1)), ptr, *words, ok, effects=True)


def bf16_floats(words):
  """b32 words of bf16 pairs (low value first) -> their float32 values, in order."""
  from jax._src.lib.mlir.dialects import arith
  return [arith.bitcast(f32_type(), v) for w in words
          for v in (arith.shli(w, const(16)), arith.andi(w, const(-65536)))]


def shuffle(v, lane_or_mask, mode: str):
  """``shfl.sync.<mode>`` of an i32 across the whole warp (every lane takes part)."""
  return asm(int_type(), f"shfl.sync.{mode}.b32 $0, $1, $2, 0x1f, 0xffffffff;", "=r,r,r", v,
             lane_or_mask)


def fmax(a, b):
  """``max.f32``: a NaN operand gives the other (CUDA's ``fmaxf``)."""
  return asm(f32_type(), "max.f32 $0, $1, $2;", "=f,f,f", a, b)


def across_row(v, combine):
  """``combine`` of an f32 over the four lanes that hold one ``mma.sync`` row (lanes
  ``4 r`` .. ``4 r + 3``), in each of them."""
  from jax._src.lib.mlir.dialects import arith
  for mask in (1, 2):
    v = combine(v, arith.bitcast(f32_type(), shuffle(arith.bitcast(int_type(), v), const(mask),
                                                     "bfly")))
  return v


def warpgroup_thread():
  """This thread's index in its 128-thread warpgroup, as i32."""
  from jax._src.lib.mlir.dialects import arith
  from jax.experimental.mosaic import gpu as mgpu
  return arith.remui(mgpu.thread_idx(), const(128))


def lane_and_warp():
  """``(lane, warp)`` of this thread in its 128-thread warpgroup, as i32."""
  from jax._src.lib.mlir.dialects import arith
  tid = warpgroup_thread()
  return arith.remui(tid, const(32)), arith.divui(tid, const(32))


def warpgroup_leader():
  """Whether this thread is its warpgroup's first, as an i1 (a predicate for one thread's
  arrivals and TMA issues)."""
  from jax._src.lib.mlir.dialects import arith
  return arith.cmpi(arith.CmpIPredicate.eq, warpgroup_thread(), const(0))


def block_x():
  """``blockIdx.x`` as i32."""
  from jax._src.lib.mlir.dialects import arith, gpu
  return arith.index_cast(int_type(), gpu.block_id(gpu.Dimension.x))


def exp2(x):
  """``2**x`` (``ex2.approx.ftz``; ``-inf`` gives 0)."""
  return asm(f32_type(), "ex2.approx.ftz.f32 $0, $1;", "=f,f", x)


def log2(x):
  """``log2(x)`` (``lg2.approx.ftz``: the callers' arguments are sums of at least 1)."""
  return asm(f32_type(), "lg2.approx.ftz.f32 $0, $1;", "=f,f", x)


def clamp(x, bound: float):
  """``x`` clamped to ``[-bound, bound]`` (float32)."""
  return asm(f32_type(), "{.reg .f32 t; max.f32 t, $1, $2; min.f32 $0, t, $3;}",
             "=f,f,f,f", x, fconst(-bound), fconst(bound))


def pack(lo, hi, dtype: str):
  """Two float32 values rounded into one b32 word of ``dtype`` (``bf16`` or ``f16``)
  pairs, ``lo`` in the low half."""
  return asm(int_type(), f"cvt.rn.{dtype}x2.f32 $0, $1, $2;", "=r,f,f", hi, lo)


def fp8_pairs(word, fp8: str):
  """Four fp8 bytes (``e4m3`` or ``e5m2``) -> two b32 words of fp16 pairs, exactly."""
  out = asm(struct("i32", "i32"),
            f"{{.reg .b16 lo, hi; mov.b32 {{lo, hi}}, $2; cvt.rn.f16x2.{fp8}x2 $0, lo; "
            f"cvt.rn.f16x2.{fp8}x2 $1, hi;}}", "=r,=r,r", word)
  return fields(out, int_type(), 2)


def mma_16816(acc, a, b, *, dtype: str):
  """``mma.sync.m16n8k16`` with float32 accumulation: ``acc`` (4 float32), ``a`` (4 b32
  words of ``dtype`` pairs, row-major), ``b`` (2 words, column-major); PTX's fragment
  layouts. Returns the 4 new accumulator values."""
  out = asm(struct("f32", "f32", "f32", "f32"),
            f"mma.sync.aligned.m16n8k16.row.col.f32.{dtype}.{dtype}.f32 "
            "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
            "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", *a, *b, *acc)
  return fields(out, f32_type(), 4)


def softmax_step(s, m, l):
  """One step of the online softmax (base 2) of the ``mma.sync`` kernels for a row whose
  scores sit four to a lane across the row's four lanes (``s``: this lane's 4, masked
  ones ``-inf``): ``(m, l, alpha, p)``. ``m`` is the row's running max (the same in its
  four lanes), ``l`` this lane's part of the running sum (summed over the lanes at the
  end); a row with no key yet keeps ``m = -inf`` and takes exponents against 0."""
  from jax._src.lib.mlir.dialects import arith
  neg_inf = fconst(float("-inf"))
  top = across_row(fmax(fmax(s[0], s[1]), fmax(s[2], s[3])), fmax)
  m_new = fmax(m, top)
  m_safe = arith.select(arith.cmpf(arith.CmpFPredicate.OEQ, m_new, neg_inf), fconst(0.0), m_new)
  alpha = exp2(arith.subf(m, m_safe))
  p = [exp2(arith.subf(v, m_safe)) for v in s]
  l = arith.addf(arith.mulf(l, alpha), arith.addf(arith.addf(p[0], p[1]), arith.addf(p[2], p[3])))
  return m_new, l, alpha, p

"""DeepSeek V4.1 caches ``"fp8_v41"`` / ``"fp4_v41"``: bytes against a numpy transcription
of FlashMLA's quantizer (random and adversarial inputs), the Triton writer against the
XLA writer, and sparse decode (reference vs the Triton kernel, the fp8 main + fp4 extra
pair) on FlashMLA's adversarial index cases. Kernels run in the Pallas interpreter on CPU;
the ``gpu`` tests compile them."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import rel_err
from sparse_cases import indices_and_used_slots, random_sink

from jax_mla import _mosaic
from jax_mla.cache import (
  KV_CACHE_DTYPES,
  concat_and_cache_mla,
  dequantize_fp4_v41,
  dequantize_fp8_v41,
  e2m1,
  gather_dequantize,
  kv_cache_shape,
  kv_cache_storage_dtype,
  quantize_fp4_v41,
  quantize_fp8_v41,
)
from jax_mla.cache.ds_mla import DS_MLA
from jax_mla.cache.formats import resolve
from jax_mla.cache.model1 import MODEL1
from jax_mla.cache.v41_fp4 import V41_FP4
from jax_mla.cache.v41_fp8 import V41_FP8
from jax_mla.sparse_mla import api as sparse_api
from jax_mla.sparse_mla import mosaic, sparse_mla_decode, triton

BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn
FMTS = ("fp8_v41", "fp4_v41")
QUANTIZE = {"fp8_v41": quantize_fp8_v41, "fp4_v41": quantize_fp4_v41}
DEQUANTIZE = {"fp8_v41": dequantize_fp8_v41, "fp4_v41": dequantize_fp4_v41}
TOKEN_BYTES = {"fp8_v41": 528, "fp4_v41": 288}


# ---------------------------------------------------------------------------
# FlashMLA's tests/quant.py (V41_FP8Sparse, V41_FP4Sparse), transcribed to numpy.
# torch -> numpy: torch.max / clamp_min propagate NaN like np.max / np.maximum;
# torch.nan_to_num keeps its default posinf (the largest float32); torch.bucketize(right)
# is np.searchsorted(side); the float32 -> e4m3 cast is ml_dtypes' (nearest even, NaN
# past 464, like torch's). FlashMLA runs it on the GPU, whose arithmetic returns the one
# positive NaN: numpy keeps an operand's NaN or makes a negative one, hence _gpu_nan.

E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def _gpu_nan(v):
  return np.where(np.isnan(v), np.float32(np.nan), v).astype(np.float32)


def flashmla_fp8_v41(x):
  """quantize_k_cache(V41_FP8Sparse): float [..., 512] -> uint8 [..., 528]."""
  x = np.asarray(x, np.float32)
  tiles = x.reshape(*x.shape[:-1], 16, 32)
  with np.errstate(all="ignore"):
    inv = np.abs(tiles).max(-1) / np.float32(448)
    inv = np.maximum(inv, np.float32(1e-4))  # _cast_scale_inv_to_ue8m0
    scale = np.exp2(np.ceil(np.log2(inv))).astype(np.float32)
    q = _gpu_nan(tiles / scale[..., None])
  data = q.astype(E4M3).view(np.uint8).reshape(*x.shape[:-1], 512)
  ue8m0 = ((scale.view(np.uint32) >> 23) & 0xFF).astype(np.uint8)  # inf, NaN -> 0xFF
  return np.concatenate([data, ue8m0], -1)


def _quantize_to_e2m1(x):
  sign = np.signbit(x).astype(np.uint8) << 3
  a = np.minimum(np.nan_to_num(np.abs(x), nan=0.0, posinf=6.0), np.float32(6))
  mids = (E2M1_MAGNITUDES[:-1] + E2M1_MAGNITUDES[1:]) / 2
  code = np.searchsorted(mids, a, side="right")
  on_tie = (a[..., None] == mids).any(-1)
  tie_code = np.searchsorted(mids, a, side="left")  # on a tie: the lower candidate
  code = np.where(on_tie, tie_code + (tie_code & 1), code)
  return sign | code.astype(np.uint8)


def flashmla_fp4_v41(x):
  """quantize_k_cache(V41_FP4Sparse): float [..., 512] -> uint8 [..., 288]."""
  x = np.asarray(x, np.float32)
  tiles = x.reshape(*x.shape[:-1], 32, 16)
  amax = np.nan_to_num(np.abs(tiles), nan=np.inf).max(-1)  # NaN poisons the tile
  with np.errstate(all="ignore"):
    scale = np.clip(amax / np.float32(6), np.float32(2.0**-9), np.float32(448))
  scale = np.where(np.isinf(amax), 0x7F, scale.astype(E4M3).view(np.uint8)).astype(np.uint8)
  with np.errstate(all="ignore"):
    q = _gpu_nan(tiles / scale.view(E4M3).astype(np.float32)[..., None])
  codes = _quantize_to_e2m1(q).reshape(*x.shape[:-1], 512)
  return np.concatenate([codes[..., 0::2] | (codes[..., 1::2] << 4), scale], -1)


def flashmla_dequantize(b, fmt):
  """dequantize_k_cache: uint8 [..., 528 | 288] -> bf16 [..., 512]."""
  b = np.asarray(b, np.uint8)
  if fmt == "fp8_v41":
    vals = b[..., :512].view(E4M3).astype(np.float32).reshape(*b.shape[:-1], 16, 32)
    e = b[..., 512:].astype(np.int64)
    scale = np.where(e == 0xFF, np.nan, np.ldexp(1.0, e - 127))  # float8_e8m0fnu
  else:
    codes = np.stack([b[..., :256] & 0xF, b[..., :256] >> 4], -1).reshape(*b.shape[:-1], 512)
    mag = E2M1_MAGNITUDES[codes & 7]
    vals = np.where(codes & 8, -mag, mag).reshape(*b.shape[:-1], 32, 16)
    scale = b[..., 256:].view(E4M3).astype(np.float32)
  with np.errstate(all="ignore"):
    out = vals * scale.astype(np.float32)[..., None]
  return out.reshape(*b.shape[:-1], 512).astype(BF16)


FLASHMLA = {"fp8_v41": flashmla_fp8_v41, "fp4_v41": flashmla_fp4_v41}


# ---------------------------------------------------------------------------
# Inputs


def rand_latent(rng, n, dtype=BF16):
  """Latents with per-16-column magnitudes over 1e-8..1e4 (tiles of both formats)."""
  x = rng.standard_normal((n, 512)).astype(np.float32)
  x.reshape(n, 32, 16)[:] *= 10.0 ** rng.uniform(-8, 4, size=(n, 32, 1))
  return x.astype(dtype)


def adversarial_latent(dtype=BF16):
  """One row per case: NaN, -NaN, +-inf, zeros and -0, tiny and denormal tiles,
  values past every format limit, ties of the e2m1 / e4m3 roundings."""
  f32 = np.finfo(np.float32)
  rows = []

  def row(fill=0.0, **cols):
    r = np.full(512, fill, np.float32)
    for k, v in cols.items():
      r[int(k[1:])] = v
    rows.append(r)

  row(c3=np.nan, c100=1.0)
  row(1.0, c40=-np.nan, c200=np.inf)
  row(-2.0, c7=np.inf, c300=-np.inf, c301=5.0)
  row(0.0)
  row(-0.0, c1=0.5)
  row(3e-39, c20=-1e-40)  # float32 denormals (bf16 keeps some)
  row(1e-30, c5=-2e-30)  # tiny amax: the scale floors
  row(3e38, c9=-1e38, c64=2688.0, c65=2700.0, c66=1e4)  # fp4 scale clamps at 448
  row(float(f32.max), c1=-float(f32.max))
  ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.5, 5.5], np.float32)
  r = np.tile(np.concatenate([ties, -ties[:6]]), 32)  # amax 6 per 16-tile: scale 1
  rows.append(r)
  rows.append(r * np.float32(0.171875))  # scale 0.171875: ties at scaled midpoints
  rows.append(np.tile(np.array([6.375, 1.0] * 8, np.float32), 32))  # amax / 6 = e4m3 tie
  rows.append(np.tile(np.array([448.0, -448.0] * 16, np.float32), 16))  # fp8 amax at 448
  rows.append(np.tile(np.array([449.0, 1.0] * 16, np.float32), 16))
  return np.stack(rows).astype(dtype)


def midpoint_neighbours():
  """float32 latents next to every e2m1 midpoint times the tile scale (exact quotients
  rounded onto or off a midpoint): tests the float32 quotient's double rounding."""
  mids = (E2M1_MAGNITUDES[:-1] + E2M1_MAGNITUDES[1:]) / 2
  rows = []
  for scale in (np.float32(1.0), np.float32(0.171875), np.float32(2.0**-9), np.float32(448)):
    vals = []
    for m in mids * scale:
      v = np.float32(m)
      vals += [np.nextafter(np.nextafter(v, -1), -1), np.nextafter(v, -1), v,
               np.nextafter(v, 10), np.nextafter(np.nextafter(v, 10), 10)]
    vals = np.array(vals, np.float32)
    tile = np.concatenate([[np.float32(6) * scale], vals[:15]])  # amax / 6 = scale exactly
    tile2 = np.concatenate([[np.float32(6) * scale], vals[15:30]])
    tile3 = np.concatenate([[np.float32(6) * scale], vals[30:], np.zeros(10, np.float32)])
    rows.append(np.tile(np.concatenate([tile, tile2, -tile3, tile]), 8))
  return np.stack(rows)


# ---------------------------------------------------------------------------
# Layout and bytes


@pytest.mark.cpu_only
def test_shapes_and_registry():
  assert {"fp8_v41", "fp4_v41"} <= set(KV_CACHE_DTYPES)
  assert kv_cache_shape(10, 64, 512, "fp8_v41") == (10, 64, 528)
  assert kv_cache_shape(3, 256, 512, "fp4_v41") == (3, 256, 288)
  assert kv_cache_storage_dtype("fp4_v41") == jnp.uint8
  assert (V41_FP8.num_tiles, V41_FP8.data_bytes) == (16, 512)
  assert (V41_FP4.num_tiles, V41_FP4.data_bytes) == (32, 256)
  with pytest.raises(ValueError, match="head_size"):
    kv_cache_shape(1, 64, 576, "fp8_v41")


def test_known_bytes():
  """Hand-computed tokens. fp8: amax 1 -> scale 2**ceil(log2(1/448)) = 2**-8 (UE8M0 119),
  1.0 -> 256 = e4m3 0x78. fp4: scale e4m3(1/6) = 0.171875 (0x23), 1 / 0.171875 = 5.8
  -> 6 (code 7); -0.0 -> code 8."""
  x = np.ones((1, 512), np.float32)
  x[0, 1] = -0.0
  fp8 = np.asarray(quantize_fp8_v41(jnp.asarray(x, jnp.bfloat16)))[0]
  assert fp8[0] == 0x78 and fp8[1] == 0x80 and np.all(fp8[2:512] == 0x78)
  assert np.all(fp8[512:] == 119)
  fp4 = np.asarray(quantize_fp4_v41(jnp.asarray(x, jnp.bfloat16)))[0]
  assert fp4[0] == 0x87 and np.all(fp4[1:256] == 0x77) and np.all(fp4[256:] == 0x23)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("kind", ["random_bf16", "adversarial_bf16", "random_f32",
                                  "adversarial_f32", "midpoints_f32"])
def test_quantize_matches_flashmla(fmt, kind):
  rng = np.random.default_rng(len(kind) + len(fmt))
  x = {"random_bf16": lambda: rand_latent(rng, 64),
       "adversarial_bf16": adversarial_latent,
       "random_f32": lambda: rand_latent(rng, 64, np.float32),
       "adversarial_f32": lambda: adversarial_latent(np.float32),
       "midpoints_f32": midpoint_neighbours}[kind]()
  got = np.asarray(QUANTIZE[fmt](jnp.asarray(x)))
  want = FLASHMLA[fmt](x)
  assert got.shape == want.shape == (x.shape[0], TOKEN_BYTES[fmt])
  bad = np.argwhere(got != want)
  assert bad.size == 0, f"{len(bad)} bytes differ, first at {bad[:3].tolist()}"


def test_poisoned_tiles():
  """The special rows of the oracle, spelled out: a NaN makes its fp8 tile 0x7F with scale
  0xFF and its fp4 tile codes 0 with scale 0x7F; an inf makes the fp8 scale 0xFF (finite
  values +-0, infinities NaN) and saturates in fp4 (scale 448 = 0x7E)."""
  x = np.ones((1, 512), np.float32)
  x[0, 3], x[0, 40], x[0, 41] = np.nan, np.inf, -2.0
  fp8 = np.asarray(quantize_fp8_v41(jnp.asarray(x)))[0]
  assert np.all(fp8[:32] == 0x7F) and fp8[512] == 0xFF
  assert fp8[40] == 0x7F and fp8[41] == 0x80 and np.all(fp8[42:64] == 0) and fp8[513] == 0xFF
  assert np.all(fp8[514:] == 119)
  fp4 = np.asarray(quantize_fp4_v41(jnp.asarray(x)))[0]
  assert np.all(fp4[:8] == 0) and fp4[256] == 0x7F
  assert fp4[20] == 0x87 and np.all(fp4[21:24] == 0) and fp4[258] == 0x7E  # -2 / 448 -> -0


def test_e2m1_all_bf16_values():
  """Every bf16 value over e4m3 scales, against the transcribed _quantize_to_e2m1."""
  x = np.arange(2**16, dtype=np.uint16).view(BF16).astype(np.float32)
  x = x[np.isfinite(x)]
  for s in (1.0, 0.171875, 2.0**-9, 448.0, 0.8125):
    got = np.asarray(e2m1.codes(jnp.asarray(x), jnp.float32(s)))
    with np.errstate(over="ignore"):
      want = _quantize_to_e2m1(x / np.float32(s))
    np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(np.asarray(e2m1.values(jnp.arange(16))),
                                np.concatenate([E2M1_MAGNITUDES, -E2M1_MAGNITUDES]))


@pytest.mark.parametrize("fmt", FMTS)
def test_dequantize_matches_flashmla(fmt):
  """Round trips, and stale bytes (NaN patterns included) read as FlashMLA reads them,
  except below float32's normal range (UE8M0 bytes < 9, never written), which may
  flush to zero (XLA's arithmetic; UE8M0 byte 0 always reads as scale 0)."""
  rng = np.random.default_rng(1)
  x = np.concatenate([rand_latent(rng, 32), adversarial_latent()])
  b = QUANTIZE[fmt](jnp.asarray(x))
  stale = rng.integers(0, 256, (64, TOKEN_BYTES[fmt]), dtype=np.uint8)
  stale[rng.random(stale.shape) < 0.2] = 0x7F
  stale[rng.random(stale.shape) < 0.2] = 0xFF
  for rows in (np.asarray(b), stale):
    got = np.asarray(DEQUANTIZE[fmt](jnp.asarray(rows)))
    want = flashmla_dequantize(rows, fmt)
    nan = np.isnan(got.astype(np.float32))
    np.testing.assert_array_equal(nan, np.isnan(want.astype(np.float32)))
    tiny = np.abs(want.astype(np.float32)) < np.finfo(np.float32).tiny
    if fmt == "fp8_v41":
      tiny |= np.repeat(rows[..., 512:] == 0, 32, axis=-1)
    flushed = tiny & (got == 0)
    np.testing.assert_array_equal(got[~nan & ~flushed].view(np.uint16),
                                  want[~nan & ~flushed].view(np.uint16))
  # Inputs inside the scales' ranges come back within a step of their tile's grid.
  fin = (rng.standard_normal((16, 512)) * 0.5).astype(BF16)
  back = np.asarray(DEQUANTIZE[fmt](QUANTIZE[fmt](jnp.asarray(fin))), np.float32)
  tile = 32 if fmt == "fp8_v41" else 16
  fin = fin.astype(np.float32).reshape(16, -1, tile)
  err = np.abs(back.reshape(fin.shape) - fin).max(-1)
  assert np.all(err <= np.abs(fin).max(-1) / (8 if fmt == "fp8_v41" else 4))


@pytest.mark.parametrize("fmt", FMTS)
def test_gather_dequantize(fmt):
  rng = np.random.default_rng(2)
  x = jnp.asarray(rand_latent(rng, 24).reshape(3, 8, 512))
  cache = QUANTIZE[fmt](x)
  slots = jnp.asarray([[0, 23, 5], [9, 9, 17]], jnp.int32)
  got = gather_dequantize(cache, slots, kv_cache_dtype=fmt)
  want = DEQUANTIZE[fmt](cache.reshape(24, -1))[np.asarray(slots)]
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


# ---------------------------------------------------------------------------
# Writer


@pytest.mark.parametrize("fmt,whole", [("fp8_v41", False), ("fp4_v41", True)])
def test_writer_xla_and_triton_match_flashmla(fmt, whole, interpret):
  """Both writers put FlashMLA's token bytes at their slots and leave every other byte;
  the kernel takes the latent split (448 | 64) or whole (512 | 0)."""
  rng = np.random.default_rng(3)
  shape = kv_cache_shape(4, 4, 512, fmt)
  stale = rng.integers(0, 256, shape, dtype=np.uint8)
  x = np.concatenate([rand_latent(rng, 5), adversarial_latent()[[0, 1, 2, 7]]])
  slots = np.array([3, -1, 15, 4, 16, 0, 100, 7, 2], np.int32)  # 16, 100: past the cache
  kv_c, k_pe = (x, x[:, :0]) if whole else (x[:, :448], x[:, 448:])
  want = stale.reshape(16, -1).copy()
  for t, s in enumerate(slots):
    if 0 <= s < 16:
      want[s] = FLASHMLA[fmt](x[t])
  for impl in ("xla", "triton"):
    got = concat_and_cache_mla(jnp.asarray(kv_c), jnp.asarray(k_pe), jnp.asarray(stale),
                               jnp.asarray(slots), kv_cache_dtype=fmt, implementation=impl,
                               interpret=interpret)
    np.testing.assert_array_equal(np.asarray(got).reshape(16, -1), want)


def test_writer_under_jit_with_donation(interpret):
  rng = np.random.default_rng(4)
  cache = jnp.zeros(kv_cache_shape(2, 4, 512, "fp4_v41"), jnp.uint8)
  x = jnp.asarray(rand_latent(rng, 3))
  step = jax.jit(lambda c, s: concat_and_cache_mla(x, x[:, :0], c, s, kv_cache_dtype="fp4_v41"),
                 donate_argnums=0)
  out = step(cache, jnp.asarray([1, 6, -1], jnp.int32))
  np.testing.assert_array_equal(np.asarray(out).reshape(8, -1)[[1, 6]],
                                flashmla_fp4_v41(np.asarray(x)[:2]))
  assert cache.is_deleted()


# ---------------------------------------------------------------------------
# Sparse decode


def v41_key_set(rng, fmt, b, s_q, topk, num_blocks, block_size, lengths):
  """(cache, indices[b, s_q, topk], topk_length[b] or None): batch 0 gets length 0 and
  every slot no usable index names holds NaN latents (poisoned tiles)."""
  n = num_blocks * block_size
  idx, topk_length, used = indices_and_used_slots(rng, b, s_q, topk, n, lengths)
  x = (rng.standard_normal((n, 512)) * 0.3).astype(np.float32)
  x[~used] = np.nan
  cache = QUANTIZE[fmt](jnp.asarray(x.reshape(num_blocks, block_size, 512), jnp.bfloat16))
  return cache, jnp.asarray(idx), None if topk_length is None else jnp.asarray(topk_length)


DECODE_CASES = [
    # main fmt, extra fmt (None: no extra set), b, s_q, h_q, topk, blocks, bs, sink, lengths,
    # extra (topk, blocks, bs)
    ("fp8_v41", "fp4_v41", 2, 2, 16, 19, 3, 16, True, True, (23, 20, 2)),
    ("fp8_v41", "fp8_v41", 2, 1, 20, 9, 40, 2, False, False, (8, 2, 64)),
]


def decode_inputs(seed, case):
  fmt, efmt, b, s_q, h_q, topk, nb, bs, sink, lengths, extra = case
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((b, s_q, h_q, 512)) * 0.3, jnp.bfloat16)
  cache, idx, tl = v41_key_set(rng, fmt, b, s_q, topk, nb, bs, lengths)
  kw = dict(kv_cache_dtype=fmt, attn_sink=random_sink(rng, h_q) if sink else None,
            topk_length=tl)
  if extra:
    ecache, eidx, etl = v41_key_set(rng, efmt, b, s_q, *extra, lengths)
    kw.update(extra_kv_cache=ecache, extra_indices=eidx, extra_topk_length=etl,
              extra_kv_cache_dtype=efmt)
  return q, cache, idx, kw


def _check_lse(got, ref):
  got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
  assert not np.isnan(got).any()
  np.testing.assert_array_equal(np.isposinf(got), np.isposinf(ref))
  fin = np.isfinite(ref)
  np.testing.assert_allclose(got[fin], ref[fin], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", DECODE_CASES, ids=["fp8+fp4-u16view", "fp8+fp8"])
def test_decode_kernel_matches_reference(interpret, monkeypatch, case):
  """Invalid indices of every kind, NaN in unused slots, lengths 0, sinks +-inf; the first
  case also reads its caches through the uint16 view (caches of 2-4 GiB), block_k 16."""
  q, cache, idx, kw = decode_inputs(5, case)
  ref = sparse_mla_decode(q, cache, idx, implementation="xla", **kw)
  config = None
  if case[1] == "fp4_v41":
    monkeypatch.setattr(triton, "I32_SAFE_BYTES", 0)
    config = triton.Config(block_k=16, num_stages=1)  # a new compile, with the patched view
  out, lse = sparse_mla_decode(q, cache, idx, implementation="triton", interpret=interpret,
                               config=config, **kw)
  assert out.shape == q.shape and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
  assert not np.isnan(np.asarray(out, np.float32)).any()
  assert rel_err(out, ref[0]) < 1e-2
  _check_lse(lse, ref[1])


@pytest.mark.cpu_only
def test_decode_reference_matches_dense_numpy():
  """One softmax over the fp8 main and fp4 extra rows, dequantized by the oracle."""
  case = DECODE_CASES[0]
  q, cache, idx, kw = decode_inputs(6, case)
  out, lse = sparse_mla_decode(q, cache, idx, implementation="xla", **kw)
  b, s_q, h_q, d = q.shape
  scores, rows = [], []
  for c, i, tl, fmt in ((cache, idx, kw["topk_length"], case[0]),
                        (kw["extra_kv_cache"], kw["extra_indices"], kw["extra_topk_length"],
                         case[1])):
    dense = flashmla_dequantize(np.asarray(c), fmt).astype(np.float64).reshape(-1, d)
    i = np.asarray(i).reshape(b * s_q, -1)
    ok = (i >= 0) & (i < dense.shape[0]) & (np.arange(i.shape[1]) < np.repeat(
        np.asarray(tl), s_q)[:, None])
    k = dense[np.where(ok, i, 0)]
    qq = np.asarray(q, np.float64).reshape(b * s_q, h_q, d)
    s = np.einsum("thd,tkd->thk", qq, np.where(ok[..., None], k, 0)) * d ** -0.5
    scores.append(np.where(ok[:, None, :], s, -np.inf))
    rows.append(np.where(ok[..., None], k, 0))
  s, k = np.concatenate(scores, -1), np.concatenate(rows, 1)
  with np.errstate(all="ignore"):
    m = s.max(-1, keepdims=True)
    lse_want = (m + np.log(np.exp(s - m).sum(-1, keepdims=True)))[..., 0]
    o = np.einsum("thk,tkd->thd", np.exp(s - lse_want[..., None]), k)
    o /= (1 + np.exp(np.asarray(kw["attn_sink"], np.float64) - lse_want))[..., None]
  empty = np.isneginf(m[..., 0])
  o[empty], lse_want[empty] = 0, np.inf
  np.testing.assert_allclose(np.asarray(out, np.float64).reshape(o.shape), o, atol=2e-2)
  _check_lse(lse, lse_want.reshape(b, s_q, h_q).transpose(0, 2, 1))
  assert np.isposinf(np.asarray(lse)).any()  # lengths 0 and all-invalid rows exist


@pytest.mark.cpu_only
def test_decode_validation(monkeypatch):
  q = jnp.zeros((1, 1, 64, 512), jnp.bfloat16)
  fp8 = jnp.zeros(kv_cache_shape(2, 4, 512, "fp8_v41"), jnp.uint8)
  fp4 = jnp.zeros(kv_cache_shape(2, 4, 512, "fp4_v41"), jnp.uint8)
  idx = jnp.zeros((1, 1, 3), jnp.int32)
  extra = dict(extra_kv_cache=fp4, extra_indices=idx)
  with pytest.raises(ValueError, match="extra_kv_cache_dtype"):
    sparse_mla_decode(q, fp4, idx, kv_cache_dtype="fp4_v41", extra_kv_cache_dtype="fp8_v41",
                      extra_kv_cache=fp8, extra_indices=idx)
  with pytest.raises(ValueError, match="extra_kv_cache_dtype"):
    sparse_mla_decode(q, fp8, idx, kv_cache_dtype="fp8_v41", extra_kv_cache_dtype="fp8_model1",
                      **extra)
  with pytest.raises(ValueError, match="extra_kv_cache_dtype"):
    sparse_mla_decode(q, fp8, idx, kv_cache_dtype="fp8_v41", extra_kv_cache_dtype="fp4_v41")
  with pytest.raises(ValueError, match="extra_kv_cache"):  # fp4 bytes read as fp8_v41
    sparse_mla_decode(q, fp8, idx, kv_cache_dtype="fp8_v41", **extra)
  with pytest.raises(ValueError, match="q.shape"):
    sparse_mla_decode(jnp.zeros((1, 1, 64, 576), jnp.bfloat16), fp8, idx,
                      kv_cache_dtype="fp8_v41")
  # The Mosaic GPU kernels read every V4.1 format and pair; None picks them on Hopper
  # for every head count.
  for fmts in ((V41_FP8,), (V41_FP8, V41_FP4), (V41_FP4,), (DS_MLA,), (MODEL1, MODEL1)):
    mosaic.check_supported(q, fmts)
  monkeypatch.setattr(_mosaic, "on_hopper", lambda: True)
  monkeypatch.setattr(_mosaic, "runs_on_gpu", lambda like: True)  # q is a CPU array here
  for fmts in ((DS_MLA,), (V41_FP8, V41_FP4), (V41_FP4,)):
    assert sparse_api._implementation(q, None, False, fmts) == "mosaic"
    assert sparse_api._implementation(q[..., :16, :], None, False, fmts) == "mosaic"


# ---------------------------------------------------------------------------
# Compiled kernels (make test-gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS)
def test_gpu_writer_matches_flashmla(fmt):
  rng = np.random.default_rng(7)
  x = np.concatenate([rand_latent(rng, 61), adversarial_latent(np.float32)])
  slots = rng.permutation(90)[:x.shape[0]].astype(np.int32)  # >= 80: skipped
  cache = jnp.zeros(kv_cache_shape(5, 16, 512, fmt), jnp.uint8)
  got = concat_and_cache_mla(jnp.asarray(x[:, :448]), jnp.asarray(x[:, 448:]), cache,
                             jnp.asarray(slots), kv_cache_dtype=fmt, implementation="triton")
  got = np.asarray(got).reshape(80, -1)
  ok = slots < 80
  np.testing.assert_array_equal(got[slots[ok]], FLASHMLA[fmt](x[ok]))


@pytest.mark.gpu
def test_gpu_decode_fp8_main_fp4_extra():
  q, cache, idx, kw = decode_inputs(8, ("fp8_v41", "fp4_v41", 3, 2, 64, 70, 6, 64, True, True,
                                        (130, 40, 4)))
  ref = sparse_mla_decode(q, cache, idx, implementation="xla", **kw)
  out, lse = sparse_mla_decode(q, cache, idx, implementation="triton", **kw)
  assert rel_err(out, ref[0]) < 1e-2
  _check_lse(lse, ref[1])


MOSAIC_CASES = [
    # h_q 64 and 128; fp8 main alone, with an fp8 extra set, with an fp4 extra set; fp4 alone.
    ("fp8_v41", None, 3, 2, 64, 70, 6, 64, True, True, None),
    ("fp8_v41", "fp8_v41", 2, 2, 128, 200, 9, 64, True, True, (100, 11, 2)),
    ("fp8_v41", "fp4_v41", 3, 2, 64, 70, 6, 64, True, True, (130, 40, 4)),
    ("fp4_v41", None, 2, 1, 128, 33, 3, 16, False, True, None),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", MOSAIC_CASES, ids=["fp8", "fp8+fp8-h128", "fp8+fp4", "fp4-h128"])
def test_gpu_mosaic_decode_matches_reference(case):
  """The Mosaic GPU kernel (the default on Hopper) on V4.1 caches: invalid indices of every
  kind, NaN in unused slots, lengths 0, sinks +-inf."""
  q, cache, idx, kw = decode_inputs(9, case)
  if not _mosaic.default_for(mosaic.check_supported, q,
                             tuple(resolve(f, "kv_cache_dtype") for f in case[:2] if f)):
    pytest.skip("needs a Hopper GPU and jax >= 0.11 (Mosaic GPU)")
  ref = sparse_mla_decode(q, cache, idx, implementation="xla", **kw)
  out, lse = sparse_mla_decode(q, cache, idx, implementation="mosaic", **kw)
  assert not np.isnan(np.asarray(out, np.float32)).any()
  assert rel_err(out, ref[0]) < 1e-2
  _check_lse(lse, ref[1])
  default = sparse_mla_decode(q, cache, idx, **kw)[0]
  np.testing.assert_array_equal(np.asarray(default, np.float32), np.asarray(out, np.float32))

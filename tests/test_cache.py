"""KV-cache formats and writer: byte layouts against hand-built numpy bytes,
quantization round trips, the Triton writer against the reference writer."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import rel_err

from jax_mla.cache import (
  concat_and_cache_mla,
  dequantize_fp8_ds_mla,
  dequantize_fp8_model1,
  dequantize_fp8_model1_cache,
  gather_dequantize,
  kv_cache_shape,
  kv_cache_storage_dtype,
  model1_block_bytes,
  quantize_fp8_ds_mla,
  quantize_fp8_model1,
  quantize_fp8_model1_cache,
)

BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn


# ---------------------------------------------------------------------------
# Hand-built expected bytes (numpy, float64 log2 for the power-of-two rules)


def _fp8_bytes(v):
  """fp8 bytes of float32 ``v`` (quotients are IEEE float32 first, as in CUDA)."""
  return np.clip(v.astype(np.float32), -448, 448).astype(E4M3).view(np.uint8)


def _ceil_log2(s32):
  return np.ceil(np.log2(s32.astype(np.float64))).astype(np.int64)


def np_ds_mla(x, pow2=False):
  """x: bf16 [n, 576] -> uint8 [n, 656]."""
  xf = x.astype(np.float32)
  out = np.zeros((x.shape[0], 656), np.uint8)
  for i in range(4):
    tile = xf[:, 128 * i:128 * (i + 1)]
    s = (np.abs(tile).max(-1) / np.float32(448)).astype(np.float32)
    if pow2:
      s = np.ldexp(np.float32(1), _ceil_log2(np.maximum(s, np.float32(1e-4)))).astype(np.float32)
    else:
      s = np.maximum(s, np.finfo(np.float32).tiny)
    out[:, 128 * i:128 * (i + 1)] = _fp8_bytes(tile / s[:, None])
    out[:, 512 + 4 * i:516 + 4 * i] = s[:, None].view(np.uint8)
  out[:, 528:] = np.ascontiguousarray(x[:, 512:]).view(np.uint8)
  return out


def np_model1(x):
  """x: bf16 [n, 512] -> (data uint8 [n, 576], scales uint8 [n, 8])."""
  xf = x.astype(np.float32)
  data = np.zeros((x.shape[0], 576), np.uint8)
  scales = np.zeros((x.shape[0], 8), np.uint8)
  for i in range(7):
    tile = xf[:, 64 * i:64 * (i + 1)]
    a = np.maximum(np.abs(tile).max(-1), np.float32(1e-4))
    e = _ceil_log2((a / np.float32(448)).astype(np.float32))
    data[:, 64 * i:64 * (i + 1)] = _fp8_bytes(tile / np.ldexp(np.float32(1), e)[:, None])
    scales[:, i] = e + 127
  data[:, 448:] = np.ascontiguousarray(x[:, 448:]).view(np.uint8)
  return data, scales


def np_model1_place(cache, slot, data, scales):
  """Writes one token's V4 bytes into a numpy cache [nb, bs, width] (block-flat layout)."""
  nb, bs, width = cache.shape
  flat = cache.reshape(nb, bs * width)
  b, o = divmod(int(slot), bs)
  flat[b, o * 576:(o + 1) * 576] = data
  flat[b, bs * 576 + o * 8:bs * 576 + (o + 1) * 8] = scales


ROWS = 16  # latent rows of the quantizer tests: one shape, one compile per quantizer


def rand_latent(rng, n, d):
  """bf16 latents with per-64-tile magnitudes over 1e-6..1e3; row 1 starts with 128 zeros."""
  x = rng.standard_normal((n, d)).astype(np.float32)
  tiles = x.reshape(n, -1, 64)
  tiles *= 10.0 ** rng.uniform(-6, 3, size=(n, tiles.shape[1], 1))
  if n > 1:
    tiles[1, :2] = 0.0  # one 128-tile (two 64-tiles) of zeros
  return x.astype(BF16)


def rand_bytes_cache(rng, shape):
  """Random bytes with NaN patterns (0x7f, 0xff) sprinkled in, as stale cache memory."""
  c = rng.integers(0, 256, size=shape, dtype=np.uint8)
  c[rng.random(shape) < 0.2] = 0x7F
  c[rng.random(shape) < 0.2] = 0xFF
  return c


# ---------------------------------------------------------------------------
# Shapes


@pytest.mark.cpu_only
def test_kv_cache_shape():
  assert kv_cache_shape(10, 64) == (10, 64, 576)
  assert kv_cache_shape(10, 64, 576, "fp8") == (10, 64, 576)
  assert kv_cache_shape(10, 64, 512, "auto") == (10, 64, 512)
  assert kv_cache_shape(10, 64, 576, "fp8_ds_mla") == (10, 64, 656)
  # V4: 64 * 584 = 37376 -> 65 * 576 = 37440 bytes per block = 64 * 585.
  assert model1_block_bytes(64) == 37440
  assert kv_cache_shape(10, 64, 512, "fp8_model1") == (10, 64, 585)
  assert kv_cache_shape(3, 256, 512, "fp8_model1") == (3, 256, 585)
  assert kv_cache_shape(3, 16, 512, "fp8_model1") == (3, 16, 612)  # 17 * 576 / 16
  assert kv_cache_storage_dtype("fp8_ds_mla") == jnp.uint8
  assert kv_cache_storage_dtype("fp8") == jnp.float8_e4m3fn
  assert kv_cache_storage_dtype("auto") == jnp.bfloat16
  with pytest.raises(ValueError, match="head_size"):
    kv_cache_shape(1, 64, 512, "fp8_ds_mla")
  with pytest.raises(ValueError, match="head_size"):
    kv_cache_shape(1, 64, 576, "fp8_model1")
  with pytest.raises(ValueError, match="block_size"):
    kv_cache_shape(1, 1024, 512, "fp8_model1")  # 1024 does not divide the padded block
  with pytest.raises(ValueError, match="cache_dtype"):
    kv_cache_shape(1, 64, 576, "fp8_e5m2")


# ---------------------------------------------------------------------------
# Division-free scale rules against numpy's IEEE float32 division


def test_scale_rules_match_ieee_division():
  from jax_mla.cache.e4m3 import ceil_log2_div448, div448
  rng = np.random.default_rng(0)
  a = np.concatenate([
      (10.0 ** rng.uniform(-30, 38, 200_000)).astype(np.float32),  # wide range
      np.arange(1 << 15, dtype=np.uint16).view(BF16).astype(np.float32),  # all positive bf16
      np.ldexp(np.float32(7), np.arange(-120, 120)).astype(np.float32),  # 448 * 2**k exactly
      np.array([448 * (1 + 2.0**-23), 448 * (1 - 2.0**-24), 3.3e38], np.float32),
  ])
  a = a[np.isfinite(a) & (a > 0)]
  want = (a / np.float32(448)).astype(np.float32)
  # Jitted, as inside the quantizers (and one compile each rather than one per op).
  got = np.asarray(jax.jit(div448)(a))
  normal = want >= np.finfo(np.float32).tiny
  np.testing.assert_array_equal(got[normal].view(np.uint32), want[normal].view(np.uint32))
  assert np.all(got[~normal] <= np.finfo(np.float32).tiny)  # callers clamp these
  e = np.asarray(jax.jit(ceil_log2_div448)(a))
  np.testing.assert_array_equal(e[normal], _ceil_log2(want[normal]))


@pytest.mark.parametrize("scale", [1.0, 0.0123456, 0.029017856, 3.3e-5, 1 / 448, 2.5])
def test_fp8_quotient_matches_ieee_double_rounding(scale):
  from jax_mla.cache.e4m3 import fp8_bytes_of_quotient
  rng = np.random.default_rng(1)
  n = 50_000
  x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-4, 3, n)).astype(BF16).astype(np.float32)
  # Zeros, saturation, fp8 midpoints and ties (1.3125, 0.96875), subnormal steps.
  x[:20] = [0, -0.0, 1, -1, 448, 449, -500, 1e-30, -1e-30, 2**-10, 2**-11, 3 * 2**-11, 0.96875,
            1.3125, 0.0390625, -0.0390625, 240, 232, 464, 2**-9]
  s = np.float32(scale)
  got = np.asarray(jax.jit(fp8_bytes_of_quotient)(jnp.asarray(x), jnp.float32(s)))
  np.testing.assert_array_equal(got, _fp8_bytes(x / s))


def _fp8_midpoints():
  """float32 midpoints of consecutive e4m3fn magnitudes (0 .. 448, and 464 towards
  480), with their float32 neighbours, both signs."""
  vals = np.arange(0x7F, dtype=np.uint8).view(E4M3).astype(np.float32)  # 0 .. 448
  vals = np.append(vals, np.float32(480))
  mid = (vals[:-1] + vals[1:]) / np.float32(2)  # exact
  near = np.concatenate([mid, np.nextafter(mid, np.float32(np.inf)),
                         np.nextafter(mid, np.float32(0)), vals])
  return np.concatenate([near, -near])


def test_fp8_bytes_bit_conversion_matches_ml_dtypes():
  from jax_mla.cache.e4m3 import fp8_bytes
  v = np.concatenate([
      np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(BF16).astype(np.float32),
      _fp8_midpoints(),
      np.array([np.inf, -np.inf, np.nan, -np.nan, 1e-45, -1e-45, 2**-126, 3.4e38, 449, 464,
                463.99997, 2**-10, 2**-10 * (1 + 2**-23), 2**-10 * (1 - 2**-24)], np.float32),
  ])
  got = np.asarray(jax.jit(fp8_bytes)(jnp.asarray(v)))
  with np.errstate(invalid="ignore"):
    np.testing.assert_array_equal(got, _fp8_bytes(v))


@pytest.mark.parametrize("scale", [1.0, 0.0123456, 1 / 448, 3.3e-5, 2.5])
def test_fp8_quotient_all_bf16_and_midpoints(scale):
  from jax_mla.cache.e4m3 import fp8_bytes_of_quotient
  s = np.float32(scale)
  # x whose float32 quotient lands on or next to an fp8 midpoint: m * s and its neighbours.
  ms = _fp8_midpoints().astype(np.float64) * np.float64(s)
  ms = ms[np.abs(ms) < 3e38].astype(np.float32)
  x = np.concatenate([
      np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(BF16).astype(np.float32),
      ms, np.nextafter(ms, np.float32(np.inf)), np.nextafter(ms, np.float32(-np.inf)),
  ])
  got = np.asarray(jax.jit(fp8_bytes_of_quotient)(jnp.asarray(x), jnp.float32(s)))
  with np.errstate(invalid="ignore", over="ignore"):
    want = _fp8_bytes(x / s)
  np.testing.assert_array_equal(got, want)
  # The fix-up alone: a candidate one code off either way (as an approximate
  # division may give) settles to the same code.
  from jax_mla.cache.e4m3 import _settle_quotient_code
  ax = np.abs(x[~np.isnan(x)])
  code = (want[~np.isnan(x)] & 0x7F).astype(np.int32)
  settle = jax.jit(_settle_quotient_code)
  for delta in (-1, 1):
    candidate = np.clip(code + delta, 0, 0x7E)
    settled = np.asarray(settle(jnp.asarray(ax), jnp.float32(s), jnp.asarray(candidate)))
    np.testing.assert_array_equal(settled, code)


# ---------------------------------------------------------------------------
# fp8_ds_mla (V3.2)


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_ds_mla_bytes_match_hand_built(seed, pow2):
  x = rand_latent(np.random.default_rng(seed), ROWS, 576)
  got = np.asarray(quantize_fp8_ds_mla(jax.device_put(x), pow2_scales=pow2))
  np.testing.assert_array_equal(got, np_ds_mla(x, pow2))
  # The all-zero tile: scale FLT_MIN (or 2**-13 with pow2), fp8 bytes zero.
  want_scale = np.float32(2.0**-13) if pow2 else np.finfo(np.float32).tiny
  assert got[1, 512:516].view(np.float32)[0] == want_scale
  assert not got[1, :128].any()


def test_ds_mla_pow2_scales_are_powers_of_two():
  x = rand_latent(np.random.default_rng(3), ROWS, 576)
  b = np.asarray(quantize_fp8_ds_mla(jax.device_put(x), pow2_scales=True))
  s = b[:, 512:528].copy().view(np.float32)
  mant, _ = np.frexp(s)
  assert np.all(mant == 0.5)
  # Each scale is the smallest power of two >= max(amax/448, 1e-4).
  amax = np.abs(x.astype(np.float32)[:, :512].reshape(16, 4, 128)).max(-1)
  floor = np.maximum(amax / np.float32(448), np.float32(1e-4))
  assert np.all(s >= floor) and np.all(s / 2 < floor)


@pytest.mark.parametrize("pow2", [False, True])
def test_ds_mla_round_trip(pow2):
  x = rand_latent(np.random.default_rng(5), ROWS, 576)
  b = quantize_fp8_ds_mla(jax.device_put(x), pow2_scales=pow2)
  y = np.asarray(dequantize_fp8_ds_mla(b)).astype(np.float32)
  xf = x.astype(np.float32)
  np.testing.assert_array_equal(y[:, 512:], xf[:, 512:])  # RoPE is stored as is
  scale = np.repeat(np.asarray(b)[:, 512:528].copy().view(np.float32), 128, axis=1)
  # e4m3: half an ulp is 2**-4 relative (normals) or scale * 2**-10 (subnormals);
  # the bf16 result adds 2**-9 relative.
  bound = np.abs(xf[:, :512]) * (2.0**-4 + 2.0**-8) + scale * 2.0**-9
  assert np.all(np.abs(y[:, :512] - xf[:, :512]) <= bound)
  assert rel_err(y, xf) < 0.05


# ---------------------------------------------------------------------------
# fp8_model1 (V4)


@pytest.mark.parametrize("seed", [0, 1])
def test_model1_bytes_match_hand_built(seed):
  x = rand_latent(np.random.default_rng(seed), ROWS, 512)
  got = np.asarray(quantize_fp8_model1(jax.device_put(x)))
  data, scales = np_model1(x)
  np.testing.assert_array_equal(got, np.concatenate([data, scales], axis=1))
  # Zero tile: amax clamps to 1e-4 -> 2**ceil(log2(1e-4/448)) = 2**-22 -> code 105.
  assert got[1, 576] == 105 and not got[1, :64].any()
  assert np.all(got[:, 583] == 0)


def test_model1_round_trip():
  x = rand_latent(np.random.default_rng(2), ROWS, 512)
  b = np.asarray(quantize_fp8_model1(jax.device_put(x)))
  y = np.asarray(dequantize_fp8_model1(jax.device_put(b))).astype(np.float32)
  xf = x.astype(np.float32)
  np.testing.assert_array_equal(y[:, 448:], xf[:, 448:])
  scale = np.repeat(np.ldexp(1.0, b[:, 576:583].astype(np.int64) - 127), 64, axis=1)
  bound = np.abs(xf[:, :448]) * (2.0**-4 + 2.0**-8) + scale * 2.0**-9
  assert np.all(np.abs(y[:, :448] - xf[:, :448]) <= bound)


@pytest.mark.parametrize("block_size", [16, 64])
def test_model1_cache_layout(block_size):
  rng = np.random.default_rng(block_size)
  nb = 2
  x = rand_latent(rng, nb * block_size, 512)
  cache = np.asarray(quantize_fp8_model1_cache(jnp.asarray(x.reshape(nb, block_size, 512))))
  assert cache.shape == kv_cache_shape(nb, block_size, 512, "fp8_model1")
  want = np.zeros_like(cache)
  data, scales = np_model1(x)
  for s in range(nb * block_size):
    np_model1_place(want, s, data[s], scales[s])
  np.testing.assert_array_equal(cache, want)
  back = np.asarray(dequantize_fp8_model1_cache(jnp.asarray(cache)))
  per_token = np.asarray(dequantize_fp8_model1(jnp.asarray(np.concatenate([data, scales], 1))))
  np.testing.assert_array_equal(back.reshape(-1, 512), per_token)


# ---------------------------------------------------------------------------
# Writer: reference against hand-built caches


def _inputs(rng, num_tokens, nope, rope=64):
  kv_c = rand_latent(rng, num_tokens, nope + rope)
  return kv_c[:, :nope], np.ascontiguousarray(kv_c[:, nope:])


def _slots(rng, num_tokens, capacity):
  """Distinct valid slots with a padding slot (-1) and one past the cache."""
  slots = rng.permutation(capacity)[:num_tokens].astype(np.int32)
  if num_tokens > 2:
    slots[1] = -1
    slots[-1] = capacity + 3
  return slots


@pytest.mark.parametrize("fmt", ["auto", "fp8", "fp8_ds_mla", "fp8_model1"])
def test_reference_writer_matches_hand_built(fmt):
  rng = np.random.default_rng(11)
  nb, bs, T = 3, 16, 9
  head = 512 if fmt == "fp8_model1" else 576
  kv_c, k_pe = _inputs(rng, T, head - 64)
  slots = _slots(rng, T, nb * bs)
  shape = kv_cache_shape(nb, bs, head, fmt)
  if fmt == "auto":
    before = rng.standard_normal(shape).astype(BF16)
  else:
    before = rand_bytes_cache(rng, shape)
    if fmt == "fp8":
      before = before.view(E4M3)
  scale = 0.03 if fmt == "fp8" else None
  out = np.asarray(concat_and_cache_mla(jnp.asarray(kv_c), jnp.asarray(k_pe), jnp.asarray(before),
                                        jnp.asarray(slots), kv_cache_dtype=fmt, scale=scale,
                                        implementation="xla"))
  want = before.copy()
  x = np.concatenate([kv_c, k_pe], axis=1)
  for t, s in enumerate(slots):
    if not 0 <= s < nb * bs:
      continue
    b, o = divmod(int(s), bs)
    if fmt == "auto":
      want[b, o] = x[t]
    elif fmt == "fp8":
      want[b, o] = _fp8_bytes(x[t].astype(np.float32) / np.float32(scale)).view(E4M3)
    elif fmt == "fp8_ds_mla":
      want[b, o] = np_ds_mla(x[t:t + 1])[0]
    else:
      data, scales = np_model1(x[t:t + 1])
      np_model1_place(want, s, data[0], scales[0])
  np.testing.assert_array_equal(out.view(np.uint8), want.view(np.uint8))


def test_fp8_per_tensor_round_trip():
  rng = np.random.default_rng(4)
  nb, bs, T, scale = 2, 8, 11, 0.02
  x = rng.standard_normal((T, 576)).astype(BF16)
  slots = np.arange(T, dtype=np.int32)
  out = {}
  for dtype in (jnp.float8_e4m3fn, jnp.uint8):
    cache = jnp.zeros(kv_cache_shape(nb, bs, 576, "fp8"), dtype)
    out[dtype] = concat_and_cache_mla(jnp.asarray(x[:, :512]), jnp.asarray(x[:, 512:]), cache,
                                      jnp.asarray(slots), kv_cache_dtype="fp8", scale=scale)
    assert out[dtype].dtype == dtype
  np.testing.assert_array_equal(np.asarray(out[jnp.uint8]),
                                np.asarray(out[jnp.float8_e4m3fn]).view(np.uint8))
  y = np.asarray(gather_dequantize(out[jnp.uint8], jnp.asarray(slots), kv_cache_dtype="fp8",
                                   scale=scale)).astype(np.float32)
  xf = x.astype(np.float32)
  bound = np.abs(xf) * (2.0**-4 + 2.0**-8) + scale * 2.0**-9
  assert np.all(np.abs(y - xf) <= bound)


@pytest.mark.parametrize("fmt", ["auto", "fp8", "fp8_ds_mla", "fp8_model1"])
def test_gather_dequantize(fmt):
  rng = np.random.default_rng(8)
  nb, bs = 3, 16
  head = 512 if fmt == "fp8_model1" else 576
  # Per-tensor fp8 has no per-tile range: keep its values O(1).
  x = (rng.standard_normal((nb * bs, head)).astype(BF16) if fmt == "fp8"
       else rand_latent(rng, nb * bs, head))
  kv_c, k_pe = jnp.asarray(x[:, :head - 64]), jnp.asarray(x[:, head - 64:])
  cache = jnp.zeros(kv_cache_shape(nb, bs, head, fmt), kv_cache_storage_dtype(fmt))
  cache = concat_and_cache_mla(kv_c, k_pe, cache, jnp.arange(nb * bs, dtype=jnp.int32),
                               kv_cache_dtype=fmt, scale=0.5 if fmt == "fp8" else None)
  if fmt == "fp8_ds_mla":
    full = dequantize_fp8_ds_mla(cache).reshape(-1, head)
  elif fmt == "fp8_model1":
    full = dequantize_fp8_model1_cache(cache).reshape(-1, head)
  elif fmt == "fp8":
    full = (cache.astype(jnp.float32) * 0.5).astype(jnp.bfloat16).reshape(-1, head)
  else:
    full = cache.reshape(-1, head)
  slots = rng.integers(0, nb * bs, size=(2, 5)).astype(np.int32)
  slots[0, 0], slots[1, 4] = -1, nb * bs + 7  # clamped to 0 and to the last slot
  got = np.asarray(gather_dequantize(cache, jnp.asarray(slots), kv_cache_dtype=fmt,
                                     scale=0.5 if fmt == "fp8" else None))
  assert got.shape == (2, 5, head) and got.dtype == BF16
  want = np.asarray(full)[np.clip(slots, 0, nb * bs - 1)]
  np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
  assert rel_err(got, x[np.clip(slots, 0, nb * bs - 1)]) < 0.05


# ---------------------------------------------------------------------------
# Triton writer against the reference writer


# The writer tests write NUM_TOKENS tokens into NUM_BLOCKS blocks (16 tokens each unless a
# test is about the block size): slots and bytes are values, the writers compile once.
NUM_BLOCKS, NUM_TOKENS = 2, 13


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8_model1"])
@pytest.mark.parametrize("seed,block_size", [(0, 16), (1, 16), (2, 64)])
def test_triton_writer_matches_reference(fmt, seed, block_size, interpret):
  rng = np.random.default_rng(seed)
  nb = NUM_BLOCKS
  head = 512 if fmt == "fp8_model1" else 576
  kv_c, k_pe = _inputs(rng, NUM_TOKENS, head - 64)
  slots = _slots(rng, NUM_TOKENS, nb * block_size)
  before = rand_bytes_cache(rng, kv_cache_shape(nb, block_size, head, fmt))
  outs = {}
  for impl in ("xla", "triton"):
    outs[impl] = np.asarray(concat_and_cache_mla(
        *jax.device_put((kv_c, k_pe, before, slots)),
        kv_cache_dtype=fmt, implementation=impl, interpret=interpret and impl == "triton"))
  np.testing.assert_array_equal(outs["triton"], outs["xla"])
  # Bytes of skipped and untouched slots (and block padding) keep their old values.
  changed = np.zeros(before.shape, bool)
  written = [s for s in slots if 0 <= s < nb * block_size]
  if fmt == "fp8_ds_mla":
    for s in written:
      changed[s // block_size, s % block_size] = True
  else:
    flat = changed.reshape(nb, -1)
    for s in written:
      b, o = divmod(int(s), block_size)
      flat[b, o * 576:(o + 1) * 576] = True
      flat[b, block_size * 576 + o * 8:block_size * 576 + (o + 1) * 8] = True
  np.testing.assert_array_equal(outs["triton"][~changed], before[~changed])
  assert len(written) == 0 or (outs["triton"][changed] != before[changed]).any()
  for impl in ("xla", "triton"):  # an empty slot_mapping writes nothing
    empty = concat_and_cache_mla(*jax.device_put((kv_c, k_pe, before, slots[:0])),
                                 kv_cache_dtype=fmt, implementation=impl,
                                 interpret=interpret and impl == "triton")
    np.testing.assert_array_equal(np.asarray(empty), before)


def test_model1_whole_latent_form_and_short_slot_mapping(interpret):
  rng = np.random.default_rng(9)
  nb, bs, T = 2, 16, 6
  x = rand_latent(rng, T, 512)
  slots = np.array([5, 0, 17, 31], np.int32)  # 4 < T: the last two tokens are padding
  cache = jnp.zeros(kv_cache_shape(nb, bs, 512, "fp8_model1"), jnp.uint8)
  split = concat_and_cache_mla(jnp.asarray(x[:, :448]), jnp.asarray(x[:, 448:]), jnp.array(cache),
                               jnp.asarray(slots), kv_cache_dtype="fp8_model1",
                               implementation="xla")
  whole = concat_and_cache_mla(jnp.asarray(x), jnp.zeros((T, 0), jnp.bfloat16), jnp.array(cache),
                               jnp.asarray(slots), kv_cache_dtype="fp8_model1",
                               implementation="triton", interpret=interpret)
  np.testing.assert_array_equal(np.asarray(split), np.asarray(whole))
  got = gather_dequantize(whole, jnp.asarray(slots), kv_cache_dtype="fp8_model1")
  np.testing.assert_array_equal(np.asarray(got),
                                np.asarray(dequantize_fp8_model1(quantize_fp8_model1(x[:4]))))


def test_writer_under_jit_with_donation():
  rng = np.random.default_rng(12)
  nb, bs, T = 2, 8, 5
  kv_c, k_pe = _inputs(rng, T, 512)
  slots = jnp.asarray(np.array([3, 9, -1, 15, 0], np.int32))

  @jax.jit
  def step(cache, kv_c, k_pe):
    return concat_and_cache_mla(kv_c, k_pe, cache, slots, kv_cache_dtype="fp8_ds_mla")

  step = jax.jit(step, donate_argnums=0)
  cache = jnp.zeros(kv_cache_shape(nb, bs, 576, "fp8_ds_mla"), jnp.uint8)
  out = step(cache, jnp.asarray(kv_c), jnp.asarray(k_pe))
  want = np_ds_mla(np.concatenate([kv_c, k_pe], axis=1))
  got = np.asarray(out).reshape(-1, 656)
  np.testing.assert_array_equal(got[[3, 9, 15, 0]], want[[0, 1, 3, 4]])
  assert not np.delete(got, [3, 9, 15, 0], axis=0).any()


# ---------------------------------------------------------------------------
# Mosaic GPU writer (Hopper) against the reference writer


def _adversarial_latent(rng, num_tokens, head):
  """Random latents (:func:`rand_latent`) with the values a writer can get wrong: +-NaN,
  +-inf, bf16 subnormals, -0.0, an all-NaN tile, an all-zero token and huge values. (No
  tile of subnormals only: there the reference itself depends on the platform's
  denormal flushing, see :mod:`jax_mla.cache.e4m3`.)"""
  x = rand_latent(rng, num_tokens, head).astype(np.float32)
  x[0, 3], x[0, 200], x[2, 7] = np.nan, -np.nan, np.inf
  x[2, 300], x[3, 0:64] = -np.inf, np.nan
  x[4, :] = 0.0
  x[5, 10:20] = 1e-40  # subnormal in bf16 too
  x[5, 130:140] = -0.0
  x[6, 128:256] *= 1e35  # near bf16's largest values
  return x.astype(BF16)


MOSAIC_WRITER_CASES = [  # (format, kv_c width, k_pe width, block size, seed)
    ("fp8_ds_mla", 512, 64, 16, 0), ("fp8_ds_mla", 512, 64, 64, 1),
    ("fp8_model1", 448, 64, 16, 2), ("fp8_model1", 448, 64, 64, 3),
    ("fp8_model1", 512, 0, 16, 4), ("auto", 512, 64, 16, 5), ("fp8", 512, 64, 64, 6),
    ("fp8_v41", 448, 64, 16, 7), ("fp8_v41", 512, 0, 64, 8), ("fp4_v41", 448, 64, 16, 9),
    ("fp4_v41", 512, 0, 64, 10)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", MOSAIC_WRITER_CASES,
                         ids=["ds_mla-bs16", "ds_mla-bs64", "model1-bs16", "model1-bs64",
                              "model1-latent", "auto", "fp8", "v41-bs16", "v41-latent",
                              "fp4-bs16", "fp4-latent"])
def test_gpu_mosaic_writer_matches_reference(case):
  """Byte for byte the XLA writer's cache, on adversarial values; skipped and padding
  tokens (and an empty slot_mapping) leave every other byte, stale NaN bytes included.
  The reference runs on the CPU: XLA:GPU may flush bf16 subnormals and canonicalise NaN
  bits while it copies ``"auto"`` rows; the kernel stores them as they are."""
  from jax_mla import _mosaic
  from jax_mla.cache import mosaic
  from jax_mla.cache.formats import resolve
  fmt, nope, rope, bs, seed = case
  rng = np.random.default_rng(seed)
  T, nb = 37, 3
  x = _adversarial_latent(rng, T, nope + rope if rope else nope)
  kv_c, k_pe = jax.device_put((np.ascontiguousarray(x[:, :nope]),
                               np.ascontiguousarray(x[:, nope:])))
  shape = kv_cache_shape(nb, bs, nope + rope, fmt)
  if fmt == "auto":  # bf16 rows from random bytes (stale NaN bit patterns among them)
    before = rand_bytes_cache(rng, (*shape[:-1], 2 * shape[-1])).view(BF16)
  else:
    before = rand_bytes_cache(rng, shape)
  if not _mosaic.default_for(mosaic.check_supported, kv_c, k_pe, before, resolve(fmt)):
    pytest.skip("needs a Hopper GPU and jax >= 0.11 (Mosaic GPU)")
  slots = _slots(rng, T - 2, nb * bs)  # the last two tokens are padding
  scale = 0.37 if fmt == "fp8" else None
  cpu = jax.devices("cpu")[0]
  for s in (slots, slots[:0]):
    outs = {impl: np.asarray(concat_and_cache_mla(kv_c, k_pe, jax.device_put(before),
                                                  jax.device_put(s), kv_cache_dtype=fmt,
                                                  scale=scale, implementation=impl))
            for impl in ("mosaic", None)}
    outs["xla"] = np.asarray(concat_and_cache_mla(
        *jax.device_put((kv_c, k_pe, before, s), cpu), kv_cache_dtype=fmt, scale=scale,
        implementation="xla"))
    if fmt == "auto":
      outs = {k: v.view(np.uint16) for k, v in outs.items()}  # NaN bits compare as bits
    np.testing.assert_array_equal(outs["mosaic"], outs["xla"])
    np.testing.assert_array_equal(outs[None], outs["mosaic"])
  np.testing.assert_array_equal(outs["mosaic"], before.view(outs["mosaic"].dtype))  # empty


@pytest.mark.gpu
def test_gpu_mosaic_writer_in_place_under_jit():
  """Donated under jit, the kernel writes into the caller's buffer (no cache copy)."""
  from jax_mla import _mosaic
  rng = np.random.default_rng(21)
  if not _mosaic.on_hopper():
    pytest.skip("needs a Hopper GPU and jax >= 0.11 (Mosaic GPU)")
  kv_c, k_pe = jax.device_put(_inputs(rng, 8, 512))
  slots = jax.device_put(np.array([5, 1, 70, -1, 3, 64, 2, 9], np.int32))
  step = jax.jit(lambda c: concat_and_cache_mla(kv_c, k_pe, c, slots, kv_cache_dtype="fp8_ds_mla",
                                                implementation="mosaic"), donate_argnums=0)
  cache = jnp.zeros(kv_cache_shape(5, 16, 576, "fp8_ds_mla"), jnp.uint8)
  pointer = cache.unsafe_buffer_pointer()
  out = step(cache)
  assert out.unsafe_buffer_pointer() == pointer
  want = np_ds_mla(np.concatenate(_inputs(np.random.default_rng(21), 8, 512), axis=1))
  got = np.asarray(out).reshape(-1, 656)
  written = [0, 1, 2, 4, 5, 6, 7]
  np.testing.assert_array_equal(got[[5, 1, 70, 3, 64, 2, 9]], want[written])


def test_mosaic_writer_lowers_for_cuda():
  """The kernel's whole Mosaic GPU lowering, for each input form (any machine)."""
  from helpers import lowers_for_cuda

  from jax_mla.cache import mosaic
  from jax_mla.cache.formats import resolve
  S = jax.ShapeDtypeStruct
  for fmt, nope, rope, head in [("fp8_ds_mla", 512, 64, 576), ("fp8_model1", 448, 64, 512),
                                ("fp8_model1", 512, 0, 512), ("auto", 512, 64, 576),
                                ("fp8", 512, 64, 576), ("fp8_v41", 448, 64, 512),
                                ("fp8_v41", 512, 0, 512), ("fp4_v41", 448, 64, 512)]:
    cache = S(kv_cache_shape(3, 16, head, fmt), jnp.bfloat16 if fmt == "auto" else jnp.uint8)
    text = lowers_for_cuda(
        lambda a, b, c, d, fmt=fmt: mosaic.write(a, b, c, d, jnp.float32(0.5), fmt=resolve(fmt)),
        S((13, nope), jnp.bfloat16), S((13, rope), jnp.bfloat16), cache,
        S((11,), jnp.int32)).as_text()
    assert "mosaic_gpu" in text and "output_operand_aliases" in text


@pytest.mark.cpu_only
def test_mosaic_writer_refuses_what_it_does_not_write():
  kv_c, k_pe = jnp.zeros((4, 512), jnp.bfloat16), jnp.zeros((4, 64), jnp.bfloat16)
  cache = jnp.zeros(kv_cache_shape(2, 16, 576, "fp8_ds_mla"), jnp.uint8)
  slots = jnp.arange(4, dtype=jnp.int32)
  with pytest.raises(ValueError, match="bf16"):
    concat_and_cache_mla(kv_c.astype(jnp.float32), k_pe, cache, slots,
                         kv_cache_dtype="fp8_ds_mla", implementation="mosaic")
  with pytest.raises(ValueError, match=r"kv_c \[T, 512\]"):
    concat_and_cache_mla(kv_c[:, :500], jnp.zeros((4, 76), jnp.bfloat16),
                         jnp.zeros((2, 16, 576), jnp.uint8), slots, kv_cache_dtype="fp8",
                         implementation="mosaic")
  with pytest.raises(ValueError, match="bf16 'auto' cache"):
    concat_and_cache_mla(kv_c, k_pe, jnp.zeros((2, 16, 576), jnp.float32), slots,
                         kv_cache_dtype="auto", implementation="mosaic")
  with pytest.raises(ValueError, match="needs a GPU"):
    concat_and_cache_mla(kv_c, k_pe, cache, slots, kv_cache_dtype="fp8_ds_mla",
                         implementation="mosaic")


# ---------------------------------------------------------------------------
# Validation


@pytest.mark.cpu_only
def test_bad_inputs_raise():
  T = 4
  kv_c = jnp.zeros((T, 512), jnp.bfloat16)
  k_pe = jnp.zeros((T, 64), jnp.bfloat16)
  slots = jnp.arange(T, dtype=jnp.int32)
  cache = jnp.zeros(kv_cache_shape(2, 16, 576, "fp8_ds_mla"), jnp.uint8)

  def write(kv_c=kv_c, k_pe=k_pe, cache=cache, slots=slots, **kw):
    kw.setdefault("kv_cache_dtype", "fp8_ds_mla")
    return concat_and_cache_mla(kv_c, k_pe, cache, slots, **kw)

  with pytest.raises(ValueError, match="kv_c"):
    write(kv_c=jnp.zeros((T, 448), jnp.bfloat16))
  with pytest.raises(ValueError, match="k_pe"):
    write(k_pe=jnp.zeros((T + 1, 64), jnp.bfloat16))
  with pytest.raises(TypeError, match="slot_mapping"):
    write(slots=slots.astype(jnp.float32))
  with pytest.raises(ValueError, match="slot_mapping"):
    write(slots=jnp.arange(T + 1, dtype=jnp.int32))
  with pytest.raises(TypeError, match="kv_cache"):
    write(cache=cache.astype(jnp.int8))
  with pytest.raises(ValueError, match="kv_cache"):
    write(cache=jnp.zeros((2, 16, 600), jnp.uint8))
  with pytest.raises(ValueError, match="kv_cache_dtype"):
    write(kv_cache_dtype="fp8_e5m2")
  with pytest.raises(TypeError, match="kv_c"):
    write(kv_c=jnp.zeros((T, 512), jnp.int32))
  with pytest.raises(ValueError, match="kv_cache"):  # a V3.2 cache read as V4
    write(kv_c=jnp.zeros((T, 448), jnp.bfloat16), kv_cache_dtype="fp8_model1")
  with pytest.raises(ValueError, match="kv_c"):
    write(cache=jnp.zeros((2, 16, 576), jnp.bfloat16), kv_cache_dtype="auto",
          kv_c=jnp.zeros((T, 500), jnp.bfloat16))
  with pytest.raises(ValueError, match="scale"):
    write(cache=jnp.zeros((2, 16, 576), jnp.uint8), kv_cache_dtype="fp8",
          scale=jnp.ones((2,), jnp.float32))
  if jax.default_backend() == "cpu":
    with pytest.raises(ValueError, match="interpret"):
      write(implementation="pallas")
  with pytest.raises(ValueError, match="x"):
    quantize_fp8_ds_mla(jnp.zeros((3, 512), jnp.bfloat16))
  with pytest.raises(TypeError, match="b"):
    dequantize_fp8_ds_mla(jnp.zeros((3, 656), jnp.int8))
  with pytest.raises(ValueError, match="x"):
    quantize_fp8_model1(jnp.zeros((3, 576), jnp.bfloat16))
  with pytest.raises(TypeError, match="slots"):
    gather_dequantize(cache, jnp.zeros((3,), jnp.float32), kv_cache_dtype="fp8_ds_mla")


# ---------------------------------------------------------------------------
# Bad input and NaN, the same on every path


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8_model1"])
def test_one_nan_stays_one_nan(fmt, interpret):
  """A NaN value is stored as NaN and leaves its tile's scale alone (the CUDA writers'
  fmaxf amax): every other byte is what the tile gives with the NaN as 0."""
  rng = np.random.default_rng(13)
  head = 512 if fmt == "fp8_model1" else 576
  x = rand_latent(rng, NUM_TOKENS, head).astype(np.float32)
  x[0, 70] = np.nan
  zeroed = np.nan_to_num(x, nan=0.0)
  slots = jax.device_put(np.arange(NUM_TOKENS, dtype=np.int32))
  cache = jax.device_put(np.zeros(kv_cache_shape(NUM_BLOCKS, 16, head, fmt), np.uint8))

  def write(v, impl):
    v = v.astype(BF16)
    return np.asarray(concat_and_cache_mla(*jax.device_put((v[:, :head - 64], v[:, head - 64:])),
                                           cache, slots, kv_cache_dtype=fmt, implementation=impl,
                                           interpret=interpret and impl == "triton"))

  want = write(zeroed, "xla")
  for impl in ("xla", "triton"):
    got = write(x, impl)
    nan_byte = np.flatnonzero(got != want)
    assert nan_byte.size == 1 and got.reshape(-1)[nan_byte[0]] & 0x7F == 0x7F
    full = (dequantize_fp8_ds_mla(jnp.asarray(got)) if fmt == "fp8_ds_mla"
            else dequantize_fp8_model1_cache(jnp.asarray(got)))
    full = np.asarray(full, np.float32).reshape(-1, head)
    assert np.isnan(full[0, 70]) and np.isnan(full).sum() == 1


@pytest.mark.parametrize("impl", ["xla", "triton"])
def test_eager_call_keeps_the_callers_cache(impl, interpret):
  """Outside jit the caller's cache stays usable (a copy is written) unless donate=True."""
  rng = np.random.default_rng(14)
  kv_c, k_pe = jax.device_put(_inputs(rng, NUM_TOKENS, 512))
  slots = jax.device_put(_slots(rng, NUM_TOKENS, NUM_BLOCKS * 16))
  kw = dict(kv_cache_dtype="fp8_ds_mla", implementation=impl,
            interpret=interpret and impl == "triton")
  cache = jax.device_put(np.zeros(kv_cache_shape(NUM_BLOCKS, 16, 576, "fp8_ds_mla"), np.uint8))
  out = concat_and_cache_mla(kv_c, k_pe, cache, slots, **kw)
  assert not cache.is_deleted()
  assert not np.asarray(cache).any() and np.asarray(out).any()
  again = concat_and_cache_mla(kv_c, k_pe, cache, slots, **kw)
  np.testing.assert_array_equal(np.asarray(again), np.asarray(out))
  donated = concat_and_cache_mla(kv_c, k_pe, cache, slots, donate=True, **kw)
  np.testing.assert_array_equal(np.asarray(donated), np.asarray(out))
  assert cache.is_deleted()


@pytest.mark.cpu_only
@pytest.mark.parametrize("fmt", ["auto", "fp8_ds_mla", "fp8_model1"])
def test_token_writes_of_no_token(fmt):
  """An empty slot_mapping gives empty targets and rows, one per region of the format."""
  from jax_mla.cache.api import token_writes
  from jax_mla.cache.formats import resolve
  head = 512 if fmt == "fp8_model1" else 576
  dtype = jnp.bfloat16 if fmt == "auto" else jnp.uint8
  cache = jnp.zeros(kv_cache_shape(2, 16, head, fmt), dtype)
  block, position, rows = token_writes(jnp.zeros((3, head - 64), jnp.bfloat16),
                                       jnp.zeros((3, 64), jnp.bfloat16), cache,
                                       jnp.zeros((0,), jnp.int32), kv_cache_dtype=fmt)
  assert block.shape == position.shape == (0,)
  assert [r.shape for r in rows] == [(0, n) for _, n in
                                     resolve(fmt).token_regions(16, cache.shape[2])]


@pytest.mark.cpu_only  # the cast is host code
def test_slot_mapping_any_integer_dtype():
  rng = np.random.default_rng(15)
  kv_c, k_pe = _inputs(rng, 4, 512)
  cache = jnp.zeros(kv_cache_shape(2, 8, 576, "auto"), jnp.bfloat16)
  slots = np.array([3, -1, 15, 0])
  outs = [np.asarray(concat_and_cache_mla(jnp.asarray(kv_c), jnp.asarray(k_pe), cache,
                                          s, kv_cache_dtype="auto"))
          for s in (slots.astype(np.int64), jnp.asarray(slots, jnp.int32),
                    slots.astype(np.uint8).astype(np.int16))]
  for out in outs[1:]:
    np.testing.assert_array_equal(out, outs[0])
  with pytest.raises(TypeError, match="slot_mapping"):
    concat_and_cache_mla(jnp.asarray(kv_c), jnp.asarray(k_pe), cache, [3, 1, 2, 0])
  got = gather_dequantize(jnp.asarray(outs[0]), np.array([3, 15], np.int64),
                          kv_cache_dtype="auto")
  np.testing.assert_array_equal(np.asarray(got), outs[0].reshape(-1, 576)[[3, 15]])


@pytest.mark.cpu_only
def test_checks_flag_slots_past_the_cache():
  from jax.experimental import checkify
  rng = np.random.default_rng(16)
  kv_c, k_pe = (jnp.asarray(a) for a in _inputs(rng, 3, 512))
  cache = jnp.zeros(kv_cache_shape(2, 8, 576, "fp8_ds_mla"), jnp.uint8)
  kw = dict(kv_cache_dtype="fp8_ds_mla", checks=True)
  ok = jnp.asarray([-1, 0, 15], jnp.int32)  # negative: a skipped token, not an error
  concat_and_cache_mla(kv_c, k_pe, cache, ok, **kw)
  bad = jnp.asarray([-1, 16, 3], jnp.int32)
  with pytest.raises(ValueError, match="slot_mapping must be < num_blocks"):
    concat_and_cache_mla(kv_c, k_pe, cache, bad, **kw)
  concat_and_cache_mla(kv_c, k_pe, cache, bad, kv_cache_dtype="fp8_ds_mla")  # off by default
  step = checkify.checkify(jax.jit(
      lambda c, s: concat_and_cache_mla(kv_c, k_pe, c, s, **kw)))
  err, _ = step(cache, bad)
  assert "slot_mapping" in err.get()
  err, _ = step(cache, ok)
  assert err.get() is None

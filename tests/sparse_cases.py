"""Random sparse-MLA inputs shared by the kernel tests (import as `from sparse_cases import ...`).

Cases follow FlashMLA's tests: invalid indices of every kind, short and zero
``topk_length``, sinks at +-inf, NaN in every unused cache slot. Arrays are made on the
host and moved with ``jax.device_put`` (a ``jnp.asarray`` of each new shape is one more
compile on a GPU).
"""

import jax
import jax.numpy as jnp
import numpy as np

from jax_mla.cache import (
  dequantize_fp8_ds_mla,
  dequantize_fp8_model1_cache,
  quantize_fp8_ds_mla,
  quantize_fp8_model1_cache,
)

BAD = np.array([-1, -2**31, 2**31 - 1, -123456], np.int64)  # plus s_kv, added per case


def bf16(rng, shape, scale=0.3):
  return jax.device_put(_host_bf16(rng.standard_normal(shape) * scale))


def _host_bf16(x):
  return np.asarray(x, np.float32).astype(jnp.bfloat16)


def random_indices(rng, shape, num_slots, bad_frac=0.2):
  """Random slots, a fraction replaced by invalid entries of every kind."""
  idx = rng.integers(0, num_slots, shape)
  bad = np.concatenate([BAD, [num_slots, num_slots + 7]])
  mask = rng.random(shape) < bad_frac
  idx = np.where(mask, bad[rng.integers(0, bad.size, shape)], idx)
  return idx.astype(np.int32)


def random_sink(rng, h):
  """Per-head sinks: finite, +inf and -inf."""
  s = rng.standard_normal(h).astype(np.float32)
  s[::3] = np.inf
  s[1::3] = -np.inf
  return jax.device_put(s)


def quantized_cache(rng, kv_cache_dtype, num_blocks, block_size, used, dense=True):
  """A cache whose unused slots hold NaN (fp8 0xFF bytes / bf16 NaN), and its bf16 content
  (None unless ``dense``)."""
  d = 512 if kv_cache_dtype == "fp8_model1" else 576
  x = np.asarray(rng.standard_normal((num_blocks, block_size, d)) * 0.3, np.float32)
  x[~used.reshape(num_blocks, block_size)] = np.nan
  x = jax.device_put(_host_bf16(x))
  if kv_cache_dtype == "fp8_ds_mla":
    cache = quantize_fp8_ds_mla(x)
    return cache, dequantize_fp8_ds_mla(cache) if dense else None
  if kv_cache_dtype == "fp8_model1":
    cache = quantize_fp8_model1_cache(x)
    return cache, dequantize_fp8_model1_cache(cache) if dense else None
  return x, x


def indices_and_used_slots(rng, b, s_q, topk, num_slots, lengths):
  """(indices[b, s_q, topk], topk_length[b] or None, used[num_slots]): random indices
  (invalid ones included), lengths with batch 0 at 0, and which slots a usable index names."""
  idx = random_indices(rng, (b, s_q, topk), num_slots)
  topk_length, used_idx = None, idx
  if lengths:
    topk_length = rng.integers(0, topk + 1, b).astype(np.int32)
    topk_length[0] = 0
    used_idx = np.where(np.arange(topk) < topk_length[:, None, None], idx, -1)
  used = np.zeros(num_slots, bool)
  used[used_idx[(used_idx >= 0) & (used_idx < num_slots)]] = True
  return idx, topk_length, used


def key_set(rng, kv_cache_dtype, b, s_q, topk, num_blocks, block_size, lengths, dense=True):
  """(cache, its bf16 content or None, indices[b, s_q, topk], topk_length[b] or None);
  batch 0 gets length 0, and only the slots the usable indices name hold numbers."""
  n = num_blocks * block_size
  idx, topk_length, used = indices_and_used_slots(rng, b, s_q, topk, n, lengths)
  cache, content = quantized_cache(rng, kv_cache_dtype, num_blocks, block_size, used, dense)
  return (cache, content, jax.device_put(idx),
          None if topk_length is None else jax.device_put(topk_length))


def decode_inputs(seed, case, dense=False):
  """``(q, cache, indices, kwargs of sparse_mla_decode, [(bf16 cache or None, indices,
  lengths) per key set])`` for ``case = (dtype, b, s_q, h_q, topk, blocks, block_size,
  sink, lengths, extra (topk, blocks, block_size) or None)``; the bf16 caches (one more
  compile each) only with ``dense``."""
  dt, b, s_q, h_q, topk, nb, bs, sink, lengths, extra = case
  rng = np.random.default_rng(seed)
  d = 512 if dt == "fp8_model1" else 576
  q = bf16(rng, (b, s_q, h_q, d))
  cache, dense_cache, idx, tl = key_set(rng, dt, b, s_q, topk, nb, bs, lengths, dense)
  kw = dict(kv_cache_dtype=dt, attn_sink=random_sink(rng, h_q) if sink else None, topk_length=tl)
  sets = [(dense_cache, idx, tl)]
  if extra:
    etopk, enb, ebs = extra
    ecache, edense, eidx, etl = key_set(rng, dt, b, s_q, etopk, enb, ebs, lengths, dense)
    kw.update(extra_kv_cache=ecache, extra_indices=eidx, extra_topk_length=etl)
    sets.append((edense, eidx, etl))
  return q, cache, idx, kw, sets

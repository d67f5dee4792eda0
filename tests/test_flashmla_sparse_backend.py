"""FlashMLASparse layer forward against an independent numpy reference that attends
each token to exactly its selected tokens (absorbed MLA form)."""

import doctest

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import rel_err

from jax_mla.backends import FlashMLASparse
from jax_mla.backends.flashmla_sparse import (
  FlashMLASparseConfig,
  build_flashmla_sparse_metadata,
  flashmla_sparse_forward,
)
from jax_mla.cache import dequantize_fp8_ds_mla, kv_cache_shape

H, P, R, L, V = 4, 128, 64, 512, 128
BS = 16


def _bf16(x):
  return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def _setup(seed, q_lens, ctx_lens, topk, cache_dtype, padding=0, h=H):
  rng = np.random.default_rng(seed)
  R_ = len(q_lens)
  seq_lens = np.array(ctx_lens) + np.array(q_lens)
  nbl = -(-seq_lens.max() // BS)
  num_blocks = R_ * nbl + 2
  bt = rng.permutation(num_blocks)[:R_ * nbl].reshape(R_, nbl).astype(np.int32)
  T_real = int(sum(q_lens))
  T = T_real + padding
  qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  # Context latents already in the cache, new tokens written by the forward.
  all_lat = {r: _bf16(rng.normal(size=(seq_lens[r], L + R))) for r in range(R_)}
  width = kv_cache_shape(num_blocks, BS, 576, cache_dtype)
  if cache_dtype == "auto":
    cache = np.full(width, np.nan, np.float32)  # NaN in every unused slot
  else:
    cache = np.full(width, 0x7F, np.uint8)  # fp8 0x7F is NaN
  slot_of = lambda r, t: bt[r, t // BS] * BS + t % BS
  from jax_mla.cache import quantize_fp8_ds_mla
  for r in range(R_):
    for t in range(ctx_lens[r]):
      s = slot_of(r, t)
      row = all_lat[r][t]
      if cache_dtype == "auto":
        cache[s // BS, s % BS] = row
      else:
        cache[s // BS, s % BS] = np.asarray(quantize_fp8_ds_mla(jnp.asarray(row, jnp.bfloat16)))
  slot_mapping = np.full(T, -1, np.int32)
  k_c = np.zeros((T, L), np.float32)
  k_pe = np.zeros((T, R), np.float32)
  topk_idx = np.full((T, topk), -1, np.int32)
  for r in range(R_):
    for j in range(q_lens[r]):
      t = qsl[r] + j
      pos = ctx_lens[r] + j
      slot_mapping[t] = slot_of(r, pos)
      k_c[t], k_pe[t] = all_lat[r][pos, :L], all_lat[r][pos, L:]
      k = min(topk, pos + 1)
      topk_idx[t, :k] = rng.choice(pos + 1, k, replace=False)
  if T_real > 1:
    topk_idx[1] = -1  # a token that selects nothing: zero output row
  q = _bf16(rng.normal(size=(T, h, P + R)))
  w_uk_t = _bf16(rng.normal(size=(h, P, L)) / np.sqrt(P))
  w_uv = _bf16(rng.normal(size=(h, L, V)) / np.sqrt(L))
  return dict(rng=rng, bt=bt, qsl=qsl, cache=cache, slot_mapping=slot_mapping, k_c=k_c,
              k_pe=k_pe, topk_idx=topk_idx, q=q, w_uk_t=w_uk_t, w_uv=w_uv, all_lat=all_lat,
              T_real=T_real, T=T, q_lens=q_lens, ctx_lens=ctx_lens)


def _reference(d, scale, cache_dtype):
  h = d["q"].shape[1]
  out = np.zeros((d["T"], h, V))
  lats = [d["all_lat"][r].astype(np.float64) for r in range(len(d["q_lens"]))]
  if cache_dtype == "fp8_ds_mla":  # every request's latents in one call (one compile)
    from jax_mla.cache import quantize_fp8_ds_mla
    flat = np.asarray(dequantize_fp8_ds_mla(quantize_fp8_ds_mla(
        jnp.asarray(np.concatenate(lats), jnp.bfloat16))), np.float64)
    lats = np.split(flat, np.cumsum([len(x) for x in lats])[:-1])
  for r, lat in enumerate(lats):
    for j in range(d["q_lens"][r]):
      t = d["qsl"][r] + j
      sel = [i for i in d["topk_idx"][t] if i >= 0]
      if not sel:
        continue
      ql = np.einsum("hp,hpl->hl", d["q"][t, :, :P], d["w_uk_t"])
      ql = _bf16(ql)
      qcat = np.concatenate([ql, d["q"][t, :, P:]], -1)
      k = lat[sel]
      s = qcat @ k.T * scale
      p = np.exp(s - s.max(-1, keepdims=True))
      p /= p.sum(-1, keepdims=True)
      o = _bf16(p @ k[:, :L])
      out[t] = np.einsum("hl,hlv->hv", o, d["w_uv"])
  return out.reshape(d["T"], h * V)


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8_ds_mla"])
@pytest.mark.parametrize("impl,h,seed,q_lens,ctx_lens,topk,padding", [
    pytest.param("xla", H, 0, [3, 1, 2], [5, 20, 0], 8, 0, marks=pytest.mark.cpu_only),
    pytest.param("xla", H, 1, [1, 4], [33, 2], 5, 2, marks=pytest.mark.cpu_only),
    # The layer on the Mosaic GPU kernels (64 heads; 16, a TP-8 share of 128): one case
    # holding both cases' features (a context over 3 blocks, batch padding).
    pytest.param("mosaic", 64, 2, [3, 1, 2], [5, 33, 0], 8, 2, marks=pytest.mark.gpu),
    pytest.param("mosaic", 16, 2, [3, 1, 2], [5, 33, 0], 8, 2, marks=pytest.mark.gpu),
])
def test_forward_matches_reference(impl, h, seed, q_lens, ctx_lens, topk, padding, cache_dtype):
  d = _setup(seed, q_lens, ctx_lens, topk, cache_dtype, padding, h)
  scale = (P + R) ** -0.5
  cfg = FlashMLASparseConfig(num_heads=h, scale=scale, kv_cache_dtype=cache_dtype)
  md = build_flashmla_sparse_metadata(jnp.asarray(d["qsl"]), jnp.asarray(d["bt"]),
                                      jnp.asarray(d["slot_mapping"]), num_tokens=d["T"],
                                      block_size=BS, topk_tokens=topk)
  cache_dt = jnp.bfloat16 if cache_dtype == "auto" else jnp.uint8
  out, new_cache = flashmla_sparse_forward(
      jnp.asarray(d["q"], jnp.bfloat16), jnp.asarray(d["k_c"], jnp.bfloat16),
      jnp.asarray(d["k_pe"], jnp.bfloat16), jnp.asarray(d["cache"], cache_dt),
      jnp.asarray(d["topk_idx"]), jnp.asarray(d["w_uk_t"], jnp.bfloat16),
      jnp.asarray(d["w_uv"], jnp.bfloat16), md, config=cfg, implementation=impl)
  want = _reference(d, scale, cache_dtype)
  out = np.asarray(out, np.float32)
  assert np.isfinite(out).all()
  assert rel_err(out, want) < (2e-2 if cache_dtype == "auto" else 4e-2)
  np.testing.assert_array_equal(out[1], 0.0)  # selected nothing
  np.testing.assert_array_equal(out[d["T_real"]:], 0.0)  # batch padding
  assert new_cache.shape == d["cache"].shape


def test_forward_triton_matches_xla(interpret):
  d = _setup(3, [2, 1], [6, 3], 4, "fp8_ds_mla")
  cfg = FlashMLASparseConfig(num_heads=H, scale=(P + R) ** -0.5, kv_cache_dtype="fp8_ds_mla")
  md = build_flashmla_sparse_metadata(jnp.asarray(d["qsl"]), jnp.asarray(d["bt"]),
                                      jnp.asarray(d["slot_mapping"]), num_tokens=d["T"],
                                      block_size=BS, topk_tokens=4)
  args = lambda: (jnp.asarray(d["q"], jnp.bfloat16), jnp.asarray(d["k_c"], jnp.bfloat16),
                  jnp.asarray(d["k_pe"], jnp.bfloat16), jnp.asarray(d["cache"], jnp.uint8),
                  jnp.asarray(d["topk_idx"]), jnp.asarray(d["w_uk_t"], jnp.bfloat16),
                  jnp.asarray(d["w_uv"], jnp.bfloat16), md)
  ref, ref_cache = flashmla_sparse_forward(*args(), config=cfg, implementation="xla")
  got, got_cache = flashmla_sparse_forward(*args(), config=cfg, implementation="triton",
                                           interpret=interpret)
  np.testing.assert_array_equal(np.asarray(got_cache), np.asarray(ref_cache))
  assert rel_err(got, ref) < 1e-2


@pytest.mark.cpu_only
def test_no_metadata_gives_zeros():
  cfg = FlashMLASparseConfig(num_heads=H, scale=0.1)
  cache = jnp.ones(kv_cache_shape(2, BS, 576, "auto"), jnp.bfloat16)
  out, new_cache = flashmla_sparse_forward(
      jnp.ones((3, H, P + R), jnp.bfloat16), jnp.ones((3, L), jnp.bfloat16),
      jnp.ones((3, R), jnp.bfloat16), cache, jnp.zeros((3, 4), jnp.int32),
      jnp.ones((H, P, L), jnp.bfloat16), jnp.ones((H, L, V), jnp.bfloat16), None, config=cfg)
  np.testing.assert_array_equal(out, 0.0)
  assert out.shape == (3, H * V)
  np.testing.assert_array_equal(new_cache, 1.0)


@pytest.mark.cpu_only
def test_bad_inputs_name_argument():
  def forward(config, w_uv_shape=(H, L, V)):
    return flashmla_sparse_forward(
        jnp.ones((3, H, P + R), jnp.bfloat16), jnp.ones((3, L), jnp.bfloat16),
        jnp.ones((3, R), jnp.bfloat16), jnp.ones((2, BS, 576), jnp.bfloat16),
        jnp.zeros((3, 4), jnp.int32), jnp.ones((H, P, L), jnp.bfloat16),
        jnp.ones(w_uv_shape, jnp.bfloat16), None, config=config)
  with pytest.raises(ValueError, match="kv_cache_dtype"):
    forward(FlashMLASparseConfig(num_heads=H, scale=0.1, kv_cache_dtype="fp8"))
  with pytest.raises(ValueError, match="w_uv"):
    forward(FlashMLASparseConfig(num_heads=H, scale=0.1), w_uv_shape=(H, V, L))


@pytest.mark.cpu_only  # the example runs the reference
def test_class_docstring_example_runs():
  test = doctest.DocTestParser().get_doctest(FlashMLASparse.__doc__, {}, "FlashMLASparse", None, 0)
  assert doctest.DocTestRunner().run(test).failed == 0

"""AiterMLA backend: head padding rule, metadata builder, whole layer vs a dense MLA reference."""

import doctest
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_err

from jax_mla.backends import AiterMLA
from jax_mla.backends import aiter_mla as A

L, P, R, V = 512, 128, 64, 128  # kv_lora_rank, qk_nope, qk_rope, v_head_dim


# --- head padding -----------------------------------------------------------------------------


@pytest.mark.cpu_only
@pytest.mark.parametrize("heads,padded", [(1, 16), (4, 16), (8, 16), (16, 16), (32, 32),
                                          (128, 128)])
def test_head_padding_valid(heads, padded):
  assert A.is_valid_num_heads(heads)
  q = jnp.arange(3 * heads * 2, dtype=jnp.float32).reshape(3, heads, 2)
  qp = A.get_mla_padded_q(heads, q)
  assert qp.shape == (3, padded, 2)
  # Each head repeated 16 // heads times in place (repeat_interleave), undone by striding.
  np.testing.assert_array_equal(qp[:, ::padded // heads], q)
  np.testing.assert_array_equal(A.get_mla_unpadded_o(heads, qp), q)


@pytest.mark.cpu_only
@pytest.mark.parametrize("heads", [3, 5, 20, 24, 0])
def test_head_padding_invalid(heads):
  assert not A.is_valid_num_heads(heads)
  with pytest.raises(ValueError, match=f"multiples or divisors of 16, but provided {heads} "
                                       "number of heads"):
    A.check_num_heads_validity(heads)
  with pytest.raises(ValueError, match="tensor_parallel_size"):
    A.AiterMLAConfig(num_heads=heads, scale=0.1)


# --- metadata builder -------------------------------------------------------------------------


@pytest.mark.cpu_only
def test_builder_metadata():
  block_size = 4
  qsl = np.array([0, 1, 2, 7, 10])                 # 2 decodes, 2 prefills
  seq_lens = np.array([6, 3, 5, 13])               # prefill contexts 0 and 10
  block_table = np.array([[3, 1, 0, 0], [2, 0, 0, 0], [5, 7, 0, 0], [4, 6, 8, 9]], np.int32)
  builder = A.AiterMLAMetadataBuilder(block_size=block_size, max_model_len=16, max_num_seqs=4,
                                      chunked_prefill_workspace_size=8,
                                      implementation="xla")
  md = builder.build(qsl, seq_lens, block_table, np.arange(10, dtype=np.int32))
  assert (md.num_decodes, md.num_decode_tokens, md.num_prefills) == (2, 2, 2)
  d = md.decode
  np.testing.assert_array_equal(d.paged_kv_indptr, [0, 6, 9])
  np.testing.assert_array_equal(d.paged_kv_indices[:9], [12, 13, 14, 15, 4, 5, 8, 9, 10])
  assert np.all(np.asarray(d.paged_kv_indices[9:]) == -1) and d.paged_kv_indices.shape == (64,)
  np.testing.assert_array_equal(d.paged_kv_last_page_len, [1, 1])
  np.testing.assert_array_equal(d.qo_indptr, [0, 1, 2])
  p = md.prefill
  np.testing.assert_array_equal(p.query_start_loc, [0, 5, 8])
  assert p.max_query_len == 5
  c = p.chunked_context
  # One prefill with context: chunk = 8 tokens (2 blocks) -> chunks [0, 8), [8, 10).
  assert c.seq_tot == (8, 2) and c.max_seq_lens == (8, 2)
  np.testing.assert_array_equal(c.cu_seq_lens, [[0, 0, 8], [0, 0, 2]])
  np.testing.assert_array_equal(c.slots[0], [16, 17, 18, 19, 24, 25, 26, 27])
  np.testing.assert_array_equal(c.slots[1], [32, 33])
  leaves, treedef = jax.tree_util.tree_flatten(md)
  assert all(isinstance(x, jax.Array) for x in leaves)
  assert jax.tree_util.tree_unflatten(treedef, leaves).num_decode_tokens == 2


# --- whole layer vs dense reference -----------------------------------------------------------


def _dense_reference(q, kv_all, pe_all, kv_b_proj, ctx_lens, q_lens, num_heads, scale):
  """Decompress every key of each request and run causal attention (float64)."""
  w = np.asarray(kv_b_proj, np.float64).reshape(L, num_heads, P + V)
  q = np.asarray(q, np.float64)
  outs = []
  t = 0
  for kv, pe, c, n in zip(kv_all, pe_all, ctx_lens, q_lens, strict=True):
    kv, pe = np.asarray(kv, np.float64), np.asarray(pe, np.float64)
    k = np.concatenate([np.einsum("sl,lnp->snp", kv, w[..., :P]),
                        np.broadcast_to(pe[:, None], (len(kv), num_heads, R))], -1)
    v = np.einsum("sl,lnv->snv", kv, w[..., P:])
    for i in range(n):
      s = np.einsum("nd,snd->ns", q[t + i], k[:c + i + 1]) * scale
      p = np.exp(s - s.max(-1, keepdims=True))
      p /= p.sum(-1, keepdims=True)
      outs.append(np.einsum("ns,snv->nv", p, v[:c + i + 1]).reshape(-1))
    t += n
  return np.stack(outs)


def _layer_case(num_heads, seed, *, ctx_lens, q_lens, block_size=8, num_pad=2):
  rng = np.random.default_rng(seed)
  seq_lens = np.array(ctx_lens) + np.array(q_lens)
  max_blocks = max(math.ceil(s / block_size) for s in seq_lens)
  num_blocks = len(seq_lens) * max_blocks + 3
  block_table = rng.permutation(num_blocks)[:len(seq_lens) * max_blocks].reshape(
      len(seq_lens), max_blocks).astype(np.int32)
  bf = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
  kv_all = [bf(rng.standard_normal((s, L)) * 0.5) for s in seq_lens]
  pe_all = [bf(rng.standard_normal((s, R)) * 0.5) for s in seq_lens]
  # Unwritten slots hold NaN: they must never reach an output.
  cache = np.full((num_blocks, block_size, L + R), np.nan, np.float32)
  slot = lambda r, t: block_table[r, t // block_size] * block_size + t % block_size
  new_kv, new_pe, slots = [], [], []
  for r, (c, n) in enumerate(zip(ctx_lens, q_lens, strict=True)):
    for t in range(c):
      cache[slot(r, t) // block_size, slot(r, t) % block_size] = np.concatenate(
          [kv_all[r][t], pe_all[r][t]])
    new_kv.append(kv_all[r][c:])
    new_pe.append(pe_all[r][c:])
    slots += [slot(r, t) for t in range(c, c + n)]
  total = sum(q_lens)
  q = bf(rng.standard_normal((total + num_pad, num_heads, P + R)))
  k_c = np.concatenate(new_kv + [np.full((num_pad, L), np.nan)]).astype(np.float32)
  k_pe = np.concatenate(new_pe + [np.full((num_pad, R), np.nan)]).astype(np.float32)
  slots = np.array(slots + [-1] * num_pad, np.int32)
  kv_b_proj = bf(rng.standard_normal((L, num_heads * (P + V))) / math.sqrt(L))
  return dict(q=q, k_c=k_c, k_pe=k_pe, cache=cache, block_table=block_table, slots=slots,
              kv_b_proj=kv_b_proj, kv_all=kv_all, pe_all=pe_all, seq_lens=seq_lens,
              qsl=np.concatenate([[0], np.cumsum(q_lens)]))


LAYER_CASES = [
    # (num_heads, ctx_lens, q_lens): 2 decodes then prefills with and without context;
    # a 16-token workspace (8 per prefill with context) gives 3 context chunks.
    (4, [20, 7, 0, 13, 21], [1, 1, 9, 5, 3]),
    (16, [0, 13], [6, 4]),          # prefill only, one context chunk
    (8, [3, 30, 12], [1, 1, 1]),    # decode only
]


def _run_layer(case, num_heads, implementation, interpret):
  scale = 1.0 / math.sqrt(P + R)
  config = A.AiterMLAConfig(num_heads=num_heads, scale=scale)
  builder = A.AiterMLAMetadataBuilder(block_size=8, max_model_len=64, max_num_seqs=5,
                                      chunked_prefill_workspace_size=16,
                                      implementation=implementation, interpret=interpret)
  md = builder.build(case["qsl"], case["seq_lens"], case["block_table"], case["slots"])
  bf = lambda x: jnp.asarray(x, jnp.bfloat16)
  out, cache = A.aiter_mla_forward(
      bf(case["q"]), bf(case["k_c"]), bf(case["k_pe"]), bf(case["cache"]), md,
      bf(case["kv_b_proj"]), config=config, implementation=implementation, interpret=interpret)
  return out, cache, scale


@pytest.mark.cpu_only  # the reference layer; on a GPU the Triton layer below
@pytest.mark.parametrize("num_heads,ctx_lens,q_lens", LAYER_CASES)
def test_layer_xla_matches_dense(num_heads, ctx_lens, q_lens):
  case = _layer_case(num_heads, 0, ctx_lens=ctx_lens, q_lens=q_lens)
  out, cache, scale = _run_layer(case, num_heads, "xla", False)
  total = sum(q_lens)
  ref = _dense_reference(case["q"], case["kv_all"], case["pe_all"], case["kv_b_proj"], ctx_lens,
                         q_lens, num_heads, scale)
  out = np.asarray(out.astype(jnp.float32))
  assert out.shape == (total + 2, num_heads * V)
  assert rel_err(out[:total], ref) < 2e-2
  assert np.all(out[total:] == 0)
  # The new tokens were written to their slots.
  flat = np.asarray(cache.astype(jnp.float32)).reshape(-1, L + R)
  s = case["slots"][:total]
  np.testing.assert_array_equal(flat[s, :L], case["k_c"][:total])


def test_layer_triton_matches_dense(interpret):
  # Kernels in the loop (decode, prefill, one context chunk, page expansion); kept small
  # for the interpreter, the chunk merging itself is covered on the xla path.
  num_heads, ctx_lens, q_lens = 4, [9, 0, 13], [1, 6, 3]
  case = _layer_case(num_heads, 1, ctx_lens=ctx_lens, q_lens=q_lens)
  out, _, scale = _run_layer(case, num_heads, "triton", interpret)
  ref = _dense_reference(case["q"], case["kv_all"], case["pe_all"], case["kv_b_proj"], ctx_lens,
                         q_lens, num_heads, scale)
  out = np.asarray(out.astype(jnp.float32))
  assert rel_err(out[:sum(q_lens)], ref) < 2e-2
  assert np.all(out[sum(q_lens):] == 0)


@pytest.mark.cpu_only
def test_forward_mqa_pads_heads():
  # 4 heads go to mla_decode as 16 (each repeated 4x); the result is per original head.
  rng = np.random.default_rng(3)
  cache = jnp.asarray(rng.standard_normal((4, 8, L + R)), jnp.bfloat16)
  builder = A.AiterMLAMetadataBuilder(block_size=8, max_model_len=32, max_num_seqs=2,
                                      implementation="xla")
  md = builder.build(np.array([0, 1, 2]), np.array([11, 5]), np.array([[2, 0], [3, 1]], np.int32),
                     np.array([-1, -1], np.int32))
  q = jnp.asarray(rng.standard_normal((2, 4, L + R)), jnp.bfloat16)
  config = A.AiterMLAConfig(num_heads=4, scale=0.05)
  out, lse = A.forward_mqa(q, cache, md.decode, config=config, implementation="xla")
  assert out.shape == (2, 4, L) and lse.shape == (2, 4)
  flat = np.asarray(cache.astype(jnp.float32)).reshape(-1, L + R)
  for b, keys in enumerate([np.r_[16:24, 0:3], np.r_[24:29]]):
    s = np.asarray(q[b].astype(jnp.float32)) @ flat[keys].T * 0.05
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = (p / p.sum(-1, keepdims=True)) @ flat[keys, :L]
    assert rel_err(out[b], ref) < 1e-2


@pytest.mark.cpu_only  # expected values are rounded by the same device: no rounding check
def test_layer_fp8_cache_xla():
  # fp8 cache (per-tensor scale): context keys are dequantized from the cache, decode
  # queries are quantized with q_scale; compared with the dense reference on
  # fp8-rounded context latents.
  num_heads, ctx_lens, q_lens = 4, [11, 0, 9], [1, 5, 3]
  case = _layer_case(num_heads, 2, ctx_lens=ctx_lens, q_lens=q_lens)
  k_scale, q_scale = 0.02, 0.05
  fp8_round = lambda x: np.asarray(
      (jnp.asarray(x / k_scale, jnp.float32).astype(jnp.float8_e4m3fn).astype(jnp.float32))
      * k_scale)
  cache = jnp.asarray(case["cache"] / k_scale, jnp.float32).astype(jnp.float8_e4m3fn)
  scale = 1.0 / math.sqrt(P + R)
  config = A.AiterMLAConfig(num_heads=num_heads, scale=scale, kv_cache_dtype="fp8")
  builder = A.AiterMLAMetadataBuilder(block_size=8, max_model_len=64, max_num_seqs=3,
                                      implementation="xla")
  md = builder.build(case["qsl"], case["seq_lens"], case["block_table"], case["slots"])
  bf = lambda x: jnp.asarray(x, jnp.bfloat16)
  out, new_cache = A.aiter_mla_forward(
      bf(case["q"]), bf(case["k_c"]), bf(case["k_pe"]), cache, md, bf(case["kv_b_proj"]),
      config=config, k_scale=k_scale, q_scale=q_scale, implementation="xla")
  assert new_cache.dtype == jnp.float8_e4m3fn
  kv_all = [np.concatenate([fp8_round(kv[:c]), kv[c:]])
            for kv, c in zip(case["kv_all"], ctx_lens, strict=True)]
  pe_all = [np.concatenate([fp8_round(pe[:c]), pe[c:]])
            for pe, c in zip(case["pe_all"], ctx_lens, strict=True)]
  ref = _dense_reference(case["q"], kv_all, pe_all, case["kv_b_proj"], ctx_lens, q_lens,
                         num_heads, scale)
  out = np.asarray(out.astype(jnp.float32))
  assert rel_err(out[:sum(q_lens)], ref) < 2e-2
  assert np.all(out[sum(q_lens):] == 0)


@pytest.mark.cpu_only  # the example runs the reference
def test_class_docstring_example_runs():
  test = doctest.DocTestParser().get_doctest(AiterMLA.__doc__, {}, "AiterMLA", None, 0)
  assert doctest.DocTestRunner().run(test).failed == 0

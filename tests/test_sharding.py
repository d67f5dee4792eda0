"""Sharded attention (jax_mla.sharding) equals the unsharded ops on 4 CPU devices.

The device count must be set before JAX starts, so in the normal test run this
module defines one test that re-runs this file under pytest in a subprocess with
``--xla_force_host_platform_device_count=4`` and requires every test there to pass
(nothing skipped). In that subprocess (``JAX_MLA_SHARDING_CHILD=1``) the module
defines the real tests: each op on meshes ``dp x tp`` = 1x4 and 2x2 (heads over
``tp``, requests over ``dp``), head counts that need padding per device included,
against the op run on one device (split layout: the same global arrays; stacked
layout: each shard's own call). Meshes come from ``jax.make_mesh`` (Explicit axes);
representative cases also run on Auto, mixed and ``Mesh(...)`` meshes, and the
module docstring's example runs as written.
"""

import doctest
import os
import re
import subprocess
import sys

CHILD = os.environ.get("JAX_MLA_SHARDING_CHILD") == "1"

if not CHILD:
  import pytest

  # The child runs on 4 CPU devices whatever the machine: nothing for the GPU suite.
  pytestmark = pytest.mark.cpu_only

  def test_sharding_suite_on_4_cpu_devices():
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    env = dict(os.environ, JAX_MLA_SHARDING_CHILD="1", JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
         "-o", "addopts=", os.path.abspath(__file__)],
        cwd=root, env=env, capture_output=True, text=True, timeout=900, check=False)
    log = r.stdout[-6000:] + r.stderr[-3000:]
    assert r.returncode == 0, log
    summary = r.stdout.strip().splitlines()[-1]
    # Every child test passed: nothing failed, errored, skipped or deselected.
    assert re.fullmatch(r"=* ?\d+ passed(, \d+ warnings?)? in [\d.]+s( \(.*\))? ?=*", summary), log
    assert int(re.search(r"(\d+) passed", summary).group(1)) >= 34, log

else:

  import jax
  import jax.numpy as jnp
  import numpy as np
  import pytest
  from helpers import rel_err
  from jax.sharding import AxisType, Mesh

  from jax_mla import paged_attention, sharding
  from jax_mla.backends import aiter_mla as A
  from jax_mla.backends import deepseek_v4 as v4
  from jax_mla.backends import flashmla_sparse as F
  from jax_mla.backends import split_decodes_and_prefills
  from jax_mla.cache import quantize_fp8_ds_mla, quantize_fp8_model1_cache
  from jax_mla.dense_decode import mla_decode, mla_decode_paged, mla_ragged_paged_attention
  from jax_mla.dense_prefill import mla_prefill, mla_prefill_token_major
  from jax_mla.sparse_mla import sparse_mla_decode, sparse_mla_prefill

  MESHES = [(1, 4), (2, 2)]
  MESH_KINDS = ["explicit", "auto", "mixed", "Mesh"]
  XLA = dict(implementation="xla")
  # Every op that declares its sharding.
  OPS = [sparse_mla_prefill, sparse_mla_decode, mla_decode, mla_decode_paged,
         mla_ragged_paged_attention, mla_prefill, mla_prefill_token_major, paged_attention,
         A.aiter_mla_forward,
         A.forward_mqa, A.forward_mha, F.flashmla_sparse_forward, v4.deepseek_v4_sparse_forward,
         v4.deepseek_v4_sparse_decode, v4.deepseek_v4_sparse_prefill]

  def make_mesh(shape, kind="explicit"):
    """A ``("dp", "tp")`` mesh: ``jax.make_mesh`` with Explicit, Auto or mixed (dp
    Explicit, tp Auto) axes, or ``jax.sharding.Mesh`` over the first 4 devices."""
    assert jax.device_count() >= 4, "the child run needs 4 devices"
    if kind == "Mesh":
      return Mesh(np.array(jax.devices()[:4]).reshape(shape), ("dp", "tp"))
    types = dict(explicit=(AxisType.Explicit,) * 2, auto=(AxisType.Auto,) * 2,
                 mixed=(AxisType.Explicit, AxisType.Auto))[kind]
    return jax.make_mesh(shape, ("dp", "tp"), axis_types=types)

  def bf16(rng, shape, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.bfloat16)

  def is_array(x):
    return isinstance(x, (jax.Array, np.ndarray))

  def assert_same(out, ref):
    outs, refs = jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs, strict=True):
      assert o.shape == r.shape and o.dtype == r.dtype, (o.shape, r.shape, o.dtype, r.dtype)
      if not jnp.issubdtype(r.dtype, jnp.floating):
        np.testing.assert_array_equal(np.asarray(o), np.asarray(r))
        continue
      o, r = np.asarray(o, np.float64), np.asarray(r, np.float64)
      np.testing.assert_array_equal(np.isposinf(o), np.isposinf(r))
      np.testing.assert_array_equal(np.isneginf(o), np.isneginf(r))
      finite = np.isfinite(r)
      assert rel_err(o[finite], r[finite]) < 1e-3, rel_err(o[finite], r[finite])

  def run_sharded(op, mesh, kwargs, *, layout, heads=True, requests=True):
    """The sharded op under jit; array arguments traced, the rest static."""
    wrapped = sharding.shard_attention(
        op, mesh, head_axis="tp" if heads else None, request_axis="dp" if requests else None,
        request_layout=layout)
    arrays = {k: v for k, v in kwargs.items() if jax.tree_util.tree_leaves(v)
              and all(is_array(x) for x in jax.tree_util.tree_leaves(v))}
    static = {k: v for k, v in kwargs.items() if k not in arrays}
    return jax.jit(lambda arr: wrapped(**arr, **static))(arrays)

  def stacked_reference(op, shards, shared):
    outs = [op(**s, **shared) for s in shards]
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *outs)

  def check_stacked(op, mesh_shape, make_shard, shared):
    """Each of the dp shards is its own call; shared arguments are passed once."""
    mesh = make_mesh(mesh_shape)
    shards = [make_shard(np.random.default_rng(100 + i)) for i in range(mesh_shape[0])]
    stacked = {k: sharding.stack_shards([s[k] for s in shards]) for k in shards[0]}
    out = run_sharded(op, mesh, {**stacked, **shared}, layout="stacked")
    assert_same(out, stacked_reference(op, shards, shared))

  # --- split layout: batch-major ops ---------------------------------------------------------

  def own_ids(rng, rows, per_row, total, n=4, invalid=0.25):
    """Random ids for ``rows`` rows; row ``i`` stays in the id range of its device when
    rows and ids are both split ``n`` ways (so also 2 and 1 ways); some ids invalid."""
    dev = np.arange(rows) * n // rows
    lo, size = dev * (total // n), total // n
    ids = lo[:, None] + rng.integers(0, size, (rows, per_row))
    r = rng.random(ids.shape)
    ids[r < invalid / 2] = -1
    ids[(r >= invalid / 2) & (r < invalid)] = 2**31 - 1
    return ids.astype(np.int32)

  def sparse_prefill_case(rng, h, d_qk=576):
    s_q, s_kv, topk = 8, 32, 8
    return dict(q=bf16(rng, (s_q, h, d_qk)), kv=bf16(rng, (s_kv, d_qk)),
                indices=jnp.asarray(own_ids(rng, s_q, topk, s_kv)), sm_scale=d_qk**-0.5,
                attn_sink=jnp.asarray(rng.standard_normal(h), jnp.float32),
                topk_length=jnp.asarray(rng.integers(0, topk + 1, s_q), jnp.int32), **XLA)

  def sparse_decode_case(rng, h, cache_dtype):
    b, s_q, nb, bs, topk = 4, 2, 8, 4, 6
    kw = dict(q=bf16(rng, (b, s_q, h, 576)), kv_cache_dtype=cache_dtype,
              attn_sink=jnp.asarray(rng.standard_normal(h), jnp.float32),
              topk_length=jnp.asarray(rng.integers(1, topk + 1, b), jnp.int32), **XLA)
    x = bf16(rng, (nb, bs, 576))
    kw["kv_cache"] = quantize_fp8_ds_mla(x) if cache_dtype == "fp8_ds_mla" else x
    kw["indices"] = jnp.asarray(own_ids(rng, b, s_q * topk, nb * bs).reshape(b, s_q, topk))
    if cache_dtype == "auto":  # with an extra key set in the same softmax
      enb, ebs, etopk = 4, 2, 3
      kw.update(extra_kv_cache=bf16(rng, (enb, ebs, 576)),
                extra_indices=jnp.asarray(
                    own_ids(rng, b, s_q * etopk, enb * ebs).reshape(b, s_q, etopk)),
                extra_topk_length=jnp.asarray(rng.integers(0, etopk + 1, b), jnp.int32))
    return kw

  def paged_case(rng, h):
    b, s_q, nb, bs = 4, 2, 8, 4
    table = own_ids(rng, b, 3, nb, invalid=0)
    table[:, 2] = -1  # past every sequence: never read
    return dict(q=bf16(rng, (b, s_q, h, 576)), kv_cache=bf16(rng, (nb, bs, 576)),
                block_table=jnp.asarray(table),
                cache_seqlens=jnp.asarray([8, 3, 0, 6], jnp.int32), causal=True, **XLA)

  SPLIT_CASES = {
      "sparse_prefill_h6": (sparse_mla_prefill, lambda rng: sparse_prefill_case(rng, 6)),
      "sparse_prefill_v4_h8": (sparse_mla_prefill,
                               lambda rng: sparse_prefill_case(rng, 8, d_qk=512)),
      "sparse_decode_auto_extra_h6": (sparse_mla_decode,
                                      lambda rng: sparse_decode_case(rng, 6, "auto")),
      "sparse_decode_fp8_ds_mla_h4": (sparse_mla_decode,
                                      lambda rng: sparse_decode_case(rng, 4, "fp8_ds_mla")),
      "mla_decode_paged_h5": (mla_decode_paged, lambda rng: paged_case(rng, 5)),
  }

  @pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
  @pytest.mark.parametrize("name", list(SPLIT_CASES))
  def test_split_layout_matches_one_device(name, mesh_shape):
    op, make = SPLIT_CASES[name]
    kw = make(np.random.default_rng(len(name)))
    out = run_sharded(op, make_mesh(mesh_shape), kw, layout="split")
    assert_same(out, op(**kw))

  def test_split_layout_masks_ids_of_other_devices():
    kw = sparse_decode_case(np.random.default_rng(5), 4, "auto")
    idx = np.array(kw["indices"])
    idx[0, 0, 0] = 31  # request 0 is on device 0 of 4; slot 31 belongs to device 3
    kw["indices"] = jnp.asarray(idx)
    out = run_sharded(sparse_mla_decode, make_mesh((4, 1)), kw, layout="split")
    idx[0, 0, 0] = -1
    assert_same(out, sparse_mla_decode(**{**kw, "indices": jnp.asarray(idx)}))

  @pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
  def test_sparse_prefill_gradients_under_shard_map(mesh_shape):
    """jax.grad through the sharded op (its custom VJP inside shard_map) equals the
    gradient on one device; ``kv``'s gradient sums the heads of every device."""
    kw = sparse_prefill_case(np.random.default_rng(11), 8)
    wrapped = sharding.shard_attention(sparse_mla_prefill, make_mesh(mesh_shape),
                                       head_axis="tp", request_axis="dp",
                                       request_layout="split")
    fixed = {k: v for k, v in kw.items() if k not in ("q", "kv", "attn_sink")}

    def loss(op, q, kv, sink):
      out, _, lse = op(q=q, kv=kv, attn_sink=sink, **fixed)
      return (jnp.sum(out.astype(jnp.float32))
              + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)))

    args = (kw["q"], kw["kv"], kw["attn_sink"])
    got = jax.jit(jax.grad(lambda *a: loss(wrapped, *a), argnums=(0, 1, 2)))(*args)
    want = jax.grad(lambda *a: loss(sparse_mla_prefill, *a), argnums=(0, 1, 2))(*args)
    for g, w in zip(got, want, strict=True):
      assert g.shape == w.shape and g.dtype == w.dtype
      assert rel_err(np.asarray(g, np.float64), np.asarray(w, np.float64)) < 1e-2

  def test_triton_interpret_head_and_request_split():
    rng = np.random.default_rng(9)
    b, nb, bs, topk = 2, 4, 4, 4
    kw = dict(q=bf16(rng, (b, 1, 2, 576)), kv_cache=bf16(rng, (nb, bs, 576)),
              indices=jnp.asarray(own_ids(rng, b, topk, nb * bs, n=2).reshape(b, 1, topk)),
              kv_cache_dtype="auto", implementation="triton", interpret=True)
    out = run_sharded(sparse_mla_decode, make_mesh((2, 2)), kw, layout="split")
    assert_same(out, sparse_mla_decode(**kw))

  # --- stacked layout: ragged ops -------------------------------------------------------------

  def mla_decode_shard(rng, h=6):
    pages = 24
    kv_indices = np.full(16, -1, np.int32)
    kv_indices[:12] = rng.permutation(pages)[:12]
    return dict(q=bf16(rng, (4, h, 576)), kv_cache=bf16(rng, (pages, 1, 576)),
                qo_indptr=jnp.asarray([0, 1, 3], jnp.int32),
                kv_indptr=jnp.asarray([0, 7, 12], jnp.int32), kv_indices=jnp.asarray(kv_indices),
                kv_last_page_lens=jnp.ones(2, jnp.int32))

  def ragged_shard(rng, n=3):
    tokens = 7  # 6 live + 1 padding
    return dict(ql_nope=bf16(rng, (tokens, n, 512)), q_pe=bf16(rng, (tokens, n, 64)),
                new_kv_c=bf16(rng, (tokens, 512)), new_k_pe=bf16(rng, (tokens, 64)),
                cache_kv=bf16(rng, (8, 4, 576)), kv_lens=jnp.asarray([5, 8, 3], jnp.int32),
                page_indices=jnp.asarray(rng.permutation(8)[:6], jnp.int32),
                cu_q_lens=jnp.asarray([0, 1, 4, 6], jnp.int32),
                distribution=jnp.asarray([1, 2, 3], jnp.int32))

  def prefill_shard(rng, h=3):
    return dict(q=bf16(rng, (6, h, 192)), k=bf16(rng, (6, h, 192)), v=bf16(rng, (6, h, 128)),
                cu_seqlens_q=jnp.asarray([0, 2, 6], jnp.int32),
                cu_seqlens_k=jnp.asarray([0, 2, 6], jnp.int32))

  @pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
  def test_mla_decode_stacked(mesh_shape):
    check_stacked(mla_decode, mesh_shape, mla_decode_shard, dict(max_seqlen_q=2, **XLA))

  @pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
  def test_mla_prefill_stacked_with_lse(mesh_shape):
    check_stacked(mla_prefill, mesh_shape, prefill_shard,
                  dict(max_seqlen_q=4, max_seqlen_k=4, sm_scale=0.1, return_lse=True, **XLA))

  @pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
  def test_ragged_paged_attention_jit_donated_cache(mesh_shape):
    mesh = make_mesh(mesh_shape)
    shards = [ragged_shard(np.random.default_rng(i)) for i in range(mesh_shape[0])]
    stacked = {k: sharding.stack_shards([s[k] for s in shards]) for k in shards[0]}
    # The op donates its cache argument: the reference gets its own copies.
    ref = stacked_reference(mla_ragged_paged_attention,
                            [{**s, "cache_kv": jnp.copy(s["cache_kv"])} for s in shards],
                            dict(sm_scale=0.1, **XLA))
    attn = sharding.shard_attention(mla_ragged_paged_attention, mesh, head_axis="tp",
                                    request_axis="dp", request_layout="stacked")
    step = jax.jit(attn, static_argnames=("sm_scale", "implementation"),
                   donate_argnames=("cache_kv",))
    out = step(**stacked, sm_scale=0.1, implementation="xla")
    assert_same(out, ref)

  def test_head_parallel_replicates_cache_and_pads_heads():
    # 3 heads over 4 devices: 1 per device, one zero head added and dropped.
    mesh = make_mesh((1, 4))
    kw = ragged_shard(np.random.default_rng(3))
    attn = jax.jit(sharding.head_parallel(mla_ragged_paged_attention, mesh, "tp"),
                   static_argnames=("sm_scale", "implementation"), donate_argnames=("cache_kv",))
    ref = mla_ragged_paged_attention(**{**kw, "cache_kv": jnp.copy(kw["cache_kv"])},
                                     sm_scale=0.1, **XLA)
    out = attn(**kw, sm_scale=0.1, **XLA)
    assert kw["cache_kv"].is_deleted()  # donated to the sharded step
    assert_same(out, ref)
    assert out[1].sharding.is_fully_replicated

  # --- layer-level backends (stacked requests, heads split) -----------------------------------

  def aiter_shard(num_heads):
    def make(rng):
      bs, ctx, qlens = 8, np.array([9, 0, 12]), np.array([1, 4, 3])
      seq = ctx + qlens
      table = rng.permutation(12)[:9].reshape(3, 3).astype(np.int32)
      slots = [table[r, p // bs] * bs + p % bs for r in range(3) for p in range(ctx[r], seq[r])]
      slots = np.array(slots + [-1], np.int32)  # one padding token
      builder = A.AiterMLAMetadataBuilder(block_size=bs, max_model_len=24, max_num_seqs=3,
                                          chunked_prefill_workspace_size=16, **XLA)
      md = builder.build(np.concatenate([[0], np.cumsum(qlens)]), seq, table, slots)
      t = len(slots)
      return dict(q=bf16(rng, (t, num_heads, 192)), k_c_normed=bf16(rng, (t, 512)),
                  k_pe=bf16(rng, (t, 64)), kv_cache=bf16(rng, (12, bs, 576)), attn_metadata=md)
    return make

  @pytest.mark.parametrize("mesh_shape,h", [((2, 2), 8), ((1, 4), 48)])
  def test_aiter_mla_forward(mesh_shape, h):
    # 8 heads on 2 devices: 4 each, padded to 16 by AITER's rule inside forward_mqa.
    # 48 heads on 4 devices: 12 each is not AITER-valid -> 16 each (48 -> 64 heads:
    # zero queries and zero kv_b_proj columns, dropped after).
    w = bf16(np.random.default_rng(1), (512, h * 256), 512**-0.5)
    check_stacked(A.aiter_mla_forward, mesh_shape, aiter_shard(h),
                  dict(kv_b_proj=w, config=A.AiterMLAConfig(num_heads=h, scale=0.07), **XLA))

  def test_aiter_forward_mqa_tuple_query_head_parallel():
    # (ql_nope, q_pe) split on heads leaf by leaf; 4 heads on 4 devices: 1 each -> 16.
    rng = np.random.default_rng(6)
    builder = A.AiterMLAMetadataBuilder(block_size=8, max_model_len=32, max_num_seqs=2, **XLA)
    md = builder.build(np.array([0, 1, 2]), np.array([11, 5]),
                       np.array([[2, 0], [3, 1]], np.int32), np.array([-1, -1], np.int32))
    q = (bf16(rng, (2, 4, 512)), bf16(rng, (2, 4, 64)))
    kw = dict(q=q, kv_cache=bf16(rng, (4, 8, 576)), decode=md.decode,
              config=A.AiterMLAConfig(num_heads=4, scale=0.05), **XLA)
    out = run_sharded(A.forward_mqa, make_mesh((1, 4)), kw, layout="split", requests=False)
    assert_same(out, A.forward_mqa(**kw))

  def test_flashmla_sparse_forward_head_parallel():
    # 6 heads on 4 devices: 2 each, padded to 8 (zero queries and weights, dropped after).
    rng = np.random.default_rng(7)
    bs, t = 8, 3
    cfg = F.FlashMLASparseConfig(num_heads=6, scale=192**-0.5)
    md = F.build_flashmla_sparse_metadata(
        jnp.array([0, 2, 3], jnp.int32), jnp.array([[1, 0], [3, 2]], jnp.int32),
        jnp.array([9, 10, 17], jnp.int32), num_tokens=t, block_size=bs)
    kw = dict(q=bf16(rng, (t, 6, 192)), k_c_normed=bf16(rng, (t, 512)), k_pe=bf16(rng, (t, 64)),
              kv_cache=bf16(rng, (4, bs, 576)),
              topk_indices=jnp.array([[0, 1, -1], [2, 0, 1], [0, 1, 2]], jnp.int32),
              w_uk_t=bf16(rng, (6, 128, 512), 128**-0.5), w_uv=bf16(rng, (6, 512, 128), 512**-0.5),
              metadata=md, config=cfg, **XLA)
    out = run_sharded(F.flashmla_sparse_forward, make_mesh((1, 4)), kw, layout="split",
                      requests=False)
    assert_same(out, F.flashmla_sparse_forward(**kw))

  def v4_shard(cfg):
    def make(rng):
      reqs = [(5, 1), (20, 1), (0, 4), (9, 3)]
      ctx = np.array([c for c, _ in reqs])
      qlens = np.array([q for _, q in reqs])
      seq = (ctx + qlens).astype(np.int32)
      qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
      sbs = cfg.swa_block_size
      swa_bt = rng.permutation(16)[:12].reshape(4, 3).astype(np.int32)
      bt = rng.permutation(8)[:8].reshape(4, 2).astype(np.int32)
      slots = [swa_bt[r, p // sbs] * sbs + p % sbs for r in range(4)
               for p in range(ctx[r], seq[r])]
      slot_mapping = np.array(slots + [-1], np.int32)
      t = len(slot_mapping)
      counts = split_decodes_and_prefills(qsl)
      md = v4.build_deepseek_v4_metadata(
          cfg, jnp.asarray(qsl), jnp.asarray(seq), jnp.asarray(slot_mapping),
          jnp.asarray(swa_bt), jnp.asarray(bt), num_decodes=counts[0],
          num_decode_tokens=counts[2])
      pos = np.concatenate([np.arange(c, c + q) for c, q in reqs] + [[0]])
      topk = np.stack([rng.integers(-1, max(1, (p + 1) // 4), cfg.index_topk) for p in pos])
      return dict(q=bf16(rng, (t, cfg.num_heads, 512)), kv=bf16(rng, (t, 512)),
                  swa_cache=quantize_fp8_model1_cache(bf16(rng, (16, sbs, 512))),
                  compressed_cache=quantize_fp8_model1_cache(
                      bf16(rng, (8, cfg.compressed_block_size, 512))),
                  metadata=md, topk_indices=jnp.asarray(topk, jnp.int32))
    return make

  @pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
  def test_deepseek_v4_sparse_forward(mesh_shape):
    # 3 heads: padded to 4 over 2 or 4 devices.
    cfg = v4.DeepseekV4Config(num_heads=3, window_size=8, compress_ratio=4, index_topk=4,
                              block_size=16, max_model_len=64, swa_block_size=8)
    sink = jnp.asarray(np.random.default_rng(4).standard_normal(3), jnp.float32)
    check_stacked(v4.deepseek_v4_sparse_forward, mesh_shape, v4_shard(cfg),
                  dict(attn_sink=sink, config=cfg, **XLA))

  # --- meshes: jax.make_mesh (Explicit, Auto, mixed axes) and Mesh(...) ---------------------

  def test_module_docstring_example_runs_as_written():
    test = doctest.DocTestParser().get_doctest(sharding.__doc__, {}, "jax_mla.sharding", None, 0)
    assert doctest.DocTestRunner().run(test, clear_globs=False).failed == 0
    ns = test.globs  # the example's own names: check it against each group's own call
    ref = stacked_reference(mla_ragged_paged_attention, ns["calls"], dict(sm_scale=576 ** -0.5))
    assert_same((ns["o_latent"], ns["cache"]), ref)

  @pytest.mark.parametrize("kind", MESH_KINDS)
  def test_mesh_kinds_eager_and_jit(kind):
    # Heads padded (6 over 4 devices), eagerly as the first call did.
    kw = sparse_prefill_case(np.random.default_rng(1), 6)
    out = sharding.head_parallel(sparse_mla_prefill, make_mesh((1, 4), kind), "tp")(**kw)
    assert_same(out, sparse_mla_prefill(**kw))
    # Requests split with rebased ids and heads padded, under jit.
    kw = sparse_decode_case(np.random.default_rng(2), 3, "auto")
    out = run_sharded(sparse_mla_decode, make_mesh((2, 2), kind), kw, layout="split")
    assert_same(out, sparse_mla_decode(**kw))

  @pytest.mark.parametrize("kind", ["explicit", "Mesh"])
  def test_inputs_already_sharded_elsewhere(kind):
    # Inputs placed on another sharding of the mesh (q split over dp on its head axis)
    # are moved to the specs first.
    mesh = make_mesh((2, 2), kind)
    kw = sparse_prefill_case(np.random.default_rng(3), 8)
    placed = dict(kw, q=jax.device_put(kw["q"], jax.sharding.NamedSharding(
        mesh, jax.P(None, "dp"))))
    out = sharding.head_parallel(sparse_mla_prefill, mesh, "tp")(**placed)
    assert_same(out, sparse_mla_prefill(**kw))

  def paged_shard(rng, hq=8, hkv=2):
    nb, bs, d = 6, 4, 16
    return dict(query=bf16(rng, (3, hq, d)), key_cache=bf16(rng, (nb, hkv, bs, d)),
                value_cache=bf16(rng, (nb, hkv, bs, d)),
                block_tables=jnp.asarray(rng.permutation(nb)[:6].reshape(3, 2), jnp.int32),
                seq_lens=jnp.asarray([5, 8, 1], jnp.int32))

  def test_paged_attention_gqa_head_parallel_and_stacked():
    # 8 query heads over 2 KV heads: each device gets whole groups; 2 KV heads over
    # 4 devices pad to 4 (zero KV heads with zero query groups, dropped after).
    rng = np.random.default_rng(8)
    shared = dict(sinks=jnp.asarray(rng.standard_normal(8), jnp.float32), scale=0.25, **XLA)
    kw = paged_shard(rng)
    out = run_sharded(paged_attention, make_mesh((1, 4)), {**kw, **shared}, layout="split",
                      requests=False)
    assert_same(out, paged_attention(**kw, **shared))
    check_stacked(paged_attention, (2, 2), paged_shard, shared)

  # --- contract errors ------------------------------------------------------------------------

  def test_errors_name_the_problem():
    mesh = make_mesh((2, 2))
    with pytest.raises(ValueError, match="ragged metadata"):
      sharding.request_parallel(mla_decode, mesh, "dp")
    with pytest.raises(ValueError, match="declares no OpSharding"):
      sharding.head_parallel(jnp.sum, mesh, "tp")
    with pytest.raises(ValueError, match="not in the mesh"):
      sharding.head_parallel(mla_decode, mesh, "heads")
    with pytest.raises(ValueError, match="share axes"):
      sharding.shard_attention(mla_decode, mesh, head_axis="tp", request_axis="tp")
    kw = mla_decode_shard(np.random.default_rng(0))
    with pytest.raises(ValueError, match="stacked layout"):
      sharding.request_parallel(mla_decode, mesh, "dp", layout="stacked")(**kw, max_seqlen_q=2)
    kw = paged_case(np.random.default_rng(0), 4)
    kw["q"] = kw["q"][:3]
    kw["block_table"], kw["cache_seqlens"] = kw["block_table"][:3], kw["cache_seqlens"][:3]
    with pytest.raises(ValueError, match="must divide by the 2 devices"):
      sharding.request_parallel(mla_decode_paged, mesh, "dp")(**kw)
    for op in OPS:  # every declaration names only arguments its op takes
      assert isinstance(op.sharding, sharding.OpSharding)
      sharding.shard_attention(op, mesh, head_axis="tp", request_axis="dp",
                               request_layout="stacked")
    wrapped = sharding.head_parallel(mla_decode, mesh, "tp")
    assert not hasattr(wrapped, "sharding")  # the sharded op is not shardable again
    with pytest.raises(ValueError, match="does not take"):
      sharding.head_parallel(mla_decode, mesh, spec=sharding.OpSharding(
          heads=dict(query=1), head_outs=(1, 1), num_heads=lambda a: 1))
    with pytest.raises(ValueError, match="differs"):
      sharding.stack_shards([dict(a=jnp.ones(2)), dict(b=jnp.ones(2))])

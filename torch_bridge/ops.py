"""jax_mla ops callable with torch tensors, and FlashMLA-compatible drop-ins.

Every public jax_mla op is here under the same name and argument order (one
wrapper each, made by :func:`torch_op`; ``help(ops.sparse_mla_decode)`` shows the
op's own documentation): tensor arguments are torch tensors (CPU or CUDA,
contiguous, shared without a copy), results are torch tensors. Non-tensor arguments
(ints, floats, strings, bools, None, config objects) are static: each distinct set of
them, together with the tensor shapes and dtypes, is compiled once and cached. On CUDA,
an op whose program is Mosaic GPU kernels plus views (the sparse and dense MLA decode
on Hopper) then has its kernels launched on torch's current stream, outputs allocated
by torch (:mod:`torch_bridge._direct`); any other call costs one jitted dispatch plus
the DLPack hand-offs of tensors not seen before (a tensor's imported view is kept while
it lives) and of the results, which share JAX's output memory. A list, tuple or numpy
array where the op takes an array is refused with a TypeError naming the argument
(convert it first, e.g. ``torch.tensor(x, dtype=torch.int32)``).

``concat_and_cache_mla`` writes into the torch cache's own memory, in place (also in
vLLM's positional form): on Hopper the Mosaic GPU writer, launched directly; elsewhere
JAX encodes only the new tokens and torch stores them.

FlashMLA drop-ins (``deepseek-ai/FlashMLA`` ``flash_mla_interface``):
``get_mla_metadata``, ``flash_mla_with_kvcache``, ``flash_mla_sparse_fwd``,
backed by jax_mla's kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable

import jax
import numpy as np
import torch

from jax_mla import cache, dense_decode, dense_prefill, indexing, merge, paged, sparse_mla
from jax_mla.cache import api as cache_api
from jax_mla.cache.formats import resolve
from torch_bridge import _direct, _interop

_DYNAMIC = object()  # marks a tensor position in a call's static signature
_TENSORS = (torch.Tensor, jax.Array)
# Static values' types: a call's key skips the isinstance test on them (against jax.Array it
# costs 0.2 us, and a decode call has a dozen such arguments).
_PLAIN = frozenset({type(None), bool, int, float, str})


def _static(name: str, value):
  if isinstance(value, (list, tuple, np.ndarray)):
    raise TypeError(
        f"{name}: got a {type(value).__name__}; pass a torch.Tensor where the op takes an "
        "array (e.g. torch.tensor(x, dtype=torch.int32)), a Python scalar, str, bool or None "
        "where it takes a static value")
  try:
    hash(value)
  except TypeError:
    raise TypeError(f"{name}: non-tensor arguments are compiled in and must be hashable "
                    f"(int, float, str, bool, None); got {type(value).__name__}") from None
  return value


def _export_tree(out, stream):
  if isinstance(out, jax.Array):
    return _interop.export_array(out, stream)
  if isinstance(out, tuple) and all(isinstance(o, jax.Array) for o in out):
    return tuple(_interop.export_array(o, stream) for o in out)
  return jax.tree_util.tree_map(lambda o: _interop.export_array(o, stream), out)


def _array_device(a: jax.Array) -> jax.Device | None:
  devices = a.devices()
  return next(iter(devices)) if len(devices) == 1 else None


class _Signature:
  """One static signature of a torch op's calls: its validated static arguments, where
  its tensors sit, and one ``jax.jit`` per device (built on first use)."""

  def __init__(self, fn: Callable, params: tuple[str, ...], args: tuple, kwargs: dict,
               in_place: bool = False):
    self.fn, self.in_place = fn, in_place
    self.spec = tuple(
        _DYNAMIC if isinstance(a, _TENSORS)
        else _static(params[i] if i < len(params) else f"args[{i}]", a)
        for i, a in enumerate(args))
    self.kw_spec = tuple((k, _DYNAMIC if isinstance(v, _TENSORS) else _static(k, v))
                         for k, v in kwargs.items())
    self.positions = tuple(i for i, s in enumerate(self.spec) if s is _DYNAMIC)
    self.keywords = tuple(k for k, s in self.kw_spec if s is _DYNAMIC)
    self.names = tuple(params[i] if i < len(params) else f"args[{i}]"
                       for i in self.positions) + self.keywords
    self.jits: dict = {}
    self.plans: dict = {}  # (device, shapes and dtypes) -> _direct.Plan, or the refusal

  def bind(self, *dyn):
    """The op applied to the call's tensors ``dyn`` with this signature's static values."""
    it = iter(dyn)
    args = [next(it) if s is _DYNAMIC else s for s in self.spec]
    kwargs = {k: (next(it) if v is _DYNAMIC else v) for k, v in self.kw_spec}
    return self.fn(*args, **kwargs)

  def jit(self, device: jax.Device | None):
    """The jitted op for tensors on ``device`` (``None``: JAX's default placement)."""
    f = self.jits.get(device)
    if f is None:
      f = self.jits[device] = self._build(device)
    return f

  def _build(self, device):
    def call(fence, *dyn):
      del fence  # only its definition event matters (see torch_op)
      if device is None:
        return self.bind(*dyn)
      # Traced under the tensors' device, so implementation=None picks by where they
      # live (torch CPU tensors on a GPU machine run the reference on the CPU). Only
      # the trace pays for this: each device has its own jit.
      with jax.default_device(device):
        return self.bind(*dyn)
    # keep_unused: the fence must reach the executable, which waits for it.
    return jax.jit(call, keep_unused=True)

  def plan(self, tensors: list) -> _direct.Plan | None:
    """The direct-launch plan for CUDA ``tensors`` (None: the op takes the PJRT path).
    Made on the first call with these shapes and dtypes; a refusal is kept too."""
    device = tensors[0].device
    key = [device]
    for t in tensors:
      if (type(t) is not torch.Tensor and not isinstance(t, torch.Tensor) or t.device != device
          or not t.is_contiguous() or t.data_ptr() % 16):
        # jax.Arrays, mixed devices, strides, offsets the kernels' 16-byte accesses
        # cannot take: the PJRT path (and its errors)
        return None
      key.append(t.shape)
      key.append(t.dtype)
    key = tuple(key)
    plan = self.plans.get(key)
    if plan is None:
      try:
        plan = _direct.make_plan(self.bind, tensors, _interop.jax_device(tensors[0]),
                                 in_place=self.in_place)
      except (_direct.Unsupported, KeyError) as e:  # KeyError: a dtype JAX cannot take
        plan = _direct.Unsupported(str(e))
      self.plans[key] = plan
    return plan if isinstance(plan, _direct.Plan) else None


def _launch(plan: _direct.Plan, tensors: list, stream: torch.cuda.Stream):
  """Runs a direct plan on ``stream``, under the tensors' device (its kernels' context)."""
  if tensors[0].device.index != torch.cuda.current_device():
    with torch.cuda.device(tensors[0].device):
      return plan(tensors, stream.cuda_stream)
  return plan(tensors, stream.cuda_stream)


def torch_op(fn: Callable, *, in_place: bool = False) -> Callable:
  """Wraps a jax_mla op so that it takes and returns torch tensors.

  The wrapper has the op's signature and documentation. Tensor arguments (torch
  tensors, or jax.Arrays passed through) are dynamic;
  every other argument is static and compiled in.

  On CUDA, where the op's program for the call's shapes is Mosaic GPU kernels plus
  views and constants (e.g. the sparse MLA decode and prefill with ``topk`` a multiple
  of 64), the kernels are launched on torch's current stream without PJRT
  (:mod:`._direct`: one plan per static signature, shapes and dtypes; outputs allocated
  by torch). Otherwise
  one ``jax.jit`` of ``fn`` is kept per static signature and device (jit caches its
  executable per shape and dtype); on CUDA the executable waits for torch's current
  stream when that stream has unfinished work, torch's current stream waits (on the
  GPU) for the results, and a tensor seen in an earlier call reuses its imported view
  while it lives.

  A repeated call does no per-argument validation beyond one dictionary lookup of its
  static signature and, per tensor, the device and layout checks and the plan (or
  import-cache) lookup.

  ``in_place`` (a cache writer): the op runs only through a direct plan whose kernels
  write into the call's tensors (:func:`_direct.build`), and returns them; a call that
  has no such plan returns ``None`` (the caller writes another way).
  """
  params = tuple(inspect.signature(fn).parameters)
  signatures: dict = {}

  @functools.wraps(fn, updated=())  # not fn.__dict__ (its `sharding` is for jax arrays)
  def wrapper(*args, **kwargs):
    key = (tuple([_DYNAMIC if type(a) not in _PLAIN and isinstance(a, _TENSORS) else a
                  for a in args]),
           tuple([(k, _DYNAMIC if type(v) not in _PLAIN and isinstance(v, _TENSORS) else v)
                  for k, v in kwargs.items()]))
    try:
      sig = signatures.get(key)
    except TypeError:  # an unhashable static argument: _Signature names it
      sig = None
    if sig is None:
      sig = signatures[key] = _Signature(fn, params, args, kwargs, in_place)
    tensors = [args[i] for i in sig.positions] + [kwargs[k] for k in sig.keywords]

    first = None
    for t in tensors:
      if isinstance(t, torch.Tensor):
        first = t
        break
    stream = None if first is None else _interop.torch_stream(first)
    if stream is not None and _direct.enabled() and first is tensors[0]:
      plan = sig.plan(tensors)
      if plan is not None:
        return _launch(plan, tensors, stream)
    if in_place:  # no direct plan: the caller writes another way
      return None
    if first is None:  # jax.Arrays only: a plain call, results to torch.
      out = sig.jit(_array_device(tensors[0]) if tensors else None)(None, *tensors)
      leaf = jax.tree_util.tree_leaves(out)
      return _export_tree(out, _interop.array_stream(leaf[0]) if leaf else None)
    device = _interop.jax_device(first)
    torch_device = first.device
    # JAX must not read before torch's queued work ends. If torch's stream is idle
    # there is nothing to wait for; otherwise JAX's ready-event stream waits for it
    # and one buffer of the call (the first newly imported tensor, else a fence
    # tensor) is imported on that stream, so the executable waits for its
    # definition event. Tensors seen before reuse their imported view.
    ready = (_interop.fence_torch_to_jax(stream, device)
             if stream is not None and not stream.query() else None)
    dyn = []
    for name, t in zip(sig.names, tensors, strict=True):
      if isinstance(t, torch.Tensor):
        if t.device != torch_device:
          raise ValueError(f"{name} is on {t.device} but {sig.names[tensors.index(first)]} is "
                           f"on {torch_device}; all tensors of one call must share a device")
        t, imported = _interop.import_cached(t, device, ready, name)
        if imported:
          ready = None
      dyn.append(t)
    fence_t, fence = _interop.fence_tensor(first, device)
    if ready is not None:
      fence = _interop.import_tensor(fence_t, device, ready)
    out = sig.jit(device)(fence, *dyn)
    return _export_tree(out, _interop.stream_ptr(stream))

  wrapper.__doc__ = (f"jax_mla's ``{fn.__name__}`` on torch tensors (torch_bridge.ops): tensors "
                     f"in and out, shared without a copy; other arguments static.\n\n"
                     f"{fn.__doc__ or ''}")
  wrapper.jax_op = fn
  return wrapper


# ----------------------------------------------------------------------------
# Every jax_mla op on torch tensors.

convert_req_index_to_global_index = torch_op(indexing.convert_req_index_to_global_index)
expand_page_indices = torch_op(indexing.expand_page_indices)
req_id_per_token = torch_op(indexing.req_id_per_token)
filter_prefill_indices = torch_op(indexing.filter_prefill_indices)
merge_attn_states = torch_op(merge.merge_attn_states)
lse2_to_lse = torch_op(merge.lse2_to_lse)
_token_writes = torch_op(cache_api.token_writes)
_write_in_place = torch_op(cache.concat_and_cache_mla, in_place=True)


def concat_and_cache_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, kv_cache_dtype: str = "auto",
                         scale=None) -> torch.Tensor:
  """Writes each token's latent ``[kv_c | k_pe]`` into ``kv_cache``'s own memory, in
  place, and returns ``kv_cache``: vLLM's ``concat_and_cache_mla``, also in its
  positional form ``(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale)``.

  On Hopper (every format; for ``"auto"`` and ``"fp8"`` DeepSeek's 512 + 64 latent; bf16
  latents) jax_mla's Mosaic GPU writer runs on
  torch's current stream and stores the new tokens straight into the cache
  (:mod:`torch_bridge._direct`). Otherwise JAX encodes only the new tokens
  (:func:`jax_mla.cache.api.token_writes`: the same bytes as jax_mla's writer) and torch
  stores them with ``index_put_`` on views of the cache. Either way the cache is never
  copied and no call waits for the GPU. ``slot_mapping`` int32 or int64 (vLLM's; a
  slot < 0 skips its token); ``scale`` the ``"fp8"`` format's scale (a tensor or a
  float; the other formats ignore it).

  The arguments otherwise as in jax_mla's op, below.
  """
  _check_tensors(kv_c=kv_c, k_pe=k_pe, kv_cache=kv_cache, slot_mapping=slot_mapping)
  if slot_mapping.numel() == 0:  # nothing to write (a step without new tokens)
    return kv_cache
  if slot_mapping.dtype == torch.int64:
    slot_mapping = slot_mapping.to(torch.int32)
  # vLLM's kv_c and k_pe may be column slices of one projection, as its CUDA writer
  # takes: they are made row-major here (a few KB per token; the cache is never copied).
  kv_c, k_pe = _contiguous(kv_c), _contiguous(k_pe)
  if kv_c.is_cuda and _write_in_place(kv_c, k_pe, kv_cache, slot_mapping,
                                      kv_cache_dtype=kv_cache_dtype, scale=scale) is not None:
    return kv_cache
  block, position, rows = _token_writes(kv_c, k_pe, kv_cache, slot_mapping,
                                        kv_cache_dtype=kv_cache_dtype, scale=scale)
  num_blocks, block_size, width = kv_cache.shape
  # index_put_ has no fp8 kernels: one-byte caches are written as bytes.
  flat = kv_cache.view(torch.uint8) if kv_cache.element_size() == 1 else kv_cache
  target = (block.long(), position.long())
  regions = resolve(kv_cache_dtype).token_regions(block_size, width)
  for (offset, length), r in zip(regions, rows, strict=True):
    view = flat.as_strided((num_blocks, block_size, length), (block_size * width, length, 1),
                           flat.storage_offset() + offset)
    view.index_put_(target, r.view(flat.dtype))
  return kv_cache


concat_and_cache_mla.__signature__ = inspect.signature(concat_and_cache_mla)  # before __wrapped__
concat_and_cache_mla.jax_op = concat_and_cache_mla.__wrapped__ = cache.concat_and_cache_mla
concat_and_cache_mla.__doc__ += "\n" + cache.concat_and_cache_mla.__doc__
quantize_fp8_ds_mla = torch_op(cache.quantize_fp8_ds_mla)
dequantize_fp8_ds_mla = torch_op(cache.dequantize_fp8_ds_mla)
quantize_fp8_model1 = torch_op(cache.quantize_fp8_model1)
dequantize_fp8_model1 = torch_op(cache.dequantize_fp8_model1)
quantize_fp8_model1_cache = torch_op(cache.quantize_fp8_model1_cache)
dequantize_fp8_model1_cache = torch_op(cache.dequantize_fp8_model1_cache)
sparse_mla_prefill = torch_op(sparse_mla.sparse_mla_prefill)
sparse_mla_decode = torch_op(sparse_mla.sparse_mla_decode)
mla_decode = torch_op(dense_decode.mla_decode)
mla_decode_paged = torch_op(dense_decode.mla_decode_paged)
mla_ragged_paged_attention = torch_op(dense_decode.mla_ragged_paged_attention)
mla_prefill = torch_op(dense_prefill.mla_prefill)
paged_attention = torch_op(paged.paged_attention)


def kv_cache_shape(*args, **kwargs) -> tuple[int, ...]:
  """jax_mla.cache.kv_cache_shape (a plain shape, no tensors); allocate with torch."""
  return cache.kv_cache_shape(*args, **kwargs)


# ----------------------------------------------------------------------------
# FlashMLA-compatible drop-ins.


@dataclasses.dataclass
class FlashMLASchedMeta:
  """Stand-in for FlashMLA's tile-scheduler metadata (jax_mla needs none).

  Like FlashMLA's, it records the call configuration on first use and refuses
  a later call whose configuration differs.
  """
  have_initialized: bool = False
  config: tuple | None = None
  tile_scheduler_metadata: torch.Tensor | None = None
  num_splits: torch.Tensor | None = None


def get_mla_metadata(*args, **kwargs) -> tuple[FlashMLASchedMeta, None]:
  """FlashMLA ``get_mla_metadata``: returns ``(FlashMLASchedMeta(), None)``.

  Arguments are accepted and ignored, as in FlashMLA's current interface.
  """
  del args, kwargs
  return FlashMLASchedMeta(), None


def _model1_cache(k_cache: torch.Tensor, name: str) -> torch.Tensor:
  """FlashMLA's MODEL1 view ``[nb, bs, 1, 584]`` (block stride = padded block) as
  jax_mla's ``[nb, bs, padded // bs]`` uint8 layout, without a copy."""
  from jax_mla.cache.model1 import MODEL1
  nb, bs = k_cache.shape[0], k_cache.shape[1]
  padded = MODEL1.block_bytes(bs)
  if k_cache.stride(0) != padded or padded % bs or k_cache.stride(1) != MODEL1.token_bytes:
    raise ValueError(
        f"{name}: a MODEL1 fp8 cache must be FlashMLA's view of whole padded blocks "
        f"(block stride {padded} bytes, token stride {MODEL1.token_bytes}); got strides "
        f"{k_cache.stride()}")
  storage_end = k_cache.untyped_storage().nbytes() - k_cache.storage_offset()
  if storage_end < nb * padded:
    raise ValueError(f"{name}: the storage behind the MODEL1 cache ends before the padding "
                     "of its last block")
  return k_cache.as_strided((nb, bs, padded // bs), (padded, padded // bs, 1))


def _as_cache(k_cache: torch.Tensor | None, name: str, kv_cache_dtype: str):
  """FlashMLA's ``[nb, bs, 1, d]`` cache as jax_mla's ``[nb, bs, d]`` (a view)."""
  if k_cache is None:
    return None
  if k_cache.ndim != 4 or k_cache.shape[2] != 1:
    raise ValueError(f"{name} must have shape [num_blocks, block_size, 1, head_dim] "
                     f"(one KV head); got {list(k_cache.shape)}")
  if kv_cache_dtype == "auto":
    return k_cache.squeeze(2)
  k_cache = k_cache.view(torch.uint8)
  if kv_cache_dtype == "fp8_model1":
    return _model1_cache(k_cache, name)
  return k_cache.squeeze(2)


def _check_tensors(**tensors) -> None:
  """FlashMLA's tensor arguments must be torch tensors (``None`` where optional)."""
  for name, t in tensors.items():
    if t is not None:
      _interop.check_is_tensor(name, t)


def _contiguous(t):
  # FlashMLA only needs the last dim contiguous; the bridge shares whole buffers.
  return t if t is None or t.is_contiguous() else t.contiguous()


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    head_dim_v: int,
    tile_scheduler_metadata: FlashMLASchedMeta | torch.Tensor,
    num_splits: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    indices: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices_in_kvcache: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
  """FlashMLA ``flash_mla_with_kvcache`` backed by jax_mla.

  Sparse mode (``indices`` given) runs ``jax_mla.sparse_mla.sparse_mla_decode``:
  ``is_fp8_kvcache=True`` reads ``"fp8_ds_mla"`` caches (``head_dim`` 576,
  656 bytes a token) or ``"fp8_model1"`` caches (``head_dim`` 512, FlashMLA's
  padded-block view); ``is_fp8_kvcache=False`` reads a bf16 cache (an
  extension: FlashMLA's sparse decode needs fp8). Dense mode runs
  ``jax_mla.dense_decode.mla_decode_paged`` on a bf16 cache.

  Arguments:
    q: ``[batch, s_q, h_q, head_dim]`` bf16.
    k_cache: ``[num_blocks, block_size, 1, head_dim or bytes]``; must be
      contiguous except for FlashMLA's MODEL1 padded-block view.
    block_table, cache_seqlens: ``[batch, max_blocks]`` / ``[batch]`` int32
      (dense mode).
    head_dim_v: 512.
    tile_scheduler_metadata: from :func:`get_mla_metadata`; or, FlashMLA's earlier
      interface (vLLM's FlashMLA backends), its scheduler tensor, ignored with
      ``num_splits``: jax_mla schedules its kernels itself.
    num_splits: None; a tensor only with a tensor ``tile_scheduler_metadata``.
    softmax_scale: default ``head_dim ** -0.5``.
    causal: dense mode only.
    indices: ``[batch, s_q, topk]`` int32 global slots ``block * block_size + offset``.
    attn_sink: ``[h_q]`` float32; scales out by ``exp(lse) / (exp(lse) + exp(sink))``.
    extra_k_cache, extra_indices_in_kvcache, topk_length, extra_topk_length:
      as in FlashMLA (a second key set sharing the softmax; per-batch lengths).

  Returns:
    ``(out [batch, s_q, h_q, head_dim_v] bf16, lse [batch, h_q, s_q] float32)``.
  """
  _check_tensors(q=q, k_cache=k_cache, block_table=block_table, cache_seqlens=cache_seqlens,
                 indices=indices, attn_sink=attn_sink, extra_k_cache=extra_k_cache,
                 extra_indices_in_kvcache=extra_indices_in_kvcache, topk_length=topk_length,
                 extra_topk_length=extra_topk_length)
  meta = tile_scheduler_metadata
  if isinstance(meta, torch.Tensor):  # FlashMLA's earlier interface: nothing to check
    if num_splits is not None and not isinstance(num_splits, torch.Tensor):
      raise TypeError(f"num_splits must be a tensor or None; got {type(num_splits).__name__}")
    meta = None
  elif not isinstance(meta, FlashMLASchedMeta):
    raise TypeError("tile_scheduler_metadata must come from torch_bridge.ops.get_mla_metadata "
                    f"(or be FlashMLA's earlier scheduler tensor); got {type(meta).__name__}")
  elif num_splits is not None:
    raise ValueError("num_splits must be None with get_mla_metadata's FlashMLASchedMeta "
                     "(FlashMLA's current interface)")
  if meta is not None:  # FlashMLA's rule: one metadata object, one call configuration
    config = (q.shape[0], q.shape[1], q.shape[2], k_cache.shape[1], k_cache.shape[2], causal,
              is_fp8_kvcache, indices.shape[-1] if indices is not None else None,
              extra_k_cache.shape[1] if extra_k_cache is not None else None,
              extra_indices_in_kvcache.shape[-1] if extra_indices_in_kvcache is not None
              else None)
    if not meta.have_initialized:
      meta.have_initialized, meta.config = True, config
    elif meta.config != config:
      raise ValueError(
          "the arguments differ from the first call made with this tile_scheduler_metadata "
          f"(b, s_q, h_q, block_size, h_k, causal, is_fp8, topk, extra_block_size, "
          f"extra_topk): {meta.config} then {config}; get a new one from get_mla_metadata")
  if softmax_scale is None:
    softmax_scale = q.shape[-1] ** -0.5
  q = _contiguous(q)

  if indices is not None:
    if causal:
      raise ValueError("causal must be False when indices are given (sparse attention)")
    if is_fp8_kvcache:
      if q.shape[-1] not in (576, 512):
        raise ValueError(f"fp8 sparse decode needs head_dim 576 (V3.2) or 512 (V4); got "
                         f"{q.shape[-1]}")
      kv_cache_dtype = "fp8_ds_mla" if q.shape[-1] == 576 else "fp8_model1"
    else:
      kv_cache_dtype = "auto"
    return sparse_mla_decode(
        q, _as_cache(k_cache, "k_cache", kv_cache_dtype), _contiguous(indices),
        kv_cache_dtype=kv_cache_dtype, sm_scale=float(softmax_scale), d_v=head_dim_v,
        attn_sink=attn_sink, topk_length=topk_length,
        extra_kv_cache=_as_cache(extra_k_cache, "extra_k_cache", kv_cache_dtype),
        extra_indices=_contiguous(extra_indices_in_kvcache),
        extra_topk_length=extra_topk_length)

  extras = {"attn_sink": attn_sink, "extra_k_cache": extra_k_cache,
            "extra_indices_in_kvcache": extra_indices_in_kvcache, "topk_length": topk_length,
            "extra_topk_length": extra_topk_length}
  given = [k for k, v in extras.items() if v is not None]
  if given:
    raise ValueError(f"{', '.join(given)} need sparse attention (indices); dense decode takes "
                     "none of them")
  if block_table is None or cache_seqlens is None:
    raise ValueError("dense decode needs block_table and cache_seqlens")
  if is_fp8_kvcache:
    raise NotImplementedError("dense decode with an fp8 cache is not supported; use a bf16 "
                              "cache or sparse mode")
  if head_dim_v != 512:
    raise ValueError(f"head_dim_v must be 512; got {head_dim_v}")
  return mla_decode_paged(q, _as_cache(k_cache, "k_cache", "auto"), _contiguous(block_table),
                          cache_seqlens, sm_scale=float(softmax_scale), causal=bool(causal))


def flash_mla_sparse_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
  """FlashMLA ``flash_mla_sparse_fwd`` (sparse prefill) backed by jax_mla.

  Args:
    q: ``[s_q, h_q, d_qk]`` bf16 (``d_qk`` 576 or 512).
    kv: ``[s_kv, h_kv=1, d_qk]`` bf16.
    indices: ``[s_q, h_kv=1, topk]`` int32; ``-1`` or ``>= s_kv`` are invalid.
    sm_scale: softmax scale.
    d_v: 512.
    attn_sink: optional ``[h_q]`` float32.
    topk_length: optional ``[s_q]`` int32: only ``indices[i, :, :topk_length[i]]`` count.

  Returns:
    ``(out [s_q, h_q, d_v] bf16, max_logits [s_q, h_q] f32, lse [s_q, h_q] f32)``.
  """
  _check_tensors(q=q, kv=kv, indices=indices, attn_sink=attn_sink, topk_length=topk_length)
  return sparse_mla_prefill(_contiguous(q), _contiguous(kv), _contiguous(indices),
                            sm_scale=float(sm_scale), d_v=d_v, attn_sink=attn_sink,
                            topk_length=topk_length)


__all__ = [
    "FlashMLASchedMeta", "concat_and_cache_mla", "convert_req_index_to_global_index",
    "dequantize_fp8_ds_mla", "dequantize_fp8_model1", "dequantize_fp8_model1_cache",
    "expand_page_indices", "filter_prefill_indices", "flash_mla_sparse_fwd",
    "flash_mla_with_kvcache", "get_mla_metadata", "kv_cache_shape", "lse2_to_lse",
    "merge_attn_states", "mla_decode", "mla_decode_paged", "mla_prefill",
    "mla_ragged_paged_attention", "paged_attention", "quantize_fp8_ds_mla", "quantize_fp8_model1",
    "quantize_fp8_model1_cache", "req_id_per_token", "sparse_mla_decode", "sparse_mla_prefill",
    "torch_op",
]

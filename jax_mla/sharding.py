"""Sharded MLA attention across devices with JAX's own SPMD engine (``jax.shard_map``).

One wrapper, :func:`shard_attention`, runs an op (or layer-level backend forward)
under ``shard_map`` on a user's mesh: ``jax.make_mesh(...)`` (Explicit or Auto
axes) or ``jax.sharding.Mesh(...)``. Each op declares, beside its definition, an
:class:`OpSharding` saying which of its arguments and outputs carry query heads
or requests, on which axis (``op.sharding``; this module holds only the
mechanism). Inside the ``shard_map`` no collective is issued: attention needs
none in either layout below (every device owns complete softmax rows), so each
device runs the one-device op (Pallas kernel or jax.numpy reference) on its
shard. Only head padding, when a head count does not divide, adds XLA ops around
it, and inputs not already placed as the specs say are resharded first (on a
mesh with Explicit axes with ``jax.sharding.reshard``; Auto axes let
``shard_map`` move them). Two layouts, composable on a 2-D mesh:

Head-parallel (tensor parallel, :func:`head_parallel`)
  Query heads split across the ``head_axis`` devices; the MLA latent cache (one
  KV head shared by all query heads), the block tables and every other metadata
  array are replicated per device, as vLLM and tpu-inference shard MLA. A cache
  that the op updates (``mla_ragged_paged_attention``, the backends' forwards)
  receives the same write on every device and comes back replicated. ``h`` heads
  over ``n`` devices run ``ceil(h / n)`` heads per device (rounded up further to a
  count the op runs: AITER's rule ``16 % h == 0`` or ``h % 16 == 0`` for the
  AITER backend, e.g. 4 heads on each of 4 devices, each padded to 16 inside
  ``forward_mqa``); missing heads are zero-padded in front of the ``shard_map``
  and sliced off the outputs (weights such as ``kv_b_proj`` get zero columns).

Request-parallel (data parallel, :func:`request_parallel`)
  Requests, their queries and their cache blocks split across the
  ``request_axis`` devices. Two input layouts:

  * ``layout="split"`` (batch-major ops: ``sparse_mla_decode`` ``[b, ...]``,
    ``sparse_mla_prefill`` ``[s_q, ...]``, ``mla_decode_paged`` ``[b, ...]``): the
    arguments are the ordinary global arrays. Device ``d`` of ``n`` takes requests
    ``[d*b/n, (d+1)*b/n)`` and cache blocks (prefill: ``kv`` rows)
    ``[d*B/n, (d+1)*B/n)``; global slot / block ids in ``indices``,
    ``extra_indices`` and ``block_table`` are rebased to that device's range on the
    device. **Contract:** a request may only reference blocks of its own device's
    range; a reference outside it is treated as an invalid index (masked, never
    read), like any other out-of-range index. ``b`` and ``B`` must divide by ``n``.
    This keeps the user's program single-view (``jax.device_put(cache,
    NamedSharding(mesh, P("dp")))``) and the per-device program identical to the
    one-device op.
  * ``layout="stacked"`` (every op, and the only one for ops with ragged metadata:
    ``mla_decode`` (``qo_indptr``/``kv_indptr``), ``mla_ragged_paged_attention``
    (``cu_q_lens``, ``page_indices``), the backends' forwards (metadata pytrees)):
    each device's inputs form a complete, self-consistent call of the op with its
    own requests, its own cache and device-local ids, and every array argument
    (metadata pytrees included) is those ``n`` calls stacked along a new leading
    axis of size ``n`` (:func:`stack_shards` builds it); outputs come back stacked the
    same way. Ragged offsets cannot be split by a fixed partition spec (where
    request ``r`` starts in ``kv_indices`` depends on every earlier request), and
    rebasing them would need a cumulative sum across devices; per-shard metadata,
    built on the host as vLLM's data-parallel ranks build theirs, needs neither.
    Static fields of the stacked pytrees (e.g. ``num_decodes``) are shared, so
    shards are padded to one shape, as vLLM pads data-parallel batches. Weights,
    sinks and scales (each op's ``OpSharding.shared``) are passed once, unstacked.

Use it inside ``jax.jit``, donating the cache. On 4 devices (run with
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` on a CPU):

  >>> import jax
  >>> import jax.numpy as jnp
  >>> from jax_mla import mla_ragged_paged_attention
  >>> from jax_mla.sharding import shard_attention, stack_shards

  >>> mesh = jax.make_mesh((2, 2), ("dp", "tp"))  # requests over dp, heads over tp
  >>> attn = shard_attention(mla_ragged_paged_attention, mesh, head_axis="tp",
  ...                        request_axis="dp", request_layout="stacked")
  >>> step = jax.jit(attn, static_argnames=("sm_scale",), donate_argnames=("cache_kv",))

  >>> def dp_group_call(seed, heads=8, pages=8, page_size=16):
  ...   # The complete call of one dp group: 2 decode requests, 1 new token each.
  ...   k = jax.random.split(jax.random.key(seed), 5)
  ...   bf16 = lambda key, shape: jax.random.normal(key, shape, jnp.bfloat16)
  ...   return dict(ql_nope=bf16(k[0], (2, heads, 512)), q_pe=bf16(k[1], (2, heads, 64)),
  ...               new_kv_c=bf16(k[2], (2, 512)), new_k_pe=bf16(k[3], (2, 64)),
  ...               cache_kv=bf16(k[4], (pages, page_size, 576)),
  ...               kv_lens=jnp.array([20, 7], jnp.int32),  # keys, the new token included
  ...               page_indices=jnp.array([0, 1, 2, 3], jnp.int32),  # 2 pages a request
  ...               cu_q_lens=jnp.array([0, 1, 2], jnp.int32),
  ...               distribution=jnp.array([2, 2, 2], jnp.int32))  # 2 decodes
  ...

  >>> calls = [dp_group_call(0), dp_group_call(1)]
  >>> args = {name: stack_shards([c[name] for c in calls]) for name in calls[0]}
  >>> # Each group's call on its own devices (else the sharded step moves it there).
  >>> args = jax.device_put(args, jax.sharding.NamedSharding(mesh, jax.P("dp")))
  >>> o_latent, cache = step(**args, sm_scale=576 ** -0.5)
  >>> assert o_latent.shape == (2, 2, 8, 512) and cache.shape == (2, 8, 16, 576)

Multi-host: nothing here assumes one process. Call ``jax.distributed.initialize()``
in every process first (coordinator address, process count and id, or the
cluster's auto-detection), build the mesh over all global devices
(``jax.make_mesh`` or ``Mesh(np.array(jax.devices()).reshape(...), names)``) and
pass global ``jax.Array`` inputs (e.g. ``jax.make_array_from_process_local_data``
with a ``NamedSharding``); in the stacked layout each process then only builds
the shards of its own devices. The rebase uses ``jax.lax.axis_index``, never
process-local device numbers.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

AxisName = str | tuple[str, ...]
# Per output: its axis, or None (no such axis); a tuple for ops returning a tuple.
OutAxes = int | None | tuple[int | None, ...]
LAYOUTS = ("split", "stacked")


@dataclasses.dataclass(frozen=True)
class OpSharding:
  """How one op's arguments and outputs split across devices.

  Each op declares its own, beside its definition, as the op's ``sharding``
  attribute; :func:`shard_attention` reads it. E.g. at the end of ``my_op``'s module::

    my_op.sharding = OpSharding(heads=dict(q=1), head_outs=1, num_heads=shape_of("q", 1))

  Arguments not named are replicated (or, in the stacked layout, stacked like all
  array arguments). An argument may be a pytree (e.g. ``(ql_nope, q_pe)``): the
  axis applies to each leaf.

  Attributes:
    heads: argument name -> its query-head axis. An axis may hold ``h * unit``
      entries, heads outermost (``kv_b_proj``: ``unit = qk_nope + v_head_dim``).
    head_outs: head axis of each output (``None``: replicated), or a function of the
      bound arguments returning it (outputs that depend on a flag).
    num_heads: the global head count, from the bound arguments.
    requests: argument name -> its request axis in the ``"split"`` layout; ``None``
      when the op's metadata is ragged (stacked layout only).
    request_outs: request axis of each output in the ``"split"`` layout.
    rebase: index argument -> ``(table argument, unit)``: its global ids are made
      local to the device's part of the table; ``unit`` ``"rows"`` counts
      ``shape[0]`` per device, ``"slots"`` ``shape[0] * shape[1]`` (blocks x block size).
    shared: arguments equal for every request (weights, sinks, scales): replicated
      over the request axis and, in the stacked layout, passed once (not stacked).
    local_heads: rounds a per-device head count up to one the op runs.
    set_heads: rewrites the bound arguments for a per-device head count (backends
      carry ``config.num_heads``).
  """
  heads: Mapping[str, int]
  head_outs: OutAxes | Callable[[Mapping[str, Any]], OutAxes]
  num_heads: Callable[[Mapping[str, Any]], int]
  requests: Mapping[str, int] | None = None
  request_outs: OutAxes = None
  rebase: Mapping[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
  shared: tuple[str, ...] = ()
  local_heads: Callable[[int], int] = lambda h: h
  set_heads: Callable[[dict, int], dict] | None = None


def shape_of(name: str, axis: int) -> Callable[[Mapping[str, Any]], int]:
  """``OpSharding.num_heads`` for ops whose head count is ``name``'s size on ``axis``."""
  return lambda a: a[name].shape[axis]


def config_heads(a: Mapping[str, Any]) -> int:
  """``OpSharding.num_heads`` for layers whose static ``config`` carries ``num_heads``."""
  return a["config"].num_heads


def set_config_heads(a: dict, h: int) -> dict:
  """``OpSharding.set_heads`` for layers whose static ``config`` carries ``num_heads``."""
  return {**a, "config": dataclasses.replace(a["config"], num_heads=h)}


def _axes(name: AxisName | None) -> tuple[str, ...]:
  if name is None:
    return ()
  return (name,) if isinstance(name, str) else tuple(name)


def _axis_size(mesh: Mesh, name: AxisName | None) -> int:
  return math.prod(mesh.shape[a] for a in _axes(name))


def _spec(placements: Mapping[int, AxisName]) -> PartitionSpec:
  """A PartitionSpec naming ``placements[dim]`` at each dim (trailing dims replicated)."""
  dims = [None] * max([0, *(d + 1 for d in placements)])
  for d, name in placements.items():
    dims[d] = name
  return PartitionSpec(*dims)


def _explicit_part(mesh: Mesh, spec: PartitionSpec) -> PartitionSpec | None:
  """``spec`` restricted to the mesh's Explicit axes, or None on a mesh without any.

  ``shard_map`` requires inputs to carry the in_specs' Explicit axes in their type
  already (``jax.make_mesh`` makes Explicit axes), and it moves data only over Auto
  ones (``Mesh(...)``'s default) by itself.
  """
  explicit = {n for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
              if t == AxisType.Explicit}
  if not explicit:
    return None

  def keep(entry):
    names = tuple(a for a in _axes(entry) if a in explicit)
    return names[0] if len(names) == 1 else (names or None)
  return PartitionSpec(*(keep(e) for e in spec))


def _place(x, mesh: Mesh, spec: PartitionSpec):
  """Reshards ``x`` (a pytree) onto ``spec``'s Explicit axes of ``mesh`` (a no-op where it
  is there already, eagerly or under ``jax.jit``)."""
  explicit = _explicit_part(mesh, spec)
  if explicit is None:
    return x
  sharding = NamedSharding(mesh, explicit)
  return jax.tree_util.tree_map(lambda leaf: jax.sharding.reshard(leaf, sharding), x)


def _is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray))


def _is_dynamic(name: str, value) -> bool:
  """Array arguments (or pytrees of arrays) go through shard_map; the rest is static."""
  leaves = jax.tree_util.tree_leaves(value)
  arrays = [_is_array(x) for x in leaves]
  if any(arrays) and not all(arrays):
    raise TypeError(f"{name} mixes arrays and other leaves; pass a pytree of arrays")
  return bool(leaves) and all(arrays)


def _pad_heads(x, axis: int, h: int, h_pad: int):
  """Zero-pads axis ``axis`` of ``x`` (``h * unit`` entries, heads outermost) to ``h_pad`` heads."""
  unit = x.shape[axis] // h
  x = x.reshape(*x.shape[:axis], h, unit, *x.shape[axis + 1:])
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, h_pad - h)
  x = jnp.pad(x, pad)
  return x.reshape(*x.shape[:axis], h_pad * unit, *x.shape[axis + 2:])


def shard_attention(op: Callable, mesh: Mesh, *, head_axis: AxisName | None = None,
                    request_axis: AxisName | None = None, request_layout: str = "split",
                    spec: OpSharding | None = None) -> Callable:
  """Wraps an attention op so that it runs under ``jax.shard_map`` on ``mesh``.

  The wrapper has the op's signature and returns the op's outputs as global
  arrays (see the module docstring for both layouts). It can be called eagerly or
  inside ``jax.jit`` (donate the cache there: ``donate_argnames=("cache_kv",)``).

  Args:
    op: a jax-mla op or backend forward: ``sparse_mla_prefill``,
      ``sparse_mla_decode``, ``mla_decode``, ``mla_decode_paged``,
      ``mla_ragged_paged_attention``, ``mla_prefill``, ``paged_attention``, ``aiter_mla_forward``,
      ``forward_mqa``, ``forward_mha``, ``deepseek_v4_sparse_forward`` /
      ``_decode`` / ``_prefill``; or any op with ``spec``.
    mesh: the device mesh (all global devices for multi-host): ``jax.make_mesh``
      with Explicit or Auto axes, or ``jax.sharding.Mesh``.
    head_axis: mesh axis name (or tuple of names) that splits query heads; ``None``
      keeps heads whole.
    request_axis: mesh axis name (or tuple) that splits requests; ``None`` keeps
      requests whole.
    request_layout: ``"split"`` (global batch-major arrays, ids rebased per device)
      or ``"stacked"`` (per-device calls stacked along a leading axis).
    spec: the op's :class:`OpSharding`; ``None`` takes the one the op declares
      (``op.sharding``).

  Returns:
    The wrapped op.
  """
  spec = spec if spec is not None else getattr(op, "sharding", None)
  if not isinstance(spec, OpSharding):
    raise ValueError(f"op {getattr(op, '__name__', op)!r} declares no OpSharding (its "
                     "`sharding` attribute); pass spec=")
  if request_layout not in LAYOUTS:
    raise ValueError(f"request_layout must be one of {list(LAYOUTS)}; got {request_layout!r}")
  head_names, req_names = _axes(head_axis), _axes(request_axis)
  for a in head_names + req_names:
    if a not in mesh.axis_names:
      raise ValueError(f"mesh axis {a!r} is not in the mesh's axes {list(mesh.axis_names)}")
  if set(head_names) & set(req_names):
    raise ValueError(f"head_axis {head_axis!r} and request_axis {request_axis!r} share axes")
  stacked = request_axis is not None and request_layout == "stacked"
  split = request_axis is not None and not stacked
  if split and spec.requests is None:
    raise ValueError(
        f"{getattr(op, '__name__', op)} has ragged metadata and cannot be split by a fixed "
        "partition: use request_layout='stacked' (per-device calls stacked on a leading axis)")
  n_head, n_req = _axis_size(mesh, head_axis), _axis_size(mesh, request_axis)
  sig = inspect.signature(op)
  named = {*spec.heads, *(spec.requests or {}), *spec.rebase, *spec.shared,
           *(t for t, _ in spec.rebase.values())}
  if named - set(sig.parameters):
    raise ValueError(f"the OpSharding of {getattr(op, '__name__', op)} names arguments "
                     f"{sorted(named - set(sig.parameters))} that the op does not take")

  def wrapped(*args, **kwargs):
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    a = dict(bound.arguments)
    names = [k for k, v in a.items() if _is_dynamic(k, v)]
    static = {k: v for k, v in a.items() if k not in names}
    per_device = [k for k in names if stacked and k not in spec.shared]
    # The op's own view of its arguments (one device's shard of a stacked array).
    view = {**a, **{k: jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), a[k]) for k in per_device}}
    h = spec.num_heads(view)
    h_dev = spec.local_heads(-(-h // n_head)) if head_axis is not None else h
    h_pad = h_dev * n_head
    head_outs = spec.head_outs(view) if callable(spec.head_outs) else spec.head_outs

    def shift(name):  # stacked arrays carry the device axis first
      return 1 if name in per_device else 0

    def arg_spec(name, with_heads=True):
      place = {}
      if with_heads and name in spec.heads and head_axis is not None:
        place[spec.heads[name] + shift(name)] = head_axis
      if name in per_device:
        place[0] = request_axis
      elif split and name in spec.requests:
        place[spec.requests[name]] = request_axis
      return _spec(place)

    def out_spec(head_ax, req_ax):
      place = {}
      if head_ax is not None and head_axis is not None:
        place[head_ax + int(stacked)] = head_axis
      if stacked:
        place[0] = request_axis
      elif split and req_ax is not None:
        place[req_ax] = request_axis
      return _spec(place)

    if h_pad != h:
      for name, axis in spec.heads.items():
        if name in names:
          ax = axis + shift(name)
          # Explicit axes cannot pad a dim they split: heads whole on every device first.
          x = _place(a[name], mesh, arg_spec(name, with_heads=False))
          a[name] = jax.tree_util.tree_map(lambda x, ax=ax: _pad_heads(x, ax, h, h_pad), x)
    _check_request_dims(a, names, per_device, spec.requests if split else {}, n_req,
                        request_axis)

    # Outputs as a tuple here; a single one is unwrapped at the boundaries.
    single = not isinstance(head_outs, tuple)
    h_outs = (head_outs,) if single else head_outs
    r_outs = (((spec.request_outs,) if single else spec.request_outs) if split
              else (None,) * len(h_outs))
    out_specs = tuple(out_spec(hx, rx) for hx, rx in zip(h_outs, r_outs, strict=True))

    def body(*dyn):
      kw = {**static, **dict(zip(names, dyn, strict=True))}
      for k in per_device:
        kw[k] = jax.tree_util.tree_map(lambda x: x[0], kw[k])
      if split:
        kw = _rebase(kw, spec.rebase, request_axis)
      if spec.set_heads is not None and head_axis is not None:
        kw = spec.set_heads(kw, h_dev)
      out = op(**kw)
      return jax.tree_util.tree_map(lambda x: x[None], out) if stacked else out

    in_specs = tuple(arg_spec(k) for k in names)
    # No replication checks (check_vma): Pallas calls carry no varying-axis types, and
    # replicated outputs (an updated cache) are equal on every device by construction.
    outs = jax.shard_map(body, mesh=mesh, in_specs=in_specs,
                         out_specs=out_specs[0] if single else out_specs, check_vma=False)(
        *(_place(a[k], mesh, sp) for k, sp in zip(names, in_specs, strict=True)))
    if h_pad == h:
      return outs

    def unpad(x, head_ax, req_ax):
      if head_ax is None:
        return x
      ax = head_ax + int(stacked)
      # Explicit axes cannot slice a dim they split unevenly: heads whole first.
      x = _place(x, mesh, out_spec(None, req_ax))
      return jax.lax.slice_in_dim(x, 0, x.shape[ax] // h_pad * h, axis=ax)

    outs = (outs,) if single else outs
    outs = tuple(unpad(x, hx, rx) for x, hx, rx in zip(outs, h_outs, r_outs, strict=True))
    return outs[0] if single else outs

  # Not the op's __dict__: the wrapper is not the op, its `sharding` does not apply.
  functools.update_wrapper(wrapped, op, updated=())
  wrapped.__doc__ = (f"{getattr(op, '__name__', 'op')} sharded by jax_mla.sharding "
                     f"(heads over {head_axis!r}, requests over {request_axis!r}, "
                     f"{request_layout} layout).\n\n{op.__doc__ or ''}")
  return wrapped


def _check_request_dims(a, names, per_device, requests, n_req, request_axis):
  """Clear errors for request axes that do not split evenly over the devices."""
  for name in names:
    for x in jax.tree_util.tree_leaves(a[name]):
      if name in per_device and (x.ndim == 0 or x.shape[0] != n_req):
        raise ValueError(
            f"{name}: in the stacked layout every per-device array carries the {n_req} "
            f"devices of {request_axis!r} first; got shape {tuple(x.shape)}")
      axis = requests.get(name)
      if axis is not None and x.shape[axis] % n_req:
        raise ValueError(
            f"{name}: axis {axis} (size {x.shape[axis]}) must divide by the {n_req} devices "
            f"of {request_axis!r}")


def _rebase(kw: dict, rebase: Mapping[str, tuple[str, str]], request_axis: AxisName) -> dict:
  """Global slot/block ids -> this device's local ids; ids of other devices -> -1."""
  d = jax.lax.axis_index(request_axis)
  kw = dict(kw)
  for name, (table, unit) in rebase.items():
    if kw.get(name) is None:
      continue
    t = kw[table]
    size = t.shape[0] * (t.shape[1] if unit == "slots" else 1)
    lo = (d * size).astype(jnp.int32)
    ids = kw[name]
    kw[name] = jnp.where((ids >= lo) & (ids < lo + size), ids - lo, -1).astype(ids.dtype)
  return kw


def head_parallel(op: Callable, mesh: Mesh, axis_name: AxisName = "tp", *,
                  spec: OpSharding | None = None) -> Callable:
  """``op`` with query heads split over ``axis_name`` and the latent cache replicated."""
  return shard_attention(op, mesh, head_axis=axis_name, spec=spec)


def request_parallel(op: Callable, mesh: Mesh, axis_name: AxisName = "dp", *,
                     layout: str = "split", spec: OpSharding | None = None) -> Callable:
  """``op`` with requests and their cache blocks split over ``axis_name`` (see the
  module docstring for the ``"split"`` and ``"stacked"`` layouts)."""
  return shard_attention(op, mesh, request_axis=axis_name, request_layout=layout, spec=spec)


def stack_shards(shards: Sequence[Any]) -> Any:
  """Stacks per-device arguments (arrays or metadata pytrees) for the stacked layout.

  Every shard must have the same structure, static fields and shapes (pad the
  shards to one shape first).
  """
  if not shards:
    raise ValueError("stack_shards needs at least one shard")
  treedef = jax.tree_util.tree_structure(shards[0])
  for i, s in enumerate(shards[1:], 1):
    other = jax.tree_util.tree_structure(s)
    if other != treedef:
      raise ValueError(f"shard {i} differs in structure or static fields from shard 0:\n"
                       f"{other}\nvs\n{treedef}")
  return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *shards)


__all__ = ["OpSharding", "config_heads", "head_parallel", "request_parallel", "set_config_heads",
           "shape_of", "shard_attention", "stack_shards"]

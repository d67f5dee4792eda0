"""Direct launch: a jax_mla op's Mosaic GPU kernels run on torch's stream, without PJRT.

Through PJRT a bridge call pays a jitted dispatch (about 93 us of host time for the
sparse decode on the H100's host, twice FlashMLA's whole call), DLPack hand-offs and a
stream fence. Where an op, for one set of shapes, lowers to Mosaic GPU kernels plus
reshapes, transposes, slices, input-free constants and updates of a kernel's output at
fixed places, none of that is needed: a
:class:`Plan` is made once per signature from the op's StableHLO, and a call then

* makes torch views of its tensors (reshapes, transposes, slices; a pad copies),
* allocates each kernel's outputs with torch (torch's caching allocator, on the
  caller's current stream),
* launches each kernel on torch's current stream through the host function jaxlib's
  Mosaic GPU runtime compiles for it (``MosaicGpuCompile``, the entry point behind
  ``jax.experimental.pallas.mosaic_gpu.as_torch_kernel``),

so the kernels are ordered with torch's own work by the stream alone, and the host
never waits. Constants (e.g. a full ``topk`` length per token, ``-inf`` sinks) are
computed once, when the plan is made. An op whose program holds anything else (an
XLA fusion, a Triton kernel) has no plan and takes the PJRT path, as does a kernel
that writes into a call's tensor, except in a plan made ``in_place`` (the cache write).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import threading
import weakref
from collections.abc import Callable

import jax
import numpy as np
import torch

_MOSAIC_TARGET = "mosaic_gpu_v2"
# The first jax whose compiled Mosaic GPU host function is ``launch(function, stream,
# buffers)`` (seen on 0.11.2; 0.10.2's takes MLIR's packed arguments).
_MIN_JAX = (0, 11, 2)

_TORCH_DTYPES = {
    "bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32,
    "f8E4M3FN": torch.float8_e4m3fn, "f8E5M2": torch.float8_e5m2,
    "i1": torch.bool, "i8": torch.int8, "i16": torch.int16, "i32": torch.int32,
    "ui8": torch.uint8,
}

_enabled = os.environ.get("JAX_MLA_TORCH_DIRECT", "1") != "0"


def set_enabled(enabled: bool) -> bool:
  """Turns direct launch on or off for later calls; returns the previous setting.

  Off, every CUDA call takes the PJRT path (DLPack hand-offs, a jitted dispatch). The
  environment variable ``JAX_MLA_TORCH_DIRECT=0`` turns it off at import."""
  global _enabled
  previous, _enabled = _enabled, bool(enabled)
  return previous


def enabled() -> bool:
  return _enabled


class Unsupported(Exception):
  """The op's program holds something a plan cannot run (the PJRT path runs it)."""


# ----------------------------------------------------------------------------
# jaxlib's Mosaic GPU runtime


@dataclasses.dataclass(frozen=True)
class _Runtime:
  compile: Callable
  unload: Callable


_runtime: _Runtime | None = None
_runtime_lock = threading.Lock()


def _load_runtime() -> _Runtime:
  """``MosaicGpuCompile`` / ``MosaicGpuUnload`` from jax's CUDA plugin (or the process)."""
  global _runtime
  if jax.__version_info__ < _MIN_JAX:
    # Older jaxlibs' host functions take MLIR's packed C interface instead.
    raise Unsupported(f"direct launch needs jax >= {'.'.join(map(str, _MIN_JAX))}; this is "
                      f"{jax.__version__}")
  with _runtime_lock:
    if _runtime is None:
      try:
        try:
          import jax_plugins.xla_cuda13 as plugin
        except ImportError:
          import jax_plugins.xla_cuda12 as plugin
        dll = ctypes.CDLL(plugin._get_library_path())
      except ImportError:
        dll = ctypes.CDLL(None)
      try:
        compile_fn, unload_fn = dll.MosaicGpuCompile, dll.MosaicGpuUnload
      except AttributeError as e:
        raise Unsupported(f"this jaxlib exports no Mosaic GPU compile entry point ({e})") from None
      compile_fn.argtypes = [ctypes.c_char_p, ctypes.c_int]
      compile_fn.restype = ctypes.POINTER(ctypes.c_void_p)
      unload_fn.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
      unload_fn.restype = None
      _runtime = _Runtime(compile_fn, unload_fn)
  return _runtime


class _Kernel:
  """One compiled Mosaic GPU module: ``launch(pointers, stream)`` with the XLA calling
  convention (operand pointers, then result pointers)."""

  def __init__(self, module: bytes, device: torch.device):
    runtime = _load_runtime()
    with torch.cuda.device(device):
      compiled = runtime.compile(module, len(module))
    if not compiled:
      raise RuntimeError("jaxlib's Mosaic GPU runtime failed to compile a kernel module")
    self._function = compiled[0]
    self._host = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p,
                                  ctypes.POINTER(ctypes.c_void_p))(compiled[1])
    weakref.finalize(self, runtime.unload, compiled)

  def launch(self, pointers: list[int], stream: int) -> None:
    self._host(self._function, stream, (ctypes.c_void_p * len(pointers))(*pointers))


# ----------------------------------------------------------------------------
# Plans


@dataclasses.dataclass(frozen=True)
class _Value:
  """Where an SSA value of the program lives when a call runs: ``slot`` in the call's
  environment, or ``const`` (computed when the plan was made). ``fresh`` names the
  kernel output it is a view of (None: it may be an input's memory or a constant);
  ``dense_source``: the row-major value it is a reshape of (itself when it is one), whose
  memory a kernel can take as it is."""
  slot: int | None = None
  const: torch.Tensor | None = None
  fresh: int | None = None
  dense_source: _Value | None = None


def _row_major(**where) -> _Value:
  """A value that is row-major memory of its own (a call's tensor, a constant, a kernel
  buffer): its own ``dense_source``."""
  return _Value(**where, dense_source=_Value(**where))


def _tensor_type(value):
  from jax._src.lib.mlir import ir
  t = ir.RankedTensorType(value.type)
  name = str(t.element_type)
  if name not in _TORCH_DTYPES:
    raise Unsupported(f"element type {name}")
  return tuple(t.shape), _TORCH_DTYPES[name]


def _i64s(attr) -> list[int]:
  return [int(v) for v in attr]


def _constant(op, device):
  from jax._src.lib.mlir import ir
  shape, dtype = _tensor_type(op.result)
  attr = ir.DenseElementsAttr(op.attributes["value"])
  if attr.is_splat:
    v = attr.get_splat_value()
    try:
      value = ir.FloatAttr(v).value
    except ValueError:  # not a float
      value = ir.IntegerAttr(v).value
    if dtype == torch.bool:
      value = bool(value)
    return torch.full(shape, value, dtype=dtype, device=device)
  try:
    array = np.array(attr)
  except Exception:  # noqa: BLE001 - element types numpy cannot view
    raise Unsupported(f"non-splat constant of {dtype}") from None
  return torch.from_numpy(array.copy()).to(device=device, dtype=dtype).reshape(shape)


def _view_op(op):
  """A torch function for a reshape / transpose / slice / broadcast / convert / pad /
  concatenate (``None`` for any other op)."""
  name = op.operation.name
  attrs = op.attributes
  if name == "stablehlo.reshape":
    shape, _ = _tensor_type(op.result)
    return lambda x: x.reshape(shape)
  if name == "stablehlo.transpose":
    perm = _i64s(attrs["permutation"])
    return lambda x: x.permute(perm)
  if name == "stablehlo.slice":
    index = tuple(slice(a, b, s) for a, b, s in zip(
        _i64s(attrs["start_indices"]), _i64s(attrs["limit_indices"]), _i64s(attrs["strides"]),
        strict=True))
    return lambda x: x[index]
  if name == "stablehlo.broadcast_in_dim":
    shape, _ = _tensor_type(op.result)
    dims = _i64s(attrs["broadcast_dimensions"])

    def broadcast(x):
      placed = [1] * len(shape)
      for i, d in enumerate(dims):
        placed[d] = x.shape[i]
      return x.reshape(placed).expand(shape)
    return broadcast
  if name == "stablehlo.convert":
    _, dtype = _tensor_type(op.result)
    return lambda x: x.to(dtype)
  if name == "stablehlo.concatenate":
    dim = int(attrs["dimension"].value)
    return lambda *xs: torch.cat(xs, dim)
  if name == "stablehlo.pad":
    low, high = _i64s(attrs["edge_padding_low"]), _i64s(attrs["edge_padding_high"])
    if any(_i64s(attrs["interior_padding"])) or min(low + high) < 0:
      raise Unsupported("interior or negative padding")
    # ``value``: a Python number (the plan reads the constant once: ``.item()`` of a
    # device tensor on every call would make the host wait for the GPU).
    return lambda x, value: _pad(x, low, high, value)
  return None


def _as_words(x: torch.Tensor) -> torch.Tensor | None:
  """``x`` viewed as int64 words along its last axis (the same memory), or None where its
  rows are not whole, aligned words."""
  size = x.element_size()
  if size >= 8 or x.dim() == 0:
    return None
  ratio = 8 // size
  if (x.stride(-1) != 1 or x.shape[-1] % ratio or x.data_ptr() % 8
      or any(s % ratio for s in x.stride()[:-1])):
    return None
  return x.view(torch.int64)


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
  """``dst.copy_(src)`` (same dtype), moving 8-byte words where both allow: torch copies
  a strided tensor one element a thread, and a bf16 copy then ran at half the speed of
  XLA's (H100, the 48-head decode's output slice: 16.6 vs 9.0 us; RESULTS.md, session
  40). A copy is bitwise either way."""
  dst_words, src_words = _as_words(dst), _as_words(src)
  if dst_words is None or src_words is None:  # not ``None in``: that compares tensors
    dst.copy_(src)
  else:
    dst_words.copy_(src_words)


def _row_major_copy(x: torch.Tensor) -> torch.Tensor:
  """``x.contiguous()`` through :func:`_copy_into`."""
  if x.is_contiguous():
    return x
  out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
  _copy_into(out, x)
  return out


def _pad(x: torch.Tensor, low, high, value) -> torch.Tensor:
  """``x`` padded by ``low`` / ``high`` elements per axis (non-negative) with ``value``."""
  out = torch.full([lo + n + hi for lo, n, hi in zip(low, x.shape, high, strict=True)], value,
                   dtype=x.dtype, device=x.device)
  _copy_into(out[tuple(slice(lo, lo + n) for lo, n in zip(low, x.shape, strict=True))], x)
  return out


def _update(x, u, *, at):
  """``x`` with ``u`` written at ``at`` (clamped into ``x``, as XLA's
  ``dynamic_update_slice`` does), in place: ``x`` is a kernel's buffer that nothing else
  reads."""
  x[tuple(slice(i, i + n) for i, n in (
      (min(max(i, 0), m - n), n) for i, n, m in zip(at, u.shape, x.shape, strict=True)))].copy_(u)
  return x


def _read_once(value) -> bool:
  """Whether ``value`` and each value it is a view of, back to a kernel's output, has one
  reader: only then may an update write into their memory."""
  while len(list(value.uses)) == 1:
    if value.owner.name not in ("stablehlo.reshape", "stablehlo.transpose",
                                "stablehlo.slice"):
      return True
    value = value.owner.operands[0]
  return False


@dataclasses.dataclass
class _KernelStep:
  """A launch. ``operands``: the values it reads; ``results``, ``types``, ``aliases``:
  per output, the value it defines, its shape and dtype, the operand it aliases;
  ``buffers``: how its buffer is made (set by :func:`_returned_in_place`)."""
  kernel: _Kernel
  operands: tuple[_Value, ...]
  results: tuple[_Value, ...]
  types: tuple[tuple[tuple[int, ...], torch.dtype], ...]
  aliases: tuple[int | None, ...]
  # per result: ("alloc", shape) | ("scratch", tensor) | ("alias", i) | ("stream", shape)
  buffers: tuple = ()


@dataclasses.dataclass
class _ViewStep:
  fn: Callable
  operands: tuple[_Value, ...]
  slot: int
  reshape: bool = False  # a row-major reshape of its operand (any shape of it will do)


def _row_major_strides(shape) -> tuple[int, ...]:
  strides, step = [], 1
  for n in reversed(shape):
    strides.append(step)
    step *= max(n, 1)
  return tuple(reversed(strides))


class Plan:
  """A torch op's program for one signature, run on torch's stream (see the module).

  ``kernels``: its launches; ``steps``: what a call runs, in order (torch views and
  launches). A kernel output that is returned, as it is or reshaped (a transpose that
  only moves size-1 axes counts), is allocated in the returned shape; one nothing reads
  goes to a scratch buffer kept with the plan (written by every launch, read by none);
  one only later launches of the call read (a split kernel's parts) goes to a buffer
  kept per stream: the stream orders one call's reads before the next call's writes.
  ``in_place``: see :func:`build`."""

  def __init__(self, steps, outputs, out_shapes, treedef, num_slots, device, in_place=False):
    self.steps, self.outputs, self.treedef, self.in_place = steps, outputs, treedef, in_place
    self.out_strides = [_row_major_strides(shape) for shape in out_shapes]
    self.num_slots, self.device = num_slots, device
    self.kernels = [s for s in steps if isinstance(s, _KernelStep)]
    self._per_stream: dict[int, dict] = {}
    # What a call does, worked out once (a call is host time on every layer).
    self._blank = [None] * num_slots
    strided = {s.slot for s in steps if isinstance(s, _ViewStep) and not s.reshape}
    self._launches = [(
        step.kernel,
        tuple((None, v.const.data_ptr()) if v.const is not None else (v.slot, None)
              for v in step.operands),
        any(v.slot in strided for v in step.operands if v.const is None),
        tuple((v.slot, kind, arg, dtype) for v, (kind, arg), (_, dtype)
              in zip(step.results, step.buffers, step.types, strict=True)),
    ) if isinstance(step, _KernelStep) else step for step in steps]
    self._returned = self._returned_as_they_are(out_shapes)
    self._tuple_out = treedef == jax.tree_util.tree_structure((0,) * len(outputs))

  def _returned_as_they_are(self, out_shapes) -> bool:
    """Whether every output is a kernel buffer allocated in its returned shape (or, in
    place, the call's own tensor), each once: the call returns them without a look."""
    allocated = {v.slot: arg for step in self.kernels
                 for v, (kind, arg) in zip(step.results, step.buffers, strict=True)
                 if kind == "alloc"}
    fresh = set()
    for v, shape in zip(self.outputs, out_shapes, strict=True):
      if self.in_place and v.fresh is None and v.const is None:
        continue
      if v.fresh is None or v.fresh in fresh or allocated.get(v.slot) != tuple(shape):
        return False
      fresh.add(v.fresh)
    return True

  def __call__(self, tensors, stream: int):
    env = [*tensors, *self._blank]
    per_stream = self._per_stream.get(stream)
    if per_stream is None:
      per_stream = self._per_stream[stream] = {}
    for step in self._launches:
      if step.__class__ is _ViewStep:
        env[step.slot] = step.fn(*[env[v.slot] if v.const is None else v.const
                                   for v in step.operands])
        continue
      kernel, reads, check, writes = step
      if check:  # a view may be strided: the kernel takes row-major memory
        for slot, _ in reads:
          if slot is not None and not env[slot].is_contiguous():
            env[slot] = _row_major_copy(env[slot])
      pointers = [ptr if slot is None else env[slot].data_ptr() for slot, ptr in reads]
      for slot, kind, arg, dtype in writes:
        if kind == "alloc":
          x = torch.empty(arg, dtype=dtype, device=self.device)
        elif kind == "scratch":
          x = arg
        elif kind == "alias":
          x = env[reads[arg][0]]
        else:  # "stream": allocated on (the caching allocator's pool of) the stream
          x = per_stream.get(slot)
          if x is None:
            x = per_stream[slot] = torch.empty(arg, dtype=dtype, device=self.device)
        env[slot] = x
        pointers.append(x.data_ptr())
      kernel.launch(pointers, stream)
    if self._returned:
      leaves = [env[v.slot] for v in self.outputs]
    else:
      leaves = self._leaves(env)
    if self._tuple_out:
      return tuple(leaves)
    return jax.tree_util.tree_unflatten(self.treedef, leaves)

  def _leaves(self, env):
    leaves, seen = [], set()
    for v, strides in zip(self.outputs, self.out_strides, strict=True):
      x = env[v.slot] if v.const is None else v.const
      if self.in_place and v.fresh is None and v.const is None:
        pass  # the call's own tensor (or a view of it), written in place
      elif v.fresh is not None and v.fresh not in seen and x.stride() == strides:
        seen.add(v.fresh)  # a kernel's buffer, allocated as returned
      elif v.fresh is None or v.fresh in seen:
        # Results own their memory, as PJRT's do: a constant, an input's memory or a
        # second view of one kernel output is copied.
        x = x.clone(memory_format=torch.contiguous_format)
      else:
        seen.add(v.fresh)
        x = _row_major_copy(x)
        if x.stride() != strides:  # row-major, but a size-1 axis kept a permuted stride
          x = x.as_strided(x.shape, strides)
      leaves.append(x)
    return leaves


def lowered_main(fn: Callable, structs, device: jax.Device | None, platform: str = "cuda"):
  """``fn``'s StableHLO for arguments ``structs``, with every call inlined into ``main``:
  ``(module, main's block, output treedef)``."""
  from jax._src.lib.mlir import passmanager
  from jax._src.lib.mlir.dialects import func

  jitted = jax.jit(fn, keep_unused=True)
  if device is None:
    traced = jitted.trace(*structs)
  else:
    with jax.default_device(device):
      traced = jitted.trace(*structs)
  lowered = traced.lower(lowering_platforms=(platform,))
  module = lowered.compiler_ir()
  with module.context:
    try:
      from jax.experimental.mosaic.gpu import dialect as mgpu_dialect
      mgpu_dialect.register_inliner_extensions(module.context)
    except (ImportError, AttributeError):
      pass
    passmanager.PassManager.parse("builtin.module(inline{default-pipeline=})").run(
        module.operation)
  mains = [op for op in module.body.operations
           if isinstance(op, func.FuncOp) and op.name.value == "main"]
  if len(mains) != 1:
    raise Unsupported("no single main function")
  _, treedef = jax.tree_util.tree_flatten(traced.out_info)
  return module, mains[0].body.blocks[0], treedef


def _keeps_row_major(name: str, op, shape) -> bool:
  """Whether a reshape, transpose, pad or broadcast of a row-major value is the same
  memory, row-major (a pad by nothing is: jnp.pad emits one for a zero width; so is a
  broadcast that only adds size-1 axes, as ``x[:, None]`` and ``jnp.stack([x])`` do)."""
  if name == "stablehlo.reshape":
    return True
  if name == "stablehlo.broadcast_in_dim":
    dims = _i64s(op.attributes["broadcast_dimensions"])
    out, _ = _tensor_type(op.result)
    return (np.prod(out) == np.prod(shape) and dims == sorted(dims)
            and all(out[d] == n for d, n in zip(dims, shape, strict=True)))
  if name == "stablehlo.pad":
    return not any(width for k in ("edge_padding_low", "edge_padding_high", "interior_padding")
                   for width in _i64s(op.attributes[k]))
  if name != "stablehlo.transpose":
    return False
  moved = [d for d in _i64s(op.attributes["permutation"]) if shape[d] != 1]
  return moved == sorted(moved)


def build(block, treedef, device: torch.device,
          compile_kernel: Callable[[bytes, torch.device], object] = _Kernel, *,
          in_place: bool = False) -> Plan:
  """The plan of ``main``'s ``block`` (see :func:`lowered_main`) on ``device``; raises
  :class:`Unsupported` naming the first op it cannot run. ``compile_kernel`` turns a
  Mosaic GPU module's bytes into an object with ``launch(pointers, stream)``.

  ``in_place``: a kernel output aliased to a call's tensor (a cache writer's) is written
  in that tensor's memory, and returned as that tensor. Otherwise such a program has no
  plan: a call must leave its tensors as they were."""
  from jax._src.lib.mlir.dialects import hlo

  values: dict = {}
  for i, arg in enumerate(block.arguments):  # the call's tensors: checked row-major
    values[arg] = _row_major(slot=i)
  num_slots = len(block.arguments)
  steps, outputs, fresh = [], None, 0

  def new_slot():
    nonlocal num_slots
    num_slots += 1
    return num_slots - 1

  with block.owner.context:
    for op in block.operations:
      name = op.operation.name
      operands = [values[v] for v in op.operation.operands]
      if name == "func.return":
        outputs = operands
        out_shapes = [_tensor_type(v)[0] for v in op.operation.operands]
        break
      if name == "stablehlo.constant":
        values[op.result] = _row_major(const=_constant(op, device))
        continue
      if name == "stablehlo.custom_call":
        target = op.attributes["call_target_name"].value
        if target != _MOSAIC_TARGET:
          raise Unsupported(f"custom call {target!r}")
        aliases = [None] * len(op.results)
        if "output_operand_aliases" in op.attributes:
          for alias in op.attributes["output_operand_aliases"]:
            alias = hlo.OutputOperandAlias(alias)
            if alias.operand_tuple_indices or len(alias.output_tuple_indices) > 1:
              raise Unsupported("tupled operand aliases")
            [out] = alias.output_tuple_indices or [0]
            aliases[out] = alias.operand_index
            target = operands[alias.operand_index]
            if target.const is not None or (target.fresh is None and not in_place):
              raise Unsupported("a kernel writes into a call's tensor or a constant")
            if target.dense_source is None:  # a call would write into a row-major copy
              raise Unsupported("a kernel writes into a strided view")
        results = []
        for r, alias in zip(op.results, aliases, strict=True):
          values[r] = _row_major(slot=new_slot(), fresh=None if alias is not None else fresh)
          results.append(values[r])
          fresh += 1
        # A reshape of row-major memory is that memory: the kernel takes its source.
        # (An aliased operand keeps its own shape: the output is that tensor.)
        ins = tuple(v.dense_source if v.dense_source is not None and i not in aliases
                    else v for i, v in enumerate(operands))
        module = op.attributes["mhlo.backend_config"]["module"].value_bytes
        steps.append(_KernelStep(compile_kernel(module, device), ins, tuple(results),
                                 tuple(_tensor_type(r) for r in op.results), tuple(aliases)))
        continue
      if name == "stablehlo.dynamic_update_slice":  # in place, into a kernel's buffer
        target, update, *starts = operands
        if any(v.const is None for v in starts):
          raise Unsupported("an update at a computed place")
        if target.const is not None or target.fresh is None:
          raise Unsupported("an update of a call's tensor or a constant")
        if not _read_once(op.operation.operands[0]):
          raise Unsupported("an update of a kernel's output that is read elsewhere")
        # The place is read once, now (``.item()`` on every call would wait for the GPU).
        at = [int(v.const.item()) for v in starts]
        v = _Value(slot=new_slot(), fresh=target.fresh)
        steps.append(_ViewStep(functools.partial(_update, at=at), (target, update), v.slot))
        values[op.result] = v
        continue
      fn = _view_op(op)
      if fn is None or len(op.results) != 1:
        raise Unsupported(f"op {name}")
      if name == "stablehlo.pad":
        if operands[1].const is None:
          raise Unsupported("padding with a computed value")
        fn, operands = functools.partial(fn, value=operands[1].const.item()), operands[:1]
      if all(v.const is not None for v in operands):  # input-free: computed now
        values[op.result] = _row_major(const=fn(*[v.const for v in operands]).contiguous())
        continue
      src = operands[0]
      in_shape, _ = _tensor_type(op.operation.operands[0])
      if src.dense_source is not None and _keeps_row_major(name, op, in_shape):
        # The same memory, still row-major: one reshape of the source.
        src = src.dense_source
        shape, _ = _tensor_type(op.result)
        v = _Value(slot=new_slot(), fresh=src.fresh, dense_source=src)
        steps.append(_ViewStep(lambda x, shape=shape: x.reshape(shape), (src,), v.slot,
                               reshape=True))
      else:
        views = name in ("stablehlo.reshape", "stablehlo.transpose", "stablehlo.slice")
        v = _Value(slot=new_slot(), fresh=src.fresh if views else None)
        steps.append(_ViewStep(fn, tuple(operands), v.slot))
      values[op.result] = v
  if outputs is None:
    raise Unsupported("no return")
  if not any(isinstance(s, _KernelStep) for s in steps):
    raise Unsupported("no Mosaic GPU kernel")
  steps, outputs = _returned_in_place(steps, outputs, out_shapes, device)
  return Plan(steps, outputs, out_shapes, treedef, num_slots, device, in_place)


def _returned_in_place(steps, outputs, out_shapes, device):
  """``(steps, outputs)`` with kernel results returned in place: a result returned as
  it is or reshaped (and read by no view but reshapes) is allocated in the returned
  shape and returned as it is; the views nothing reads then are dropped; a result
  nothing reads is a scratch buffer; one only later launches read is a buffer kept per
  stream. Sets each kernel step's ``buffers``."""
  shaped = {v.slot for step in steps if isinstance(step, _ViewStep) and not step.reshape
            for v in step.operands}  # read with their own shape
  outputs, returned = list(outputs), {}
  for i, v in enumerate(outputs):
    src = v.dense_source
    if src is not None and src.fresh is not None and src.slot not in shaped | set(returned):
      returned[src.slot] = i
  kernels = [step for step in steps if isinstance(step, _KernelStep)]
  for v in (v for step in kernels for v in step.results if v.slot in returned):
    outputs[returned[v.slot]] = v
  steps = _used(steps, outputs)
  read = {v.slot for step in steps for v in step.operands} | {v.slot for v in outputs}
  # Read by later launches only (split parts, say): kept per stream (see Plan).
  between = read - {v.slot for step in steps if isinstance(step, _ViewStep)
                    for v in step.operands} - {v.slot for v in outputs}
  for step in kernels:
    buffers = []
    for v, (shape, dtype), alias in zip(step.results, step.types, step.aliases, strict=True):
      if alias is not None:
        buffers.append(("alias", alias))
      elif v.slot in returned:
        buffers.append(("alloc", out_shapes[returned[v.slot]]))
      elif v.slot not in read:
        buffers.append(("scratch", torch.empty(shape, dtype=dtype, device=device)))
      elif v.slot in between:
        buffers.append(("stream", shape))
      else:
        buffers.append(("alloc", shape))
    step.buffers = tuple(buffers)
  return steps, outputs


def _used(steps, outputs):
  """``steps`` without the views nothing reads (reshapes a kernel took the source of)."""
  needed = {v.slot for v in outputs if v.slot is not None}
  kept = []
  for step in reversed(steps):
    if isinstance(step, _ViewStep) and step.slot not in needed:
      continue
    needed |= {v.slot for v in step.operands if v.slot is not None}
    kept.append(step)
  return kept[::-1]


def make_plan(fn: Callable, tensors: list[torch.Tensor], device: jax.Device, *,
              in_place: bool = False) -> Plan:
  """The plan of ``fn(*tensors)`` on the GPU holding ``tensors``; raises
  :class:`Unsupported` when the op's program has no plan. ``in_place``: see :func:`build`."""
  from torch_bridge._interop import TORCH_TO_JAX_DTYPE

  structs = [jax.ShapeDtypeStruct(tuple(t.shape), TORCH_TO_JAX_DTYPE[t.dtype]) for t in tensors]
  _, block, treedef = lowered_main(fn, structs, device)
  plan = build(block, treedef, tensors[0].device, in_place=in_place)
  torch.cuda.synchronize(tensors[0].device)  # its constants are ready for any stream
  return plan

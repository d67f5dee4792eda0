"""Zero-copy DLPack transfers between torch tensors and jax.Arrays, stream-ordered.

Ordering on CUDA follows the DLPack stream protocol:

* torch -> JAX: JAX's "external ready events" stream is made to wait for torch's
  current stream (one event, re-recorded by each call), then each buffer is imported with that
  stream, so PJRT records its definition event after the wait and every JAX
  kernel reading it runs after the torch kernels that wrote it.
* JAX -> torch: each buffer is exported with torch's current stream; PJRT makes
  that stream wait for the buffer's definition event (GPU-side, no host sync).

The jaxlib entry points used by ``jax.dlpack.from_dlpack`` are called directly
(cached device and stream, no dtype canonicalisation): the public function costs
about 35 us a tensor on a CPU host, this path about 4 us. If this jaxlib exposes
them differently, the public functions are used instead (same protocol, slower).

Per-call costs measured on the H100 (jax 0.11.2) shaped the ops path:

* An import still costs ~16 us a tensor (a PJRT view and its definition event),
  so :func:`import_cached` keeps the imported view of a tensor while the tensor
  (or the tensor it is a view of) lives: caches and weights cross once.
* The fence (JAX waits for torch's stream) costs tens of us and chains every call
  to the previous one; it is skipped when torch's stream has no pending work, since
  then everything torch queued is already complete.
"""

from __future__ import annotations

import collections
import threading

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.utils.dlpack

try:  # jaxlib internals behind jax.dlpack (present in jax 0.10 and 0.11).
  from jax._src.lib import _jax as _jaxlib
  from jax._src.lib import jaxlib_extension_version as _JAXLIB_VERSION
  _FAST = hasattr(_jaxlib, "dlpack_managed_tensor_to_buffer") and hasattr(
      _jaxlib, "buffer_to_dlpack_managed_tensor")
except ImportError:  # pragma: no cover - depends on the installed jaxlib
  _jaxlib, _JAXLIB_VERSION, _FAST = None, 0, False

# The dtypes the bridge carries (both sides zero-copy). 64-bit types are refused:
# JAX runs with 32-bit types unless x64 is enabled, and would silently copy.
TORCH_TO_JAX_DTYPE = {
    torch.bfloat16: jnp.dtype(jnp.bfloat16),
    torch.float16: jnp.dtype(jnp.float16),
    torch.float32: jnp.dtype(jnp.float32),
    torch.float8_e4m3fn: jnp.dtype(jnp.float8_e4m3fn),
    torch.float8_e5m2: jnp.dtype(jnp.float8_e5m2),
    torch.int8: jnp.dtype(jnp.int8),
    torch.int16: jnp.dtype(jnp.int16),
    torch.int32: jnp.dtype(jnp.int32),
    torch.uint8: jnp.dtype(jnp.uint8),
    torch.bool: jnp.dtype(jnp.bool_),
}
JAX_TO_TORCH_DTYPE = {v: k for k, v in TORCH_TO_JAX_DTYPE.items()}

_DL_DEVICE_TYPE = {"cpu": 1, "cuda": 2, "rocm": 10}
_CUDA_LEGACY_DEFAULT_STREAM = 1  # DLPack's value for CUDA's legacy default stream.

_lock = threading.Lock()
_jax_devices: dict[tuple[str, int], jax.Device] = {}
# Per GPU: JAX's ready-event stream (its pointer, a torch handle of it, and one event
# re-recorded by every fence: a wait captures the event's latest record when it is
# queued, so one event serves every call and none is created per call).
_ext_streams: dict[int, tuple[int, torch.cuda.ExternalStream, torch.cuda.Event]] = {}


def _supported() -> str:
  return ", ".join(str(d).removeprefix("torch.") for d in TORCH_TO_JAX_DTYPE)


def check_is_tensor(name: str, t) -> None:
  """Raises TypeError naming ``name`` unless ``t`` is a torch tensor."""
  if not isinstance(t, torch.Tensor):
    hint = (" (convert it: torch.tensor(x, dtype=...))"
            if isinstance(t, (list, tuple, np.ndarray)) else "")
    raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}{hint}")


def check_tensor(name: str, t) -> None:
  """Raises TypeError/ValueError unless ``t`` can cross the bridge without a copy."""
  check_is_tensor(name, t)
  if t.dtype not in TORCH_TO_JAX_DTYPE:
    hint = " (use int32 for indices)" if t.dtype == torch.int64 else ""
    raise TypeError(f"{name} has dtype {t.dtype}, which the torch bridge does not carry"
                    f"{hint}; supported: {_supported()}")
  if t.layout != torch.strided:
    raise ValueError(f"{name} must be a dense (strided) tensor; got layout {t.layout}")
  if not t.is_contiguous():
    raise ValueError(
        f"{name} must be contiguous (row-major) to be shared without a copy; got shape "
        f"{tuple(t.shape)} with strides {t.stride()}. Call .contiguous() first if a copy "
        "is acceptable")
  if t.is_conj() or t.is_neg():
    raise ValueError(f"{name} has a lazy conjugate/negative bit; call .resolve_conj() first")


def jax_device(t: torch.Tensor) -> jax.Device:
  """The JAX device that holds the memory of torch tensor ``t``."""
  dev = t.device
  key = (dev.type, dev.index or 0)
  d = _jax_devices.get(key)
  if d is not None:
    return d
  with _lock:
    if dev.type == "cpu":
      d = jax.devices("cpu")[0]
    elif dev.type == "cuda":
      try:
        gpus = jax.devices("gpu")
      except RuntimeError as e:
        raise RuntimeError(
            f"tensor is on {dev} but JAX has no GPU backend ({e}); install jax with "
            "CUDA/ROCm support (e.g. pip install 'jax[cuda13]')") from None
      matches = [g for g in gpus if g.local_hardware_id == key[1]]
      if not matches:
        raise RuntimeError(f"tensor is on {dev} but JAX sees no GPU with that id: {gpus}")
      d = matches[0]
    else:
      raise ValueError(f"the torch bridge supports cpu and cuda tensors; got device {dev}")
    _jax_devices[key] = d
  return d


def _jax_ready_stream(device: jax.Device
                     ) -> tuple[int, torch.cuda.ExternalStream, torch.cuda.Event]:
  """JAX's stream for external ready events on ``device``, a torch handle of it, and
  the event its fences wait on."""
  hw = device.local_hardware_id
  s = _ext_streams.get(hw)
  if s is None:
    ptr = device.get_stream_for_external_ready_events()
    s = _ext_streams[hw] = (ptr, torch.cuda.ExternalStream(ptr, device=f"cuda:{hw}"),
                            torch.cuda.Event())
  return s


_fences: dict[torch.device, tuple[torch.Tensor, jax.Array]] = {}


def fence_tensor(t: torch.Tensor, device: jax.Device) -> tuple[torch.Tensor, jax.Array]:
  """A one-element ordering token on ``t``'s device: the tensor, and its view imported
  once without a stream (what a call passes when it has nothing to wait for)."""
  f = _fences.get(t.device)
  if f is None:
    token = torch.zeros(1, dtype=torch.int32, device=t.device)
    f = _fences[t.device] = (token, import_tensor(token, device, None))
  return f


_current_streams: dict[tuple, torch.cuda.Stream] = {}


def torch_stream(t: torch.Tensor) -> torch.cuda.Stream | None:
  """torch's current stream on ``t``'s device (None on CPU).

  One ``torch.cuda.Stream`` per stream seen, looked up by torch's raw stream triple:
  ``torch.cuda.current_stream`` builds a new object each call (about 20 us).
  """
  if t.device.type != "cuda":
    return None
  data = torch._C._cuda_getCurrentStream(t.device.index)
  s = _current_streams.get(data)
  if s is None:
    s = _current_streams[data] = torch.cuda.Stream(
        stream_id=data[0], device_index=data[1], device_type=data[2])
  return s


def stream_ptr(stream: torch.cuda.Stream | None) -> int | None:
  """A torch stream as a DLPack stream value (None for None: CPU)."""
  if stream is None:
    return None
  return stream.cuda_stream or _CUDA_LEGACY_DEFAULT_STREAM


def torch_stream_ptr(t: torch.Tensor) -> int | None:
  """torch's current stream on ``t``'s device as a DLPack stream value (None on CPU)."""
  return stream_ptr(torch_stream(t))


def fence_torch_to_jax(stream: torch.cuda.Stream | None, device: jax.Device) -> int | None:
  """Makes JAX's ready-event stream wait for the torch ``stream``; returns that stream.

  Everything torch has queued so far on ``stream`` finishes before any buffer
  imported with the returned stream is read by JAX. ``None`` (CPU) does nothing.
  """
  if stream is None:
    return None
  ptr, ext, event = _jax_ready_stream(device)
  if stream.cuda_stream != ptr:
    with _lock:  # another thread's record between these two would be waited for instead
      event.record(stream)
      ext.wait_event(event)
  return ptr


def import_tensor(t: torch.Tensor, device: jax.Device, stream: int | None) -> jax.Array:
  """Imports a checked, fenced tensor as a jax.Array sharing its memory."""
  global _FAST
  if t.requires_grad:  # DLPack refuses; the bridge carries values, not autograd.
    t = t.detach()
  if _FAST:
    cap = torch.utils.dlpack.to_dlpack(t)
    try:
      if _JAXLIB_VERSION >= 467:
        return _jaxlib.dlpack_managed_tensor_to_buffer(
            cap, device, stream, None, _DL_DEVICE_TYPE[t.device.type])
      return _jaxlib.dlpack_managed_tensor_to_buffer(cap, device, stream, None)
    except TypeError:  # a jaxlib with another signature: use the public path.
      _FAST = False
  return jax.dlpack.from_dlpack(t)


# Imported views, keyed by the memory they cover (device, address, dtype, shape,
# strides); at most _CACHE_SIZE entries are kept, least recently used dropped first.
# A cached view does not own its memory, so the cache never keeps a tensor alive: it
# is used only for a tensor at the same address with the same geometry, whose memory
# the caller's tensor keeps valid (whatever Python object the caller holds: views of
# views, dtype views and views of a root nobody references all hit). torch queues its
# later work, a reuse of the memory included, after the JAX work that read it (the
# results' stream wait in ``torch_bridge.ops``). The cached jax.Array reads the memory
# as it is when a JAX computation runs, so torch may keep writing it in place between
# calls.
_CACHE_SIZE = 256
_imports: collections.OrderedDict = collections.OrderedDict()


def _unowned_view(t: torch.Tensor) -> torch.Tensor:
  """A tensor over ``t``'s memory that does not keep it alive."""
  storage = torch._C._construct_storage_from_data_pointer(
      t.untyped_storage().data_ptr(), t.device, t.untyped_storage().nbytes())
  return torch.empty(0, dtype=t.dtype, device=t.device).set_(
      storage, t.storage_offset(), t.shape, t.stride())


def import_cached(t: torch.Tensor, device: jax.Device, stream: int | None, name: str = "t"
                  ) -> tuple[jax.Array, bool]:
  """``import_tensor`` with reuse: returns (array, whether it was imported now).

  A new import is made with ``stream``; a cached one was ordered by the stream it
  was imported with, and later writes by torch are ordered by the caller's fence.
  ``t`` is checked (:func:`check_tensor`, naming ``name``) when it is imported: a
  cache hit has the memory, dtype, shape and strides of a tensor checked before.
  Only for arrays used within one call (the ``torch_bridge.ops`` wrappers): the
  array does not keep ``t``'s memory alive.
  """
  if t.layout != torch.strided:  # no strides to key on: check_tensor says what is wrong
    check_tensor(name, t)
  key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.is_neg())
  with _lock:
    hit = _imports.get(key)
    if hit is not None:
      _imports.move_to_end(key)
      return hit, False
  check_tensor(name, t)
  a = import_tensor(_unowned_view(t), device, stream)
  if t.numel() and a.unsafe_buffer_pointer() != t.data_ptr():
    return a, True  # JAX copied (e.g. a misaligned CPU view): a copy must not be reused.
  with _lock:
    _imports[key] = a
    if len(_imports) > _CACHE_SIZE:
      _imports.popitem(last=False)
  return a, True


def export_array(a: jax.Array, stream: int | None) -> torch.Tensor:
  """Exports a single-device jax.Array as a torch tensor sharing its memory."""
  global _FAST
  if _FAST:
    try:
      return torch.utils.dlpack.from_dlpack(
          _jaxlib.buffer_to_dlpack_managed_tensor(a, stream=stream))
    except TypeError:
      _FAST = False
  return torch.from_dlpack(a)


def check_array(name: str, a) -> None:
  if not isinstance(a, jax.Array):
    raise TypeError(f"{name} must be a jax.Array; got {type(a).__name__}")
  if a.dtype not in JAX_TO_TORCH_DTYPE:
    raise TypeError(f"{name} has dtype {a.dtype}, which the torch bridge does not carry; "
                    f"supported: {_supported()}")
  if len(a.sharding.device_set) != 1:
    raise ValueError(f"{name} is sharded over {len(a.sharding.device_set)} devices; the "
                     "torch bridge carries single-device arrays")


def array_stream(a: jax.Array) -> int | None:
  """torch's current stream on the device of ``a`` (None for CPU arrays)."""
  dev = next(iter(a.sharding.device_set))
  if dev.platform == "cpu":
    return None
  ptr = torch.cuda.current_stream(dev.local_hardware_id).cuda_stream
  return ptr or _CUDA_LEGACY_DEFAULT_STREAM


def to_jax(t: torch.Tensor) -> jax.Array:
  """Returns a jax.Array that shares ``t``'s memory (no copy).

  Args:
    t: a contiguous CPU or CUDA tensor of a supported dtype (bf16, fp16, fp32,
      fp8 e4m3fn/e5m2, int8, int16, int32, uint8, bool). ``requires_grad`` is
      dropped: the bridge carries values, not autograd.

  On CUDA the JAX array is ordered after all work queued on torch's current
  stream, so JAX never reads it before the producing torch kernel ends. JAX
  treats arrays as immutable: do not write ``t`` in place while the returned
  array (or anything computed from it lazily) is in use.

  Raises:
    TypeError: ``t`` is not a tensor or has an unsupported dtype (e.g. int64).
    ValueError: ``t`` is not contiguous, or on an unsupported device.
  """
  check_tensor("t", t)
  device = jax_device(t)
  return import_tensor(t, device, fence_torch_to_jax(torch_stream(t), device))


def to_torch(a: jax.Array) -> torch.Tensor:
  """Returns a torch tensor that shares ``a``'s memory (no copy).

  On CUDA torch's current stream waits (on the GPU, not the host) until the
  JAX computation that produces ``a`` has finished. On CPU the call waits for
  ``a`` to be ready.

  Raises:
    TypeError: ``a`` is not a jax.Array or has an unsupported dtype.
    ValueError: ``a`` is sharded over several devices.
  """
  check_array("a", a)
  return export_array(a, array_stream(a))

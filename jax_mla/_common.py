"""Conventions shared by every op: dispatch, device facts, MLA dimensions, validation.

Every public op takes ``implementation=None | "mosaic" | "triton" | "xla"``
(``"pallas"`` is accepted as the old name of ``"triton"``) and ``interpret``.
``None`` picks the Mosaic GPU kernel on Hopper where the op has one for the shapes,
else the Triton kernel on a GPU, else the jax.numpy reference; ``interpret=True``
runs the Triton kernel in the Pallas interpreter (CPU tests).
Validation runs at trace time and raises ``ValueError``/``TypeError`` naming the
argument, what was given and what was expected. Integer metadata of any integer
dtype (numpy int64 included) is cast to int32 by :func:`as_int32`; floats are refused.
``checks=True`` on an op adds value checks (:func:`check_values`) for what shapes
cannot show.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

Implementation = Literal["mosaic", "triton", "xla", "pallas"] | None
IMPLEMENTATIONS = ("mosaic", "triton", "xla")
_ALIASES = {"pallas": "triton"}  # the old name of the Triton backend

# MLA latent dimensions. DeepSeek V3 / V3.2: kv_c 512 + k_pe 64 = 576 per token,
# values 512 wide. DeepSeek V4: 448 NoPE + 64 RoPE = 512 (values are the whole row).
D_NOPE = 512
D_ROPE = 64
D_QK = D_NOPE + D_ROPE  # 576
D_V = 512
D_QK_V4 = 512

# Kernels keep scores in base 2 (exp2) and turn their LSE back to natural log.
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# Largest finite fp8 e4m3fn value.
FP8_E4M3_MAX = 448.0


_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def op_platform(like=None) -> str:
  """Where an op over the array ``like`` runs: the platform of a concrete jax.Array's
  devices; under tracing (or with no array) the device set by ``jax.default_device``,
  else JAX's default backend. torch CPU tensors on a GPU machine arrive as CPU arrays."""
  if isinstance(like, jax.Array):
    try:
      return next(iter(like.devices())).platform
    except jax.errors.ConcretizationTypeError:
      pass  # a tracer (jit, grad, vmap) has no devices: the rules below
  device = jax.config.jax_default_device
  if device is not None:
    return device if isinstance(device, str) else device.platform
  return jax.default_backend()


def runs_on_gpu(like=None) -> bool:
  """Whether an op over ``like`` runs on a GPU (see :func:`op_platform`)."""
  return op_platform(like) in _GPU_PLATFORMS


@functools.cache
def num_sms() -> int:
  """Streaming multiprocessors of the first device (132 on an H100 SXM when unknown)."""
  return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def without_mosaic(implementation: Implementation) -> Implementation:
  """A layer's ``implementation`` for the ops it calls that have no Mosaic GPU kernel
  (cache writes, index conversion): ``"mosaic"`` means their Triton kernel there."""
  return "triton" if implementation == "mosaic" else implementation


def resolve_implementation(implementation: Implementation, interpret: bool = False, *,
                           has_mosaic: bool = False, like=None) -> str:
  """Returns "triton", "mosaic" or "xla" for a user's ``implementation`` argument.

  ``has_mosaic``: the op has a Mosaic GPU kernel (otherwise "mosaic" is refused).
  ``like``: the op's first array; ``None`` picks by where it lives (:func:`op_platform`).
  ``None`` never returns "mosaic"; such ops decide that themselves (``_mosaic.default_for``).
  """
  implementation = _ALIASES.get(implementation, implementation)
  on_gpu = runs_on_gpu(like)
  if implementation is None:
    return "triton" if (interpret or on_gpu) else "xla"
  if implementation not in IMPLEMENTATIONS:
    raise ValueError("implementation must be None, 'mosaic', 'triton' (or its old name "
                     f"'pallas') or 'xla'; got {implementation!r}")
  if implementation == "mosaic":
    if not has_mosaic:
      raise ValueError("this op has no Mosaic GPU kernel; use implementation='triton' or 'xla'")
    if interpret:
      raise ValueError("the Mosaic GPU kernel has no interpreter; use implementation='triton' "
                       "with interpret=True")
  if implementation != "xla" and not interpret and not on_gpu:
    raise ValueError(
        f"implementation={implementation!r} needs a GPU (the op runs on "
        f"{op_platform(like)!r}); pass interpret=True to run the Triton kernel "
        "in the Pallas interpreter, or implementation='xla' for the reference")
  return implementation


def check_config(config, config_type: type, implementation: str):
  """``config`` for the chosen backend: ``None`` (the heuristic) or a ``config_type``."""
  if config is not None and not isinstance(config, config_type):
    raise TypeError(
        f"config must be None or a {config_type.__module__}.{config_type.__qualname__} for "
        f"implementation={implementation!r}; got {type(config).__name__}")
  return config


def backend_config(implementation: str, config, **backends):
  """The op's private ``config`` argument for the backend that runs.

  ``backends``: each kernel backend of the op by name (``triton=``, ``mosaic=``) as
  ``(its Config type, the function that completes a user's config for this call)``;
  the function takes the config or ``None`` (the heuristic). The reference
  (``"xla"``) has no tuning and gets ``None``: a config of any of the op's backends is
  accepted there, unused, so one config serves every implementation. Any other config
  raises ``TypeError`` (:func:`check_config`).
  """
  if implementation == "xla":
    types = tuple(config_type for config_type, _ in backends.values())
    if config is not None and not isinstance(config, types):
      check_config(config, types[0], implementation)
    return None
  config_type, complete = backends[implementation]
  return complete(check_config(config, config_type, implementation))


def with_num_splits(config, num_kv_splits: int | None, default: Callable[[], int]):
  """``config`` with ``num_splits`` set: the op's ``num_kv_splits`` when given (it
  replaces ``config.num_splits``), else the config's own, else ``default()``."""
  if num_kv_splits is not None:
    return dataclasses.replace(config, num_splits=num_kv_splits)
  if config.num_splits is not None:
    return config
  return dataclasses.replace(config, num_splits=default())


def check_rank(name: str, x, ranks: int | Iterable[int]) -> None:
  ranks = (ranks,) if isinstance(ranks, int) else tuple(ranks)
  if x.ndim not in ranks:
    want = " or ".join(str(r) for r in ranks)
    raise ValueError(f"{name} must have rank {want}; got shape {tuple(x.shape)}")


def check_dtype(name: str, x, dtypes) -> None:
  dtypes = tuple(jnp.dtype(d) for d in (dtypes if isinstance(dtypes, (list, tuple)) else [dtypes]))
  if jnp.dtype(x.dtype) not in dtypes:
    want = " or ".join(str(d) for d in dtypes)
    raise TypeError(f"{name} must have dtype {want}; got {x.dtype}")


def check_int32(name: str, x) -> None:
  check_dtype(name, x, jnp.int32)


def as_int32(name: str, x) -> jax.Array:
  """Integer metadata as an int32 ``jax.Array``: any integer dtype (numpy int64 from
  ``np.arange`` included) is cast, anything else is refused naming ``name``."""
  if isinstance(x, (list, tuple)) or not hasattr(x, "dtype"):
    raise TypeError(f"{name} must be an integer array (jax.Array or numpy.ndarray); "
                    f"got {type(x).__name__}")
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must have an integer dtype (cast to int32); got {x.dtype}")
  return jnp.asarray(x, jnp.int32)


def check_static(name: str, value, kind: type | tuple[type, ...] = (int, float)) -> None:
  """Static (compile-time) arguments must be Python values: a jax/numpy array there would
  reach ``jax.jit`` as an unhashable static argument."""
  if isinstance(value, (jax.Array, np.ndarray)) or not isinstance(value, kind):
    kinds = kind if isinstance(kind, tuple) else (kind,)
    want = " or ".join(k.__name__ for k in kinds)
    raise TypeError(f"{name} is static (it changes the compiled code) and must be a Python "
                    f"{want}; got {type(value).__name__} (use float(x) / int(x) on a "
                    "concrete value)")


def check_values(checks: bool, *conditions) -> None:
  """Opt-in value checks (``checks=True`` on an op): ``(ok, message, fmt_kwargs)``
  triples through ``checkify.check``. Eager calls raise at once with ``message``; under
  ``jax.jit`` wrap the call in ``checkify.checkify`` and call ``err.throw()``."""
  if not checks:
    return
  for ok, message, *fmt in conditions:
    checkify.check(jnp.all(ok), message, **(fmt[0] if fmt else {}))


def check_power_of_two(name: str, value, minimum: int) -> None:
  """A tile size: a Python int, a power of two, at least ``minimum``."""
  if not isinstance(value, int) or value < minimum or value & (value - 1):
    raise ValueError(f"{name} must be a power of two >= {minimum}; got {value!r}")


def check_num_splits(name: str, value) -> None:
  """A KV split count (``Config.num_splits``, an op's ``num_kv_splits``): ``None`` (the
  heuristic) or a Python int >= 1."""
  if value is not None and (not isinstance(value, int) or value < 1):
    raise ValueError(f"{name} must be None or an int >= 1; got {value!r}")


def check_shape(name: str, x, shape: Sequence[int | None]) -> None:
  """Checks ``x.shape`` against ``shape``; ``None`` entries match any size."""
  ok = len(x.shape) == len(shape) and all(
      want is None or got == want for got, want in zip(x.shape, shape, strict=True))
  if not ok:
    want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
    raise ValueError(f"{name} must have shape {want}; got {list(x.shape)}")


def check_one_of(name: str, value, allowed: Sequence) -> None:
  if value not in allowed:
    raise ValueError(f"{name} must be one of {list(allowed)}; got {value!r}")


def next_pow2(n: int) -> int:
  """Smallest power of two >= n (>= 1): Pallas Triton arrays need power-of-two sizes."""
  return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
  return -(-a // b)

"""Conventions shared by every op: implementation dispatch and input validation.

Every public op takes ``implementation=None | "pallas" | "xla"`` and ``interpret``.
``None`` picks the Pallas kernel on GPU and the jax.numpy reference elsewhere;
``interpret=True`` runs the Pallas kernel in the Pallas interpreter (CPU tests).
Ops with a second, Pallas Mosaic GPU kernel (Hopper) also take ``"mosaic"``.
Validation runs at trace time and raises ``ValueError``/``TypeError`` naming the
argument, what was given and what was expected.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

import jax
import jax.numpy as jnp

Implementation = Literal["pallas", "mosaic", "xla"] | None
IMPLEMENTATIONS = ("pallas", "mosaic", "xla")

# Kernels keep scores in base 2 (exp2) and turn their LSE back to natural log.
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# Largest finite fp8 e4m3fn value.
FP8_E4M3_MAX = 448.0


def default_backend_is_gpu() -> bool:
  return jax.default_backend() in ("gpu", "cuda", "rocm")


def without_mosaic(implementation: Implementation) -> Implementation:
  """A layer's ``implementation`` for the ops it calls that have no Mosaic GPU kernel
  (cache writes, index conversion): ``"mosaic"`` means their Triton kernel there."""
  return "pallas" if implementation == "mosaic" else implementation


def resolve_implementation(implementation: Implementation, interpret: bool = False, *,
                           has_mosaic: bool = False) -> str:
  """Returns "pallas", "mosaic" or "xla" for a user's ``implementation`` argument.

  ``has_mosaic``: the op has a Mosaic GPU kernel (otherwise "mosaic" is refused).
  ``None`` never returns "mosaic"; such ops decide that themselves.
  """
  if implementation is None:
    return "pallas" if (interpret or default_backend_is_gpu()) else "xla"
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
        f"implementation must be None, 'pallas', 'mosaic' or 'xla'; got {implementation!r}")
  if implementation == "mosaic":
    if not has_mosaic:
      raise ValueError("this op has no Mosaic GPU kernel; use implementation='pallas' "
                       "(Triton) or 'xla'")
    if interpret:
      raise ValueError("the Mosaic GPU kernel has no interpreter; use implementation='pallas' "
                       "with interpret=True")
  if implementation != "xla" and not interpret and not default_backend_is_gpu():
    raise ValueError(
        f"implementation={implementation!r} needs a GPU backend (found "
        f"{jax.default_backend()!r}); pass interpret=True to run the Pallas (Triton) kernel "
        "in the Pallas interpreter, or implementation='xla' for the reference")
  return implementation


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

"""Pytree dataclasses for metadata: array fields are leaves, static fields are treedef."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax


def static_field(default: Any = dataclasses.MISSING):
  """A dataclass field kept in the treedef (hashable, static under jit)."""
  return dataclasses.field(default=default, metadata={"static": True})


def pytree_dataclass(cls):
  """Frozen dataclass registered as a pytree; ``static_field()`` fields are metadata."""
  cls = dataclasses.dataclass(frozen=True)(cls)
  fields = dataclasses.fields(cls)
  return jax.tree_util.register_dataclass(
      cls, data_fields=[f.name for f in fields if not f.metadata.get("static")],
      meta_fields=[f.name for f in fields if f.metadata.get("static")])

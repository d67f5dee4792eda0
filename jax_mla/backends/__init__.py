"""Layer-level attention backends: functional versions of vLLM's MLA backends.

Metadata are pytree dataclasses built on the host by a builder; forwards are
pure functions of (inputs, cache, metadata, weights).
"""

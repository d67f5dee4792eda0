"""Host-side batch facts shared by the layer backends."""

from __future__ import annotations

import numpy as np


def split_decodes_and_prefills(query_start_loc, *, decode_threshold: int = 1,
                               require_uniform: bool = False) -> tuple[int, int, int, int]:
  """Where the decodes end in a batch ordered decodes first (vLLM's rule).

  Requests with ``query_len <= decode_threshold`` at the front of the batch are
  decodes; the first longer one starts the prefills. With ``require_uniform``
  (backends whose decode kernel takes one query length, vLLM's
  ``QueryLenSupport.UNIFORM``: AiterMLA) the decodes must also share the first
  request's length, so a shorter one after them starts the prefills; a batch whose
  lengths all equal the first's or 0 (a padded uniform batch) is all decodes, and a
  batch of lengths ``<= 1`` is all decodes in either mode.

  Args:
    query_start_loc: concrete int ``[R + 1]`` new-token offsets (numpy, a list, or a
      committed jax array).
    decode_threshold: longest query that counts as a decode.
    require_uniform: decodes must share one query length.

  Returns:
    ``(num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens)``.
  """
  qsl = np.asarray(query_start_loc)
  query_lens = np.diff(qsl)
  num_reqs, num_tokens = len(query_lens), int(qsl[-1] - qsl[0])
  all_decodes = (num_reqs, 0, num_tokens, 0)
  if num_reqs == 0 or (query_lens.max() <= decode_threshold
                       and (not require_uniform or decode_threshold <= 1)):
    return all_decodes
  if query_lens[0] > decode_threshold:
    return 0, num_reqs, 0, num_tokens
  if require_uniform:
    if np.all((query_lens == query_lens[0]) | (query_lens == 0)):
      return all_decodes
    is_prefill = query_lens != query_lens[0]
  else:
    is_prefill = query_lens > decode_threshold
  num_decodes = int(np.argmax(is_prefill))
  num_decode_tokens = int(qsl[num_decodes] - qsl[0])
  return num_decodes, num_reqs - num_decodes, num_decode_tokens, num_tokens - num_decode_tokens

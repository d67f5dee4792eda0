"""Training through sparse MLA: a DeepSeek-V3.2-shaped attention layer fitted to a teacher.

  python examples/train_sparse_mla.py [--steps 20] [--small] [--implementation triton]

The layer: ``q = x W_q`` (``h`` heads of 576 = 512 NoPE + 64 RoPE), one latent row per
token ``kv = x W_kv`` (576), sparse attention of every token over its own top-k earlier
tokens (given indices, as DeepSeek's indexer would pick them) with a learned sink per
head, ``y = o W_o``. The student starts from other random weights than the teacher and
learns them back by Adam on the mean squared error; gradients flow through
``jax_mla.sparse_mla_prefill`` (its custom VJP) into ``W_q``, ``W_kv`` (through the
gathered rows) and the sink. Prints the loss per step and the median step time.

Uses ``optax.adam`` where optax is installed, else the few lines of Adam below.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from jax_mla import sparse_mla_prefill

D_QK, D_V = 576, 512


def init(key, hidden, heads):
  k = jax.random.split(key, 3)
  return dict(
      w_q=jax.random.normal(k[0], (hidden, heads * D_QK)) / hidden ** 0.5,
      w_kv=jax.random.normal(k[1], (hidden, D_QK)) / hidden ** 0.5,
      w_o=jax.random.normal(k[2], (heads * D_V, hidden)) / (heads * D_V) ** 0.5,
      sink=jnp.zeros((heads,), jnp.float32))


def layer(params, x, indices, *, heads, implementation):
  s = x.shape[0]
  q = (x @ params["w_q"]).reshape(s, heads, D_QK).astype(jnp.bfloat16)
  kv = (x @ params["w_kv"]).astype(jnp.bfloat16)
  o, _, _ = sparse_mla_prefill(q, kv, indices, sm_scale=D_QK ** -0.5, attn_sink=params["sink"],
                               implementation=implementation)
  return o.reshape(s, heads * D_V).astype(jnp.float32) @ params["w_o"]


def causal_topk(key, s, topk):
  """Each token's ``topk`` indices among the tokens up to itself (``-1`` where fewer)."""
  scores = jax.random.uniform(key, (s, s))
  scores = jnp.where(jnp.arange(s)[None, :] <= jnp.arange(s)[:, None], scores, -1.0)
  top, idx = jax.lax.top_k(scores, topk)
  return jnp.where(top >= 0, idx, -1).astype(jnp.int32)


def adam(lr, b1=0.9, b2=0.999, eps=1e-8):
  """``(init, update)`` of Adam: ``update(grads, state) -> (updates, state)``."""
  try:
    import optax
    opt = optax.adam(lr)
    return opt.init, opt.update
  except ImportError:
    pass

  def init_fn(params):
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    return (zeros, zeros, jnp.zeros((), jnp.int32))

  def update_fn(grads, state, params=None):
    del params
    m, v, t = state
    t = t + 1
    m = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
    v = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, v, grads)
    scale = lr * jnp.sqrt(1 - b2 ** t) / (1 - b1 ** t)
    updates = jax.tree_util.tree_map(lambda m, v: -scale * m / (jnp.sqrt(v) + eps), m, v)
    return updates, (m, v, t)

  return init_fn, update_fn


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--steps", type=int, default=20)
  ap.add_argument("--tokens", type=int, default=1024)
  ap.add_argument("--heads", type=int, default=64)
  ap.add_argument("--topk", type=int, default=256)
  ap.add_argument("--hidden", type=int, default=1024)
  ap.add_argument("--lr", type=float, default=None,
                  help="Adam step size (default 3e-4; 3e-3 with --small)")
  ap.add_argument("--implementation", default=None, choices=[None, "mosaic", "triton", "xla"])
  ap.add_argument("--small", action="store_true", help="CPU-sized shapes")
  args = ap.parse_args(argv)
  if args.small:
    args.tokens, args.heads, args.topk, args.hidden = 32, 4, 8, 64
  if args.lr is None:  # 3e-3 diverges at the full size (loss 0.039 -> 2.4 in 12 steps)
    args.lr = 3e-3 if args.small else 3e-4
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  teacher, params = init(keys[0], args.hidden, args.heads), init(keys[1], args.hidden,
                                                                  args.heads)
  x = jax.random.normal(keys[2], (args.tokens, args.hidden))
  indices = causal_topk(keys[3], args.tokens, args.topk)
  fwd = lambda p: layer(p, x, indices, heads=args.heads,  # noqa: E731
                        implementation=args.implementation)
  target = jax.jit(fwd)(teacher)
  opt_init, opt_update = adam(args.lr)

  @jax.jit
  def step(params, opt_state):
    loss, grads = jax.value_and_grad(lambda p: jnp.mean((fwd(p) - target) ** 2))(params)
    updates, opt_state = opt_update(grads, opt_state, params)
    return jax.tree_util.tree_map(jnp.add, params, updates), opt_state, loss

  opt_state = opt_init(params)
  losses, times = [], []
  for i in range(args.steps):
    t0 = time.perf_counter()
    params, opt_state, loss = step(params, opt_state)
    losses.append(float(loss))  # waits for the step
    times.append(time.perf_counter() - t0)
    print(f"step {i:3d} loss {losses[-1]:.6f}", flush=True)
  step_ms = 1e3 * statistics.median(times[1:] or times)  # the first step compiles
  print(f"{jax.devices()[0].device_kind}: tokens {args.tokens}, heads {args.heads}, topk "
        f"{args.topk}: median step {step_ms:.2f} ms; loss {losses[0]:.6f} -> {losses[-1]:.6f}")
  return 0 if losses[-1] < losses[0] else 1


if __name__ == "__main__":
  sys.exit(main())

"""Random loss programs over a batch of token sequences, for the differential fuzzer.

Where `programs` draws maps of `[B, F]` activations, these draw what large models' losses
do to `[B, L, F]` ones: the batch merged with the sequence and flattened (`[B * L]`), iotas
and constants over that axis (masks and weights by position, `eye`, `ones(2B)`), the batch
in segments (`concatenate([a, b])`, then `[:B]`, `[B:]`), integer labels, masks from the
inputs, the batch's size as a number, `has_aux`, `stop_gradient` cross terms, gradients
inside the loss, `scan` / `cond` / `checkpoint`, more than 8 batch sums, custom rules whose
residuals are per example, and a batch that is a tuple with a table in it. A program is
run under a pinned microbatch plan and under jax.jit: a split that trains differently is
the one result never allowed.
"""

from __future__ import annotations

import dataclasses
import random

import jax
import jax.numpy as jnp
import optax

from tests.exactness import harness

B, L, D, F = 8, 4, 5, 10  # F > 8: a reduction over the batch alone leaves F sums


@jax.custom_vjp
def _sign_scaled(h):
  return h


_sign_scaled.defvjp(lambda h: (h, h), lambda res, g: (g * (1.0 + 0.5 * jnp.sign(res)),))


@jax.custom_vjp
def _batch_scaled(h):
  return h


_batch_scaled.defvjp(lambda h: (h, h), lambda res, g: (g * jnp.mean(res ** 2),))


def _flat(fn):
  """`fn` on the tokens flattened to `[B * L, F]`, reshaped back."""
  return lambda h, c: fn(h.reshape(-1, h.shape[-1]), c).reshape(h.shape)


def _scan_over_tokens(h, c):
  def step(carry, x):
    carry = jnp.tanh(carry + x)
    return carry, carry
  _, ys = jax.lax.scan(step, jnp.zeros_like(h[:, 0]), jnp.swapaxes(h, 0, 1))
  return jnp.swapaxes(ys, 0, 1)


def _views(h, c):
  both = jnp.concatenate([h, 0.5 * h], axis=0)
  a, b = jnp.split(jnp.tanh(both), 2)
  return a - 0.3 * b


def _ones_2b(h, c):
  n = h.shape[0]
  both = jnp.concatenate([h, jnp.tanh(h)]) * jnp.ones((2 * n, 1, 1))
  return both[:n] + both[n:]


def _views_at_b(h, c):
  """Two views cut back at `c["b"]`: the batch's size, read before the loss where the
  program's step reads it there (`outside`)."""
  both = jnp.concatenate([h, jnp.tanh(h)], axis=0)
  return both[:c["b"]] - 0.5 * both[c["b"]:]


def _merged_at_b(h, c):
  t = jnp.tanh(h.reshape(c["b"] * h.shape[1], h.shape[2]))
  return t.reshape(c["b"], h.shape[1], h.shape[2]) + h


def _time_major_weights(h, c):
  t = jnp.swapaxes(h, 0, 1).reshape(-1, h.shape[-1])  # [L * B]: the batch minor
  t = t * (1.0 + jnp.arange(t.shape[0]) % 2)[:, None]
  return jnp.swapaxes(t.reshape(h.shape[1], h.shape[0], -1), 0, 1)


# op name -> (h [B, L, F], context) -> h
OPS = {
    "tanh": lambda h, c: jnp.tanh(h),
    "square": lambda h, c: h * h,
    "flat_roundtrip": _flat(lambda t, c: jnp.tanh(t)),
    "flat_position_weights": _flat(lambda t, c: t * (1 + jnp.arange(t.shape[0]) % 3)[:, None] / 3),
    "flat_valid_mask": _flat(lambda t, c: t * (jnp.arange(t.shape[0]) < c["n"] * L)[:, None]),
    "flat_eye_column": _flat(lambda t, c: t * (1 + jnp.eye(t.shape[0])[:, :1])),
    "sequence_mask": lambda h, c: h * (jnp.arange(h.shape[1]) < h.shape[1] - 1)[None, :, None],
    "input_mask": lambda h, c: h * (c["x"][..., :1] > 0),
    "position_gather_param": lambda h, c: h + c["p"]["pos"][jnp.arange(h.shape[1])][None],
    "segments_views": _views,
    "segments_ones_2b": _ones_2b,
    "batch_size_number": lambda h, c: h / h.shape[0],
    "views_at_b": _views_at_b,
    "merged_at_b": _merged_at_b,
    "divided_by_b": lambda h, c: h / c["b"],
    "checkpointed": lambda h, c: jax.checkpoint(lambda z: jnp.tanh(z) * 2.0)(h),
    "checkpoint_dots": lambda h, c: jax.checkpoint(
        lambda z: jnp.tanh(z @ c["p"]["m"]),
        policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)(h),
    "scan_over_tokens": _scan_over_tokens,
    "cond_on_a_count": lambda h, c: jax.lax.cond(c["n"] > 2, lambda z: z * 2.0, jnp.sin, h),
    "gradient_inside": lambda h, c: h + jax.grad(lambda z: jnp.sum(jnp.sin(z)))(h),
    "custom_vjp_residual": lambda h, c: _sign_scaled(h),
    "write_beside": lambda h, c: h.at[:, 0].set(1.0),
    # may make examples interact
    "stop_gradient_batch_mean": lambda h, c: h * jax.lax.stop_gradient(jnp.mean(h)),
    "custom_vjp_batch_residual": lambda h, c: _batch_scaled(h),
    "time_major_flat_weights": _time_major_weights,
    "flat_cumsum": _flat(lambda t, c: jnp.cumsum(t, axis=0) / t.shape[0]),
    "flat_roll": _flat(lambda t, c: jnp.roll(t, 1, axis=0)),
    "pairs_by_reshape": lambda h, c: (h.reshape(-1, 2, *h.shape[1:]) * jnp.array([1.0, -1.0])[
        None, :, None, None]).sum(1).repeat(2, 0),
}
MIXING = frozenset(list(OPS)[list(OPS).index("stop_gradient_batch_mean"):])


def _ce(h, c, labels):
  return optax.softmax_cross_entropy_with_integer_labels(h, labels)


REDUCTIONS = {
    "mean": lambda h, c: jnp.mean(h ** 2),
    "token_ce": lambda h, c: jnp.mean(_ce(h, c, c["y"])),
    "zeros_labels_ce": lambda h, c: jnp.mean(_ce(h, c, jnp.zeros(h.shape[:2], jnp.int32))),
    "masked_mean": lambda h, c: jnp.sum(jnp.sum(h ** 2, -1) * c["mask"]) / jnp.maximum(
        jnp.sum(c["mask"]), 1.0),
    "many_sums": lambda h, c: jnp.sum(jnp.log(jnp.mean(h ** 2, (0, 1)) + 1.0)),
    "log_mean": lambda h, c: jnp.log(jnp.mean(h ** 2) + 1.0),
    "table_ce": lambda h, c: jnp.mean(_ce(h @ c["table"], c, c["y"])),
    "stop_gradient_cross": lambda h, c: jnp.mean(h ** 2) * (
        1.0 + jax.lax.stop_gradient(jnp.mean(jnp.abs(h)))),
}


@dataclasses.dataclass(frozen=True)
class TokenProgram:
  ops: tuple[str, ...]
  reduction: str
  k: int
  aux: bool = False  # returns per-example values beside the loss (has_aux)
  tupled: bool = False  # the batch as one tuple (x, y, mask, table)
  outside: bool = False  # the step reads the batch's size before the loss (`b`)

  def loss(self, p, x, y, mask, table, n, b=None):
    c = {"x": x, "y": y, "mask": mask, "table": table, "n": n, "p": p,
         "b": x.shape[0] if b is None else b}
    h = jnp.tanh(x @ p["w"])
    for name in self.ops:
      h = OPS[name](h, c)
    value = REDUCTIONS[self.reduction](h @ p["v"], c)
    return (value, jnp.sum(h, -1)) if self.aux else value

  def case(self) -> harness.Case:
    def step(params, *batch):
      if self.tupled:
        (x, y, mask, table), n = batch
        loss_fn = lambda p, b, n: self.loss(p, *b, n)  # noqa: E731
        out, g = jax.value_and_grad(loss_fn, has_aux=self.aux)(params, (x, y, mask, table), n)
      elif self.outside:  # the size read here, the batch closed over
        b = batch[0].shape[0]
        loss_fn = lambda p: self.loss(p, *batch, b=b)  # noqa: E731
        out, g = jax.value_and_grad(loss_fn, has_aux=self.aux)(params)
      else:
        out, g = jax.value_and_grad(self.loss, has_aux=self.aux)(params, *batch)
      loss = out[0] if self.aux else out
      metrics = {"loss": loss, **({"aux": out[1]} if self.aux else {})}
      return jax.tree.map(lambda a, b: a - 0.1 * b, params, g), metrics

    def make():
      key = jax.random.key(hash(self) % (1 << 31))
      k = jax.random.split(key, 7)
      params = {"w": jax.random.normal(k[0], (D, F)) * 0.5,
                "v": jax.random.normal(k[1], (F, F)) * 0.5,
                "m": jax.random.normal(k[2], (F, F)) * 0.3,
                "pos": jax.random.normal(k[3], (L, F)) * 0.1}
      x = jax.random.normal(k[4], (B, L, D))
      y = jax.random.randint(k[5], (B, L), 0, F)
      mask = (jax.random.uniform(k[6], (B, L)) > 0.3).astype(jnp.float32)
      table = jnp.eye(F) + 0.1
      n = jnp.int32(B // 2 + 1)
      if self.tupled:
        return params, (x, y, mask, table), n
      return params, x, y, mask, table, n
    name = " ".join(self.ops) + f" | {self.reduction} | k={self.k}" + (
        " | aux" if self.aux else "") + (" | tupled" if self.tupled else "") + (
            " | outside" if self.outside else "")
    return harness.Case(name, step, make)


def random_program(rng: random.Random, max_ops: int = 4) -> TokenProgram:
  ops = tuple(rng.choice(sorted(OPS)) for _ in range(rng.randint(0, max_ops)))
  aux, tupled, outside = rng.random() < 0.25, rng.random() < 0.25, rng.random() < 0.25
  return TokenProgram(ops, rng.choice(sorted(REDUCTIONS)), rng.choice((2, 4, B)), aux,
                      tupled, outside and not tupled)

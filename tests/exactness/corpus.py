"""Training steps people write, each small: the drop-in must split them exactly or refuse.

Every case is `step(state, *args) -> (state, metrics)`, written the way its kind is written
in the wild (JAX's documentation, Flax's examples, RL and contrastive codebases), and run
unmodified. Sizes are tiny so that the whole corpus runs in CI on two cores.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import nnx
from flax.training import train_state

from tests.exactness.harness import Case

B, D, H, C = 128, 8, 128, 4
CASES: list[Case] = []


def case(name: str, **kw) -> Callable:
  def register(make_case: Callable) -> Callable:
    step, make = make_case()
    CASES.append(Case(name, step, make, **kw))
    return make_case
  return register


def _normal(seed, shape, scale=0.3):
  return jax.random.normal(jax.random.key(seed), shape) * scale


def mlp_params(seed=0, d=D, h=H, c=C):
  return {"w1": _normal(seed, (d, h)), "b1": jnp.zeros(h), "w2": _normal(seed + 1, (h, c))}


def mlp(p, x):
  return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]


def _x(seed=10, shape=(B, D)):
  return _normal(seed, shape, 1.0)


def _labels(seed=11, n=B, c=C):
  return jax.random.randint(jax.random.key(seed), (n,), 0, c)


def sgd(loss_fn, lr=0.1, **vg):
  """The plainest step: `jax.value_and_grad(loss_fn)(params, *batch)`, then SGD."""
  def step(params, *batch):
    loss, g = jax.value_and_grad(loss_fn, **vg)(params, *batch)
    if vg.get("has_aux"):
      loss, aux = loss
      return jax.tree.map(lambda a, b: a - lr * b, params, g), {"loss": loss, "aux": aux}
    return jax.tree.map(lambda a, b: a - lr * b, params, g), {"loss": loss}
  return step


def _xy():
  return mlp_params(), _x(), _labels()


# ------------------------------------------------------------------ plain losses (split)
@case("mse_mean", expect_split=True)
def _():
  return sgd(lambda p, x, y: jnp.mean((mlp(p, x) - jax.nn.one_hot(y, C)) ** 2)), _xy


@case("cross_entropy", expect_split=True)
def _():
  return sgd(lambda p, x, y: optax.softmax_cross_entropy_with_integer_labels(
      mlp(p, x), y).mean()), _xy


@case("sum_loss", expect_split=True)
def _():
  return sgd(lambda p, x, y: jnp.sum(optax.softmax_cross_entropy_with_integer_labels(
      mlp(p, x), y)), lr=0.01), _xy


@case("label_smoothing", expect_split=True)
def _():
  def loss(p, x, y):
    target = optax.smooth_labels(jax.nn.one_hot(y, C), 0.1)
    return optax.softmax_cross_entropy(mlp(p, x), target).mean()
  return sgd(loss), _xy


@case("z_loss", expect_split=True)
def _():
  def loss(p, x, y):
    logits = mlp(p, x)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    z = jax.nn.logsumexp(logits, axis=-1)
    return jnp.mean(ce + 1e-4 * z ** 2)
  return sgd(loss), _xy


@case("focal_loss", expect_split=True)
def _():
  def loss(p, x, y):
    logp = jax.nn.log_softmax(mlp(p, x))
    pt = jnp.take_along_axis(logp, y[:, None], -1)[:, 0]
    return -jnp.mean((1 - jnp.exp(pt)) ** 2 * pt)
  return sgd(loss), _xy


@case("huber", expect_split=True)
def _():
  return sgd(lambda p, x, y: optax.huber_loss(mlp(p, x), jax.nn.one_hot(y, C)).mean()), _xy


@case("hinge", expect_split=True)
def _():
  return sgd(lambda p, x, y: optax.hinge_loss(mlp(p, x)[:, 0], 2.0 * (y % 2) - 1).mean()), _xy


@case("weight_decay_in_loss", expect_split=True)
def _():
  def loss(p, x, y):
    ce = optax.softmax_cross_entropy_with_integer_labels(mlp(p, x), y).mean()
    return ce + 1e-3 * sum(jnp.sum(w ** 2) for w in jax.tree.leaves(p))
  return sgd(loss), _xy


@case("relu_gelu_softmax", expect_split=True)
def _():
  def loss(p, x, y):
    h = jax.nn.relu(x @ p["w1"]) + jax.nn.gelu(x @ p["w1"])
    return -jnp.mean(jnp.log(jax.nn.softmax(h @ p["w2"]) + 1e-6)[:, 0] * (y >= 0))
  return sgd(loss), _xy


@case("log_of_mean", expect_split=True)
def _():
  return sgd(lambda p, x, y: jnp.log(jnp.mean(mlp(p, x) ** 2))), _xy


@case("has_aux_per_example", expect_split=True)
def _():
  def loss(p, x, y):
    logits = mlp(p, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), logits.argmax(-1)
  return sgd(loss, has_aux=True), _xy


@case("argnums_negative", expect_split=True)
def _():
  def step(params, x, y):
    loss_fn = lambda x, y, p: jnp.mean((mlp(p, x) - jax.nn.one_hot(y, C)) ** 2)  # noqa: E731
    loss, g = jax.value_and_grad(loss_fn, argnums=-1)(x, y, params)
    return jax.tree.map(lambda a, b: a - 0.1 * b, params, g), {"loss": loss}
  return step, _xy


@case("argnums_tuple", expect_split=True)
def _():
  def step(state, x, y):
    loss_fn = lambda p, q, x, y: optax.softmax_cross_entropy_with_integer_labels(  # noqa
        mlp(p, x) + x @ q, y).mean()
    loss, (g1, g2) = jax.value_and_grad(loss_fn, argnums=(0, 1))(state["p"], state["q"], x, y)
    new = {"p": jax.tree.map(lambda a, b: a - 0.1 * b, state["p"], g1),
           "q": state["q"] - 0.1 * g2}
    return new, {"loss": loss}
  return step, lambda: ({"p": mlp_params(), "q": _normal(3, (D, C))}, _x(), _labels())


@case("grad_only", expect_split=True)
def _():
  def step(params, x, y):
    g = jax.grad(lambda p: jnp.mean((mlp(p, x) - jax.nn.one_hot(y, C)) ** 2))(params)
    return jax.tree.map(lambda a, b: a - 0.1 * b, params, g), {"g": g}
  return step, _xy


@case("allow_int")
def _():
  def step(params, x, y):
    loss_fn = lambda p, x: jnp.mean((mlp(p, x) - jax.nn.one_hot(y, C)) ** 2)  # noqa: E731
    loss, g = jax.value_and_grad(loss_fn, allow_int=True)(params, x)
    return jax.tree.map(lambda a, b: a - 0.1 * b, params, g), {"loss": loss}
  return step, _xy


@case("token_weighted_lm", expect_split=True)
def _():
  def loss(p, tokens, w):
    emb = p["emb"][tokens]
    logits = jnp.tanh(emb @ p["w"]) @ p["emb"].T
    ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:])
    return jnp.sum(ce * w[:, 1:]) / jnp.sum(w[:, 1:])
  def make():
    tokens = jax.random.randint(jax.random.key(5), (B, 12), 0, 20)
    lengths = jax.random.randint(jax.random.key(6), (B, 1), 3, 13)
    w = (jnp.arange(12)[None] < lengths).astype(jnp.float32)
    return {"emb": _normal(0, (20, D)), "w": _normal(1, (D, D))}, tokens, w
  return sgd(loss), make


@case("mask_normalised_before_sum", expect_split=True)
def _():
  def loss(p, x, y):
    mask = (y > 0).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(mlp(p, x), y)
    return jnp.sum(ce * (mask / mask.sum()))
  return sgd(loss), _xy


@case("ppo_advantage_normalisation", expect_split=True)
def _():
  def loss(p, obs, act, adv, old_logp):
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    out = mlp(p, obs)
    logits, value = out[:, :-1], out[:, -1]
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits), act[:, None] % 3, -1)[:, 0]
    ratio = jnp.exp(logp - old_logp)
    policy = -jnp.mean(jnp.minimum(ratio * adv, jnp.clip(ratio, 0.8, 1.2) * adv))
    entropy = -jnp.mean(jnp.sum(jax.nn.softmax(logits) * jax.nn.log_softmax(logits), -1))
    return policy + 0.5 * jnp.mean((value - adv) ** 2) - 0.01 * entropy
  def make():
    return mlp_params(), _x(), _labels(), _normal(12, (B,), 1.0), _normal(13, (B,), 0.1) - 1.4
  return sgd(loss), make


@case("logsumexp_over_the_batch", expect_split=True)
def _():
  def loss(p, x, y):
    temp = jax.nn.logsumexp(x[:, 0])  # a batch statistic of the inputs
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(mlp(p, x), y)) * temp
  return sgd(loss), _xy


@case("logsumexp_of_losses")
def _():
  # a soft maximum over the examples' losses: a function of the parameters over the batch
  return sgd(lambda p, x, y: jax.nn.logsumexp(
      optax.softmax_cross_entropy_with_integer_labels(mlp(p, x), y))), _xy


@case("cls_token_concat", expect_split=True)
def _():
  def loss(p, patches, y):
    cls = jnp.broadcast_to(p["cls"], (patches.shape[0], 1, D))
    h = jnp.concatenate([cls, patches], axis=1)
    h = jnp.tanh(h @ p["w"])
    return optax.softmax_cross_entropy_with_integer_labels(h[:, 0] @ p["head"], y).mean()
  def make():
    return ({"cls": _normal(0, (1, 1, D)), "w": _normal(1, (D, D)), "head": _normal(2, (D, C))},
            _x(20, (B, 5, D)), _labels())
  return sgd(loss), make


@case("conv_net", expect_split=True)
def _():
  class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.relu(nn.Conv(4, (3, 3))(x))
      x = nn.avg_pool(x, (2, 2), (2, 2))
      return nn.Dense(C)(x.reshape(x.shape[0], -1))
  model = CNN()

  def loss(p, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean()
  return sgd(loss), lambda: (model.init(jax.random.key(0), jnp.ones((1, 8, 8, 1))),
                             _x(21, (B, 8, 8, 1)), _labels())


@case("lstm_scan_over_time", expect_split=True)
def _():
  def loss(p, xs, y):
    def cell(h, x):
      h = jnp.tanh(x @ p["wx"] + h @ p["wh"])
      return h, None
    h, _ = jax.lax.scan(cell, jnp.zeros((xs.shape[0], H)), jnp.swapaxes(xs, 0, 1))
    return optax.softmax_cross_entropy_with_integer_labels(h @ p["out"], y).mean()
  def make():
    return ({"wx": _normal(0, (D, H)), "wh": _normal(1, (H, H)), "out": _normal(2, (H, C))},
            _x(22, (B, 6, D)), _labels())
  return sgd(loss), make


@case("attention_causal", expect_split=True)
def _():
  def loss(p, tokens):
    h = p["emb"][tokens]
    q, k, v = jnp.split(h @ p["qkv"], 3, axis=-1)
    att = jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(D)
    att = jnp.where(jnp.tril(jnp.ones((tokens.shape[1],) * 2, bool)), att, -1e9)
    h = h + jnp.einsum("bts,bsd->btd", jax.nn.softmax(att), v)
    logits = h @ p["emb"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()
  def make():
    return ({"emb": _normal(0, (20, D)), "qkv": _normal(1, (D, 3 * D))},
            jax.random.randint(jax.random.key(7), (B, 10), 0, 20))
  return sgd(loss), make


@case("packed_segments", expect_split=True)
def _():
  def loss(p, tokens, segments):
    h = p["emb"][tokens]
    same = segments[:, :, None] == segments[:, None, :]
    causal = jnp.tril(jnp.ones((tokens.shape[1],) * 2, bool))
    att = jnp.einsum("btd,bsd->bts", h @ p["q"], h) / np.sqrt(D)
    att = jnp.where(same & causal, att, -1e9)
    h = h + jnp.einsum("bts,bsd->btd", jax.nn.softmax(att), h)
    ce = optax.softmax_cross_entropy_with_integer_labels((h @ p["emb"].T)[:, :-1], tokens[:, 1:])
    w = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)
    return jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1)
  def make():
    tokens = jax.random.randint(jax.random.key(8), (B, 12), 0, 20)
    segments = jnp.tile(jnp.array([1, 1, 1, 1, 2, 2, 2, 3, 3, 3, 0, 0]), (B, 1))
    return {"emb": _normal(0, (20, D)), "q": _normal(1, (D, D))}, tokens, segments
  return sgd(loss), make


@case("sort_within_example", expect_split=True)
def _():
  return sgd(lambda p, x, y: jnp.mean(jnp.sort(mlp(p, x), axis=-1)[:, -1])), _xy


@case("cumsum_within_example", expect_split=True)
def _():
  return sgd(lambda p, x, y: jnp.mean(jnp.cumsum(mlp(p, x), axis=-1) ** 2)), _xy


@case("take_along_axis", expect_split=True)
def _():
  return sgd(lambda p, x, y: -jnp.mean(jnp.take_along_axis(
      jax.nn.log_softmax(mlp(p, x)), y[:, None], axis=-1))), _xy


@case("debug_print", expect_split=True)
def _():
  def loss(p, x, y):
    l = optax.softmax_cross_entropy_with_integer_labels(mlp(p, x), y).mean()
    jax.debug.callback(lambda v: None, l)
    return l
  return sgd(loss), _xy


@case("uniform_constant_of_batch_length", expect_split=False)
def _():
  return sgd(lambda p, x, y: jnp.mean(jnp.sum(mlp(p, x) ** 2, -1) * jnp.asarray(np.ones(B)))), _xy


@case("custom_jvp_per_example", expect_split=True)
def _():
  @jax.custom_jvp
  def softplus(x):
    return jnp.logaddexp(x, 0.0)
  softplus.defjvp(lambda p, t: (softplus(p[0]), jax.nn.sigmoid(p[0]) * t[0]))
  return sgd(lambda p, x, y: jnp.mean(softplus(mlp(p, x)))), _xy


@case("custom_vjp_clip_gradient", expect_split=True)
def _():
  @jax.custom_vjp
  def clip_gradient(lo, hi, x):
    return x  # JAX's documentation: "Custom derivative rules", gradient clipping
  clip_gradient.defvjp(lambda lo, hi, x: (x, (lo, hi)),
                       lambda res, g: (None, None, jnp.clip(g, *res)))

  def loss(p, x, y):
    return jnp.mean((clip_gradient(-0.002, 0.002, mlp(p, x)) - jax.nn.one_hot(y, C)) ** 2)
  return sgd(loss), _xy


@case("custom_vjp_nonlinear_in_cotangent", expect_split=True)
def _():
  @jax.custom_vjp
  def signed_sqrt_grad(x):
    return x
  signed_sqrt_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.sign(g) * jnp.sqrt(jnp.abs(g)),))
  return sgd(lambda p, x, y: jnp.mean(signed_sqrt_grad(mlp(p, x)) ** 2), lr=0.01), _xy


# ------------------------------------------------------- steps that must not be split
@case("custom_jvp_centred_over_batch", expect_split=False)
def _():
  @jax.custom_jvp
  def centred(x):
    return jnp.sin(x)
  centred.defjvp(lambda p, t: (centred(p[0]), t[0] - t[0].mean()))
  return sgd(lambda p, x, y: jnp.mean(centred(mlp(p, x)))), _xy


@case("custom_vjp_normalises_over_batch", expect_split=False)
def _():
  @jax.custom_vjp
  def unit_grad(x):
    return x
  unit_grad.defvjp(lambda x: (x, None), lambda _, g: (g / (jnp.linalg.norm(g) + 1e-6),))
  return sgd(lambda p, x, y: jnp.mean(unit_grad(mlp(p, x)) ** 2)), _xy


@case("custom_vjp_on_parameters", expect_split=False)
def _():
  @jax.custom_vjp
  def clipped(w):
    return w
  clipped.defvjp(lambda w: (w, None), lambda _, g: (jnp.clip(g, -0.01, 0.01),))

  def loss(p, x, y):
    return jnp.mean((jnp.tanh(x @ clipped(p["w1"])) @ p["w2"] - jax.nn.one_hot(y, C)) ** 2)
  return sgd(loss), _xy


@case("custom_vjp_with_log_of_sum", expect_split=True)
def _():
  # The sums' cotangent needs the totals: they are taken first, so the rule's backward
  # sees, per microbatch, the very cotangent jax.jit gives it (a nonlinear clip).
  @jax.custom_vjp
  def clip_gradient(x):
    return x
  clip_gradient.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.01, 0.01),))
  return sgd(lambda p, x, y: jnp.log(jnp.sum(clip_gradient(mlp(p, x)) ** 2))), _xy


@case("write_at_batch_positions", expect_split=False)
def _():
  return sgd(lambda p, x, y: jnp.mean(jnp.sum(mlp(p, x) ** 2, -1).at[:8].set(0))), _xy


@case("dynamic_update_slice", expect_split=False)
def _():
  return sgd(lambda p, x, y: jnp.mean(jax.lax.dynamic_update_slice(
      jnp.sum(mlp(p, x) ** 2, -1), jnp.zeros(2), (0,)))), _xy


@case("weights_by_position_constant", expect_split=False)
def _():
  return sgd(lambda p, x, y: jnp.mean(jnp.sum(mlp(p, x) ** 2, -1) * jnp.asarray(
      np.tile([1, .25], B // 2)))), _xy


@case("class_weights_from_callback", expect_split=True)
def _():
  # a callback on the labels alone: computed once over the whole batch and split
  def balance(labels):
    counts = np.bincount(labels, minlength=C)
    return (1.0 / counts[labels]).astype(np.float32)

  def loss(p, x, y):
    w = jax.pure_callback(balance, jax.ShapeDtypeStruct(y.shape, jnp.float32), y)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(mlp(p, x), y) * w)
  return sgd(loss), _xy


@case("first_half_mask", expect_split=True)
def _():
  # a mask by position: computed once over the whole batch and split with it
  return sgd(lambda p, x, y: jnp.mean(jnp.where(jnp.arange(x.shape[0]) < x.shape[0] // 2,
                                                jnp.sum(mlp(p, x) ** 2, -1), 0.0))), _xy


@case("batchnorm_statistics", expect_split=False)
def _():
  def loss(p, x, y):
    h = x @ p["w1"]
    h = (h - h.mean(0)) / (h.std(0) + 1e-5)
    return optax.softmax_cross_entropy_with_integer_labels(jnp.tanh(h) @ p["w2"], y).mean()
  return sgd(loss), _xy


@case("in_batch_negatives", expect_split=False)
def _():
  def loss(p, x, y):
    a, b = mlp(p, x), mlp(p, x[::-1])
    logits = a @ b.T
    return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.arange(x.shape[0])).mean()
  return sgd(loss), _xy


@case("clip_contrastive", expect_split=False)
def _():
  def loss(p, img, txt):
    zi = img @ p["wi"]
    zt = txt @ p["wt"]
    zi = zi / jnp.linalg.norm(zi, axis=-1, keepdims=True)
    zt = zt / jnp.linalg.norm(zt, axis=-1, keepdims=True)
    logits = zi @ zt.T * jnp.exp(p["t"])
    labels = jnp.arange(img.shape[0])
    return (optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            + optax.softmax_cross_entropy_with_integer_labels(logits.T, labels).mean()) / 2
  return sgd(loss), lambda: ({"wi": _normal(0, (D, H)), "wt": _normal(1, (D, H)),
                              "t": jnp.float32(0.0)}, _x(), _x(23))


@case("median_over_batch", expect_split=False)
def _():
  return sgd(lambda p, x, y: jnp.median(jnp.sum(mlp(p, x) ** 2, -1))), _xy


@case("hard_example_top_k", expect_split=False)
def _():
  return sgd(lambda p, x, y: jnp.mean(jax.lax.top_k(optax.softmax_cross_entropy_with_integer_labels(
      mlp(p, x), y), 4)[0])), _xy


@case("mixup_roll", expect_split=False)
def _():
  def loss(p, x, y):
    xm = 0.7 * x + 0.3 * jnp.roll(x, 1, axis=0)
    ym = 0.7 * jax.nn.one_hot(y, C) + 0.3 * jnp.roll(jax.nn.one_hot(y, C), 1, axis=0)
    return optax.softmax_cross_entropy(mlp(p, xm), ym).mean()
  return sgd(loss), _xy


@case("while_loop_per_example", expect_split=True)
def _():
  # the loop reads no parameter: computed once over the whole batch and split
  def loss(p, x, y):
    def body(c):  # a per-example normaliser found by iteration (not differentiated)
      i, s = c
      return i + 1, 0.5 * (s + jnp.sum(x ** 2, -1) / s)
    _, norm = jax.lax.while_loop(lambda c: c[0] < 5, body, (0, jnp.ones(x.shape[0])))
    return jnp.mean(jnp.sum(mlp(p, x) ** 2, -1) / norm)
  return sgd(loss), _xy


@case("scatter_add_histogram", expect_split=False)
def _():
  def loss(p, x, y):
    per = jnp.sum(mlp(p, x) ** 2, -1)
    by_class = jnp.zeros(C).at[y].add(per)
    return jnp.sum(by_class ** 2) / 100
  return sgd(loss), _xy


@case("per_example_division_by_batch_size", expect_split=False)
def _():
  return sgd(lambda p, x, y: jnp.sum(jnp.sum(mlp(p, x) ** 2, -1) / x.shape[0])), _xy


@case("prime_batch")
def _():
  return sgd(lambda p, x, y: jnp.mean((mlp(p, x) - jax.nn.one_hot(y, C)) ** 2)), lambda: (
      mlp_params(), _x(10, (127, D)), _labels(11, 127))


@case("captions_five_per_image", expect_split=True)
def _():
  def loss(p, img, cap):
    zi = jnp.repeat(img @ p["wi"], 5, axis=0)
    return jnp.mean((zi - cap @ p["wt"]) ** 2)
  return sgd(loss), lambda: ({"wi": _normal(0, (D, H)), "wt": _normal(1, (D, H))}, _x(),
                             _x(24, (5 * B, D)))


@case("time_major_batch", expect_split=True)
def _():
  def loss(p, xs, y):  # xs: [T, B, D]
    def cell(h, x):
      return jnp.tanh(x @ p["wx"] + h @ p["wh"]), None
    h, _ = jax.lax.scan(cell, jnp.zeros((xs.shape[1], H)), xs)
    return optax.softmax_cross_entropy_with_integer_labels(h @ p["out"], y).mean()
  def make():
    return ({"wx": _normal(0, (D, H)), "wh": _normal(1, (H, H)), "out": _normal(2, (H, C))},
            _x(25, (6, B, D)), _labels())
  return sgd(loss), make


# Where another layout of the same shapes would be read as examples major or the batch's
# axis is ambiguous: refused (or, where the analysis can prove it, exact), never different.
@case("captions_caption_major_tiled", expect_split=True)
def _():
  # caption j of image i at row j * B + i, beside the images tiled 5 times the same way:
  # five segments of the batch, split alike (before jnp.tile had a rule: refused)
  def loss(p, img, cap):
    zi = jnp.tile(img @ p["wi"], (5, 1))
    return jnp.mean((zi - cap @ p["wt"]) ** 2)
  return sgd(loss), lambda: ({"wi": _normal(0, (D, H)), "wt": _normal(1, (D, H))}, _x(),
                             _x(26, (5 * B, D)))


@case("captions_read_caption_major", expect_split=True)
def _():
  # the captions' reshape reads no parameter: computed once over the whole batch and split
  def loss(p, img, cap):
    per_caption = cap.reshape(5, img.shape[0], -1).mean(0)  # rows j * B + i as image i's
    return jnp.mean((img @ p["wi"] - per_caption @ p["wt"]) ** 2)
  return sgd(loss), lambda: ({"wi": _normal(0, (D, H)), "wt": _normal(1, (D, H))}, _x(),
                             _x(27, (5 * B, D)))


@case("time_major_as_long_as_the_batch")
def _():
  def loss(p, xs, y):  # xs: [T, B, D] with T == B: the first axis is taken, and scanned over
    def cell(h, x):
      return jnp.tanh(x @ p["wx"] + h @ p["wh"]), None
    h, _ = jax.lax.scan(cell, jnp.zeros((xs.shape[1], H)), xs)
    return optax.softmax_cross_entropy_with_integer_labels(h @ p["out"], y).mean()
  def make():
    return ({"wx": _normal(0, (D, H)), "wh": _normal(1, (H, H)), "out": _normal(2, (H, C))},
            _x(28, (B, B, D)), _labels())
  return sgd(loss), make


@case("time_major_per_step_labels")
def _():
  def loss(p, xs, ys):  # xs: [T, B, D], ys: [T, B]
    logits = jnp.tanh(xs @ p["w1"] + p["b1"]) @ p["w2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, ys).mean()
  return sgd(loss), lambda: (mlp_params(), _x(29, (8, B, D)),
                             jax.random.randint(jax.random.key(30), (8, B), 0, C))


# ------------------------------------------------------ optimizers and whole steps
def _optax_step(loss_fn, tx):
  def step(state, *batch):
    loss, g = jax.value_and_grad(loss_fn)(state["params"], *batch)
    updates, opt = tx.update(g, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": loss}
  return step


def _ce(p, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(mlp(p, x), y).mean()


def _optax_case(tx):
  def make():
    p = mlp_params()
    return {"params": p, "opt": tx.init(p)}, _x(), _labels()
  return _optax_step(_ce, tx), make


@case("adamw", expect_split=True)
def _():
  return _optax_case(optax.adamw(1e-2))


@case("clip_by_global_norm_adam", expect_split=True)
def _():
  return _optax_case(optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2)))


@case("multi_steps", expect_split=True)
def _():
  return _optax_case(optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2))


@case("apply_if_finite", expect_split=True)
def _():
  return _optax_case(optax.apply_if_finite(optax.sgd(0.1), max_consecutive_errors=3))


@case("train_state_linen", expect_split=True)
def _():
  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(C)(nn.tanh(nn.Dense(H)(x)))
  model = MLP()

  def step(state, x, y):
    def loss_fn(params):
      return optax.softmax_cross_entropy_with_integer_labels(
          state.apply_fn({"params": params}, x), y).mean()
    loss, g = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=g), {"loss": loss}

  def make():
    params = model.init(jax.random.key(0), jnp.ones((1, D)))["params"]
    return (train_state.TrainState.create(apply_fn=model.apply, params=params,
                                          tx=optax.adam(1e-2)), _x(), _labels())
  return step, make


@case("dqn_target_network_shared", expect_split=True)
def _():
  tx = optax.adam(1e-2)

  def step(state, obs, act, rew, nxt, target):
    def loss_fn(p):
      qa = jnp.take_along_axis(mlp(p, obs), act[:, None], 1)[:, 0]
      y = rew + 0.9 * mlp(target, nxt).max(-1)
      return jnp.mean(optax.huber_loss(qa, jax.lax.stop_gradient(y)))
    loss, g = jax.value_and_grad(loss_fn)(state["params"])
    u, opt = tx.update(g, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], u), "opt": opt}, {"loss": loss}

  def make():
    p = mlp_params()
    # the target network is the online one (a copy is made only every N steps)
    return {"params": p, "opt": tx.init(p)}, _x(), _labels(), _normal(14, (B,), 1.0), _x(15), p
  return step, make


@case("gan_two_gradients", expect_split=True)
def _():
  def step(state, real, z):
    def d_loss(d, g):
      fake = jnp.tanh(z @ g["w"])
      return jnp.mean(jax.nn.softplus(-(real @ d["w"]))) + jnp.mean(jax.nn.softplus(fake @ d["w"]))

    def g_loss(g, d):
      return jnp.mean(jax.nn.softplus(-(jnp.tanh(z @ g["w"]) @ d["w"])))
    ld, gd = jax.value_and_grad(d_loss)(state["d"], state["g"])
    d = jax.tree.map(lambda a, b: a - 0.1 * b, state["d"], gd)
    lg, gg = jax.value_and_grad(g_loss)(state["g"], d)
    g = jax.tree.map(lambda a, b: a - 0.1 * b, state["g"], gg)
    return {"d": d, "g": g}, {"d": ld, "g": lg}
  return step, lambda: ({"d": {"w": _normal(0, (D, 1))}, "g": {"w": _normal(1, (4, D))}},
                        _x(), _x(16, (B, 4)))


@case("wgan_gradient_penalty", expect_split=True)
def _():
  def step(critic, real, fake, eps):
    def loss(c):
      f = lambda x: jnp.tanh(x @ c["w1"]) @ c["w2"]  # noqa: E731
      mixed = eps * real + (1 - eps) * fake
      grads = jax.vmap(jax.grad(lambda x: f(x[None])[0, 0]))(mixed)
      gp = jnp.mean((jnp.linalg.norm(grads, axis=-1) - 1) ** 2)
      return jnp.mean(f(fake)) - jnp.mean(f(real)) + 10 * gp
    l, g = jax.value_and_grad(loss)(critic)
    return jax.tree.map(lambda a, b: a - 0.01 * b, critic, g), {"loss": l}
  return step, lambda: ({"w1": _normal(0, (D, H)), "w2": _normal(1, (H, 1))}, _x(),
                        _x(17), jax.random.uniform(jax.random.key(18), (B, 1)))


@case("maml_inner_step")
def _():
  def step(params, x_support, y_support, x_query, y_query):
    def outer(p):
      g = jax.grad(_ce)(p, x_support, y_support)
      adapted = jax.tree.map(lambda a, b: a - 0.1 * b, p, g)
      return _ce(adapted, x_query, y_query)
    l, g = jax.value_and_grad(outer)(params)
    return jax.tree.map(lambda a, b: a - 0.1 * b, params, g), {"loss": l}
  return step, lambda: (mlp_params(), _x(), _labels(), _x(19), _labels(20))


@case("dp_sgd_per_example_clipping")
def _():
  def step(params, x, y):
    def one(p, xi, yi):
      return _ce(p, xi[None], yi[None])
    grads = jax.vmap(jax.grad(one), in_axes=(None, 0, 0))(params, x, y)
    norms = jnp.sqrt(sum(jnp.sum(g.reshape(g.shape[0], -1) ** 2, -1)
                         for g in jax.tree.leaves(grads)))
    scale = jnp.minimum(1.0, 1.0 / (norms + 1e-6))
    g = jax.tree.map(lambda g: jnp.mean(g * scale.reshape((-1,) + (1,) * (g.ndim - 1)), 0), grads)
    return jax.tree.map(lambda a, b: a - 0.1 * b, params, g), {"norm": norms.mean()}
  return step, _xy


# -------------------------------------------------------------- random numbers
@case("dropout_key_argument", stochastic=True)
def _():
  def step(params, x, y, rng):
    def loss_fn(p, x, y, rng):
      h = jnp.tanh(x @ p["w1"])
      keep = jax.random.bernoulli(rng, 0.8, h.shape)
      return _ce_logits(jnp.where(keep, h / 0.8, 0) @ p["w2"], y), keep
    (loss, keep), g = jax.value_and_grad(loss_fn, has_aux=True)(params, x, y, rng)
    return jax.tree.map(lambda a, b: a - 0.1 * b, params, g), {"loss": loss, "keep": keep}
  return step, lambda: (mlp_params(), _x(), _labels(), jax.random.key(3))


@case("dropout_raw_key_argument", stochastic=True)
def _():
  def step(params, x, y, rng):
    def loss_fn(p, rng):
      h = jnp.tanh(x @ p["w1"])
      keep = jax.random.bernoulli(rng, 0.8, h.shape)
      return _ce_logits(jnp.where(keep, h / 0.8, 0) @ p["w2"], y), keep
    (loss, keep), g = jax.value_and_grad(loss_fn, has_aux=True)(params, rng)
    return jax.tree.map(lambda a, b: a - 0.1 * b, params, g), {"loss": loss, "keep": keep}
  return step, lambda: (mlp_params(), _x(), _labels(), jax.random.PRNGKey(3))


def _ce_logits(logits, y):
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@case("nnx_dropout_batchnorm", stochastic=True)
def _():
  class Net(nnx.Module):
    def __init__(self, rngs):
      self.l1 = nnx.Linear(D, H, rngs=rngs)
      self.bn = nnx.BatchNorm(H, rngs=rngs)
      self.drop = nnx.Dropout(0.2, rngs=rngs)
      self.l2 = nnx.Linear(H, C, rngs=rngs)

    def __call__(self, x):
      return self.l2(self.drop(nnx.relu(self.bn(self.l1(x)))))

  def step(state, x, y):
    graphdef, rest = state
    model = nnx.merge(graphdef, rest)

    def loss_fn(m):
      return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()
    loss, g = nnx.value_and_grad(loss_fn)(model)
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda a, b: a - 0.1 * b, params, g))
    return (graphdef, nnx.state(model)), {"loss": loss}

  def make():
    graphdef, rest = nnx.split(Net(nnx.Rngs(0)))
    return (graphdef, rest), _x(), _labels()
  return step, make


@case("nnx_rngs_argument", stochastic=True)
def _():
  def step(params, x, y, rngs_state):
    rngs = nnx.merge(*rngs_state)

    def loss_fn(p, rngs):
      h = jnp.tanh(x @ p["w1"])
      keep = jax.random.bernoulli(rngs.dropout(), 0.8, h.shape)
      return _ce_logits(jnp.where(keep, h / 0.8, 0) @ p["w2"], y)
    loss, g = nnx.value_and_grad(loss_fn)(params, rngs)
    return jax.tree.map(lambda a, b: a - 0.1 * b, params, g), {"loss": loss}
  return step, lambda: (mlp_params(), _x(), _labels(), nnx.split(nnx.Rngs(dropout=3)))


# ----------------------------------- steps from a second reading (stop 46): new shapes
def _per(p, x):
  return jnp.sum(mlp(p, x) ** 2, -1)


@case("mean_with_where", expect_split=True)
def _():
  return sgd(lambda p, x, y: jnp.mean(_per(p, x), where=y > 0)), _xy


@case("average_with_weights", expect_split=True)
def _():
  return sgd(lambda p, x, y: jnp.average(_per(p, x), weights=(y + 1).astype(jnp.float32))), _xy


@case("square_of_the_mean", expect_split=True)
def _():
  # a function of a sum whose cotangent needs the total: each sum's gradient is scaled
  # once combined (a small step: the loss's curvature amplifies rounding over 3 steps)
  def loss(p, x, y):
    m = jnp.mean(_per(p, x))
    return m ** 2 + jnp.sqrt(m)
  return sgd(loss, lr=1e-6), _xy


@case("label_prior_from_the_batch", expect_split=True)
def _():
  def loss(p, x, y):  # logit adjustment by the batch's label frequencies: parameter-free
    prior = jnp.mean(jax.nn.one_hot(y, C), 0)
    return optax.softmax_cross_entropy_with_integer_labels(mlp(p, x) + jnp.log(prior + 1e-3),
                                                           y).mean()
  return sgd(loss), _xy


@case("repeat_each_example", expect_split=True)
def _():
  return sgd(lambda p, x, y: jnp.mean(mlp(p, jnp.repeat(x, 2, axis=0)) ** 2)), _xy


@case("dynamic_loss_scale", expect_split=True)
def _():
  def step(state, x, y):
    def loss(p):
      return _ce(p, x, y) * state["scale"]
    l, g = jax.value_and_grad(loss)(state["p"])
    g = jax.tree.map(lambda t: t / state["scale"], g)
    return ({"p": jax.tree.map(lambda a, b: a - 0.1 * b, state["p"], g), "scale": state["scale"]},
            {"loss": l})
  return step, lambda: ({"p": mlp_params(), "scale": jnp.float32(1024.0)}, _x(), _labels())


@case("sharpness_aware_two_gradients", expect_split=True)
def _():
  def step(p, x, y):  # SAM: a gradient at the parameters, the update's at a perturbed copy
    g = jax.grad(_ce)(p, x, y)
    norm = jnp.sqrt(sum(jnp.sum(t ** 2) for t in jax.tree.leaves(g)))
    l, g2 = jax.value_and_grad(_ce)(jax.tree.map(lambda a, b: a + 0.05 * b / norm, p, g), x, y)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g2), {"loss": l}
  return step, _xy


@case("gradient_in_a_fori_loop", expect_split=True)
def _():
  def step(p, x, y):  # several updates on the same batch
    def body(_, p):
      return jax.tree.map(lambda a, b: a - 0.1 * b, p, jax.grad(_ce)(p, x, y))
    return jax.lax.fori_loop(0, 3, body, p), {}
  return step, _xy


@case("linen_dropout_rngs_closed_over", stochastic=True)
def _():
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train):
      h = nn.Dropout(0.3, deterministic=not train)(nn.relu(nn.Dense(H)(x)))
      return nn.Dense(C)(h)
  net = Net()

  def step(params, x, y, key):
    def loss(q):
      return _ce_logits(net.apply({"params": q}, x, True, rngs={"dropout": key}), y)
    l, g = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda a, b: a - 0.1 * b, params, g), {"loss": l}
  return step, lambda: (net.init(jax.random.key(0), _x(), False)["params"], _x(), _labels(),
                        jax.random.key(2))


@case("stop_gradient_of_a_batch_statistic", expect_split=True)
def _():
  # stop_gradient does not make a statistic of the parameters' outputs parameter-free: it
  # is totalled in a pass of its own and given to each microbatch (no gradient through it)
  return sgd(lambda p, x, y: jnp.mean(_per(p, x) / jax.lax.stop_gradient(
      jnp.mean(_per(p, x))))), _xy


@case("two_views_by_jnp_tile", expect_split=True)
def _():
  # jnp.tile(x, (2, 1)): the batch twice, one copy after the other (a primitive in newer
  # jax, broadcast and reshape in older): two segments, sliced back at B
  def loss(p, x, y):
    n = x.shape[0]
    z = mlp(p, jnp.tile(x, (2, 1)) * jnp.concatenate([jnp.ones((n, 1)), 0.9 * jnp.ones((n, 1))]))
    return optax.softmax_cross_entropy_with_integer_labels(z[:n], y).mean() + jnp.mean(
        (jax.nn.softmax(z[:n]) - jax.nn.softmax(z[n:])) ** 2)
  return sgd(loss), _xy


@case("two_views_by_jnp_tile_scaled_by_a_repeat", expect_split=True)
def _():
  # the views' scales built by jnp.repeat([1.0, 0.8], n): a constant in segments, taken
  # as the batch's segments (not two rows per example) by the op it meets the views at
  def loss(p, x, y):
    n = x.shape[0]
    z = mlp(p, jnp.tile(x, (2, 1)) * jnp.repeat(jnp.array([1.0, 0.8]), n)[:, None])
    return optax.softmax_cross_entropy_with_integer_labels(z[:n], y).mean() + jnp.mean(
        (z[:n] - z[n:]) ** 2)
  return sgd(loss), _xy


@case("checkpoint_around_the_whole_loss", expect_split=True)
def _():
  # jax.checkpoint(loss_fn) with its mean inside: opened, its sums split like any
  def loss(p, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(mlp(p, x), y).mean(), jnp.mean(
        jnp.argmax(mlp(p, x), -1) == y)
  return sgd(jax.checkpoint(
      loss, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable),
      has_aux=True), _xy


@case("simclr_views_concatenated", expect_split=True)
def _():
  # the two views in segments of one axis, compared view with view of each example (no
  # in-batch negatives): split segment by segment
  def loss(p, x, y):
    z = mlp(p, jnp.concatenate([x, 0.9 * x], axis=0))
    return jnp.mean((z[:x.shape[0]] - z[x.shape[0]:]) ** 2)
  return sgd(loss), _xy


@case("pairs_by_reshape", expect_split=False)
def _():
  def loss(p, x, y):
    z = mlp(p, x).reshape(-1, 2, C)
    return jnp.mean((z[:, 0] - z[:, 1]) ** 2)
  return sgd(loss), _xy


@case("triplets_by_index_arguments", expect_split=False)
def _():
  def loss(p, x, anchor, pos, neg):
    z = mlp(p, x)
    d = lambda i, j: jnp.sum((z[i] - z[j]) ** 2, -1)  # noqa: E731
    return jnp.mean(jax.nn.relu(d(anchor, pos) - d(anchor, neg) + 1))
  idx = jnp.arange(B)
  return sgd(loss), lambda: (mlp_params(), _x(), idx, jnp.roll(idx, 1), jnp.roll(idx, 2))


@case("mixup_with_a_shuffle_key", expect_split=True)
def _():
  # the mixing reads no parameter: computed once over the whole batch and split
  def loss(p, x, y, key):
    perm = jax.random.permutation(key, x.shape[0])
    return _ce(p, 0.7 * x + 0.3 * x[perm], y)
  return sgd(loss), lambda: (mlp_params(), _x(), _labels(), jax.random.key(8))


@case("class_centres_by_segment_sum", expect_split=False)
def _():
  def loss(p, x, y):
    z = mlp(p, x)
    counts = jax.ops.segment_sum(jnp.ones(x.shape[0]), y, num_segments=C)
    centres = jax.ops.segment_sum(z, y, num_segments=C) / (counts[:, None] + 1)
    return jnp.mean((z - centres[y]) ** 2)
  return sgd(loss), _xy


@case("gradient_norm_penalty", expect_split=True)
def _():
  # the penalty is a function of the gradient's batch sums: totalled first, then pulled back
  def loss(p, x, y):
    inner = lambda q: jnp.mean(_per(q, x))  # noqa: E731
    g = jax.grad(inner)(p)
    return inner(p) + 0.01 * sum(jnp.sum(t ** 2) for t in jax.tree.leaves(g))
  return sgd(loss), _xy


@case("returns_by_reverse_scan_over_the_batch", expect_split=True)
def _():
  # the returns read no parameter: computed once over the whole batch and split
  def loss(p, x, r):
    def back(c, rr):
      c = rr + 0.9 * c
      return c, c
    _, ret = jax.lax.scan(back, 0.0, r, reverse=True)
    return jnp.mean((mlp(p, x)[:, 0] - ret) ** 2)
  return sgd(loss), lambda: (mlp_params(), _x(), _normal(5, (B,), 1.0))


@case("vicreg_covariance", expect_split=True)
def _():
  # the mean the embeddings are centred by is totalled first; the covariance's sums then
  def loss(p, x, y):
    z = mlp(p, x)
    zc = z - z.mean(0)
    cov = zc.T @ zc / (x.shape[0] - 1)
    return jnp.mean(jax.nn.relu(1 - jnp.sqrt(jnp.diag(cov) + 1e-4))) + jnp.sum(cov ** 2) / C
  return sgd(loss), _xy


@case("pearson_correlation_over_the_batch", expect_split=True)
def _():
  # 1 - Pearson's r of predictions and targets over the batch: both centred by their batch
  # means (the targets' computed once, the predictions' totalled in a pass of its own)
  def loss(p, x, y):
    pred = mlp(p, x)[:, 0]
    t = y.astype(jnp.float32)
    pc, tc = pred - pred.mean(), t - t.mean()
    return 1 - jnp.sum(pc * tc) / jnp.sqrt(jnp.sum(pc ** 2) * jnp.sum(tc ** 2) + 1e-8)
  return sgd(loss), _xy


@case("centred_embeddings_with_aux_and_a_mean_read_again", expect_split=True)
def _():
  # the statistic read per example and by the combining part, with per-example aux
  def loss(p, x, y):
    z = mlp(p, x)
    m = z.mean(0)
    per = jnp.sum((z - m) ** 2, -1)
    return jnp.mean(per) + jnp.sum(m ** 2), per
  return sgd(loss, has_aux=True), _xy


@case("tilted_erm_logsumexp_over_the_batch", expect_split=True)
def _():
  # (1/t) log mean exp(t l_i): logsumexp's maximum (under its stop_gradient) taken from the
  # microbatches' maxima in a pass of its own, then the sum of exp(t l_i - max)
  def loss(p, x, y):
    per = optax.softmax_cross_entropy_with_integer_labels(mlp(p, x), y)
    return (jax.nn.logsumexp(2.0 * per) - jnp.log(per.shape[0])) / 2.0
  return sgd(loss), _xy


@case("softmax_weights_over_the_batch", expect_split=True)
def _():
  # each example weighted by a softmax over the batch: its maximum, then the sum of
  # exponentials that reads it, then the weighted sum (statistics two stages deep)
  def loss(p, x, y):
    per = optax.softmax_cross_entropy_with_integer_labels(mlp(p, x), y)
    return jnp.sum(jax.nn.softmax(per) * per)
  return sgd(loss), _xy


@case("standardised_predictions_over_the_batch", expect_split=True)
def _():
  # (p - mean) / std over the batch against standardised targets: the deviation reads the
  # mean (two stages), the Huber loss reads both per example
  def loss(p, x, y):
    pred = mlp(p, x)[:, 0]
    z = (pred - pred.mean()) / (pred.std() + 1e-6)
    t = y.astype(jnp.float32)
    return jnp.mean(optax.huber_loss(z, (t - t.mean()) / (t.std() + 1e-6)))
  return sgd(loss), _xy


@case("listnet_softmax_over_the_batch", expect_split=True)
def _():
  # ListNet: cross-entropy between the softmax over the batch of the scores and of the
  # targets (log_softmax: the maximum, then the log of the sum of exponentials)
  def loss(p, x, y):
    scores = mlp(p, x)[:, 0]
    target = jax.nn.softmax(y.astype(jnp.float32))
    return -jnp.sum(target * jax.nn.log_softmax(scores))
  return sgd(loss), _xy


@case("a_maximum_over_the_batch_with_its_gradient", expect_split=False)
def _():
  def loss(p, x, y):
    per = optax.softmax_cross_entropy_with_integer_labels(mlp(p, x), y)
    return jnp.mean(jnp.exp(per - jnp.max(per)))
  return sgd(loss), _xy


@case("clipped_gradient_rule_before_a_batch_statistic", expect_split=False)
def _():
  # a custom_vjp that clips each example's cotangent, on values both the batch mean and the
  # centred term read: jax.jit clips the sum of both parts once; refused by name
  @jax.custom_vjp
  def clip_rows(h):
    return h
  clip_rows.defvjp(lambda h: (h, None), lambda _, g: (
      g / jnp.maximum(1.0, 50.0 * jnp.linalg.norm(g, axis=-1, keepdims=True)),))

  def loss(p, x, y):
    z = clip_rows(mlp(p, x))
    return jnp.mean(jnp.sum((z - z.mean(0)) ** 2, -1))
  return sgd(loss), _xy


@case("batch_centred_features_then_a_learned_scale", expect_split=False)
def _():
  # the centred values meet a parameter again (as the layers after a BatchNorm do): the
  # statistic would need a pass of its own before them; refused by name
  def loss(p, x, y):
    h = jnp.tanh(x @ p["w1"])
    return jnp.mean(((h - h.mean(0)) @ p["w2"]) ** 2)
  return sgd(loss), _xy


@case("minibatches_scanned_by_the_step", expect_split=True)
def _():
  # each gradient sees a minibatch: split at the minibatch's size
  def step(p, x, y):  # PPO's epochs over minibatches: the gradient sees a slice, not the batch
    def body(p, mb):
      l, g = jax.value_and_grad(_ce)(p, *mb)
      return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), l
    p, losses = jax.lax.scan(body, p, (x.reshape(4, -1, D), y.reshape(4, -1)))
    return p, {"loss": losses}
  return step, _xy


@case("largest_loss_in_aux", expect_split=True)
def _():
  # a metric returned as it is: the largest of the microbatches' largest
  def loss(p, x, y):
    per = optax.softmax_cross_entropy_with_integer_labels(mlp(p, x), y)
    return per.mean(), jnp.max(per)
  return sgd(loss, has_aux=True), _xy


from tests.exactness import corpus_breadth  # noqa: E402,F401  pylint: disable=g-import-not-at-top,wrong-import-position

assert len(CASES) == len({c.name for c in CASES}), "case names are unique"

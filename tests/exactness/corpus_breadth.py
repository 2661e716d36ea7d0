"""Steps large models are written with (issue 55): the user's own checkpoints, MoE load
balancing, DPO's concatenated forward, batch-length constants, positions over a flattened
token axis, and the less common shapes beside them. Each registers into `corpus.CASES`.

Written after the analysis gained their rules, by the same hand: the outside reading in
BENCHMARKS.md (steps nobody here wrote) is the check on them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax import nnx

from tests.exactness.corpus import B, C, D, H, _labels, _normal, _x, case, mlp, mlp_params, sgd

L = 6  # tokens per example


def _xy():
  return mlp_params(), _x(), _labels()


def _tokens(seed=30):
  return _normal(seed, (B, L, D), 1.0)


def _block(p, h):
  return jnp.tanh(h @ p["w1"][:, :D] + p["b1"][:D]) + h


# ---------------------------------------------------------------- the user's checkpoints
@case("user_checkpoint_block", expect_split=True)
def _():
  def loss(p, x, y):
    h = jax.checkpoint(_block)(p, x)
    h = jax.checkpoint(_block)(p, h)
    return optax.softmax_cross_entropy_with_integer_labels(mlp(p, h), y).mean()
  return sgd(loss), _xy


@case("user_checkpoint_policy_dots", expect_split=True)
def _():
  block = jax.checkpoint(_block, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)

  def loss(p, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(mlp(p, block(p, block(p, x))), y).mean()
  return sgd(loss), _xy


@case("user_checkpoint_names_offload", expect_split=True)
def _():
  from jax.ad_checkpoint import checkpoint_name  # pylint: disable=import-outside-toplevel
  policy = jax.checkpoint_policies.save_only_these_names("hidden")

  def block(p, h):
    return checkpoint_name(_block(p, h), "hidden")

  def loss(p, x, y):
    h = jax.checkpoint(block, policy=policy)(p, x)
    return optax.softmax_cross_entropy_with_integer_labels(mlp(p, h), y).mean()
  return sgd(loss), _xy


@case("linen_remat_blocks", expect_split=True)
def _():
  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      return x + nn.tanh(nn.Dense(D)(x))

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      for _ in range(3):
        x = nn.remat(Block, policy=jax.checkpoint_policies.nothing_saveable)()(x)
      return nn.Dense(C)(x)
  model = Net()

  def loss(p, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean()
  return sgd(loss), lambda: (model.init(jax.random.key(0), _x()), _x(), _labels())


@case("linen_scan_of_remat_blocks", expect_split=True)
def _():
  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      return x + nn.tanh(nn.Dense(D)(x)), None

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      stack = nn.scan(nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True},
                      length=3)
      x, _ = stack()(x, None)
      return nn.Dense(C)(x)
  model = Net()

  def loss(p, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean()
  return sgd(loss), lambda: (model.init(jax.random.key(0), _x()), _x(), _labels())


@case("nnx_remat_layers", expect_split=True)
def _():
  class Net(nnx.Module):
    def __init__(self, rngs):
      self.up = nnx.Linear(D, 2 * D, rngs=rngs)  # (activations outweigh the parameters)
      self.layers = nnx.List([nnx.Linear(2 * D, 2 * D, rngs=rngs) for _ in range(2)])
      self.head = nnx.Linear(2 * D, C, rngs=rngs)

    def __call__(self, x):
      x = self.up(x)
      for layer in self.layers:
        x = nnx.remat(lambda m, h: h + jnp.tanh(m(h)))(layer, x)
      return self.head(x)

  def step(state, x, y):
    model = nnx.merge(*state)

    def loss_fn(m):
      return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()
    loss, g = nnx.value_and_grad(loss_fn)(model)
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda a, b: a - 0.1 * b, params, g))
    return nnx.split(model), {"loss": loss}
  return step, lambda: (nnx.split(Net(nnx.Rngs(0))), _x(), _labels())


# ---------------------------------------------------- constants and positions of the batch
@case("padding_mask_over_flat_tokens", expect_split=True)
def _():
  def loss(p, x, n_valid):
    per_token = jnp.sum(mlp(p, x) ** 2, -1).reshape(-1)  # [B * L]
    valid = jnp.arange(x.shape[0] * x.shape[1]) < n_valid * x.shape[1]
    return jnp.sum(per_token * valid) / jnp.sum(valid)
  return sgd(loss), lambda: (mlp_params(), _tokens(), jnp.int32(B // 3))


@case("position_weights_flat_time_major", expect_split=True)
def _():
  def loss(p, x, y):
    per = jnp.sum(mlp(p, x) ** 2, -1)  # [B, L]
    flat = per.reshape(-1)
    w = 1.0 + jnp.arange(flat.shape[0]) % L / L  # a weight by token position
    return jnp.mean(flat * w)
  return sgd(loss), lambda: (mlp_params(), _tokens(), _labels())


@case("infonce_positive_at_zero", expect_split=True)
def _():
  def loss(p, q, candidates):
    e = mlp(p, q)
    scores = jnp.einsum("bc,bnc->bn", e, mlp(p, candidates)) / 0.1
    labels = jnp.zeros(q.shape[0], jnp.int32)  # each example's own candidates: the first
    return optax.softmax_cross_entropy_with_integer_labels(scores, labels).mean()
  return sgd(loss), lambda: (mlp_params(), _x(), _normal(31, (B, 5, D), 1.0))


@case("labels_of_ones_for_a_discriminator", expect_split=True)
def _():
  def loss(p, x, y):
    logits = mlp(p, x)[:, 0]
    return optax.sigmoid_binary_cross_entropy(logits, jnp.ones(x.shape[0])).mean()
  return sgd(loss), _xy


@case("weights_from_the_batch_size", expect_split=True)
def _():
  def loss(p, x, y):
    w = jnp.full((x.shape[0],), 1.0 / x.shape[0])
    return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(mlp(p, x), y) * w)
  return sgd(loss), _xy


@case("statistic_broadcast_by_where", expect_split=True)
def _():
  def loss(p, x, y):
    scale = jnp.where(x[:, 0] > 0, jnp.mean(jnp.abs(x[:, 1])), 1.0)
    return jnp.mean(jnp.sum(mlp(p, x) ** 2, -1) * scale)
  return sgd(loss), _xy


@case("bias_table_read_by_position", expect_split=True)
def _():
  def loss(p, x, y):
    bias = p["per_slot"][jnp.arange(x.shape[0]) % 8]  # a learnt bias per slot of the batch
    return jnp.mean((mlp(p, x)[:, 0] + bias) ** 2)
  return sgd(loss), lambda: ({**mlp_params(), "per_slot": _normal(32, (8,))}, _x(), _labels())


# ------------------------------------------------------------------------ sums of the batch
@case("moe_load_balancing", expect_split=True)
def _():
  E = 4

  def loss(p, x, y):
    router = x @ p["router"]  # [B, E]
    probs = jax.nn.softmax(router)
    f = jnp.mean(jax.nn.one_hot(jnp.argmax(router, -1), E), 0)  # no gradient reaches it
    balance = E * jnp.sum(f * jnp.mean(probs, 0))
    z = jnp.mean(jax.nn.logsumexp(router, -1) ** 2)
    return optax.softmax_cross_entropy_with_integer_labels(mlp(p, x), y).mean() + 0.01 * (
        balance + 0.1 * z)
  return sgd(loss), lambda: ({**mlp_params(), "router": _normal(33, (D, E))}, _x(), _labels())


@case("many_sums_of_the_parameters", expect_split=True)
def _():
  def loss(p, x, y):
    o = mlp(p, x)  # a function of 2 * C + 1 sums of the parameters: none known in advance
    return (jnp.sum(jnp.log(jnp.mean(o ** 2, 0) + 1.0) * jnp.log(jnp.mean(jnp.abs(o), 0) + 1.0))
            + jnp.log(jnp.mean(o[:, 0] ** 2) + 2.0))
  return sgd(loss), _xy


# --------------------------------------------------------------------- the batch in segments
@case("dpo_concatenated_forward", expect_split=True)
def _():
  def loss(p, chosen, rejected, ref_chosen, ref_rejected):
    both = jnp.concatenate([chosen, rejected])
    logp = jnp.sum(jax.nn.log_softmax(mlp(p, both)), -1)
    n = chosen.shape[0]
    margin = (logp[:n] - ref_chosen) - (logp[n:] - ref_rejected)
    return -jax.nn.log_sigmoid(0.1 * margin).mean()
  return sgd(loss), lambda: (mlp_params(), _x(40), _x(41), _normal(42, (B,), 1.0),
                             _normal(43, (B,), 1.0))


@case("two_views_split_back", expect_split=True)
def _():
  def loss(p, x, y):
    views = jnp.concatenate([x, x[:, ::-1]], axis=0)
    a, b = jnp.split(mlp(p, views), 2)
    return jnp.mean((a - b) ** 2) + optax.softmax_cross_entropy_with_integer_labels(a, y).mean()
  return sgd(loss), _xy


@case("segments_reshaped_apart", expect_split=True)
def _():
  def loss(p, chosen, rejected):
    scores = jnp.sum(mlp(p, jnp.concatenate([chosen, rejected])), -1)
    pair = scores.reshape(2, -1)  # [chosen; rejected] as two rows
    return -jax.nn.log_sigmoid(pair[0] - pair[1]).mean()
  return sgd(loss), lambda: (mlp_params(), _x(44), _x(45))


# --------------------------------------------------- sizes the step read before the loss
@case("dpo_n_read_before_the_loss", expect_split=True)
def _():
  def step(p, chosen, rejected, ref_chosen, ref_rejected):
    both, n = jnp.concatenate([chosen, rejected]), chosen.shape[0]  # n: the batch's

    def loss(p):
      logp = jnp.sum(jax.nn.log_softmax(mlp(p, both)), -1)
      margin = (logp[:n] - ref_chosen) - (logp[n:] - ref_rejected)
      return -jax.nn.log_sigmoid(0.1 * margin).mean()
    value, g = jax.value_and_grad(loss)(p)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), {"loss": value}
  return step, lambda: (mlp_params(), _x(46), _x(47), _normal(48, (B,), 1.0),
                        _normal(49, (B,), 1.0))


@case("pairs_reshaped_by_the_steps_sizes", expect_split=True)
def _():
  def step(p, pairs):
    b, two, d = pairs.shape

    def loss(p):
      r = jnp.sum(mlp(p, pairs.reshape(two * b, d)), -1).reshape(b, two)
      return -jnp.mean(jax.nn.log_sigmoid(r[:, 0] - r[:, 1]))
    value, g = jax.value_and_grad(loss)(p)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), {"loss": value}
  return step, lambda: (mlp_params(), _normal(50, (B, 2, D), 1.0))


@case("labels_broadcast_to_the_steps_sizes", expect_split=True)
def _():
  def step(p, x):
    b, c = x.shape[0], C

    def loss(p):
      labels = jnp.broadcast_to(jnp.arange(c)[None, :] % 2, (b, c))  # as long as the batch
      return jnp.mean((mlp(p, x) - labels) ** 2)
    value, g = jax.value_and_grad(loss)(p)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), {"loss": value}
  return step, lambda: (mlp_params(), _x(51))


@case("size_read_before_the_loss_divides_each_example", expect_split=False)
def _():
  # `(l / b).sum()` is exact only at b: traced again at a microbatch it would divide by the
  # microbatch's size (refused: "uses the batch size as a number"); the reshape by b makes
  # the loss alone not trace on a microbatch, so the second trace is the one held
  def step(p, pairs):
    b, two, d = pairs.shape

    def loss(p):
      r = jnp.sum(mlp(p, pairs.reshape(two * b, d)), -1).reshape(b, two)
      return jnp.sum(jax.nn.softplus(r[:, 1] - r[:, 0]) / b)
    value, g = jax.value_and_grad(loss)(p)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), {"loss": value}
  return step, lambda: (mlp_params(), _normal(52, (B, 2, D), 1.0))


# ----------------------------------------------------------------------- less common shapes
@case("per_example_keys", expect_split=True)
def _():
  def loss(p, x, keys):
    def one(xi, k):
      keep = jax.random.bernoulli(k, 0.8, (H,))
      return jnp.sum(((jnp.tanh(xi @ p["w1"]) * keep) @ p["w2"]) ** 2)
    return jnp.mean(jax.vmap(one)(x, keys))
  return sgd(loss), lambda: (mlp_params(), _x(), jax.random.split(jax.random.key(5), B))


@case("batch_tuple_with_a_table", expect_split=True)
def _():
  def loss(p, batch):
    x, y, table = batch
    return optax.softmax_cross_entropy_with_integer_labels(mlp(p, x) @ table, y).mean()
  return sgd(loss), lambda: (mlp_params(), (_x(), _labels(), _normal(46, (C, C), 1.0)))


@case("apply_fn_as_an_argument", expect_split=True)
def _():
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(C)(nn.tanh(nn.Dense(H)(x)))
  model = Net()

  def step(params, x, y):
    def loss_fn(p, apply_fn, x, y):
      return optax.softmax_cross_entropy_with_integer_labels(apply_fn(p, x), y).mean()
    loss, g = jax.value_and_grad(loss_fn)(params, model.apply, x, y)
    return jax.tree.map(lambda a, b: a - 0.1 * b, params, g), {"loss": loss}
  return step, lambda: (model.init(jax.random.key(0), _x()), _x(), _labels())


@case("time_major_sequence_outnumbers_the_batch", expect_split=True)
def _():
  def loss(p, xs, mask, y):
    def cell(h, x):
      return jnp.tanh(x @ p["w1"] + h @ p["wh"]), None
    h, _ = jax.lax.scan(cell, jnp.zeros((xs.shape[1], H)), xs * mask[..., None])
    return optax.softmax_cross_entropy_with_integer_labels(h @ p["w2"], y).mean()
  T = 2 * B  # the sequence's axis is the commonest first axis: [T, B, D], [T, B] beside [B]
  return sgd(loss), lambda: ({**mlp_params(), "wh": _normal(54, (H, H), 0.05)},
                             _normal(47, (T, B, D), 1.0),
                             (jax.random.uniform(jax.random.key(48), (T, B)) > 0.2)
                             .astype(jnp.float32), _labels())


@case("ctc_loss", expect_split=True)
def _():
  T, K = 10, 5

  def loss(p, x, labels, logit_pad, label_pad):
    logits = jnp.tanh(x @ p["w1"]) @ p["out"]
    return optax.ctc_loss(logits, logit_pad, labels, label_pad).mean()
  return sgd(loss), lambda: (
      {**mlp_params(), "out": _normal(49, (H, K))}, _normal(50, (B, T, D), 1.0),
      jax.random.randint(jax.random.key(51), (B, 4), 1, K),
      (jnp.arange(T)[None] >= jax.random.randint(jax.random.key(52), (B, 1), 6, T + 1))
      .astype(jnp.float32), jnp.zeros((B, 4)))


@case("write_beside_the_batch_axis", expect_split=True)
def _():
  def loss(p, x, y):
    h = jnp.tanh(x @ p["w1"]).at[:, 0].set(1.0).at[:, 1].add(x[:, 0])
    return optax.softmax_cross_entropy_with_integer_labels(h @ p["w2"], y).mean()
  return sgd(loss), _xy


@case("per_example_triangular_solve", expect_split=True)
def _():
  def loss(p, x, y):
    a = jnp.eye(3) + 0.1 * jnp.tril(jnp.einsum("bi,bj->bij", x[:, :3], x[:, :3]))
    h = jax.scipy.linalg.solve_triangular(a, jnp.tanh(x @ p["w1"])[:, :3, None], lower=True)
    return jnp.mean(h ** 2)
  return sgd(loss), _xy


@case("cond_on_the_optimizer_step", expect_split=True)
def _():
  def step(state, x, y):
    params, count = state

    def loss(p, x, y, count):
      ce = optax.softmax_cross_entropy_with_integer_labels(mlp(p, x), y).mean()
      return jax.lax.cond(count > 1, lambda: ce, lambda: 2.0 * ce)
    l, g = jax.value_and_grad(loss)(params, x, y, count)
    return (jax.tree.map(lambda a, b: a - 0.1 * b, params, g), count + 1), {"loss": l}
  return step, lambda: ((mlp_params(), jnp.int32(0)), _x(), _labels())


@case("log_probs_of_actions_by_arange", expect_split=True)
def _():
  def loss(p, obs, actions, returns):
    logp = jax.nn.log_softmax(mlp(p, obs))
    chosen = logp[jnp.arange(obs.shape[0]), actions]  # each example its own row
    return -jnp.mean(chosen * returns)
  return sgd(loss), lambda: (mlp_params(), _x(), _labels(), _normal(55, (B,), 1.0))


@case("rows_shifted_by_one", expect_split=False)
def _():
  def loss(p, x, y):  # each example reads its neighbour's row: examples interact
    logp = jax.nn.log_softmax(mlp(p, x))
    return -jnp.mean(logp[(jnp.arange(x.shape[0]) + 1) % x.shape[0], y])
  return sgd(loss), _xy


# ------------------------------------------------------------- examples that interact: refused
@case("softmax_over_the_batch", expect_split=True)
def _():
  # exact in stages: the maximum over the batch (under log_softmax's stop_gradient), the log
  # of the sum of exponentials that reads it, then the mean that reads both (was refused)
  return sgd(lambda p, x, y: -jnp.mean(jax.nn.log_softmax(mlp(p, x)[:, 0]))), _xy


@case("pairwise_example_distances", expect_split=False)
def _():
  def loss(p, x, y):
    e = mlp(p, x)
    d = jnp.sum((e[:, None] - e[None]) ** 2, -1)
    return jnp.mean(jnp.exp(-d))
  return sgd(loss), _xy


@case("batch_hard_triplets", expect_split=False)
def _():
  def loss(p, x, y):
    e = mlp(p, x)
    d = jnp.sqrt(jnp.sum((e[:, None] - e[None]) ** 2, -1) + 1e-9)
    same = y[:, None] == y[None]
    hardest_pos = jnp.max(jnp.where(same, d, 0.0), -1)
    hardest_neg = jnp.min(jnp.where(same, 1e9, d), -1)
    return jnp.mean(jax.nn.relu(hardest_pos - hardest_neg + 0.2))
  return sgd(loss), _xy


@case("capacity_routing_by_cumsum", expect_split=False)
def _():
  E, CAP = 4, B // 4 + 2

  def loss(p, x, y):
    expert = jnp.argmax(x @ p["router"], -1)
    onehot = jax.nn.one_hot(expert, E)
    slot = jnp.cumsum(onehot, axis=0) * onehot  # position in its expert's queue, batch-wide
    kept = jnp.sum(jnp.where(slot <= CAP, onehot, 0.0), -1)
    return jnp.mean(jnp.sum(mlp(p, x) ** 2, -1) * kept * jax.nn.softmax(x @ p["router"])[:, 0])
  return sgd(loss), lambda: ({**mlp_params(), "router": _normal(53, (D, E))}, _x(), _labels())


@case("linen_batchnorm_in_train_mode", expect_split=False)
def _():
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(C)(nn.BatchNorm(use_running_average=False)(nn.Dense(H)(x)))
  model = Net()

  def step(variables, x, y):
    def loss(params):
      logits, upd = model.apply({"params": params, "batch_stats": variables["batch_stats"]},
                                x, mutable=["batch_stats"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), upd
    (l, upd), g = jax.value_and_grad(loss, has_aux=True)(variables["params"])
    params = jax.tree.map(lambda a, b: a - 0.1 * b, variables["params"], g)
    return {"params": params, "batch_stats": upd["batch_stats"]}, {"loss": l}
  return step, lambda: (model.init(jax.random.key(0), _x()), _x(), _labels())



# ------------------------------------------- where the batch is: later axes and segments
# (outside reading 3: steps written after the rules, by a hand that had not read them)
@case("features_first_batch_on_last_axis", expect_split=True)
def _():
  def loss(p, xt, yt):  # xt [D, B], yt [C, B]: no first axis is the batch's
    h = jnp.tanh(p["w1"].T @ xt + p["b1"][:, None])
    return jnp.mean(jnp.sum((p["w2"].T @ h - yt) ** 2, axis=0))
  return sgd(loss), lambda: (mlp_params(), _x(40, (D, B)), _normal(41, (C, B), 1.0))


def _pair_distance(e, a, b):
  return jnp.sqrt(jnp.sum((e[a] - e[b]) ** 2, axis=-1) + 1e-6)


@case("pairs_stored_as_halves", expect_split=True)
def _():
  def loss(p, pairs, same):  # pairs [2B, D]: rows i and B + i form pair i
    e = mlp(p, pairs)
    n = e.shape[0] // 2
    d = _pair_distance(e, slice(None, n), slice(n, None))
    return jnp.mean(same * d ** 2 + (1 - same) * jnp.maximum(1.0 - d, 0.0) ** 2)
  return sgd(loss), lambda: (mlp_params(), _x(42, (2 * B, D)),
                             jax.random.bernoulli(jax.random.key(43), 0.5, (B,)).astype(jnp.float32))


@case("triplets_stored_as_thirds", expect_split=True)
def _():
  def loss(p, triplets, w):  # triplets [3B, D]: anchor, positive, negative, in thirds
    a, pos, neg = jnp.split(mlp(p, triplets), 3)
    return jnp.mean(w * jax.nn.relu(jnp.sum((a - pos) ** 2, -1) - jnp.sum((a - neg) ** 2, -1) + 1))
  return sgd(loss), lambda: (mlp_params(), _x(44, (3 * B, D)), _normal(45, (B,), 1.0) ** 2)


@case("halves_paired_in_reverse", expect_split=False)
def _():
  def loss(p, pairs, same):  # pair i is rows i and 2B - 1 - i: examples meet across the split
    e = mlp(p, pairs)
    n = e.shape[0] // 2
    d = jnp.sum((e[:n] - e[n:][::-1]) ** 2, axis=-1)
    return jnp.mean(same * d)
  return sgd(loss), lambda: (mlp_params(), _x(46, (2 * B, D)), _normal(47, (B,), 1.0))


@case("halves_paired_by_stride", expect_split=None)
def _():
  def loss(p, pairs, same):  # pair i is rows 2i and 2i + 1 (examples major): either reading
    e = mlp(p, pairs)
    return jnp.mean(same * jnp.sum((e[0::2] - e[1::2]) ** 2, axis=-1))
  return sgd(loss), lambda: (mlp_params(), _x(48, (2 * B, D)), _normal(49, (B,), 1.0))


@case("recurrence_across_the_flattened_batch", expect_split=False)
def _():
  def loss(p, x, y):  # one hidden state runs through every example in turn
    def cell(h, xi):
      h = jnp.tanh(h @ p["w1"][:, :D] + xi)
      return h, h @ p["w2"][:D]
    _, logits = jax.lax.scan(cell, jnp.zeros(D), x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  return sgd(loss), _xy


# ----------------------------------------------------- while loops over per-example values
def _bisect_threshold(z, stop):
  """Sparsemax's threshold by bisection, row by row, under a `while_loop`."""
  def body(c):
    lo, hi, i = c
    mid = 0.5 * (lo + hi)
    over = jnp.sum(jnp.maximum(z - mid[:, None], 0.0), axis=-1) > 1
    return jnp.where(over, mid, lo), jnp.where(over, hi, mid), i + 1
  lo, hi, _ = jax.lax.while_loop(lambda c: stop(c), body,
                                 (jnp.max(z, -1) - 1.0, jnp.max(z, -1), jnp.int32(0)))
  return 0.5 * (lo + hi)


def _sparsemax_loss(stop):
  def loss(p, x, y):
    z = mlp(p, x)
    tau = jax.lax.stop_gradient(_bisect_threshold(jax.lax.stop_gradient(z), stop))
    probs = jnp.maximum(z - tau[:, None], 0.0)
    return jnp.mean(jnp.sum((probs - jax.nn.one_hot(y, C)) ** 2, axis=-1))
  return loss


@case("while_loop_bisection_per_row_counted", expect_split=True)
def _():
  return sgd(_sparsemax_loss(lambda c: c[2] < 30)), _xy


@case("while_loop_bisection_stops_on_the_batch", expect_split=False)
def _():  # stops when every row is within 1e-3: the count depends on the whole batch
  return sgd(_sparsemax_loss(lambda c: (c[2] < 60) & (jnp.max(c[1] - c[0]) > 1e-3))), _xy


@case("while_loop_carry_rolled_across_examples", expect_split=False)
def _():
  def loss(p, x, y):
    z = jax.lax.stop_gradient(mlp(p, x))
    smooth = jax.lax.while_loop(lambda c: c[1] < 3,
                                lambda c: (0.5 * (c[0] + jnp.roll(c[0], 1, 0)), c[1] + 1),
                                (z, 0))[0]
    return optax.softmax_cross_entropy_with_integer_labels(mlp(p, x) + smooth, y).mean()
  return sgd(loss), _xy


# ------------------------------------------- conds on the step's own values (not the batch)
def _mse_or_l1(p, x, y, pick):
  d = mlp(p, x) - jax.nn.one_hot(y, C)
  return pick(lambda: jnp.mean(jnp.abs(d)), lambda: jnp.mean(d ** 2))


@case("cond_on_the_step_counter", expect_split=True)
def _():
  def loss(p, x, y, count):  # every third step an L1 loss (a warm-up trick)
    return _mse_or_l1(p, x, y, lambda l1, mse: jax.lax.cond(count % 3 == 0, l1, mse))
  return sgd(loss), lambda: (*_xy(), jnp.int32(3))


@case("switch_on_a_config_flag_and_cond_on_the_step", expect_split=True)
def _():
  def loss(p, x, y, kind, count):
    d = mlp(p, x) - jax.nn.one_hot(y, C)
    main = jax.lax.switch(kind, [lambda d: jnp.mean(d ** 2),
                                 lambda d: jnp.mean(optax.huber_loss(d, delta=0.5)),
                                 lambda d: jnp.mean(jnp.log(jnp.cosh(d)))], d)
    extra = jax.lax.cond(count % 2 == 0, lambda: jnp.mean(jnp.abs(d)), lambda: 0.0 * d.sum())
    return main + 0.1 * extra
  return sgd(loss), lambda: (*_xy(), jnp.int32(1), jnp.int32(4))


@case("cond_whose_untaken_branch_is_nan", expect_split=True)
def _():  # jax.jit never runs the log branch: a split that evaluated both would give NaN
  def loss(p, x, y, flag):
    z = mlp(p, x)
    return jax.lax.cond(flag > 0, lambda: jnp.mean(jnp.log(z - 100.0)),
                        lambda: optax.softmax_cross_entropy_with_integer_labels(z, y).mean())
  return sgd(loss), lambda: (*_xy(), jnp.int32(0))


@case("cond_on_a_parameter", expect_split=True)
def _():  # the parameters are the same for every microbatch: the branch too (no gradient
  # flows through a cond's index)
  def loss(p, x, y):
    return _mse_or_l1(p, x, y, lambda l1, mse: jax.lax.cond(p["b1"].sum() > 0, l1, mse))
  return sgd(loss), _xy


@case("cond_on_the_batch_mean", expect_split=False)
def _():  # the branch depends on the batch: a microbatch could choose the other
  def loss(p, x, y):
    return _mse_or_l1(p, x, y, lambda l1, mse: jax.lax.cond(jnp.mean(x) > 0, l1, mse))
  return sgd(loss), _xy


_jitted_pick = jax.jit(lambda count, d: jax.lax.cond(count % 2 == 0, lambda: jnp.mean(jnp.abs(d)),
                                                      lambda: jnp.mean(d ** 2)))


@case("cond_on_the_step_inside_a_jitted_helper", expect_split=None)
def _():  # the helper's trace is cached by jax: split only where the guard can follow it
  def loss(p, x, y, count):
    return _jitted_pick(count, mlp(p, x) - jax.nn.one_hot(y, C))
  return sgd(loss), lambda: (*_xy(), jnp.int32(2))


# ------------------------------------- a table riding in the batch's dict, as long as it
@case("codebook_in_the_batch_dict_as_long_as_the_batch", expect_split=True)
def _():  # VQ: every example's nearest code, from a codebook of B entries beside the data
  def loss(p, batch):
    z = mlp(p, batch["x"])
    d = jnp.sum((z[:, None, :] - batch["codebook"][None, :, :]) ** 2, axis=-1)
    q = batch["codebook"][jnp.argmin(d, axis=1)]
    return jnp.mean(jnp.sum((z - jax.lax.stop_gradient(q)) ** 2, axis=-1))
  return sgd(loss), lambda: (mlp_params(), {"x": _x(), "codebook": _normal(50, (B, C), 1.0)})


@case("class_weights_as_long_as_the_batch_indexed_by_label", expect_split=True)
def _():  # a per-class weight table of B classes, read at each example's label
  def loss(p, x, y, class_weight):
    ce = optax.softmax_cross_entropy_with_integer_labels(mlp(p, x), y % C)
    return jnp.mean(class_weight[y] * ce)
  return sgd(loss), lambda: (mlp_params(), _x(), jax.random.randint(jax.random.key(51), (B,), 0, B),
                             _normal(52, (B,), 1.0) ** 2)


_jitted_signed_mean = jax.jit(lambda d: jax.lax.cond(d.sum() > 0, lambda: jnp.mean(d), lambda: -jnp.mean(d)))


@case("cond_on_the_step_beside_a_vmapped_cond_and_a_jitted_one", expect_split=None)
def _():  # a vmapped cond binds once and leaves no cond; a cached jitted one, the reverse:
  # the guard must not take one cond for another when it traces the loss again
  def loss(p, x, y, count):
    z = mlp(p, x)
    flipped = jax.vmap(lambda zi: jax.lax.cond(zi.sum() > 0, lambda: zi, lambda: -zi))(z)
    d = flipped - jax.nn.one_hot(y, C)
    main = jax.lax.cond(count % 2 == 0, lambda: jnp.mean(d ** 2), lambda: jnp.mean(jnp.abs(d)))
    return main + 0.1 * _jitted_signed_mean(jax.lax.stop_gradient(d))
  return sgd(loss), lambda: (*_xy(), jnp.int32(2))

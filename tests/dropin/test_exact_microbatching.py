"""Issue #9: microbatching is exact for token-weighted LM losses; aux, keys, kwargs, nnx."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hbm_guard
from hbm_guard._src.backends import compile as C
from hbm_guard._src.plans import plan as plan_lib
from hbm_guard._src.plans import rungs as rungs_lib
from tests.helpers import side_by_side

VOCAB, SEQ, BATCH, WIDTH = 64, 16, 16, 32


def _lm_params(key):
  k = jax.random.split(key, 4)
  n = lambda k, s: jax.random.normal(k, s) * 0.1  # noqa: E731
  return {"embed": n(k[0], (VOCAB, WIDTH)), "qkv": n(k[1], (WIDTH, 3 * WIDTH)),
          "mlp": n(k[2], (WIDTH, WIDTH)), "out": n(k[3], (WIDTH, VOCAB))}


def _logits(p, tokens):
  """A one-block causal transformer LM."""
  h = p["embed"][tokens]
  q, k, v = jnp.split(h @ p["qkv"], 3, axis=-1)
  att = jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(WIDTH)
  att = jnp.where(jnp.tril(jnp.ones((SEQ, SEQ), bool)), att, -1e9)
  h = h + jnp.einsum("bts,bsd->btd", jax.nn.softmax(att), v)
  h = h + jnp.tanh(h @ p["mlp"])
  return h @ p["out"]


def _token_losses(p, batch):
  logits = _logits(p, batch["inputs"])
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  return losses, batch["weights"], logits


def weighted_sums(p, batch):  # the exact form: (sum of losses, sum of weights)
  losses, w, logits = _token_losses(p, batch)
  return (jnp.sum(losses * w), jnp.sum(w)), logits


def weighted_mean(p, batch):  # what Flax's lm1b and MaxText write: not exact when split
  losses, w, logits = _token_losses(p, batch)
  return jnp.sum(losses * w) / jnp.sum(w), logits


def _padded_batch(seed=0):
  """Rows padded to different lengths (weights 0 on padding), random 0 tokens inside."""
  k1, k2 = jax.random.split(jax.random.key(seed))
  tokens = jax.random.randint(k1, (BATCH, SEQ + 1), 0, VOCAB)
  lengths = jax.random.randint(k2, (BATCH,), 2, SEQ + 1)
  weights = (jnp.arange(SEQ)[None, :] < lengths[:, None]).astype(jnp.float32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": weights}


def _sgd_steps(loss, weighted, k, steps=3, lr=0.5):
  vg = hbm_guard.value_and_grad(loss, batch_argnums=1, has_aux=True, weighted=weighted)

  def step(p, batch):
    (value, logits), g = vg(p, batch)
    return jax.tree.map(lambda a, b: a - lr * b, p, g), value, logits

  with plan_lib.plan_scope(hbm_guard.Plan(microbatches=k)):
    run = jax.jit(lambda *a: step(*a)).lower(_lm_params(jax.random.key(0)),
                                            _padded_batch()).compile()
  p = _lm_params(jax.random.key(0))
  out = []
  for i in range(steps):
    new, value, logits = run(p, _padded_batch(i))
    out.append((jax.tree.map(lambda a, b: a - b, new, p), value, logits))
    p = new
  return out


def _rel(a, b):
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.mark.parametrize("k", [2, 4, 8])
def test_weighted_lm_loss_is_exact_however_the_batch_is_split(k):
  whole, split = _sgd_steps(weighted_sums, True, 1), _sgd_steps(weighted_sums, True, k)
  for (du, lu, xu), (ds, ls, xs) in zip(whole, split):
    assert abs(float(ls) - float(lu)) <= 1e-5 * abs(float(lu))
    for name in du:
      assert _rel(ds[name], du[name]) <= 1e-5, name  # the parameter update
    assert xs.shape == xu.shape == (BATCH, SEQ, VOCAB)  # logits of the global batch
    np.testing.assert_allclose(xs, xu, rtol=1e-5, atol=1e-5)


def test_weighted_mean_inside_the_loss_is_not_exact_and_the_step_says_so():
  whole, split = _sgd_steps(weighted_mean, False, 1), _sgd_steps(weighted_mean, False, 4)
  assert max(_rel(split[0][0][n], whole[0][0][n]) for n in whole[0][0]) > 1e-3
  with plan_lib.plan_scope(hbm_guard.Plan()) as scope:
    jax.jit(lambda p, b: hbm_guard.value_and_grad(weighted_mean, batch_argnums=1,
                                                  has_aux=True)(p, b)).trace(
        _lm_params(jax.random.key(0)), _padded_batch())
  assert scope.facts["loss_form"] == "mean"


def test_each_microbatch_gets_its_own_key():
  def noisy(w, x, key):
    noise = jax.random.normal(key, x.shape)
    return jnp.mean((x + noise) * w), noise

  vg = hbm_guard.value_and_grad(noisy, batch_argnums=1, has_aux=True, rng_argnums=2)
  x = jnp.ones((8, 4))
  with plan_lib.plan_scope(hbm_guard.Plan(microbatches=2)):
    (_, noise), _ = jax.jit(lambda *a: vg(*a))(jnp.float32(1.0), x, jax.random.key(0))
  assert noise.shape == (8, 4)
  assert not np.allclose(noise[:4], noise[4:])  # not the same draw repeated


def test_keyword_batch_arguments_and_other_keywords_pass_through():
  def loss(w, *, batch, scale):
    return jnp.mean((batch @ w) * scale)

  vg = hbm_guard.value_and_grad(loss, batch_argnames=("batch",))
  w, x = jnp.ones((4, 2)), jax.random.normal(jax.random.key(1), (8, 4))
  want = jax.value_and_grad(loss)(w, batch=x, scale=3.0)
  with plan_lib.plan_scope(hbm_guard.Plan(microbatches=4)) as scope:
    got = jax.jit(lambda w, x: vg(w, batch=x, scale=3.0))(w, x)
  assert scope.facts["batch_size"] == 8
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
  np.testing.assert_allclose(got[1], want[1], rtol=1e-6)


def test_batch_arguments_must_be_named():
  with pytest.raises(TypeError, match="batch_argnums"):
    hbm_guard.value_and_grad(lambda w, x: (w * x).sum())


def test_nnx_model_and_optimizer_climb_to_microbatching(tmp_path):
  from flax import nnx
  from hbm_guard.integrations import flax as hg_flax

  class MLP(nnx.Module):
    def __init__(self, rngs):
      self.layers = nnx.List([nnx.Linear(256, 256, rngs=rngs) for _ in range(3)])

    def __call__(self, x):
      block = hg_flax.remat(lambda layer, h: jnp.tanh(layer(h)))
      for layer in self.layers:
        x = block(layer, x)
      return x

  def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

  model = MLP(nnx.Rngs(0))
  # SGD with momentum: Adam turns the rounding noise of near-zero gradients (2 of 65536
  # elements here) into learning-rate-sized steps, hiding what this test checks.
  tx = optax.sgd(0.05, momentum=0.9)
  graphdef, state = nnx.split((model, nnx.Optimizer(model, tx, wrt=nnx.Param)))
  step = hg_flax.nnx_train_step(loss_fn, graphdef)
  batch = {"x": jax.random.normal(jax.random.key(0), (1024, 256)),
           "y": jax.random.normal(jax.random.key(1), (1024, 256))}

  def peak(plan):
    with plan_lib.plan_scope(plan):
      return C.memory_of(jax.jit(lambda *a: step(*a), donate_argnums=0)
                         .lower(state, batch).compile())
  capacity = peak(hbm_guard.Plan(microbatches=8))["peak"] + (64 << 10)
  ladder = [{"name": "donate", "kind": "donate", "class": "exact"},
            {"name": "microbatch", "kind": "microbatch", "class": "numerics"},
            {"name": "offload_optimizer", "kind": "offload", "class": "exact"}]
  guarded = hbm_guard.guarded_jit(step, state_argnums=0, capacity=capacity, ladder=ladder,
                                  max_class="numerics", report_dir=str(tmp_path))
  s_guard, s_plain = side_by_side.train_side_by_side(step, guarded, state, batch, steps=10)
  assert guarded.plan.microbatches > 1 and 0 in guarded.plan.donate_argnums, guarded.attempts
  skipped = {s.rung: s.kind for a in guarded.attempts for s in a.skipped}
  assert skipped.get("offload_optimizer") in (None, rungs_lib.SkipKind.NOT_APPLICABLE)  # CPU: host
  assert guarded.attempts[-1].memory["peak"] <= capacity
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               s_guard, s_plain)

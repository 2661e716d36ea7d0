"""Every refusal reaches the user; several gradients in one step are each analysed; a bug
in the guard's own analysis is said to be one (and fails the tests).

The whole-batch analysis can say "(exact)" and a microbatch program, traced only once the
search prices a microbatch plan, still refuse (the batch's size used as a number in work on
the parameters): that refusal must reach the report, the attempt that priced it, the page
and the error, with its primitive and source line, not only a "no plan fits".
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

import hbm_guard
from hbm_guard._src.backends import compile as compile_lib
from hbm_guard._src.backends import options as options_lib
from hbm_guard._src.backends import steps as steps_lib
from hbm_guard._src.cli import report_html
from hbm_guard._src.dropin import intercept
from hbm_guard._src.dropin import microbatch
from hbm_guard._src.plans import plan as plan_lib

B, D, H = 256, 32, 512


def _params():
  k1, k2 = jax.random.split(jax.random.key(0))
  return {"w1": jax.random.normal(k1, (D, H)) * 0.1, "w2": jax.random.normal(k2, (H, 4)) * 0.1}


def _batch():
  return jax.random.normal(jax.random.key(1), (B, D))


def _per_example(p, x):
  return jnp.sum((jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2, -1)


def _sgd(loss_fn):
  def step(p, x):
    loss, g = jax.value_and_grad(loss_fn)(p, x)
    return jax.tree.map(lambda a, b: a - 0.01 * b, p, g), loss
  return step


def _divided_per_example(p, x):
  return jnp.sum(_per_example(p, x) / x.shape[0])  # the batch's size in per-example work


def _peak(step, *args) -> int:
  compiled = jax.jit(step, donate_argnums=0).lower(*args).compile()
  return compile_lib.memory_of(compiled)["peak"]


def test_a_refusal_only_a_microbatch_program_meets_reaches_the_report_page_and_error(tmp_path):
  step = _sgd(_divided_per_example)
  p, x = _params(), _batch()
  g = hbm_guard.guarded_jit(step, state_argnums=0, capacity=int(_peak(step, p, x) * 0.4),
                            max_class="numerics", plan_cache=False, report_dir=str(tmp_path))
  with pytest.raises(hbm_guard.LadderExhaustedError) as raised:
    g(p, x)
  message = str(raised.value)
  assert "The batch was not split" in message and "uses the batch size as a number" in message
  assert "test_drop_in_refusals.py" in message  # the user's source line
  report = json.loads(open(g.report_path, encoding="utf-8").read())
  (refused,) = report["refused"]
  assert "`div`" in refused["why"] and "microbatch" in refused["plan"]
  assert any("uses the batch size" in r for a in report["attempts"] for r in a["refused"])
  page = report_html.render(report)
  assert "The batch was not split" in page and "uses the batch size as a number" in page


def _two_gradients(first_refused: bool):
  """A step with two gradients, one that splits and one that is refused (a maximum over
  the batch that the gradient flows through), in either order."""
  def split_loss(p, x):
    return jnp.mean(_per_example(p, x))

  def refused_loss(p, x):
    per = _per_example(p, x)
    return jnp.mean(per - jnp.max(per))

  def step(p, x):
    losses = (refused_loss, split_loss) if first_refused else (split_loss, refused_loss)
    out = []
    for fn in losses:
      loss, g = jax.value_and_grad(fn)(p, x)
      p = jax.tree.map(lambda a, b: a - 0.01 * b, p, g)
      out.append(loss)
    return p, out
  return step


@pytest.mark.parametrize("first_refused", [False, True])
def test_several_gradients_are_each_reported_whatever_their_order(first_refused):
  step = _two_gradients(first_refused)
  p, x = _params(), _batch()
  facts: dict = {}
  jitted = steps_lib.StepBuilder(step, options_lib.make(state_argnums=0)).jit(
      plan_lib.Plan(microbatches=4), None, 2, None, facts)
  got = jitted(p, x)
  (fact,) = facts.values()
  assert fact.auto_refused is None  # one gradient splits: the rung is offered
  described = fact.auto.split(" | ")
  assert len(described) == 2
  assert ["not split" in d for d in described] == ([True, False] if first_refused
                                                   else [False, True])
  refused = next(d for d in described if "not split" in d)
  assert "reads a maximum or minimum over the batch" in refused, refused
  assert "` at " in refused and "test_drop_in_refusals.py" in refused  # primitive and line
  want = jax.jit(step)(p, x)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert jnp.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_several_gradients_all_refused_block_the_rung_and_say_each():
  def refused_loss(p, x):
    per = _per_example(p, x)
    return jnp.mean(per - jnp.max(per))

  def step(p, x):
    l1, g1 = jax.value_and_grad(refused_loss)(p, x)
    l2, g2 = jax.value_and_grad(_divided_per_example)(p, x)
    return jax.tree.map(lambda a, b, c: a - 0.01 * (b + c), p, g1, g2), (l1, l2)
  facts: dict = {}
  steps_lib.StepBuilder(step, options_lib.make(state_argnums=0)).jit(
      plan_lib.Plan(microbatches=4), None, 2, None, facts).trace(_params(), _batch())
  (fact,) = facts.values()
  assert "refused_loss (the gradient at " in fact.auto_refused
  assert "_divided_per_example (the gradient at " in fact.auto_refused
  assert fact.auto_refused.count("test_drop_in_refusals.py") >= 2  # each call's line


def test_a_bug_in_the_rewrite_is_said_to_be_one(monkeypatch):
  """Users get jax's own gradient and a refusal that asks for a report; the tests (which
  set HBM_GUARD_RAISE_INTERNAL=1) fail on it instead."""
  def broken(*args, **kwargs):
    raise RuntimeError("a rewrite defect")
  monkeypatch.setattr(microbatch, "microbatched", broken)
  step = _sgd(lambda p, x: jnp.mean(_per_example(p, x)))
  p, x = _params(), _batch()

  def traced():
    facts: dict = {}
    out = steps_lib.StepBuilder(step, options_lib.make(state_argnums=0)).jit(
        plan_lib.Plan(microbatches=4), None, 2, None, facts)(p, x)
    return out, next(iter(facts.values()))

  assert intercept.RAISE_INTERNAL  # (conftest)
  with pytest.raises(RuntimeError, match="a rewrite defect"):
    traced()
  monkeypatch.setattr(intercept, "RAISE_INTERNAL", False)
  out, fact = traced()
  assert intercept.INTERNAL_ERROR in fact.auto_refused and "Please report it" in fact.auto_refused
  want = jax.jit(step)(p, x)
  assert jnp.allclose(out[1], want[1])

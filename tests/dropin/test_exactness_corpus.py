"""The drop-in against jax.jit on the corpus of steps people write: exact or refused.

Each step trains 3 steps under the guard and under jax.jit from the same state. Where the
guard says it split the batch, the two agree within 1e-5; where it refused, it runs jax's
own gradient; far above capacity it is jax.jit's step, bit for bit; and it never crashes
where jax.jit does not.
"""

import numpy as np
import pytest

from hbm_guard._src.dropin import intercept
from hbm_guard._src.plans import plan as plan_lib
from hbm_guard._src.record import errors
from tests.exactness import corpus
from tests.exactness import harness

_BY_NAME = {c.name: c for c in corpus.CASES}
_IDS = sorted(_BY_NAME)
_SPLITTABLE = [n for n in _IDS if _BY_NAME[n].expect_split is not False]


def test_the_corpus_has_the_kinds_the_issue_names():
  assert len(corpus.CASES) >= 60
  for name in ("custom_vjp_clip_gradient", "write_at_batch_positions", "dropout_key_argument",
               "argnums_negative", "dqn_target_network_shared", "gan_two_gradients",
               "wgan_gradient_penalty", "maml_inner_step", "ppo_advantage_normalisation",
               "clip_contrastive", "dp_sgd_per_example_clipping", "packed_segments",
               "nnx_dropout_batchnorm", "multi_steps", "apply_if_finite"):
    assert name in _BY_NAME


@pytest.mark.parametrize("k", [4, "one example each"])
@pytest.mark.parametrize("name", _IDS)
def test_a_pinned_microbatch_plan_trains_like_jax_jit_or_is_refused(name, k):
  """At 4 microbatches, and at one example per microbatch (where a value as long as the
  batch broadcasts against the microbatch instead of failing to)."""
  case = _BY_NAME[name]
  if k != 4:
    k = harness.batch_size(case)
  try:
    out = harness.under_plan(case, plan_lib.Plan(microbatches=k))
  except errors.UnevenMicrobatchError:
    assert name == "prime_batch"  # the climb then picks a count that divides
    return
  if case.expect_split is not None and k == 4:
    assert out.split == case.expect_split, out.auto
  if case.expect_split is False:
    assert not out.split, out.auto
  if not out.split:
    assert out.refused, f"not split and no reason given: {out.auto}"
  if case.stochastic and out.split:
    return  # each microbatch draws its own numbers: see the test below
  assert not out.different, (out.distance, out.distance64, out.auto)


@pytest.mark.parametrize("name", ["dropout_key_argument", "dropout_raw_key_argument"])
def test_a_key_passed_to_the_loss_is_folded_per_microbatch(name):
  """Before, a key argument was not folded: 256 distinct masks for 1024 examples."""
  case = _BY_NAME[name]
  state, *args = case.make()
  from hbm_guard._src.backends import options as options_lib  # pylint: disable=import-outside-toplevel
  from hbm_guard._src.backends import steps as steps_lib  # pylint: disable=import-outside-toplevel
  facts: dict = {}
  jitted = steps_lib.StepBuilder(case.step, options_lib.make(state_argnums=0)).jit(
      plan_lib.Plan(microbatches=4), None, 1 + len(args), None, facts)
  _, metrics = jitted(state, *args)
  (fact,) = facts.values()
  assert fact.auto_refused is None and "(exact)" in fact.auto
  keep = np.asarray(metrics["keep"])
  # microbatch i holds examples i, i+4, ...: its rows must not repeat another's
  rows = {keep[i::4].tobytes() for i in range(4)}
  assert len(rows) == 4


# Steps whose peak is mostly not activations: no split reaches half of it.
_SMALL_ACTIVATIONS = frozenset({"gan_two_gradients", "minibatches_scanned_by_the_step"})


@pytest.mark.parametrize("fraction", [0.5, 0.3])
@pytest.mark.parametrize("name", _SPLITTABLE)  # the refused ones: the pinned test
def test_under_a_capacity_the_fitted_step_trains_like_jax_jit(name, fraction, tmp_path):
  case = _BY_NAME[name]
  capacity = int(harness.donated_peak(case) * fraction)
  fitted = harness.under_capacity(case, capacity, str(tmp_path))
  assert not any(intercept.INTERNAL_ERROR in r for r in fitted.refused), fitted.refused
  if fitted.plan is None and fitted.refused:  # said where the user reads it
    assert all(r[:60] in fitted.error for r in fitted.refused[:2]), fitted.error
  if case.expect_split and fraction == 0.5 and name not in _SMALL_ACTIVATIONS:
    assert fitted.plan is not None and fitted.plan.microbatches > 1  # not a vacuous pass
  if fitted.plan is None or case.stochastic and fitted.plan.microbatches > 1:
    return  # no plan fits (said so), or a split that draws its own random numbers
  if fitted.distance > harness.RTOL:  # rounding or a difference: told apart in float64
    pinned = harness.under_plan(case, fitted.plan)
    assert pinned.split and not pinned.different, (fitted.plan, fitted.distance,
                                                   pinned.distance64, fitted.auto)


@pytest.mark.parametrize("name", _IDS)
def test_far_above_capacity_the_guarded_step_is_jax_jit_bit_for_bit(name, tmp_path):
  case = _BY_NAME[name]
  fitted = harness.under_capacity(case, 1 << 34, str(tmp_path))
  assert fitted.plan == plan_lib.Plan()
  assert fitted.distance == 0.0

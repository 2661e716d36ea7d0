"""A property-based differential fuzzer: random loss programs over a batch, split by the
drop-in under a pinned microbatch plan and run by jax.jit. Never a split that trains
differently (a difference above 1e-5 is run again in float64: rounding shrinks there, a
semantic difference does not), never a crash jax.jit does not have, never a refusal that is
the guard's own bug. Two families: maps of `[B, F]` activations (`programs`), and what
large models do to `[B, L, F]` tokens (`token_programs`: flattened token axes with
positions over them, segments, labels, checkpoints, scans, many sums, a tuple batch).
`benchmarks/bench_exactness_fuzz.py` is the long run."""

import dataclasses

import hypothesis
import pytest
from hypothesis import strategies as st

from hbm_guard._src.dropin import intercept

from tests.exactness import harness
from tests.exactness import programs
from tests.exactness import token_programs

_SETTINGS = dict(deadline=None, derandomize=True,
                 suppress_health_check=[hypothesis.HealthCheck.too_slow])
_OPS = st.lists(st.sampled_from(sorted(programs.OPS)), max_size=4).map(tuple)
_PROGRAMS = st.builds(programs.Program, _OPS, st.sampled_from(sorted(programs.REDUCTIONS)),
                      st.sampled_from((2, 4, 8)))
_COND_PROGRAMS = st.builds(programs.Program, _OPS, st.sampled_from(sorted(programs.REDUCTIONS)),
                           st.sampled_from((2, 4, 8)), _OPS,
                           st.sampled_from(sorted(programs.CHOOSERS)))
_TOKEN_OPS = st.lists(st.sampled_from(sorted(token_programs.OPS)), max_size=3).map(tuple)
_TOKEN_PROGRAMS = st.builds(token_programs.TokenProgram, _TOKEN_OPS,
                            st.sampled_from(sorted(token_programs.REDUCTIONS)),
                            st.sampled_from((2, 4, 8)), st.booleans(), st.booleans(),
                            st.booleans())


def _holds(verdict: programs.Verdict) -> None:
  assert verdict.error is None, (verdict.program, verdict.error)
  assert not verdict.silently_different, (verdict.program, verdict.distance,
                                          verdict.distance64)
  assert not verdict.internal_error, (verdict.program, verdict.refused)


@hypothesis.settings(max_examples=40, **_SETTINGS)
@hypothesis.given(_PROGRAMS)
def test_a_random_loss_program_is_split_exactly_or_refused(program):
  _holds(programs.judge(program))


@hypothesis.settings(max_examples=30, **_SETTINGS)
@hypothesis.given(_COND_PROGRAMS)
def test_a_random_loss_program_with_a_cond_is_split_exactly_or_refused(program):
  """Two random branches under `lax.cond`, chosen by the parameters, a constant or the
  batch: split branch by branch only where no example chooses."""
  verdict = programs.judge(program)
  _holds(verdict)
  if program.chooser == "batch_mean":
    assert not verdict.split, program


@pytest.mark.parametrize("reduction", ["centred_variance", "correlation_with_input",
                                       "covariance_off_diagonal", "standardised_by_batch",
                                       "softmax_over_batch"])
def test_a_batch_statistic_of_the_parameters_values_splits_exactly(reduction):
  """Not a vacuous pass: a centred moment, a standardisation, a softmax over the batch
  (statistics the parameters reach, read per example, one or two stages deep) are split,
  in passes, and train as jax.jit does."""
  verdict = programs.judge(programs.Program(("tanh",), reduction, 4))
  _holds(verdict)
  assert verdict.split, verdict.refused


def test_a_cond_on_the_parameters_splits_each_branch():
  """Not a vacuous pass: two branches that split alone split under a cond."""
  for chooser in ("parameter", "constant"):
    verdict = programs.judge(programs.Program(("tanh",), "mean", 4, ("square",), chooser))
    _holds(verdict)
    assert verdict.split, (chooser, verdict.refused)


@hypothesis.settings(max_examples=30, **_SETTINGS)
@hypothesis.given(_TOKEN_PROGRAMS)
def test_a_random_token_loss_program_is_split_exactly_or_refused(program):
  _holds(programs.judge(program))


def test_every_op_alone_is_split_exactly_or_refused():
  """Each op once, so the bounded run covers all of them whatever hypothesis draws."""
  for name in sorted(programs.OPS):
    verdict = programs.judge(programs.Program((name,), "mean", 2))
    _holds(verdict)
    if name in programs.MIXING:  # none of these mixes examples in a way a split keeps
      assert not verdict.split or name in _SPLITS_EXACTLY, name


# What reads no parameter is computed once over the whole batch and split: exact.
_SPLITS_EXACTLY = frozenset({"uniform_constant", "max_batch", "position_weights",
                             "callback_weights", "while_loop_normaliser"})


def test_every_token_op_alone_is_split_exactly_or_refused():
  """Each token op once, at 4 microbatches; those that keep examples apart
  split (not a vacuous pass: the flattened positions, segments, labels, checkpoints)."""
  for name in sorted(token_programs.OPS):
    verdict = programs.judge(token_programs.TokenProgram((name,), "token_ce", 4))
    _holds(verdict)
    if name in token_programs.MIXING:
      assert not verdict.split, name
    elif name not in _TOKEN_REFUSED:
      assert verdict.split, (name, verdict.refused)


_TOKEN_REFUSED = frozenset({"batch_size_number", "divided_by_b"})  # x / n, per example


def test_token_ops_at_a_size_the_step_read_before_the_loss_split_through_the_step():
  """The batch's size read by the step, the loss closing over it: views cut at it and
  reshapes by it split (the step traced again at a microbatch); `h / b` alone splits (the
  loss alone traces, b the batch's in both), beside a reshape by b it is refused (traced
  again, b would be the microbatch's: a number in per-example work)."""
  for name in ("views_at_b", "merged_at_b", "divided_by_b"):
    verdict = programs.judge(token_programs.TokenProgram((name,), "token_ce", 4, outside=True))
    _holds(verdict)
    assert verdict.split, (name, verdict.refused)
  verdict = programs.judge(token_programs.TokenProgram(("merged_at_b", "divided_by_b"),
                                                       "token_ce", 4, outside=True))
  _holds(verdict)
  assert not verdict.split and "batch size as a number" in verdict.refused, verdict.refused


def test_every_token_reduction_splits():
  """Each is a function of batch sums (a `stop_gradient` of one carries no gradient), with
  per-example values in `has_aux`, the batch as a tuple with a table in it."""
  for name in sorted(token_programs.REDUCTIONS):
    verdict = programs.judge(token_programs.TokenProgram(("tanh",), name, 4, True, True))
    _holds(verdict)
    assert verdict.split, (name, verdict.refused)


@hypothesis.settings(max_examples=6, **_SETTINGS)
@hypothesis.given(program=_TOKEN_PROGRAMS)
def test_a_random_token_program_climbed_to_a_capacity_is_exact_and_says_its_refusals(
    program, tmp_path_factory):
  """The guarded climb itself, not a pinned plan: a refusal only a probe meets is in the
  report and the error, never the guard's own bug; what fits trains like jax.jit."""
  case = program.case()
  capacity = int(harness.donated_peak(case) * 0.4)
  fitted = harness.under_capacity(case, capacity, str(tmp_path_factory.mktemp("r")), steps=1)
  assert not any(intercept.INTERNAL_ERROR in r for r in fitted.refused), fitted.refused
  if fitted.plan is None:
    assert all(r[:60] in fitted.error for r in fitted.refused[:2]), fitted.error
  elif fitted.plan.microbatches > 1 and fitted.distance > harness.RTOL:
    verdict = programs.judge(dataclasses.replace(program, k=fitted.plan.microbatches))
    assert not verdict.silently_different, (program, fitted.plan, verdict)


def test_a_difference_in_float32_only_is_told_from_a_semantic_one():
  import numpy as np  # pylint: disable=import-outside-toplevel
  want = {"w": np.ones(4), "b": np.full(2, 1e-4)}
  def moved(tree, w=0.0, b=0.0):
    return {"w": tree["w"] + w, "b": tree["b"] + b}
  # apart in float32 and in float64 alike: a semantic difference
  assert harness.beyond_rounding(moved(want, w=0.1), want, moved(want, w=0.1), want, 1e-5) > 0
  # apart in float32 only: rounding
  assert harness.beyond_rounding(moved(want, w=0.1), want, want, want, 1e-5) == 0.0
  # a leaf rounding alone moves by a whole step (jax.jit in float32 against float64: Adam
  # normalising a gradient that is zero but for rounding): not held against the guard
  assert harness.beyond_rounding(moved(want, b=1e-3), want, moved(want, b=1e-3),
                                 moved(want, b=-1e-3), 1e-5) == 0.0
  assert harness.semantic(1e-2, 1e-2) and not harness.semantic(1.2, 8e-9)

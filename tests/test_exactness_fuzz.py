"""A property-based differential fuzzer: random loss programs over a batch, split by the
drop-in under a pinned microbatch plan and run by jax.jit. Never a split that trains
differently, never a crash jax.jit does not have. `benchmarks/bench_exactness_fuzz.py` is
the long run."""

import hypothesis
from hypothesis import strategies as st

from tests.exactness import programs

_OPS = st.lists(st.sampled_from(sorted(programs.OPS)), max_size=4).map(tuple)
_PROGRAMS = st.builds(programs.Program, _OPS, st.sampled_from(sorted(programs.REDUCTIONS)),
                      st.sampled_from((2, 4, 8)))


@hypothesis.settings(max_examples=40, deadline=None, derandomize=True,
                     suppress_health_check=[hypothesis.HealthCheck.too_slow])
@hypothesis.given(_PROGRAMS)
def test_a_random_loss_program_is_split_exactly_or_refused(program):
  verdict = programs.judge(program)
  assert verdict.error is None, (program, verdict.error)
  assert not verdict.silently_different, (program, verdict.distance)


def test_every_op_alone_is_split_exactly_or_refused():
  """Each op once, so the bounded run covers all of them whatever hypothesis draws."""
  for name in sorted(programs.OPS):
    verdict = programs.judge(programs.Program((name,), "mean", 2))
    assert verdict.error is None, (name, verdict.error)
    assert not verdict.silently_different, (name, verdict.distance)
    if name in programs.MIXING:  # none of these mixes examples in a way a split keeps
      assert not verdict.split or name in _SPLITS_EXACTLY, name


_SPLITS_EXACTLY = frozenset({"uniform_constant", "max_batch"})

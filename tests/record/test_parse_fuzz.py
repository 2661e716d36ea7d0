"""parse never raises: random text, and random mutations of every real corpus message.

The fuzzing calls the parser below `parse`'s last-resort `except`, so a parser bug shows up
here as an exception instead of being swallowed into None.
"""

import random
import time

import pytest

from hypothesis import HealthCheck, given, settings, strategies as st

import hbm_guard
from hbm_guard._src.record import record
from benchmarks.bench_parse_adversarial import adversarial_inputs
from tests.record.test_record_corpus import EXPECTED, body

_COUNT = {"random": 0}
_ALPHABET = st.characters(codec="utf-8") | st.sampled_from(list("0123456789.GMKB:()[]{},= \n"))
_FRAGMENTS = ["Ran out of memory in memory space hbm. ", "Used ", "of ", " hbm.", "Size: ",
              "1.5G", "99999999999999E", "Exceeded hbm capacity by ", "Total hbm usage >= ",
              "  1. Size: ", "Shape: f32[", "{1,0:T(8,128)}", "Operator: op_name=\"",
              "HLO temp ", "(", ")", "\n", "Largest program allocations in hbm:\n",
              "HLO temporaries (", "exceeds available HBM (", "E1000: CompileTimeHbmOom:",
              "Attempting to reserve ", "There are ", " free", "=" * 26]


@settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.sampled_from(_FRAGMENTS) | st.text(_ALPHABET, max_size=20), max_size=40))
def test_random_text_never_raises(parts):
  _COUNT["random"] += 1
  rec = record._parse_text("".join(parts))
  if rec is not None:
    rec.to_dict()
    hbm_guard.diagnose(rec)


def _mutate(rng, text):
  ops = rng.randrange(1, 6)
  chars = list(text)
  for _ in range(ops):
    if not chars:
      break
    i = rng.randrange(len(chars))
    op = rng.randrange(5)
    if op == 0:
      del chars[i:i + rng.randrange(1, 50)]
    elif op == 1:
      chars.insert(i, rng.choice("0123456789.:GMKE()[]{}\n =\"x"))
    elif op == 2:
      j = rng.randrange(len(chars))
      chars[i:i] = chars[j:j + rng.randrange(1, 200)]
    elif op == 3:
      chars[i] = rng.choice("9.\n ")
    else:
      del chars[i:]
  return "".join(chars)


def test_mutated_corpus_never_raises():
  rng = random.Random(20261130)
  per_file = 300
  ran = 0
  for name in sorted(EXPECTED):
    original = body(name)
    for _ in range(per_file):
      rec = record._parse_text(_mutate(rng, original))
      if rec is not None:
        rec.to_dict()
        hbm_guard.diagnose(rec)
      ran += 1
  print(f"fuzz: {ran} mutated corpus messages, {_COUNT['random']} random texts, no exception")
  assert ran == per_file * len(EXPECTED)


@pytest.mark.parametrize("name", sorted(adversarial_inputs(16)))
def test_adversarial_whitespace_parses_in_linear_time(name):
  # 256 KiB each: a quadratic regex takes minutes here (20,000 newlines took 19 s before);
  # linear parsing takes well under the budget (benchmarks/bench_parse_adversarial.py).
  text = adversarial_inputs(256 << 10)[name]
  t0 = time.process_time()  # this process's CPU seconds: a busy machine does not add to them
  record._parse_text(text)
  assert time.process_time() - t0 < 2.0, name


_SPACE_RUNS = st.lists(st.tuples(st.text(st.sampled_from(record.UNICODE_WHITESPACE), min_size=1,
                                         max_size=4), st.integers(500, 4000)),
                       min_size=1, max_size=6)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(_SPACE_RUNS)
def test_runs_of_any_unicode_whitespace_parse_within_budget(runs):
  # Issue #16: U+00A0, U+3000, U+2028, \x1f ... went quadratic where [ \t] did not.
  head = ("Ran out of memory in memory space hbm. Used 1.00G of 512.00M hbm.\n"
          "Total hbm usage >= 1.00G:\n")
  rows = "".join(f"    reserved{unit * n}x {unit * n}1.0M\n" for unit, n in runs)
  text = head + rows * max(1, (128 << 10) // max(1, len(rows)))
  t0 = time.process_time()
  rec = record._parse_text(text)
  assert time.process_time() - t0 < 1.0
  assert rec is not None and rec.used_bytes == 2**30

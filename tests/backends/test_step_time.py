"""A target's step time, estimated from the compiled program (step_time.py): loops counted
by their trip counts, the compiler's own cycles where it gives them, untrusted text safe."""

import json
import time

import jax
import jax.numpy as jnp
import pytest

import hbm_guard
from hbm_guard._src.backends import step_time
from hbm_guard._src.backends import targets
from hbm_guard._src.files import report as report_lib

SPEED = step_time.DeviceSpeed(peak_flops=100e12, hbm_bytes_per_second=1e12, clock_hz=1e9)

_LOOP = """HloModule jit_step, is_scheduled=true

%body (p: (s32[], f32[1024,1024])) -> (s32[], f32[1024,1024]) {
  %p = (s32[]{:T(128)}, f32[1024,1024]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %w = f32[1024,1024]{1,0:T(8,128)} get-tuple-element(%p), index=1
  %d = f32[1024,1024]{1,0} dot(%w, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %f = f32[1024,1024]{1,0} fusion(%d), kind=kLoop, calls=%fused, backend_config={"window_config":{"estimated_cycles":"2000"}}
  ROOT %t = (s32[], f32[1024,1024]{1,0}) tuple(%i, %f)
}

%cond (p.1: (s32[], f32[1024,1024])) -> pred[] {
  %p.1 = (s32[], f32[1024,1024]) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %n = s32[] constant(TRIPS)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

%fused (x: f32[1024,1024]) -> f32[1024,1024] {
  %x = f32[1024,1024]{1,0} parameter(0)
  ROOT %y = f32[1024,1024]{1,0} tanh(%x)
}

ENTRY %main (a: f32[1024,1024]) -> f32[1024,1024] {
  %a = f32[1024,1024]{1,0} parameter(0)
  %z = s32[] constant(0)
  %t0 = (s32[], f32[1024,1024]) tuple(%z, %a)
  %loop = (s32[]{:T(128)}, f32[1024,1024]{1,0}) while(%t0), condition=%cond, body=%body
  ROOT %out = f32[1024,1024]{1,0} get-tuple-element(%loop), index=1
}
"""


def _loop(trips: int) -> str:
  return _LOOP.replace("TRIPS", str(trips))


def test_a_loop_counts_its_body_times_its_trip_count():
  # the body: a 1024^3 dot (2.1e9 flops at 100 TFLOP/s = 21.5 us, over its 12 MiB at 1 TB/s
  # = 12.6 us) and a fusion the compiler priced at 2000 cycles (2 us at 1 GHz)
  one = step_time.estimate(_loop(1), SPEED)
  assert one.seconds == pytest.approx(2 * 1024**3 / 100e12 + 2e-6, rel=1e-6)
  assert (one.by_cycles, one.by_roofline) == (1, 2)  # the condition's compare too
  assert step_time.estimate(_loop(8), SPEED).seconds == pytest.approx(8 * one.seconds)


def test_without_a_clock_the_compilers_cycles_give_way_to_the_roofline():
  slow = step_time.DeviceSpeed(peak_flops=100e12, hbm_bytes_per_second=1e12)
  est = step_time.estimate(_loop(1), slow)
  assert (est.by_cycles, est.by_roofline) == (0, 3)
  assert est.seconds == pytest.approx(2 * 1024**3 / 100e12 + 8 * 2**20 / 1e12, rel=1e-6)


_ASYNC = """HloModule jit_step, is_scheduled=true

ENTRY %main (a: f32[1024,1024], b: f32[COPY]) -> f32[1024,1024] {
  %a = f32[1024,1024]{1,0} parameter(0)
  %b = f32[COPY]{0} parameter(1)
  %cs = (f32[COPY]{0}, f32[COPY]{0:S(1)}, u32[]) copy-start(%b)
  %f = f32[1024,1024]{1,0} fusion(%a), kind=kLoop, calls=%fused, backend_config={"window_config":{"estimated_cycles":"4000"}}
  %cd = f32[COPY]{0:S(1)} copy-done(%cs)
  %cc = f32[1024,1024]{1,0} custom-call(%f), custom_call_target="ConcatBitcast"
  ROOT %r = f32[1024,1024]{1,0} fusion(%cc, %cd), kind=kLoop, calls=%fused, backend_config={"window_config":{"estimated_cycles":"1000"}}
}

%fused (x: f32[1024,1024]) -> f32[1024,1024] {
  %x = f32[1024,1024]{1,0} parameter(0)
  ROOT %y = f32[1024,1024]{1,0} tanh(%x)
}
"""


def test_an_asynchronous_copy_runs_beside_the_compute_and_is_priced_once():
  # compute: 5000 cycles = 5 us. A 1 MiB copy at 1 TB/s (~1 us) hides behind it; a 64 MiB
  # one (~67 us) is what the step waits for, counted once, not at its start and its done.
  # libtpu writes such pairs for its prefetches into VMEM: priced as blocking, twice each,
  # they had put a step without remat 2.8x behind full remat on v5e.
  small = step_time.estimate(_ASYNC.replace("COPY", str(2**18)), SPEED)
  assert small.seconds == pytest.approx(5e-6, rel=1e-6)
  assert (small.by_cycles, small.by_roofline) == (2, 1)  # the bitcast is free
  large = step_time.estimate(_ASYNC.replace("COPY", str(2**24)), SPEED)
  assert large.seconds == pytest.approx(2**26 / 1e12, rel=1e-6)


def test_damaged_text_costs_nothing_it_does_not_recognise_and_parses_in_linear_time():
  assert step_time.estimate("", SPEED) is None
  assert step_time.estimate("not HLO at all {{{ ((((", SPEED) is None
  broken = _loop(4).replace("lhs_contracting_dims={1}", "lhs_contracting_dims={9}")
  assert step_time.estimate(broken, SPEED).seconds > 0  # a bad dimension: no flops, no crash
  cyclic = _loop(4).replace("body=%body", "body=%main")  # a loop whose body is itself
  assert step_time.estimate(cyclic, SPEED) is not None
  huge = _loop(4).replace("constant(4)", "constant(99999999999)")
  assert step_time.estimate(huge, SPEED).seconds < 1.0  # an absurd bound is not believed
  chain = "".join(f"%c{i} (p: f32[]) -> f32[] {{\n  %r = f32[] call(%p), to_apply=%c{i + 1}\n"
                  f"  %s = f32[] fusion(%p), kind=kLoop, calls=%c{i + 1}\n}}\n"
                  for i in range(5000))  # deeper than any recursion limit
  assert step_time.estimate(chain + "ENTRY %main (p: f32[]) -> f32[] {\n"
                            "  %x = f32[] call(%p), calls=%c0\n}\n", SPEED) is not None
  t0 = time.perf_counter()
  for text in ("(" * 200_000 + "\n" + "%x = (" * 20_000, "%h (" + ")->" * 100_000 + "x\n"):
    step_time.estimate(text, SPEED)
  assert time.perf_counter() - t0 < 5.0


def test_speeds_come_from_the_device_table_and_bad_entries_give_none():
  v5e = targets.Target.parse("v5e:1x1").speed
  assert v5e.peak_flops == 197e12 and v5e.clock_hz == 1.5e9
  assert targets.Target.parse("v6e:1x1").speed.clock_hz is None  # not published
  assert step_time.DeviceSpeed.from_entry({"peak_tflops": "x", "hbm_gbps": 1}) is None
  assert step_time.DeviceSpeed.from_entry({"peak_tflops": -1, "hbm_gbps": 1}) is None


def test_a_report_holding_a_bad_estimate_shows_none():
  assert report_lib.estimated_ms({"estimated_step": {"seconds": 0.002}}) == pytest.approx(2.0)
  for bad in ("2", True, -1.0, float("inf"), None):
    assert report_lib.estimated_ms({"estimated_step": {"seconds": bad}}) is None


def _step(w, x):
  loss, g = jax.value_and_grad(
      lambda w, x: jnp.mean(jnp.tanh(jnp.tanh(x @ w[0]) @ w[1]) ** 2))(w, x)
  return w - 0.1 * g, loss


@pytest.mark.real_compiler
def test_a_targets_estimate_prices_what_flops_miss_and_the_report_says_it_is_one(tmp_path):
  # bf16 weights of 2 x 1024 x 1024: each microbatch reads them again, so at 64 examples a
  # microbatch the step is bound by HBM, which a flop count (the same at every count) misses
  w = jax.ShapeDtypeStruct((2, 1024, 1024), jnp.bfloat16)
  x = jax.ShapeDtypeStruct((2048, 1024), jnp.bfloat16)
  seconds = {}
  for k in (1, 32):
    g = hbm_guard.guarded_jit(_step, state_argnums=0, target="v5e:1x1", max_class="numerics",
                              plan=hbm_guard.Plan(donate_argnums=(0,), microbatches=k),
                              plan_cache=False, progress=False, report_dir=str(tmp_path))
    g.fit(w, x)
    (fit,) = [a for a in g.attempts if a.estimate is not None]
    assert fit.estimate.by_cycles > 0  # libtpu's own per-op figures were read
    seconds[k] = fit.estimate.seconds
  flops = 3 * 2 * 2 * 2048 * 1024 * 1024
  assert flops / 197e12 < seconds[1] < 5 * flops / 197e12
  assert seconds[32] > 2 * seconds[1]
  # the report of a fit that climbed carries it, and says it is an estimate
  g = hbm_guard.guarded_jit(_step, state_argnums=0, target="v5e:1x1", capacity="12MiB",
                            max_class="numerics", plan_cache=False, progress=False,
                            report_dir=str(tmp_path))
  g.fit(w, x)
  data = json.load(open(g.report_path))
  fits = [a for a in data["attempts"] if a["outcome"] == "fits"]
  assert fits and fits[-1]["estimated_step"]["seconds"] > 0
  assert "estimated step time" in report_lib.render(data) and "an estimate" in report_lib.render(data)


def _layers(w, x, remat: bool):
  layer = lambda h, wi: jnp.tanh(h @ wi)  # noqa: E731
  if remat:
    layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable)
  for i in range(w.shape[0]):
    x = layer(x, w[i])
  return jnp.mean(x ** 2)


def _remat_step(remat: bool):
  def step(w, x):
    loss, g = jax.value_and_grad(lambda w, x: _layers(w, x, remat))(w, x)
    return w - 0.1 * g, loss
  return step


@pytest.mark.real_compiler
def test_recomputing_the_forward_costs_what_it_computes(tmp_path):
  # Full remat runs the forward, a third of the step's flops, twice: a third more. libtpu's
  # prefetches into VMEM (copy-start/copy-done pairs), once priced as blocking and twice
  # each, put the step that keeps its activations 1.21x behind it here (and 2.8x behind on
  # bench_target_quality's lm); they run beside the compute.
  w = jax.ShapeDtypeStruct((8, 1024, 1024), jnp.float32)
  x = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
  seconds = {}
  for remat in (False, True):
    g = hbm_guard.guarded_jit(_remat_step(remat), state_argnums=0, target="v5e:1x1",
                              plan=hbm_guard.Plan(donate_argnums=(0,)), auto_fallback=False,
                              plan_cache=False, progress=False, report_dir=str(tmp_path))
    g.fit(w, x)
    seconds[remat] = g.attempts[-1].estimate.seconds
  assert seconds[True] > 1.25 * seconds[False], seconds  # 1.48 read here

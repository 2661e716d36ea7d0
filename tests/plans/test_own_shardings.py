"""Your own shardings (#21): a multi-chip step written the usual way works under the guard.

Hand-written FSDP shardings over a 2x2 mesh ("data", "fsdp"): the mesh over the target's
devices (here, on libtpu) and over 4 local CPU devices (a subprocess). Resharding extends
the user's layout: each state leaf is also sharded over the mesh axes the user left it
replicated over.
"""

import json
import os
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import hbm_guard
from hbm_guard._src.backends import backend as backend_lib
from hbm_guard._src.backends import options as options_lib
from hbm_guard._src.backends import steps as steps_lib
from hbm_guard._src.files import report as report_lib
from hbm_guard._src.plans import user_shardings
from tests import paths

ROOT = str(paths.ROOT)
CAPACITY = 20_000_000  # bytes per chip: the user's layout needs ~36 MB, extended ~10 MB


def step(state, batch):
  def loss(p):
    return ((jnp.tanh(batch @ p["w1"]) @ p["w2"]) ** 2).mean()
  value, grads = jax.value_and_grad(loss)(state)
  return jax.tree.map(lambda a, g: a - 0.1 * g, state, grads), value


def fsdp_shardings(mesh):
  state = {"w1": NamedSharding(mesh, P("fsdp", None)), "w2": NamedSharding(mesh, P(None, "fsdp"))}
  return state, NamedSharding(mesh, P("data"))


def arrays():
  rng = np.random.default_rng(0)
  state = {"w1": jnp.asarray(rng.normal(size=(1024, 4096)) * 0.02, jnp.float32),
           "w2": jnp.asarray(rng.normal(size=(4096, 1024)) * 0.02, jnp.float32)}
  return state, jnp.asarray(rng.normal(size=(256, 1024)), jnp.float32)


def abstract(state_s, batch_s):
  state, batch = arrays()
  put = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)  # noqa: E731
  return jax.tree.map(put, state, state_s), put(batch, batch_s)


@pytest.fixture(name="target_mesh")
def _target_mesh(v5e_devices):
  return jax.sharding.Mesh(np.array(v5e_devices).reshape(2, 2), ("data", "fsdp"))


@pytest.mark.real_compiler
def test_fsdp_over_the_targets_devices_fits_and_the_guard_extends_it(target_mesh, tmp_path):
  state_s, batch_s = fsdp_shardings(target_mesh)
  g = hbm_guard.guarded_jit(step, state_argnums=0, target="v5e:2x2", capacity=CAPACITY,
                            in_shardings=(state_s, batch_s), out_shardings=(state_s, None),
                            report_dir=str(tmp_path))
  plan = g.fit(*abstract(state_s, batch_s))
  assert plan.shard_state and len(g.attempts) <= 2
  assert g.attempts[-1].memory["peak"] <= CAPACITY  # per chip, the compiler's figure
  with open(g.report_path, encoding="utf-8") as f:
    page = report_lib.render(json.load(f))
  # the layout before (the user's) and after (extended over "data")
  assert "state 0['w1'] float32[1024, 4096]: sharded P('fsdp', None)" in page
  assert "state 0['w1'] float32[1024, 4096]: sharded P('fsdp', 'data')" in page
  assert "argument 1 float32[256, 1024]: sharded P('data',)" in page


@pytest.mark.real_compiler
def test_arguments_that_carry_the_shardings_need_no_in_shardings(target_mesh, tmp_path):
  state_s, batch_s = fsdp_shardings(target_mesh)
  g = hbm_guard.guarded_jit(step, state_argnums=0, target="v5e:2x2",
                            report_dir=str(tmp_path))
  assert g.fit(*abstract(state_s, batch_s)) == hbm_guard.Plan()  # fits as the user laid out


def scaled_step(state, batch, *, scale):
  def loss(p):
    return ((jnp.tanh(batch @ p["w1"]) @ p["w2"]) ** 2).mean() * scale
  value, grads = jax.value_and_grad(loss)(state)
  return jax.tree.map(lambda a, g: a - 0.1 * g, state, grads), value


@pytest.mark.real_compiler
def test_a_step_called_with_keywords_is_resharded_too(target_mesh, tmp_path):
  # A plan's layout gives jax.jit in_shardings, and jax then refuses keyword arguments
  # ("pjit does not support kwargs when in_shardings is specified").
  state_s, batch_s = fsdp_shardings(target_mesh)
  whole = jax.tree.map(lambda s: NamedSharding(target_mesh, P()), state_s)
  state, batch = abstract(whole, batch_s)
  g = hbm_guard.guarded_jit(scaled_step, state_argnums=0, target="v5e:2x2",
                            capacity=CAPACITY, report_dir=str(tmp_path))
  plan = g.fit(state, batch, scale=jax.ShapeDtypeStruct((), jnp.float32))
  assert plan.shard_state and g.attempts[-1].memory["peak"] <= CAPACITY


@pytest.mark.real_compiler
def test_a_mesh_of_another_size_than_the_target_is_a_clear_error(v5e_devices, tmp_path):
  mesh = jax.sharding.Mesh(np.array(v5e_devices[:2]), ("fsdp",))
  with pytest.raises(hbm_guard.InvalidOptionError, match="target has 4"):
    user_shardings.on_devices(NamedSharding(mesh, P("fsdp")), v5e_devices[:1] * 4)


def test_resharding_shards_what_the_user_left_replicated():
  devices = np.array(jax.devices() * 4)[:4].reshape(2, 2)
  mesh = jax.sharding.Mesh(devices, ("data", "fsdp")) if len(set(devices.flat)) == 4 else None
  if mesh is None:  # one CPU device here: an abstract mesh says the same
    mesh = jax.sharding.AbstractMesh((2, 2), ("data", "fsdp"))
  extend = lambda spec, shape: user_shardings.extend_fsdp(  # noqa: E731
      NamedSharding(mesh, spec), shape)
  assert extend(P("fsdp", None), (1024, 4096)) == P("fsdp", "data")
  assert extend(P(), (1024, 4096)) == P(None, ("data", "fsdp"))  # replicated: FSDP style
  assert extend(P("fsdp", "data"), (1024, 4096)) == P("fsdp", "data")  # nothing left
  assert extend(P("fsdp"), (6,)) == P("fsdp")  # nothing divides: as the user gave it


def test_a_refusal_asked_for_while_it_is_traced_waits_for_the_answer(monkeypatch):
  """The preparation thread asks while the fit's first compile runs; the fit asks when that
  compile fails. Asked twice at once, each gets the trace's answer (not a `None` set before
  the trace was done: the fit then planned a resharding the step's types refuse, and its
  trace raised out of the fit), and the step is traced once."""
  opts = options_lib.GuardOptions(state_argnums=0)
  backend = backend_lib.make(steps_lib.StepBuilder(step, opts), opts)
  traces = []
  def slow_refusal(args, kwargs):
    traces.append(threading.current_thread().name)
    time.sleep(0.3)
    return "refused by the step's types"
  monkeypatch.setattr(user_shardings, "explicit", lambda given: True)
  monkeypatch.setattr(backend, "_refusal", slow_refusal)
  args, answers = arrays(), []
  ask = lambda: answers.append(backend._reshard_refused(args, {}, {}))  # noqa: E731
  threads = [threading.Thread(target=ask) for _ in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert answers == ["refused by the step's types"] * 2 and len(traces) == 1


@pytest.fixture(name="four_devices", scope="module")
def _four_devices(tmp_path_factory):
  """tests/helpers/own_shardings_main.py run once, with 4 local CPU devices: what it printed."""
  env = dict(os.environ, HG_REPORT_DIR=str(tmp_path_factory.mktemp("reports")),
             ALLOW_MULTIPLE_LIBTPU_LOAD="1")
  env.pop("JAX_PLATFORMS", None)  # libtpu compiles for the target; the step runs on the CPU
  proc = subprocess.run([sys.executable, "-m", "tests.helpers.own_shardings_main"], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  # the preparation thread traced the explicit step under the caller's jax.set_mesh
  assert "preparing the fallback failed" not in proc.stderr, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def test_over_four_local_devices_mapped_onto_the_target_and_run_here(four_devices):
  out = four_devices
  assert out["target_plan"]["shard_state"] and out["target_compiles"] <= 2
  assert out["target_peak"] <= CAPACITY
  assert out["local_plan"]["shard_state"] and out["local_compiles"] <= 3
  assert out["local_peak"] <= out["local_capacity"]
  assert out["w1_spec"] in ("PartitionSpec('fsdp', 'data')", "P('fsdp', 'data')")
  assert out["same"]


def test_jax_set_mesh_with_explicit_axes_fits_for_the_target_and_here(four_devices):
  # The context mesh is over the 4 local devices; the target compile traces under the same
  # mesh over the target's chips (else jax: "context mesh ... should match the aval mesh").
  out = four_devices
  assert out["explicit_target"][0] == "oom" and out["explicit_target"][-1] == "fits"
  assert out["explicit_target_peak"] <= CAPACITY
  assert out["explicit_local"][0] == "oom" and out["explicit_local"][-1] == "fits"
  assert out["explicit_local_peak"] <= out["explicit_local_capacity"]
  assert out["explicit_same"]
  # a step that does not gather its weights itself: its types refuse them sharded further
  assert "refuse its state sharded further" in out["explicit_refused"]

"""Where the memory goes: the peak of a real libtpu compile broken down from the compiler's
own buffer assignment, by kind, by layer and by buffer, each part with the rung that
removes it; for a compile its early check fails (no executable, no listing in the
message) as for one that fits. Dumps are untrusted text: malformed ones give a partial
breakdown, never a crash."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import linen as nn
from flax.training import train_state

import hbm_guard
from hbm_guard._src.cli import report_html
from hbm_guard._src.memory import breakdown as breakdown_lib
from hbm_guard._src.memory import breakdown_check
from hbm_guard._src.memory import buffer_dump
from hbm_guard._src.memory import memory_dump
from tests import paths

Kind = breakdown_lib.Kind
MiB = 1 << 20


class _LM(nn.Module):
  vocab: int = 4096

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(self.vocab, 128)(tokens)
    for i in range(2):
      x = x + nn.Dense(128)(nn.gelu(nn.Dense(512, name=f"up_{i}")(x)))
    return nn.Dense(self.vocab)(x)  # the logits: [batch, length, vocab]


def _step(state, tokens):
  def loss_fn(params):
    logits = state.apply_fn({"params": params}, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), loss


def _abstract(vocab: int, batch: int = 16, length: int = 129):
  model = _LM(vocab)

  def make():
    params = model.init(jax.random.key(0), jnp.ones((1, 8), jnp.int32))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                         tx=optax.adam(1e-3))
  return jax.eval_shape(make), jax.ShapeDtypeStruct((batch, length), jnp.int32)


def _fit_breakdowns(vocab: int, capacity: str, tmp_path, batch: int = 32, length: int = 257,
                    **kw):
  state, tokens = _abstract(vocab, batch, length)
  g = hbm_guard.guarded_jit(_step, state_argnums=0, target="v5e:1x1", capacity=capacity,
                            max_class="numerics", plan_cache=False, report_dir=str(tmp_path),
                            progress=False, **kw)
  try:
    g.fit(state, tokens)
  except hbm_guard.LadderExhaustedError:
    pass
  return g


def test_an_early_check_failure_is_broken_down_from_the_compilers_own_assignment(tmp_path):
  g = _fit_breakdowns(8192, "24MiB", tmp_path)
  first = g.attempts[0]
  assert first.record is not None and first.record.kind == "compile_hbm_early"
  b = first.breakdown
  assert b is not None and "buffer assignment" in b.source
  assert b.agrees, (b.total, b.figure, b.notes)  # the parts sum to libtpu's figure
  assert "early check" in b.checked_against
  head = b.part(Kind.LOSS_HEAD)
  assert head == max(p.bytes for p in b.parts)  # the logits are the largest part
  logits = [x for x in b.top if x.kind is Kind.LOSS_HEAD]
  assert logits and logits[0].shape.endswith(",8192]") and logits[0].source.startswith(
      "test_memory_breakdown.py:")
  micro = next(s for p in b.parts if p.kind is Kind.LOSS_HEAD for s in p.savings)
  assert micro.rung.startswith("microbatch(") and micro.remaining == head // 4
  assert b.parts and all(p.bytes > 0 for p in b.parts)
  report = json.loads(open(g.report_path, encoding="utf-8").read())
  assert report["attempts"][0]["breakdown"]["total_bytes"] == b.total
  page = report_html.render(report)
  assert "Where the memory goes" in page and "loss head" in page


def test_doubling_the_vocabulary_moves_the_loss_head_not_the_rest(tmp_path):
  small = _fit_breakdowns(4096, "8MiB", tmp_path / "a").attempts[0].breakdown
  large = _fit_breakdowns(8192, "8MiB", tmp_path / "b").attempts[0].breakdown
  head = large.part(Kind.LOSS_HEAD) / small.part(Kind.LOSS_HEAD)
  assert 1.8 < head < 2.2, head
  # (the state and its gradients grow with the vocabulary's embedding and head too)
  moved = {p.kind: abs(large.part(p.kind) - p.bytes) for p in small.parts
           if p.kind not in (Kind.LOSS_HEAD, Kind.PARAMETERS, Kind.OPTIMIZER_STATE,
                             Kind.OUTPUTS, Kind.GRADIENTS, Kind.ARENA_SLACK)}
  assert sum(moved.values()) < 0.1 * (large.part(Kind.LOSS_HEAD) - small.part(Kind.LOSS_HEAD))


def test_a_fitting_plan_is_broken_down_against_memory_analysis(tmp_path):
  g = _fit_breakdowns(4096, "2GiB", tmp_path)
  (attempt,) = g.attempts
  b = attempt.breakdown
  assert b is not None and "memory_analysis" in b.checked_against and b.agrees


def test_the_plan_kept_is_held_against_the_first_programs_prediction(tmp_path):
  """The logits of a microbatched step are predicted to halve under microbatch(2); the
  compiled program's own figures say they did. The rewritten program keeps the user's
  module names (its ops run under "while/body", jax's name stack kept)."""
  g = _fit_breakdowns(8192, "200MiB", tmp_path)
  report = json.loads(open(g.report_path, encoding="utf-8").read())
  assert report["status"] == "fits" and report["final_plan"]["microbatches"] == 2
  rows = {r["kind"]: r for r in report["predicted_vs_compiled"]}
  head = rows[Kind.LOSS_HEAD.value]
  assert head["predicted_bytes"] == head["before_bytes"] // 2
  assert head["agrees"] is True, head
  assert rows[Kind.PARAMETERS.value]["agrees"] is True
  kept = g.attempts[-1].breakdown
  logits = [b for b in kept.top if b.kind is Kind.LOSS_HEAD]
  assert logits and logits[0].module and "Dense_2" in logits[0].module, kept.top
  text = hbm_guard.render_report(g.report_path)
  assert "predicted under the plan kept and compiled" in text and "agree within 10%" in text
  assert "Predicted and compiled" in report_html.render(report)


def test_a_prediction_read_back_from_a_report_is_checked_not_trusted():
  first = {"plan": {"microbatches": 1}, "breakdown": {"total_bytes": 1000, "parts": [
      {"kind": Kind.LOSS_HEAD.value, "bytes": 800}, {"kind": "made up", "bytes": 100},
      {"kind": Kind.PARAMETERS.value, "bytes": "100"}, "junk"],
      "own_peak_bytes": {Kind.LOSS_HEAD.value: 800, "x": -1}}}
  kept = {"plan": {"microbatches": 4, "remat_policy": 3}, "breakdown": {
      "parts": [{"kind": Kind.LOSS_HEAD.value, "bytes": 10}],
      "own_peak_bytes": {Kind.LOSS_HEAD.value: 200}, "on_chip_peak_bytes": []}}
  rows = breakdown_check.compare(first, kept)
  assert [r["kind"] for r in rows] == [Kind.LOSS_HEAD.value, "made up"]
  assert rows[0]["predicted_bytes"] == 200 and rows[0]["agrees"] is True
  assert rows[1]["predicted_bytes"] is None and rows[1]["agrees"] is None
  assert breakdown_check.compare(first, first) == []
  assert breakdown_check.compare({"breakdown": None}, kept) == []
  assert breakdown_check.lines("not a list") == [] and breakdown_check.summary(None) is None
  kept["breakdown"]["own_peak_bytes"] = {Kind.LOSS_HEAD.value: 600}  # saved 200, not 600
  assert breakdown_check.compare(first, kept)[0]["agrees"] is False


def test_the_breakdown_can_be_switched_off(tmp_path):
  g = _fit_breakdowns(4096, "8MiB", tmp_path, memory_breakdown=False)
  assert all(a.breakdown is None for a in g.attempts)


def test_a_malformed_dump_gives_a_partial_breakdown_and_never_raises(tmp_path):
  (tmp_path / "m.after_optimizations-buffer-assignment.txt").write_text(
      "allocation 0: size 1024, page 0, preallocated-temp:\n"
      " value: <1 fusion.1 @0> (size=1024,offset=0): f32[16,16]{1,0}\n"
      " value: <2 garbage\nallocation x: size y\n" + "\x00" * 100 + "\nallocation 1: size 64, "
      "page 0, parameter 0, shape |f32[16]| at ShapeIndex {}:\n"
      " value: <3 p.1 @0> (size=64,offset=0): f32[16]{0}\n")
  (tmp_path / "m.after_optimizations-live-range.txt").write_text("  fusion.1{}:0-")
  (tmp_path / "m.after_optimizations.txt").write_text("%fusion.1 = f32[16,16] fusion(\n" * 3)
  dump = buffer_dump.read(str(tmp_path))
  b = breakdown_lib.compute(dump, breakdown_lib.Arguments(("state",)), figure=1088)
  assert b.total == 1088 and b.agrees
  assert any("live ranges" in n for n in b.notes)  # said, not guessed
  assert buffer_dump.read(str(tmp_path / "absent")) is None


def test_a_dump_over_the_size_bound_is_not_read(tmp_path, monkeypatch):
  monkeypatch.setattr(buffer_dump, "MAX_FILE_BYTES", 10)
  (tmp_path / "m.after_optimizations-buffer-assignment.txt").write_text("x" * 100)
  dump = buffer_dump.read(str(tmp_path))
  assert dump is not None and not dump.allocations
  assert any("not read" in n for n in dump.notes)


def test_stack_frames_name_the_users_line_not_the_librarys():
  hlo = ('FileNames\n1 "/home/u/train.py"\n2 "/x/site-packages/flax/linen/linear.py"\n'
         'FunctionNames\n1 "loss_fn"\n2 "Dense.__call__"\n'
         'FileLocations\n1 {file_name_id=1 function_name_id=1 line=17}\n'
         '2 {file_name_id=2 function_name_id=2 line=300}\n'
         'StackFrames\n1 {file_location_id=1 parent_frame_id=1}\n'
         '2 {file_location_id=2 parent_frame_id=2}\n'
         '  %dot.1 = f32[8,8]{1,0} dot(%a, %b), metadata={op_name="jit(s)/jvp(LM)/Dense_0/'
         'dot_general" stack_frame_id=2}\n')
  instructions, frames = buffer_dump.parse_hlo(hlo)
  dump = buffer_dump.Dump((), {}, instructions, frames, ())
  assert dump.source_of(instructions["dot.1"].frame) == "train.py:17"


def test_a_memory_dump_scope_leaves_nothing_behind():
  with memory_dump.scope(True) as s:
    directory = s.directory
    assert os.path.isdir(directory) and s.options()["xla_dump_to"] == directory
  assert not os.path.exists(directory)
  with memory_dump.scope(False) as s:
    assert s.options() == {} and s.breakdown(None, None) is None


@pytest.mark.parametrize("path, kind", [
    ("state.params['Dense_0']['kernel']", Kind.PARAMETERS),
    ("state.opt_state[0].mu['Dense_0']['kernel']", Kind.OPTIMIZER_STATE),
    ("state.step", Kind.OTHER_STATE),
    ("batch['tokens']", Kind.BATCH),
])
def test_entry_parameters_are_named_by_their_pytree_path(path, kind):
  assert breakdown_lib.Arguments(("state",)).kind(path) is kind


def test_the_memory_command_breaks_a_step_down_for_a_target_without_fitting_it(capsys):
  from hbm_guard._src.cli import cli  # pylint: disable=import-outside-toplevel
  code = cli.main(["memory", "tests.helpers.preflight_factory:make_layers", "--target",
                   "v5e:1x1", "--capacity", "12MiB", "--json"])
  row = json.loads(capsys.readouterr().out)
  assert code == 0 and row["fits"] is False  # compiled once, as written: not fitted
  b = row["breakdown"]
  assert b["agrees"] and b["parts"] and b["top"][0]["bytes"] >= b["top"][-1]["bytes"]
  assert cli.main(["memory", "tests.helpers.preflight_factory:make_layers", "--target",
                   "v5e:1x1", "--capacity", "12MiB"]) == 0
  text = capsys.readouterr().out
  assert "where the memory goes" in text and "checked against" in text
  assert cli.main(["memory", "no_such_module:make", "--target", "v5e:1x1"]) == 2


def test_explain_breaks_down_the_allocations_a_message_lists(tmp_path):
  from hbm_guard._src.cli import cli  # pylint: disable=import-outside-toplevel
  import io  # pylint: disable=import-outside-toplevel
  out = io.StringIO()
  assert cli.main(["explain", os.path.join(paths.DATA, "corpus",
                                            "001_easydel-166-falcon-v4-32.txt")], out) == 0
  text = out.getvalue()
  assert "where the memory goes" in text and "not the whole program" in text
  assert "attention_module.py:1059" in text

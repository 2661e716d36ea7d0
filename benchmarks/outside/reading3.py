"""A third outside corpus of JAX/Flax train steps for hbm_guard's exactness harness.

Every case is a step `step(state, *args) -> (new_state, metrics)` written the way people
write them, plus `make()` giving concrete arguments. `expect_split` is the author's own
mathematical judgement (see the `# why` comment on each case):
  True  -- loss and gradient over the batch are computable exactly from per-microbatch
           pieces (sums over examples, functions of such sums, parameter-free batch
           preprocessing that can be done on the whole batch first);
  False -- examples interact through the parameters;
  None  -- the author is unsure.

Judged by `benchmarks/bench_outside.py`.
"""
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import optax
import flax.linen as nn
from flax import nnx
from flax import struct
from flax.training import train_state

from tests.exactness.harness import Case

CASES: list = []


def add(name, step, make, *, stochastic=False, expect_split=None, options=()):
  CASES.append(Case(name=name, step=step, make=make, stochastic=stochastic,
                    expect_split=expect_split, options=tuple(options)))


# ----------------------------------------------------------------------------------------
# small helpers (the sort of thing that lives in a project's utils.py)
# ----------------------------------------------------------------------------------------

def R(seed):
  return np.random.default_rng(seed)


def f32(a):
  return jnp.asarray(np.asarray(a), dtype=jnp.float32)


def i32(a):
  return jnp.asarray(np.asarray(a), dtype=jnp.int32)


def w(r, *shape, scale=None):
  s = (1.0 / math.sqrt(shape[0])) if scale is None else scale
  return f32(r.normal(size=shape) * s)


def init_mlp(seed, sizes, scale=1.0):
  r = R(seed)
  return [{'w': w(r, a, b, scale=scale / math.sqrt(a)), 'b': f32(np.zeros(b))}
          for a, b in zip(sizes[:-1], sizes[1:])]


def mlp(params, x, act=jnp.tanh):
  for i, p in enumerate(params):
    x = x @ p['w'] + p['b']
    if i < len(params) - 1:
      x = act(x)
  return x


def opt_init(params, tx, **extra):
  return {'params': params, 'opt_state': tx.init(params), **extra}


def opt_apply(state, grads, tx):
  updates, opt_state = tx.update(grads, state['opt_state'], state['params'])
  return {**state, 'params': optax.apply_updates(state['params'], updates),
          'opt_state': opt_state}


def l2norm(x, axis=-1, eps=1e-6):
  return x / jnp.sqrt(jnp.sum(x * x, axis=axis, keepdims=True) + eps)


def key0(seed=0):
  return jax.random.PRNGKey(seed)


class MLP(nn.Module):
  features: tuple
  act: str = 'gelu'

  @nn.compact
  def __call__(self, x):
    act = getattr(nn, self.act)
    for f in self.features[:-1]:
      x = act(nn.Dense(f)(x))
    return nn.Dense(self.features[-1])(x)


def make_ts(model, x, tx, seed=0, cls=train_state.TrainState, **kw):
  variables = model.init(jax.random.PRNGKey(seed), x)
  return cls.create(apply_fn=model.apply, params=variables['params'], tx=tx, **kw)


class RngTrainState(train_state.TrainState):
  key: jax.Array


# tiny causal self-attention LM used by the token-level cases -----------------------------
PAD = 0
V, D_LM, MAXPOS = 13, 16, 16


def lm_init(seed):
  r = R(seed)
  return {'emb': w(r, V, D_LM, scale=0.5), 'pos': w(r, MAXPOS, D_LM, scale=0.1),
          'wq': w(r, D_LM, D_LM), 'wk': w(r, D_LM, D_LM), 'wv': w(r, D_LM, D_LM),
          'wo': w(r, D_LM, D_LM), 'out': w(r, D_LM, V)}


def lm_apply(p, tokens, mask, positions=None):
  """tokens [..., T] int; mask [..., T, T] bool (query, key) -> logits [..., T, V]."""
  T = tokens.shape[-1]
  pos = p['pos'][:T] if positions is None else p['pos'][positions]
  x = p['emb'][tokens] + pos
  q, k, v = x @ p['wq'], x @ p['wk'], x @ p['wv']
  s = jnp.einsum('...qd,...kd->...qk', q, k) / math.sqrt(D_LM)
  s = jnp.where(mask, s, -1e9)
  a = jax.nn.softmax(s, axis=-1)
  h = x + jnp.einsum('...qk,...kd->...qd', a, v) @ p['wo']
  return jnp.tanh(h) @ p['out']


def lm_tokens(seed, B=16, T=12, min_len=4):
  r = R(seed)
  toks = r.integers(1, V, size=(B, T))
  lens = r.integers(min_len, T + 1, size=(B,))
  toks = np.where(np.arange(T)[None, :] < lens[:, None], toks, PAD)
  return i32(toks)


def packed_tokens(seed, B=16, T=8, unique=False):
  """Rows of 2-3 packed documents, trailing pad; segment ids 1,2,3 per row (0 = pad)."""
  r = R(seed)
  toks = r.integers(1, V, size=(B, T))
  seg = np.zeros((B, T), np.int64)
  for b in range(B):
    t, s = 0, 1
    while t < T - 1 and s <= 3:
      L = int(r.integers(2, 4))
      seg[b, t:min(T - 1, t + L)] = s  # always leave at least one pad at the end
      t += L
      s += 1
  if unique:
    seg = np.where(seg > 0, seg + 10 * np.arange(B)[:, None], 0)
  toks = np.where(seg > 0, toks, PAD)
  return i32(toks), i32(seg)


def positions_from_segments(seg, axis=-1):
  """Position of each token inside its own segment (resets at every segment start)."""
  T = seg.shape[axis]
  idx = lax.broadcasted_iota(jnp.int32, seg.shape, seg.ndim - 1)
  first = jnp.ones_like(seg[..., :1], dtype=bool)
  starts = jnp.concatenate([first, seg[..., 1:] != seg[..., :-1]], axis=-1)
  return idx - lax.cummax(jnp.where(starts, idx, 0), axis=seg.ndim - 1)


LM_TX = optax.adam(3e-3)


def lm_state(seed=0):
  return opt_init(lm_init(seed), LM_TX)


# ========================================================================================
# 1. plain supervised baselines and reductions
# ========================================================================================

def mlp_mse_step(state, x, y):
  def loss_fn(params):
    pred = state.apply_fn({'params': params}, x)
    return jnp.mean((pred - y) ** 2)
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  state = state.apply_gradients(grads=grads)
  return state, {'loss': loss}


def mlp_mse_make():
  r = R(1)
  x, y = f32(r.normal(size=(32, 8))), f32(r.normal(size=(32, 1)))
  return make_ts(MLP((16, 16, 1)), x, optax.adam(1e-2)), x, y


# why: mean of per-example squared errors -- the textbook splittable loss.
add('mlp_mse_trainstate', mlp_mse_step, mlp_mse_make, expect_split=True)


GLOBAL_BATCH = 32
SUM_TX = optax.sgd(0.05, momentum=0.9)


def sum_reduction_l2_step(state, x, y):
  def loss_fn(params):
    logits = mlp(params, x)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    # "loss is normalised by the global batch size from the config", plus L2 in the loss
    l2 = sum(jnp.sum(p['w'] ** 2) for p in params)
    return jnp.sum(ce) / GLOBAL_BATCH + 1e-3 * l2
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, SUM_TX), {'loss': loss}


def sum_reduction_l2_make():
  r = R(2)
  return (opt_init(init_mlp(2, [10, 16, 5]), SUM_TX), f32(r.normal(size=(32, 10))),
          i32(r.integers(0, 5, size=32)))


# why: sum over examples divided by a constant, plus a parameter-only L2 term (which must be
# counted once, not once per microbatch) -- still exactly a sum plus a constant term.
add('sum_over_constant_plus_l2_in_loss', sum_reduction_l2_step, sum_reduction_l2_make,
    expect_split=True)


RMSE_TX = optax.adam(1e-2)


def rmse_step(state, x, y):
  def loss_fn(params):
    pred = mlp(params, x)[:, 0]
    return jnp.sqrt(jnp.mean((pred - y) ** 2) + 1e-8)
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, RMSE_TX), {'rmse': loss}


def rmse_make():
  r = R(3)
  return (opt_init(init_mlp(3, [6, 16, 1]), RMSE_TX), f32(r.normal(size=(24, 6))),
          f32(r.normal(size=24)))


# why: sqrt of a batch mean -- a (non-linear) function of one sum over examples.
add('rmse_sqrt_of_batch_mean', rmse_step, rmse_make, expect_split=True)


TILT_TX = optax.sgd(0.1)
TILT = 2.0


def tilted_erm_step(state, x, y):
  def loss_fn(params):
    logits = mlp(params, x)
    per_ex = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    # tilted ERM: (1/t) log mean exp(t * loss_i)
    return (jax.nn.logsumexp(TILT * per_ex) - jnp.log(per_ex.shape[0])) / TILT
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, TILT_TX), {'tilted_loss': loss}


def tilted_erm_make():
  r = R(4)
  return (opt_init(init_mlp(4, [8, 16, 4]), TILT_TX), f32(r.normal(size=(32, 8))),
          i32(r.integers(0, 4, size=32)))


# why: log of a mean of exp(per-example loss) is a function of one sum over examples
# (the gradient is a softmax-over-batch weighting, but it is determined by that one sum).
add('tilted_erm_logmeanexp', tilted_erm_step, tilted_erm_make, expect_split=True)


WORST_TX = optax.sgd(0.1)


def max_loss_step(state, x, y):
  def loss_fn(params):
    per_ex = optax.softmax_cross_entropy_with_integer_labels(mlp(params, x), y)
    return jnp.max(per_ex), jnp.mean(per_ex)
  (loss, mean_loss), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  return opt_apply(state, grads, WORST_TX), {'worst': loss, 'mean': mean_loss}


def max_loss_make():
  r = R(5)
  return (opt_init(init_mlp(5, [8, 16, 4]), WORST_TX), f32(r.normal(size=(16, 8))),
          i32(r.integers(0, 4, size=16)))


# why: max over examples is decomposable (max of per-microbatch maxes, gradient of the
# winner) but it is a selection across the batch -- unsure how it should be classed.
add('worst_case_max_over_batch', max_loss_step, max_loss_make, expect_split=None)


CVAR_TX = optax.sgd(0.1)


def cvar_step(state, x, y):
  def loss_fn(params):
    per_ex = optax.softmax_cross_entropy_with_integer_labels(mlp(params, x), y)
    k = per_ex.shape[0] // 4
    top, _ = lax.top_k(per_ex, k)   # CVaR_0.25: mean of the worst quarter of the batch
    return jnp.mean(top)
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, CVAR_TX), {'cvar': loss}


def cvar_make():
  r = R(6)
  return (opt_init(init_mlp(6, [8, 16, 4]), CVAR_TX), f32(r.normal(size=(32, 8))),
          i32(r.integers(0, 4, size=32)))


# why: which examples are in the top quarter is a ranking across the batch by a
# parameter-dependent loss, and k depends on the batch size.
add('cvar_topk_over_batch', cvar_step, cvar_make, expect_split=False)


WEIGHTED_TX = optax.adam(5e-3)
N_CLS = 5


def inv_freq_focal_step(state, x, y):
  def loss_fn(params):
    logits = mlp(params, x)
    # class weights from this batch's label histogram (parameter-free)
    counts = jnp.sum(jax.nn.one_hot(y, N_CLS), axis=0)
    cw = jnp.where(counts > 0, y.shape[0] / (N_CLS * jnp.maximum(counts, 1.0)), 0.0)
    wts = cw[y]
    logp = jax.nn.log_softmax(logits)
    pt = jnp.exp(jnp.take_along_axis(logp, y[:, None], axis=1)[:, 0])
    focal = -((1 - pt) ** 2) * jnp.log(pt + 1e-8)
    return jnp.sum(wts * focal) / jnp.sum(wts)
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, WEIGHTED_TX), {'loss': loss}


def inv_freq_focal_make():
  r = R(7)
  y = r.choice(N_CLS, size=32, p=[0.5, 0.2, 0.15, 0.1, 0.05])
  return (opt_init(init_mlp(7, [8, 16, N_CLS]), WEIGHTED_TX), f32(r.normal(size=(32, 8))),
          i32(y))


# why: the class weights come from the whole batch's label counts, but they are
# parameter-free; with them fixed the loss is a weighted sum over examples / sum of weights.
add('inverse_freq_class_weights_from_batch_focal', inv_freq_focal_step, inv_freq_focal_make,
    expect_split=True)


FEAT_FIRST_TX = optax.sgd(0.05)


def features_first_step(state, xT, yT):
  """Data stored column-major: xT is [features, batch], yT is [outputs, batch]."""
  def loss_fn(p):
    h = jnp.tanh(p['W1'] @ xT + p['b1'][:, None])
    pred = p['W2'] @ h + p['b2'][:, None]
    return jnp.mean(jnp.sum((pred - yT) ** 2, axis=0))
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, FEAT_FIRST_TX), {'loss': loss}


def features_first_make():
  r = R(8)
  p = {'W1': w(r, 16, 6, scale=0.4), 'b1': f32(np.zeros(16)), 'W2': w(r, 3, 16, scale=0.25),
       'b2': f32(np.zeros(3))}
  return opt_init(p, FEAT_FIRST_TX), f32(r.normal(size=(6, 32))), f32(r.normal(size=(3, 32)))


# why: per-example (per-column) squared error; the batch axis is the LAST axis.
add('features_first_batch_last_axis', features_first_step, features_first_make,
    expect_split=True)


# ========================================================================================
# 2. token-level language-model losses: masks, positions, packing
# ========================================================================================

def lm_flat_mask_step(state, tokens):
  def loss_fn(params):
    T = tokens.shape[1]
    logits = lm_apply(params, tokens, jnp.tri(T, dtype=bool))[:, :-1]
    targets = tokens[:, 1:]
    logits = logits.reshape(-1, logits.shape[-1])
    targets = targets.reshape(-1)
    mask = (targets != PAD).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    ntok = jnp.sum(mask)
    return jnp.sum(ce * mask) / jnp.maximum(ntok, 1.0), ntok
  (loss, ntok), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  return opt_apply(state, grads, LM_TX), {'loss': loss, 'tokens': ntok}


# why: sum of masked per-token CE over the batch's total real-token count: ratio of two
# sums over examples (the count is parameter-free).
add('lm_flat_tokens_norm_by_batch_token_count', lm_flat_mask_step,
    lambda: (lm_state(10), lm_tokens(10)), expect_split=True)


def lm_arange_mod_step(state, tokens):
  def loss_fn(params):
    B, T = tokens.shape
    logits = lm_apply(params, tokens, jnp.tri(T, dtype=bool))[:, :-1].reshape(-1, V)
    targets = tokens[:, 1:].reshape(-1)
    n = targets.shape[0]
    # later positions in each sequence count more: position = flat index mod (T-1)
    pos = jnp.arange(n) % (T - 1)
    wts = (1.0 + pos / (T - 1)) * (targets != PAD)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(wts * ce) / jnp.sum(wts)
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, LM_TX), {'loss': loss}


# why: weights from jnp.arange over the FLATTENED token axis, but modulo the sequence
# length, so each weight is really a function of the position inside its own sequence.
add('lm_flat_arange_mod_seq_len_weights', lm_arange_mod_step,
    lambda: (lm_state(11), lm_tokens(11)), expect_split=True)


def lm_global_decay_step(state, tokens):
  def loss_fn(params):
    T = tokens.shape[1]
    logits = lm_apply(params, tokens, jnp.tri(T, dtype=bool))[:, :-1].reshape(-1, V)
    targets = tokens[:, 1:].reshape(-1)
    # the batch is a chronologically ordered stream: older tokens decay in weight
    age = jnp.arange(targets.shape[0])[::-1]
    wts = (0.99 ** age) * (targets != PAD)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(wts * ce) / jnp.sum(wts)
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, LM_TX), {'loss': loss}


# why: per-token weights depend on the GLOBAL flat index in the batch, but are
# parameter-free: with the weights computed on the whole batch the loss is a ratio of sums.
# A microbatch recomputing jnp.arange locally would get different weights.
add('lm_flat_arange_global_recency_weights', lm_global_decay_step,
    lambda: (lm_state(12), lm_tokens(12)), expect_split=True)


SEP = 3


def lm_prompt_mask_step(state, tokens):
  def loss_fn(params):
    T = tokens.shape[1]
    logits = lm_apply(params, tokens, jnp.tri(T, dtype=bool))[:, :-1]
    targets = tokens[:, 1:]
    # only train on the answer: tokens after the first SEP in each row
    after_sep = jnp.cumsum((tokens == SEP).astype(jnp.int32), axis=1)[:, :-1] > 0
    mask = (after_sep & (targets != PAD)).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    per_seq = jnp.sum(ce * mask, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1.0)
    has_answer = (jnp.sum(mask, axis=1) > 0).astype(jnp.float32)
    return jnp.sum(per_seq * has_answer) / jnp.maximum(jnp.sum(has_answer), 1.0)
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, LM_TX), {'loss': loss}


def lm_prompt_make():
  toks = np.array(lm_tokens(13))
  r = R(13)
  for b in range(toks.shape[0]):
    if b % 5 != 4:  # a few rows without any SEP (no answer)
      toks[b, int(r.integers(1, 4))] = SEP
    else:
      toks[b] = np.where(toks[b] == SEP, 4, toks[b])
  return lm_state(13), i32(toks)


# why: cumsum of the SEP mask along each row (per sequence), per-sequence mean, then mean
# over the sequences that have an answer -- a ratio of sums with a parameter-free count.
add('lm_prompt_mask_cumsum_per_seq_then_batch_mean', lm_prompt_mask_step, lm_prompt_make,
    expect_split=True)


TOKEN_BUDGET = 60


def lm_token_budget_step(state, tokens):
  def loss_fn(params):
    T = tokens.shape[1]
    logits = lm_apply(params, tokens, jnp.tri(T, dtype=bool))[:, :-1].reshape(-1, V)
    targets = tokens[:, 1:].reshape(-1)
    real = (targets != PAD).astype(jnp.int32)
    # keep only the first TOKEN_BUDGET real tokens of the (flattened) batch
    keep = ((jnp.cumsum(real) <= TOKEN_BUDGET) & (real > 0)).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(ce * keep) / jnp.sum(keep)
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, LM_TX), {'loss': loss}


# why: cumsum of the mask over the flattened batch decides which tokens count; it is
# parameter-free and fixed by the whole batch, after which the loss is a ratio of sums.
add('lm_token_budget_flat_cumsum', lm_token_budget_step,
    lambda: (lm_state(14), lm_tokens(14)), expect_split=True)


def lm_packed_rows_step(state, tokens, segment_ids):
  def loss_fn(params):
    T = tokens.shape[1]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    mask = jnp.tri(T, dtype=bool)[None] & same & (segment_ids[:, :, None] > 0)
    pos = positions_from_segments(segment_ids)
    logits = lm_apply(params, tokens, mask, positions=pos)[:, :-1]
    targets = tokens[:, 1:]
    valid = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] > 0)
    valid = valid.astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(ce * valid) / jnp.sum(valid)
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, LM_TX), {'loss': loss}


# why: packing with segment_ids inside each row; attention never crosses rows, the loss is
# per-token normalised by the batch's valid-token count (parameter-free).
add('lm_packed_segment_ids_rowwise', lm_packed_rows_step,
    lambda: (lm_state(15), *packed_tokens(15)), expect_split=True)


def lm_packed_stream_step(state, tokens, segment_ids):
  """Treat the whole batch as one packed stream (flatten rows), masking by segment id."""
  def loss_fn(params):
    tok = tokens.reshape(-1)
    seg = segment_ids.reshape(-1)
    n = tok.shape[0]
    mask = jnp.tri(n, dtype=bool) & (seg[:, None] == seg[None, :]) & (seg[:, None] > 0)
    pos = positions_from_segments(seg)
    logits = lm_apply(params, tok, mask, positions=pos)[:-1]
    valid = ((seg[1:] == seg[:-1]) & (seg[1:] > 0)).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tok[1:])
    return jnp.sum(ce * valid) / jnp.sum(valid)
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, LM_TX), {'loss': loss}


# why: jnp.tri over the flattened stream, but the segment ids are unique across rows, so
# the segment mask stops any attention (and any loss pair) across rows.
add('lm_packed_flat_stream_unique_segment_ids', lm_packed_stream_step,
    lambda: (lm_state(16), *packed_tokens(16, unique=True)), expect_split=True)

# why: the SAME step, but segment ids restart at 1 in every row: once flattened, segment 1
# of row r attends to segment 1 of every earlier row, through the attention parameters.
add('lm_packed_flat_stream_reused_segment_ids', lm_packed_stream_step,
    lambda: (lm_state(17), *packed_tokens(17, unique=False)), expect_split=False)


RNN_STREAM_TX = optax.adam(3e-3)


def stream_rnn_step(state, tokens):
  """Truncated-BPTT style: the hidden state runs through the batch as one long stream."""
  def loss_fn(p):
    tok = tokens.reshape(-1)
    emb = p['emb'][tok[:-1]]
    def cell(h, e):
      h = jnp.tanh(h @ p['Wh'] + e @ p['Wx'] + p['b'])
      return h, h @ p['out']
    _, logits = lax.scan(cell, jnp.zeros((p['Wh'].shape[0],)), emb)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tok[1:])
    return jnp.mean(ce)
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, RNN_STREAM_TX), {'loss': loss}


def stream_rnn_make():
  r = R(18)
  p = {'emb': w(r, V, 8, scale=0.5), 'Wh': w(r, 12, 12, scale=0.2), 'Wx': w(r, 8, 12),
       'b': f32(np.zeros(12)), 'out': w(r, 12, V)}
  return opt_init(p, RNN_STREAM_TX), i32(r.integers(1, V, size=(16, 6)))


# why: the recurrent state is carried across row boundaries of the flattened batch, so
# each row's predictions depend on all earlier rows through the recurrent weights.
add('rnn_hidden_state_carried_across_flattened_batch', stream_rnn_step, stream_rnn_make,
    expect_split=False)


def token_infonce_eye_step(state, tokens_a, tokens_b):
  """Token-level contrastive: token t of view a should match token t of view b."""
  def loss_fn(params):
    T = tokens_a.shape[1]
    causal = jnp.tri(T, dtype=bool)
    ea = l2norm(lm_apply(params, tokens_a, causal).reshape(-1, V))
    eb = l2norm(lm_apply(params, tokens_b, causal).reshape(-1, V))
    n = ea.shape[0]
    logits = ea @ eb.T / 0.1
    targets = jnp.eye(n)
    return jnp.mean(optax.softmax_cross_entropy(logits, targets))
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, LM_TX), {'loss': loss}


def token_infonce_make():
  a = np.array(lm_tokens(19, B=16, T=6, min_len=6))
  r = R(19)
  b = np.where(r.random(a.shape) < 0.2, r.integers(1, V, size=a.shape), a)
  return lm_state(19), i32(a), i32(b)


# why: jnp.eye over all flattened tokens of the batch: every token of every sequence is a
# negative for every other -- in-batch negatives at token level.
add('token_infonce_eye_over_flattened_batch', token_infonce_eye_step, token_infonce_make,
    expect_split=False)


# ========================================================================================
# 3. labels built inside the loss, odd batch layouts
# ========================================================================================

TWO_TOWER_TX = optax.adam(5e-3)


def first_is_positive_step(state, query, candidates):
  """query [B, D]; candidates [B, C, D]; candidate 0 is the clicked one."""
  def loss_fn(p):
    q = l2norm(mlp(p['q'], query))
    c = l2norm(mlp(p['c'], candidates))
    scores = jnp.einsum('bd,bcd->bc', q, c) / 0.2
    labels = jnp.zeros((scores.shape[0],), jnp.int32)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(scores, labels))
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, TWO_TOWER_TX), {'loss': loss}


def first_is_positive_make():
  r = R(20)
  p = {'q': init_mlp(20, [8, 16, 8]), 'c': init_mlp(21, [8, 16, 8])}
  return opt_init(p, TWO_TOWER_TX), f32(r.normal(size=(16, 8))), f32(r.normal(size=(16, 5, 8)))


# why: softmax only over each query's OWN candidates; labels jnp.zeros from the shape.
add('first_candidate_is_positive_zeros_labels', first_is_positive_step,
    first_is_positive_make, expect_split=True)


ROT_TX = optax.adam(5e-3)


def rotation_pred_step(state, images):
  """RotNet: predict which of 4 rotations was applied."""
  def loss_fn(p):
    B = images.shape[0]
    rots = jnp.concatenate([jnp.rot90(images, k, axes=(1, 2)) for k in range(4)], axis=0)
    labels = jnp.repeat(jnp.arange(4), B)
    logits = mlp(p, rots.reshape(4 * B, -1))
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, ROT_TX), {'loss': loss}


def rotation_pred_make():
  r = R(21)
  return opt_init(init_mlp(22, [16, 16, 4]), ROT_TX), f32(r.normal(size=(16, 4, 4)))


# why: the batch is concatenated 4 times with labels jnp.repeat(arange(4), B) -- the block
# layout depends on B, but every (example, rotation) term is independent.
add('rotation_pred_concat_repeat_arange_labels', rotation_pred_step, rotation_pred_make,
    expect_split=True)


AUG_K = 3
AUG_TX = optax.adam(5e-3)


def which_shift_step(state, x):
  def loss_fn(p):
    shifts = p['shift_table']  # not trained (masked out below), fixed augmentations
    xr = jnp.repeat(x, AUG_K, axis=0)
    labels = jnp.arange(xr.shape[0]) % AUG_K
    xr = xr + lax.stop_gradient(shifts)[labels]
    logits = mlp(p['net'], xr)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, AUG_TX), {'loss': loss}


def which_shift_make():
  r = R(22)
  p = {'net': init_mlp(23, [6, 16, AUG_K]), 'shift_table': w(r, AUG_K, 6, scale=1.0)}
  return opt_init(p, AUG_TX), f32(r.normal(size=(24, 6)))


# why: jnp.repeat of the batch, labels jnp.arange(n) % k, stop_gradient on a table; each
# repeated copy only involves its own example.
add('repeat_batch_arange_mod_k_labels', which_shift_step, which_shift_make,
    expect_split=True)


LS_TX = optax.sgd(0.1)
LS_C = 6


def onehot_eye_ls_step(state, x, y):
  def loss_fn(p):
    onehot = jnp.eye(LS_C)[y]
    target = onehot * 0.9 + 0.1 / LS_C
    return jnp.mean(optax.softmax_cross_entropy(mlp(p, x), target))
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, LS_TX), {'loss': loss}


def onehot_eye_ls_make():
  r = R(23)
  return (opt_init(init_mlp(24, [8, 16, LS_C]), LS_TX), f32(r.normal(size=(24, 8))),
          i32(r.integers(0, LS_C, size=24)))


# why: one-hot targets via jnp.eye(num_classes)[y] (eye over classes, not the batch).
add('onehot_eye_label_smoothing', onehot_eye_ls_step, onehot_eye_ls_make, expect_split=True)


VQ_TX = optax.adam(3e-3)


def vq_codebook_step(state, batch):
  """batch = {'x': [B, 6], 'codebook': [K, 4]} -- the codebook is NOT per-example."""
  def loss_fn(p):
    x, codebook = batch['x'], batch['codebook']
    z = mlp(p['enc'], x)
    d = jnp.sum((z[:, None, :] - codebook[None, :, :]) ** 2, axis=-1)
    q = codebook[jnp.argmin(d, axis=1)]
    commit = jnp.mean(jnp.sum((z - lax.stop_gradient(q)) ** 2, axis=-1))
    zq = z + lax.stop_gradient(q - z)  # straight-through
    recon = mlp(p['dec'], zq)
    return jnp.mean(jnp.sum((recon - x) ** 2, axis=-1)) + 0.25 * commit
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, VQ_TX), {'loss': loss}


def vq_codebook_make():
  r = R(24)
  p = {'enc': init_mlp(25, [6, 16, 4]), 'dec': init_mlp(26, [4, 16, 6])}
  # codebook has 16 entries == the batch size, to look like a batch array
  return opt_init(p, VQ_TX), {'x': f32(r.normal(size=(16, 6))),
                              'codebook': f32(r.normal(size=(16, 4)))}


# why: the codebook rides in the batch dict with leading dim 16 == batch size but is shared
# by all examples; per-example nearest-code losses are independent of each other.
add('vq_codebook_in_batch_dict_same_leading_dim', vq_codebook_step, vq_codebook_make,
    expect_split=True)


PRIOR_TX = optax.adam(5e-3)


def logit_adjust_step(state, batch):
  def loss_fn(params):
    logits = state.apply_fn({'params': params}, batch['x'])
    adjusted = logits + 1.0 * batch['log_prior'][None, :]
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(adjusted, batch['y']))
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


def logit_adjust_make():
  r = R(25)
  C = 16  # as many classes as examples in the batch
  prior = r.dirichlet(np.ones(C))
  x = f32(r.normal(size=(16, 8)))
  batch = {'x': x, 'y': i32(r.choice(C, size=16, p=prior)), 'log_prior': f32(np.log(prior))}
  return make_ts(MLP((16, C)), x, PRIOR_TX), batch


# why: the class-prior vector [C=16] sits beside [16]-sized batch arrays; it is shared by
# all examples; the loss is a mean of per-example CE.
add('logit_adjustment_class_prior_vector_in_batch', logit_adjust_step, logit_adjust_make,
    expect_split=True)


KD_TX = optax.adam(5e-3)


def kd_temperature_step(state, batch):
  """batch = (x, y, temperature) -- temperature is a scalar riding in the batch tuple."""
  x, y, T = batch
  def loss_fn(p):
    s_logits = mlp(p, x)
    t_logits = lax.stop_gradient(mlp(state['teacher'], x))
    kl = optax.kl_divergence(jax.nn.log_softmax(s_logits / T), jax.nn.softmax(t_logits / T))
    ce = optax.softmax_cross_entropy_with_integer_labels(s_logits, y)
    return jnp.mean(0.5 * ce + 0.5 * (T ** 2) * kl)
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, KD_TX), {'loss': loss}


def kd_temperature_make():
  r = R(26)
  st = opt_init(init_mlp(27, [8, 12, 5]), KD_TX, teacher=init_mlp(28, [8, 32, 5], scale=2.0))
  return st, (f32(r.normal(size=(24, 8))), i32(r.integers(0, 5, size=24)), f32(2.0))


# why: classic Hinton distillation; teacher frozen in the state, scalar temperature in the
# batch tuple; per-example KL + CE.
add('distill_teacher_in_state_scalar_temperature_in_tuple', kd_temperature_step,
    kd_temperature_make, expect_split=True)


GRU_TX = optax.adam(5e-3)


def time_major_gru_step(state, x_tbd, y):
  """x is time-major: [T, B, D]."""
  def loss_fn(p):
    H = p['Uz'].shape[0]
    def cell(h, xt):
      z = jax.nn.sigmoid(xt @ p['Wz'] + h @ p['Uz'])
      r_ = jax.nn.sigmoid(xt @ p['Wr'] + h @ p['Ur'])
      n = jnp.tanh(xt @ p['Wn'] + (r_ * h) @ p['Un'])
      h = (1 - z) * n + z * h
      return h, h
    h0 = jnp.zeros((x_tbd.shape[1], H))
    hT, hs = lax.scan(cell, h0, x_tbd)
    logits = hT @ p['out']
    aux = jnp.mean(jnp.sum(hs ** 2, axis=-1))  # small activity regulariser over time
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y)) + 1e-3 * aux
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, GRU_TX), {'loss': loss}


def time_major_gru_make():
  r = R(27)
  D, H = 4, 10
  p = {k: w(r, D, H) for k in ('Wz', 'Wr', 'Wn')}
  p.update({k: w(r, H, H, scale=0.3) for k in ('Uz', 'Ur', 'Un')})
  p['out'] = w(r, H, 3)
  return opt_init(p, GRU_TX), f32(r.normal(size=(7, 16, D))), i32(r.integers(0, 3, size=16))


# why: time-major [T, B, D] GRU via lax.scan; sequences are independent (batch axis 1).
add('time_major_gru_lax_scan_batch_axis_1', time_major_gru_step, time_major_gru_make,
    expect_split=True)


SEMI_TX = optax.adam(5e-3)


def semi_supervised_step(state, labeled, unlabeled):
  """labeled = (x [16, D], y [16]); unlabeled = x [32, D]: two batch args of different size."""
  x_l, y_l = labeled
  def loss_fn(p):
    ce = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(mlp(p, x_l), y_l))
    pu = jax.nn.softmax(mlp(p, unlabeled))
    ent = jnp.mean(-jnp.sum(pu * jnp.log(pu + 1e-8), axis=-1))
    return ce + 0.3 * ent, (ce, ent)
  (loss, (ce, ent)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  return opt_apply(state, grads, SEMI_TX), {'loss': loss, 'ce': ce, 'entropy': ent}


def semi_supervised_make():
  r = R(28)
  return (opt_init(init_mlp(29, [6, 16, 4]), SEMI_TX),
          (f32(r.normal(size=(16, 6))), i32(r.integers(0, 4, size=16))),
          f32(r.normal(size=(32, 6))))


# why: two means over two independent batches of different sizes; each is a sum over its
# own examples (split both proportionally).
add('semi_supervised_entropy_min_two_batches_diff_sizes', semi_supervised_step,
    semi_supervised_make, expect_split=True)


SIAM_TX = optax.adam(5e-3)
MARGIN = 1.0


def siamese_halves_step(state, x_pairs, same):
  """x_pairs is [2B, D]: rows i and i+B form pair i."""
  def loss_fn(p):
    e = mlp(p, x_pairs)
    B = e.shape[0] // 2
    d = jnp.sqrt(jnp.sum((e[:B] - e[B:]) ** 2, axis=-1) + 1e-8)
    l = same * d ** 2 + (1 - same) * jnp.maximum(MARGIN - d, 0.0) ** 2
    return jnp.mean(l)
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, SIAM_TX), {'loss': loss}


def siamese_halves_make():
  r = R(29)
  return (opt_init(init_mlp(30, [6, 16, 4]), SIAM_TX), f32(r.normal(size=(32, 6))),
          f32(r.integers(0, 2, size=16)))


# why: pairs stored as [2B, D] with pair i = rows (i, i+B); each pair's loss only involves
# its own two rows (a naive contiguous split of the 2B rows would break the pairing).
add('siamese_pairs_stored_as_two_halves', siamese_halves_step, siamese_halves_make,
    expect_split=True)


def siamese_interleaved_step(state, x_pairs, same):
  """x_pairs is [2B, D] interleaved: rows 2i and 2i+1 form pair i."""
  def loss_fn(p):
    e = mlp(p, x_pairs).reshape(-1, 2, 4)
    d2 = jnp.sum((e[:, 0] - e[:, 1]) ** 2, axis=-1)
    l = same * d2 + (1 - same) * jnp.maximum(MARGIN - jnp.sqrt(d2 + 1e-8), 0.0) ** 2
    return jnp.mean(l)
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, SIAM_TX), {'loss': loss}


def siamese_interleaved_make():
  r = R(30)
  return (opt_init(init_mlp(31, [6, 16, 4]), SIAM_TX), f32(r.normal(size=(32, 6))),
          f32(r.integers(0, 2, size=16)))


# why: interleaved pairs, reshaped to [B, 2, D]: pairs are independent.
add('siamese_pairs_interleaved_reshape', siamese_interleaved_step, siamese_interleaved_make,
    expect_split=True)


SGNS_TX = optax.adam(1e-2)


def sgns_step(state, centers, contexts, negatives):
  """Skip-gram negative sampling; negatives [B, K] are given per example."""
  def loss_fn(p):
    c = p['in'][centers]                       # [B, D]
    ctx = jnp.concatenate([contexts[:, None], negatives], axis=1)  # [B, 1+K]
    o = p['out'][ctx]                          # [B, 1+K, D]
    logits = jnp.einsum('bd,bkd->bk', c, o)
    labels = jnp.concatenate([jnp.ones((c.shape[0], 1)),
                              jnp.zeros((c.shape[0], negatives.shape[1]))], axis=1)
    return jnp.mean(jnp.sum(optax.sigmoid_binary_cross_entropy(logits, labels), axis=1))
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, SGNS_TX), {'loss': loss}


def sgns_make():
  r = R(31)
  p = {'in': w(r, 30, 8, scale=0.3), 'out': w(r, 30, 8, scale=0.3)}
  return (opt_init(p, SGNS_TX), i32(r.integers(0, 30, size=32)), i32(r.integers(0, 30, size=32)),
          i32(r.integers(0, 30, size=(32, 5))))


# why: labels jnp.ones / jnp.zeros built from shapes; every example has its own negatives.
# Embedding gradients are scatter-adds, still a sum over examples.
add('skipgram_given_negatives_ones_zeros_labels', sgns_step, sgns_make, expect_split=True)


MIX_TX = optax.sgd(0.1, momentum=0.9)


def mixup_flip_step(state, x, y):
  def loss_fn(p):
    lam = 0.7
    yoh = jax.nn.one_hot(y, 4)
    xm = lam * x + (1 - lam) * jnp.flip(x, axis=0)
    ym = lam * yoh + (1 - lam) * jnp.flip(yoh, axis=0)
    return jnp.mean(optax.softmax_cross_entropy(mlp(p, xm), ym))
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, MIX_TX), {'loss': loss}


def mixup_flip_make():
  r = R(32)
  return (opt_init(init_mlp(33, [8, 16, 4]), MIX_TX), f32(r.normal(size=(32, 8))),
          i32(r.integers(0, 4, size=32)))


# why: mixup partner = the batch reversed. The mixing is parameter-free preprocessing of the
# whole batch; after it, the loss is a mean over mixed examples. (A microbatch flipping
# itself pairs different examples.)
add('mixup_with_flipped_batch_partner', mixup_flip_step, mixup_flip_make, expect_split=True)


# ========================================================================================
# 4. models with their own remat / scan / loops / control flow
# ========================================================================================

CKPT_TX = optax.adam(3e-3)


def ckpt_policy_step(state, x, y):
  def block(p, h):
    return h + jax.nn.gelu(h @ p['w1']) @ p['w2']
  block_ckpt = jax.checkpoint(block, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)

  def loss_fn(params):
    h = x @ params['inp']
    for p in params['blocks']:
      h = block_ckpt(p, h)
    return jnp.mean((h @ params['head'] - y) ** 2)
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, CKPT_TX), {'loss': loss}


def ckpt_policy_make():
  r = R(33)
  p = {'inp': w(r, 6, 12), 'head': w(r, 12, 2),
       'blocks': [{'w1': w(r, 12, 24, scale=0.2), 'w2': w(r, 24, 12, scale=0.2)} for _ in range(3)]}
  return opt_init(p, CKPT_TX), f32(r.normal(size=(24, 6))), f32(r.normal(size=(24, 2)))


# why: rematerialised residual blocks with a save policy; still a per-example MSE.
add('jax_checkpoint_dots_policy_resnet_mlp', ckpt_policy_step, ckpt_policy_make,
    expect_split=True)


class RematBlock(nn.Module):
  dim: int

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(x)
    h = nn.Dense(self.dim * 2)(h)
    return x + nn.Dense(self.dim)(nn.gelu(h))


class RematNet(nn.Module):
  dim: int = 12
  depth: int = 3

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(self.dim)(x)
    Block = nn.remat(RematBlock, prevent_cse=True)
    for _ in range(self.depth):
      x = Block(self.dim)(x)
    return nn.Dense(3)(x)


def linen_remat_step(state, x, y):
  def loss_fn(params):
    logits = state.apply_fn({'params': params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


def linen_remat_make():
  r = R(34)
  x = f32(r.normal(size=(16, 6)))
  return make_ts(RematNet(), x, optax.adamw(3e-3)), x, i32(r.integers(0, 3, size=16))


# why: nn.remat blocks with LayerNorm (per-example normalisation over features).
add('linen_nn_remat_layernorm_blocks', linen_remat_step, linen_remat_make, expect_split=True)


class ScanLayer(nn.Module):
  dim: int

  @nn.compact
  def __call__(self, x, _):
    return x + nn.tanh(nn.Dense(self.dim)(x)), None


class ScannedStack(nn.Module):
  dim: int = 12
  depth: int = 4

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(self.dim)(x)
    Stack = nn.scan(nn.remat(ScanLayer), variable_axes={'params': 0},
                    split_rngs={'params': True}, length=self.depth)
    x, _ = Stack(self.dim)(x, None)
    return nn.Dense(1)(x)


def linen_scan_layers_step(state, x, y):
  def loss_fn(params):
    pred = state.apply_fn({'params': params}, x)[:, 0]
    return jnp.mean(optax.huber_loss(pred, y))
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


def linen_scan_layers_make():
  r = R(35)
  x = f32(r.normal(size=(32, 5)))
  return make_ts(ScannedStack(), x, optax.adam(3e-3)), x, f32(r.normal(size=32))


# why: nn.scan(nn.remat(layer)) over layers with stacked params; per-example Huber.
add('linen_nn_scan_over_remat_layers', linen_scan_layers_step, linen_scan_layers_make,
    expect_split=True)


class LSTMStep(nn.Module):
  hidden: int

  @nn.compact
  def __call__(self, carry, x):
    new_carry, y = nn.OptimizedLSTMCell(self.hidden)(carry, x)
    # keep the carry dtype fixed so the scan is well typed whatever the param dtype
    new_carry = jax.tree_util.tree_map(lambda n, c: n.astype(c.dtype), new_carry, carry)
    return new_carry, y


class ScanLSTM(nn.Module):
  hidden: int = 10

  @nn.compact
  def __call__(self, x):  # x [B, T, D]
    cell = nn.scan(LSTMStep, variable_broadcast='params',
                   split_rngs={'params': False}, in_axes=1, out_axes=1)(self.hidden)
    B = x.shape[0]
    carry = (jnp.zeros((B, self.hidden), x.dtype), jnp.zeros((B, self.hidden), x.dtype))
    _, ys = cell(carry, x)
    return nn.Dense(V)(ys)


def linen_scan_lstm_step(state, tokens, lengths):
  def loss_fn(params):
    x = jax.nn.one_hot(tokens[:, :-1], V)
    logits = state.apply_fn({'params': params}, x)
    T = tokens.shape[1] - 1
    mask = (jnp.arange(T)[None, :] < (lengths[:, None] - 1)).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return jnp.sum(ce * mask) / jnp.sum(mask)
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


def linen_scan_lstm_make():
  r = R(36)
  toks = i32(r.integers(1, V, size=(16, 8)))
  lengths = i32(r.integers(3, 9, size=16))
  x = jax.nn.one_hot(toks[:, :-1], V, dtype=jnp.float32)
  return make_ts(ScanLSTM(), x, optax.adam(5e-3)), toks, lengths


# why: nn.scan over time (batch-first, in_axes=1) with a length mask built by jnp.arange;
# per-token loss normalised by the batch's valid-token count.
add('linen_nn_scan_lstm_over_time_length_mask', linen_scan_lstm_step, linen_scan_lstm_make,
    expect_split=True)


class NnxBlock(nnx.Module):
  def __init__(self, dim, rngs):
    self.norm = nnx.LayerNorm(dim, rngs=rngs)
    self.fc1 = nnx.Linear(dim, 2 * dim, rngs=rngs)
    self.fc2 = nnx.Linear(2 * dim, dim, rngs=rngs)

  def __call__(self, x):
    return x + self.fc2(nnx.gelu(self.fc1(self.norm(x))))


class NnxRematNet(nnx.Module):
  def __init__(self, din, dim, dout, depth, rngs):
    self.inp = nnx.Linear(din, dim, rngs=rngs)
    self.blocks = nnx.List([NnxBlock(dim, rngs) for _ in range(depth)])
    self.head = nnx.Linear(dim, dout, rngs=rngs)

  def __call__(self, x):
    x = self.inp(x)
    for blk in self.blocks:
      x = nnx.remat(lambda b, h: b(h))(blk, x)
    return self.head(x)


def nnx_remat_step(state, x, y):
  model, optimizer = state
  def loss_fn(model):
    logits = model(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return (model, optimizer), {'loss': loss}


def nnx_remat_make():
  r = R(37)
  model = NnxRematNet(6, 12, 4, 3, nnx.Rngs(0))
  opt = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
  return (model, opt), f32(r.normal(size=(16, 6))), i32(r.integers(0, 4, size=16))


# why: nnx.remat around LayerNorm residual blocks, nnx.Optimizer; per-example CE.
add('nnx_remat_blocks_nnx_optimizer', nnx_remat_step, nnx_remat_make, expect_split=True)


class NnxDropoutNet(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(8, 32, rngs=rngs)
    self.drop = nnx.Dropout(0.3, rngs=rngs)
    self.l2 = nnx.Linear(32, 3, rngs=rngs)

  def __call__(self, x):
    return self.l2(self.drop(nnx.relu(self.l1(x))))


def nnx_dropout_step(state, x, y):
  model, optimizer = state
  model.train()
  def loss_fn(model):
    logits = model(x)   # nnx.Dropout draws from the model's own 'dropout' rng stream
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return (model, optimizer), {'loss': loss}


def nnx_dropout_make():
  r = R(38)
  model = NnxDropoutNet(nnx.Rngs(params=0, dropout=1))
  return ((model, nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)),
          f32(r.normal(size=(24, 8))), i32(r.integers(0, 3, size=24)))


# why: nnx.Dropout drawing from the rng state carried inside the model (advanced each
# call); per-example dropout masks, per-example CE.
add('nnx_dropout_rng_stream_in_model', nnx_dropout_step, nnx_dropout_make,
    stochastic=True, expect_split=True)


DEQ_TX = optax.adam(3e-3)


def _deq_f(W, U, x, z):
  return jnp.tanh(z @ W + x @ U)


def _solve_batch_tol(fn, z0, tol=1e-5, max_iter=200):
  def cond(c):
    z, zp, i = c
    return (jnp.max(jnp.abs(z - zp)) > tol) & (i < max_iter)
  def body(c):
    z, _, i = c
    return fn(z), z, i + 1
  z, _, n = lax.while_loop(cond, body, (fn(z0), z0, jnp.int32(1)))
  return z, n


@jax.custom_vjp
def deq_layer(W, U, x):
  z, _ = _solve_batch_tol(lambda z: _deq_f(W, U, x, z), jnp.zeros((x.shape[0], W.shape[0])))
  return z


def _deq_fwd(W, U, x):
  z = deq_layer(W, U, x)
  return z, (W, U, x, z)


def _deq_bwd(res, g):
  W, U, x, z = res
  _, vjp = jax.vjp(lambda W, U, x, z: _deq_f(W, U, x, z), W, U, x, z)
  u, _ = _solve_batch_tol(lambda u: vjp(u)[3] + g, jnp.zeros_like(g))
  dW, dU, dx, _ = vjp(u)
  return dW, dU, dx


deq_layer.defvjp(_deq_fwd, _deq_bwd)


def deq_step(state, x, y):
  def loss_fn(p):
    z = deq_layer(p['W'], p['U'], x)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(z @ p['out'], y))
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, DEQ_TX), {'loss': loss}


def deq_make():
  r = R(39)
  p = {'W': w(r, 10, 10, scale=0.15), 'U': w(r, 6, 10), 'out': w(r, 10, 3)}
  return opt_init(p, DEQ_TX), f32(r.normal(size=(16, 6))), i32(r.integers(0, 3, size=16))


# why: each example's fixed point is its own, but the while_loop stops on the max residual
# over the WHOLE batch (forward and implicit backward), so the iteration count couples
# examples at the 1e-5 level -- unsure whether that counts.
add('deq_while_loop_batch_global_tolerance_custom_vjp', deq_step, deq_make,
    expect_split=None)


FORI_TX = optax.adam(3e-3)


def fori_depth_step(state, x, y):
  def loss_fn(p):
    u = x @ p['U']
    h = lax.fori_loop(0, 5, lambda i, h: jnp.tanh(h @ p['W'] + u + 0.1 * i), jnp.zeros_like(u))
    return jnp.mean((h @ p['out'] - y) ** 2)
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, FORI_TX), {'loss': loss}


def fori_depth_make():
  r = R(40)
  p = {'W': w(r, 10, 10, scale=0.3), 'U': w(r, 5, 10), 'out': w(r, 10, 2)}
  return opt_init(p, FORI_TX), f32(r.normal(size=(24, 5))), f32(r.normal(size=(24, 2)))


# why: weight-tied depth via fori_loop with a static trip count (reverse-differentiable);
# each row evolves on its own.
add('fori_loop_weight_tied_depth', fori_depth_step, fori_depth_make, expect_split=True)


SPARSEMAX_TX = optax.adam(5e-3)


def _sparsemax_tau(z, iters=40):
  lo = jnp.max(z, axis=-1) - 1.0
  hi = jnp.max(z, axis=-1)
  def body(c):
    lo, hi, i = c
    mid = 0.5 * (lo + hi)
    s = jnp.sum(jnp.maximum(z - mid[:, None], 0.0), axis=-1)
    return jnp.where(s > 1, mid, lo), jnp.where(s > 1, hi, mid), i + 1
  lo, hi, _ = lax.while_loop(lambda c: c[2] < iters, body, (lo, hi, jnp.int32(0)))
  return 0.5 * (lo + hi)


def sparsemax_step(state, x, y):
  def loss_fn(p):
    z = mlp(p, x)
    tau = lax.stop_gradient(_sparsemax_tau(lax.stop_gradient(z)))
    probs = jnp.maximum(z - tau[:, None], 0.0)
    return jnp.mean(jnp.sum((probs - jax.nn.one_hot(y, z.shape[-1])) ** 2, axis=-1))
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, SPARSEMAX_TX), {'loss': loss}


def sparsemax_make():
  r = R(41)
  return (opt_init(init_mlp(42, [8, 16, 6], scale=2.0), SPARSEMAX_TX),
          f32(r.normal(size=(32, 8))), i32(r.integers(0, 6, size=32)))


# why: per-row bisection in a fixed-count while_loop under stop_gradient; rows never mix.
add('sparsemax_bisection_while_loop_stop_gradient', sparsemax_step, sparsemax_make,
    expect_split=True)


def cond_step_counter_step(state, x, y):
  def loss_fn(params):
    pred = state.apply_fn({'params': params}, x)
    mse = lambda: jnp.mean((pred - y) ** 2)
    l1 = lambda: jnp.mean(jnp.abs(pred - y))
    # every third step use L1 (warm-up trick from some codebase)
    return lax.cond(state.step % 3 == 0, l1, mse)
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss, 'step': state.step}


def cond_step_counter_make():
  r = R(42)
  x = f32(r.normal(size=(24, 6)))
  return make_ts(MLP((16, 2)), x, optax.sgd(0.05)), x, f32(r.normal(size=(24, 2)))


# why: lax.cond on the TrainState step counter picks L1 or MSE; both are per-example means.
add('lax_cond_on_trainstate_step_counter', cond_step_counter_step, cond_step_counter_make,
    expect_split=True)


SWITCH_TX = optax.adam(5e-3)


def switch_flag_step(state, x, y, loss_kind):
  def loss_fn(p):
    pred = mlp(p, x)[:, 0]
    branches = [lambda d: jnp.mean(d ** 2),
                lambda d: jnp.mean(optax.huber_loss(d, delta=0.5)),
                lambda d: jnp.mean(jnp.log(jnp.cosh(d)))]
    return lax.switch(loss_kind, branches, pred - y)
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, SWITCH_TX), {'loss': loss}


def switch_flag_make():
  r = R(43)
  return (opt_init(init_mlp(43, [6, 16, 1]), SWITCH_TX), f32(r.normal(size=(32, 6))),
          f32(r.normal(size=32)), i32(2))


# why: lax.switch on an int32 config flag passed as a (non-batch) scalar argument.
add('lax_switch_on_config_flag_argument', switch_flag_step, switch_flag_make,
    expect_split=True)


# ========================================================================================
# 5. custom derivative rules, stop_gradient, higher order, vmap
# ========================================================================================

@jax.custom_jvp
def round_ste(x):
  return jnp.round(x)


@round_ste.defjvp
def _round_ste_jvp(primals, tangents):
  (x,), (t,) = primals, tangents
  return jnp.round(x), t


def fake_quant(x, bits=4):
  scale = lax.stop_gradient(jnp.max(jnp.abs(x)) / (2 ** (bits - 1) - 1) + 1e-8)
  return round_ste(x / scale) * scale


QAT_TX = optax.adam(3e-3)


def qat_step(state, x, y):
  def loss_fn(p):
    h = jax.nn.relu(x @ fake_quant(p['w1']) + p['b1'])
    logits = h @ fake_quant(p['w2']) + p['b2']
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, QAT_TX), {'loss': loss}


def qat_make():
  r = R(44)
  p = {'w1': w(r, 8, 16), 'b1': f32(np.zeros(16)), 'w2': w(r, 16, 4), 'b2': f32(np.zeros(4))}
  return opt_init(p, QAT_TX), f32(r.normal(size=(32, 8))), i32(r.integers(0, 4, size=32))


# why: straight-through custom_jvp on WEIGHTS only (scale from the weights); activations
# are not quantised with batch statistics, so the loss is per-example.
add('qat_straight_through_custom_jvp_weights', qat_step, qat_make, expect_split=True)


ROWCLIP = 0.35


@jax.custom_vjp
def clip_row_grad(h):
  return h


def _crg_fwd(h):
  return h, None


def _crg_bwd(_, g):
  n = jnp.sqrt(jnp.sum(g * g, axis=-1, keepdims=True))
  return (g * jnp.minimum(1.0, ROWCLIP / (n + 1e-12)),)


clip_row_grad.defvjp(_crg_fwd, _crg_bwd)

ROWCLIP_TX = optax.sgd(0.5)


def row_clip_step(state, x, y):
  def loss_fn(p):
    h = jnp.tanh(x @ p['w1'])
    h = clip_row_grad(h)  # clip each example's activation gradient
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(h @ p['w2'], y))
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, ROWCLIP_TX), {'loss': loss}


def row_clip_make():
  r = R(45)
  p = {'w1': w(r, 8, 16), 'w2': w(r, 16, 4, scale=1.5)}
  return opt_init(p, ROWCLIP_TX), f32(r.normal(size=(16, 8))), i32(r.integers(0, 4, size=16))


# why: custom_vjp clipping each ROW of the activation cotangent: the batch gradient is a sum
# over examples of per-example terms. (The cotangent carries the 1/B of the mean, so a
# microbatch that takes its own mean would clip at a different scale.)
add('custom_vjp_per_example_activation_grad_clip', row_clip_step, row_clip_make,
    expect_split=True)


BATCHCLIP = 0.8


@jax.custom_vjp
def clip_batch_grad(h):
  return h


def _cbg_fwd(h):
  return h, None


def _cbg_bwd(_, g):
  n = jnp.sqrt(jnp.sum(g * g))
  return (g * jnp.minimum(1.0, BATCHCLIP / (n + 1e-12)),)


clip_batch_grad.defvjp(_cbg_fwd, _cbg_bwd)


def batch_clip_step(state, x, y):
  def loss_fn(p):
    h = clip_batch_grad(jnp.tanh(x @ p['w1']))
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(h @ p['w2'], y))
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, ROWCLIP_TX), {'loss': loss}


def batch_clip_make():
  r = R(46)
  p = {'w1': w(r, 8, 16), 'w2': w(r, 16, 4, scale=1.5)}
  return opt_init(p, ROWCLIP_TX), f32(r.normal(size=(16, 8))), i32(r.integers(0, 4, size=16))


# why: the activation cotangent is clipped by its norm over the WHOLE batch; the clip factor
# depends on every example's parameter-dependent gradient and scales every example's term.
add('custom_vjp_whole_batch_activation_grad_clip', batch_clip_step, batch_clip_make,
    expect_split=False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def grad_reverse(x, lam):
  return x


def _gr_fwd(x, lam):
  return x, None


def _gr_bwd(lam, _, g):
  return (-lam * g,)


grad_reverse.defvjp(_gr_fwd, _gr_bwd)
DANN_TX = optax.adam(3e-3)


def dann_step(state, src, tgt_x):
  """src = (x [16, D], y [16]); tgt_x = [24, D] unlabeled target domain."""
  x_s, y_s = src
  def loss_fn(p):
    f_s = mlp(p['feat'], x_s, act=jax.nn.relu)
    f_t = mlp(p['feat'], tgt_x, act=jax.nn.relu)
    cls = optax.softmax_cross_entropy_with_integer_labels(mlp(p['cls'], f_s), y_s).mean()
    feats = grad_reverse(jnp.concatenate([f_s, f_t], axis=0), 0.5)
    dom_labels = jnp.concatenate([jnp.zeros(f_s.shape[0]), jnp.ones(f_t.shape[0])])
    dom = optax.sigmoid_binary_cross_entropy(mlp(p['dom'], feats)[:, 0], dom_labels).mean()
    return cls + dom, (cls, dom)
  (loss, (cls, dom)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  return opt_apply(state, grads, DANN_TX), {'loss': loss, 'cls': cls, 'domain': dom}


def dann_make():
  r = R(47)
  p = {'feat': init_mlp(48, [6, 16, 8]), 'cls': init_mlp(49, [8, 3]), 'dom': init_mlp(50, [8, 8, 1])}
  return (opt_init(p, DANN_TX), (f32(r.normal(size=(16, 6))), i32(r.integers(0, 3, size=16))),
          f32(r.normal(size=(24, 6)) + 0.5))


# why: gradient reversal via custom_vjp; the domain loss is a mean over the CONCATENATION of
# source (16) and target (24) features -- a single mean over 40 rows, still a sum; domain
# labels from jnp.zeros/jnp.ones of the shapes.
add('dann_gradient_reversal_custom_vjp_concat_domains', dann_step, dann_make,
    expect_split=True)


class ByolState(struct.PyTreeNode):
  params: dict
  target: dict
  opt_state: optax.OptState
  key: jax.Array
  step: jax.Array


BYOL_TX = optax.adam(3e-3)


def byol_step(state, x):
  key = jax.random.fold_in(state.key, state.step)
  k1, k2 = jax.random.split(key)
  v1 = x + 0.1 * jax.random.normal(k1, x.shape)
  v2 = x * (1.0 + 0.1 * jax.random.normal(k2, x.shape))

  def loss_fn(params):
    def one_way(a, b):
      p = l2norm(mlp(params['pred'], mlp(params['enc'], a)))
      z = lax.stop_gradient(l2norm(mlp(state.target, b)))
      return jnp.mean(2.0 - 2.0 * jnp.sum(p * z, axis=-1))
    return one_way(v1, v2) + one_way(v2, v1)
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  updates, opt_state = BYOL_TX.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  target = optax.incremental_update(params['enc'], state.target, step_size=0.01)
  return state.replace(params=params, target=target, opt_state=opt_state,
                       step=state.step + 1), {'loss': loss}


def byol_make():
  r = R(48)
  params = {'enc': init_mlp(51, [8, 16, 8]), 'pred': init_mlp(52, [8, 16, 8])}
  st = ByolState(params=params, target=jax.tree_util.tree_map(jnp.array, params['enc']),
                 opt_state=BYOL_TX.init(params), key=key0(48), step=jnp.int32(0))
  return st, f32(r.normal(size=(32, 8)))


# why: BYOL without BatchNorm: per-example cosine between online prediction and a
# stop_gradient target projection; EMA target update is a function of the new params.
add('byol_no_batchnorm_stop_gradient_target_ema', byol_step, byol_make, stochastic=True,
    expect_split=True)


class GpState(struct.PyTreeNode):
  critic: list
  gen: list
  opt_state: optax.OptState
  key: jax.Array
  step: jax.Array


GP_TX = optax.adam(1e-3, b1=0.5, b2=0.9)


def wgan_gp_critic_step(state, real):
  key = jax.random.fold_in(state.key, state.step)
  kz, ke = jax.random.split(key)
  B = real.shape[0]
  fake = mlp(state.gen, jax.random.normal(kz, (B, 4)))
  eps = jax.random.uniform(ke, (B, 1))
  interp = eps * real + (1 - eps) * fake

  def loss_fn(critic):
    f = lambda xx: mlp(critic, xx, act=jax.nn.leaky_relu)[:, 0]
    gx = jax.grad(lambda xx: jnp.sum(f(xx)))(interp)   # per-example input gradients
    gp = jnp.mean((jnp.sqrt(jnp.sum(gx ** 2, axis=-1) + 1e-12) - 1.0) ** 2)
    w_dist = jnp.mean(f(real)) - jnp.mean(f(fake))
    return -w_dist + 10.0 * gp, w_dist
  (loss, w_dist), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.critic)
  updates, opt_state = GP_TX.update(grads, state.opt_state, state.critic)
  return state.replace(critic=optax.apply_updates(state.critic, updates), opt_state=opt_state,
                       step=state.step + 1), {'loss': loss, 'w_dist': w_dist}


def wgan_gp_make():
  r = R(49)
  critic = init_mlp(53, [6, 16, 1])
  st = GpState(critic=critic, gen=init_mlp(54, [4, 16, 6]), opt_state=GP_TX.init(critic),
               key=key0(49), step=jnp.int32(0))
  return st, f32(r.normal(size=(32, 6)))


# why: gradient penalty is a second-order term but jax.grad of the SUMMED critic gives
# per-example input gradients (no batch coupling in the critic); a mean over examples.
add('wgan_gp_critic_double_backprop', wgan_gp_critic_step, wgan_gp_make, stochastic=True,
    expect_split=True)


MAML_TX = optax.adam(1e-3)


def maml_step(state, support, query):
  xs, ys = support
  xq, yq = query
  def task_loss(p, x, y):
    return jnp.mean((mlp(p, x) - y) ** 2)
  def outer(p):
    g = jax.grad(task_loss)(p, xs, ys)
    adapted = jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, g)
    return task_loss(adapted, xq, yq)
  loss, grads = jax.value_and_grad(outer)(state['params'])
  return opt_apply(state, grads, MAML_TX), {'query_loss': loss}


def maml_make():
  r = R(50)
  return (opt_init(init_mlp(55, [3, 16, 1]), MAML_TX),
          (f32(r.normal(size=(16, 3))), f32(r.normal(size=(16, 1)))),
          (f32(r.normal(size=(16, 3))), f32(r.normal(size=(16, 1)))))


# why: the query loss is evaluated at parameters adapted by the gradient of the WHOLE
# support batch: every query term depends on all support examples through the params.
add('maml_one_inner_step_support_query', maml_step, maml_make, expect_split=False)


DP_TX = optax.sgd(0.1)
DP_CLIP = 0.5


def dp_sgd_step(state, x, y):
  params = state['params']
  def ex_loss(p, xi, yi):
    logits = mlp(p, xi[None])[0]
    return optax.softmax_cross_entropy_with_integer_labels(logits, yi)
  losses, per_ex = jax.vmap(jax.value_and_grad(ex_loss), in_axes=(None, 0, 0))(params, x, y)
  sq = sum(jnp.sum(g.reshape(g.shape[0], -1) ** 2, axis=1)
           for g in jax.tree_util.tree_leaves(per_ex))
  factor = jnp.minimum(1.0, DP_CLIP / (jnp.sqrt(sq) + 1e-6))
  grads = jax.tree_util.tree_map(
      lambda g: jnp.tensordot(factor, g, axes=1) / x.shape[0], per_ex)
  return opt_apply(state, grads, DP_TX), {'loss': jnp.mean(losses),
                                          'clipped_frac': jnp.mean(factor < 1.0)}


def dp_sgd_make():
  r = R(51)
  return (opt_init(init_mlp(56, [8, 16, 4], scale=2.0), DP_TX), f32(r.normal(size=(32, 8))),
          i32(r.integers(0, 4, size=32)))


# why: DP-SGD without noise: vmap(grad) per example, clip each, average -- a sum over
# examples of per-example clipped gradients (no value_and_grad of a batch loss at all).
add('dp_sgd_vmap_per_example_clip_no_noise', dp_sgd_step, dp_sgd_make, expect_split=True)


ENS_TX = optax.adam(5e-3)


def ensemble_vmap_step(state, x, y):
  def loss_fn(stacked):
    logits = jax.vmap(lambda p: mlp(p, x))(stacked)     # [E, B, C]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y[None, :])
    mean_prob = jnp.mean(jax.nn.softmax(logits), axis=0)
    nll_ens = -jnp.log(jnp.take_along_axis(mean_prob, y[:, None], axis=1)[:, 0] + 1e-8)
    return jnp.mean(ce) + 0.1 * jnp.mean(nll_ens)
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, ENS_TX), {'loss': loss}


def ensemble_vmap_make():
  r = R(52)
  members = [init_mlp(60 + i, [6, 12, 3]) for i in range(4)]
  stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *members)
  return opt_init(stacked, ENS_TX), f32(r.normal(size=(24, 6))), i32(r.integers(0, 3, size=24))


# why: jax.vmap over ensemble members (not examples); the ensemble NLL mixes members but
# only within each example.
add('vmap_over_ensemble_members_ensemble_nll', ensemble_vmap_step, ensemble_vmap_make,
    expect_split=True)


HUTCH_TX = optax.adam(3e-3)


class KeyedState(struct.PyTreeNode):
  params: dict
  opt_state: optax.OptState
  key: jax.Array
  step: jax.Array


def hutchinson_make():
  r = R(53)
  params = {'a': init_mlp(57, [4, 12])[0], 'b': init_mlp(58, [12, 1])[0]}
  st = KeyedState(params=params, opt_state=HUTCH_TX.init(params), key=key0(53),
                  step=jnp.int32(0))
  return st, f32(r.normal(size=(16, 4))), f32(r.normal(size=(16, 1)))


def hutchinson_step2(state, x, y):
  key = jax.random.fold_in(state.key, state.step)
  leaves, treedef = jax.tree_util.tree_flatten(state.params)
  keys = jax.random.split(key, len(leaves))
  v = jax.tree_util.tree_unflatten(
      treedef, [jax.random.rademacher(k, l.shape, dtype=l.dtype) for k, l in zip(keys, leaves)])

  def data_loss(p):
    h = jnp.tanh(x @ p['a']['w'] + p['a']['b'])
    return jnp.mean((h @ p['b']['w'] + p['b']['b'] - y) ** 2)

  def total(p):
    hv = jax.jvp(jax.grad(data_loss), (p,), (v,))[1]
    trace_est = sum(jnp.vdot(a, b) for a, b in zip(jax.tree_util.tree_leaves(v),
                                                   jax.tree_util.tree_leaves(hv)))
    return data_loss(p) + 1e-3 * trace_est, trace_est
  (loss, tr), grads = jax.value_and_grad(total, has_aux=True)(state.params)
  updates, opt_state = HUTCH_TX.update(grads, state.opt_state, state.params)
  return state.replace(params=optax.apply_updates(state.params, updates), opt_state=opt_state,
                       step=state.step + 1), {'loss': loss, 'hess_trace': tr}


# why: Hutchinson estimate v^T H v of the mean loss is linear in the batch loss, so a sum
# over examples (the third-order autodiff through it is still per example); the random
# probe v is drawn once per step, not per example.
add('hutchinson_hessian_trace_regulariser', hutchinson_step2, hutchinson_make,
    stochastic=True, expect_split=True)


GNP_TX = optax.sgd(0.05)


def grad_norm_penalty_step(state, x, y):
  def data_loss(p):
    return optax.softmax_cross_entropy_with_integer_labels(mlp(p, x), y).mean()
  def total(p):
    l, g = jax.value_and_grad(data_loss)(p)
    gn2 = sum(jnp.sum(t ** 2) for t in jax.tree_util.tree_leaves(g))
    return l + 0.1 * gn2, (l, gn2)
  (loss, (l, gn2)), grads = jax.value_and_grad(total, has_aux=True)(state['params'])
  return opt_apply(state, grads, GNP_TX), {'loss': loss, 'data': l, 'grad_norm2': gn2}


def grad_norm_penalty_make():
  r = R(54)
  return (opt_init(init_mlp(59, [6, 12, 3]), GNP_TX), f32(r.normal(size=(16, 6))),
          i32(r.integers(0, 3, size=16)))


# why: ||grad of the batch mean||^2 = sum over PAIRS of examples of g_i.g_j -- a function of
# one (vector) sum, but with cross terms between examples through the params. Unsure.
add('gradient_norm_penalty_double_backprop', grad_norm_penalty_step, grad_norm_penalty_make,
    expect_split=None)


SAM_TX = optax.sgd(0.05, momentum=0.9)
SAM_RHO = 0.05


def sam_step(state, x, y):
  def loss_fn(p):
    return optax.softmax_cross_entropy_with_integer_labels(mlp(p, x), y).mean()
  params = state['params']
  loss, g = jax.value_and_grad(loss_fn)(params)
  gnorm = optax.global_norm(g)
  eps = jax.tree_util.tree_map(lambda t: SAM_RHO * t / (gnorm + 1e-12), g)
  perturbed = jax.tree_util.tree_map(jnp.add, params, eps)
  sam_loss, sam_g = jax.value_and_grad(loss_fn)(perturbed)
  return opt_apply(state, sam_g, SAM_TX), {'loss': loss, 'sam_loss': sam_loss}


def sam_make():
  r = R(55)
  return (opt_init(init_mlp(61, [6, 16, 3]), SAM_TX), f32(r.normal(size=(24, 6))),
          i32(r.integers(0, 3, size=24)))


# why: the gradient used is taken at params + rho * g/|g| with g the WHOLE-batch gradient:
# each example's gradient depends on every other example through the perturbation.
add('sam_sharpness_aware_two_pass', sam_step, sam_make, expect_split=False)


# ========================================================================================
# 6. mixture of experts
# ========================================================================================

E_MOE, D_MOE = 4, 8
MOE_TX = optax.adam(3e-3)


def moe_params(seed):
  r = R(seed)
  return {'router': w(r, D_MOE, E_MOE, scale=0.5), 'w_in': w(r, E_MOE, D_MOE, 16, scale=0.35),
          'w_out': w(r, E_MOE, 16, D_MOE, scale=0.25), 'head': w(r, D_MOE, D_MOE)}


def _experts_dense(p, x):
  h = jax.nn.gelu(jnp.einsum('nd,edh->neh', x, p['w_in']))
  return jnp.einsum('neh,ehd->ned', h, p['w_out'])  # [N, E, D]: every expert on every token


def moe_make(seed, B=16, T=4):
  r = R(seed)
  return (opt_init(moe_params(seed), MOE_TX), f32(r.normal(size=(B, T, D_MOE))),
          f32(r.normal(size=(B, T, D_MOE))))


def moe_top1_capacity_step(state, x, y):
  def loss_fn(p):
    B, T, D = x.shape
    tok = x.reshape(-1, D)
    n = tok.shape[0]
    probs = jax.nn.softmax(tok @ p['router'])
    idx = jnp.argmax(probs, axis=-1)
    gate = jnp.max(probs, axis=-1)
    onehot = jax.nn.one_hot(idx, E_MOE)
    capacity = int(1.0 * n / E_MOE)
    position = jnp.cumsum(onehot, axis=0) * onehot        # slot in the expert's buffer
    keep = jnp.sum((position <= capacity) * onehot, axis=-1)
    out = jnp.einsum('ne,ned->nd', onehot, _experts_dense(p, tok)) * (gate * keep)[:, None]
    h = (tok + out) @ p['head']
    return jnp.mean((h.reshape(B, T, D) - y) ** 2), 1.0 - jnp.mean(keep)
  (loss, dropped), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  return opt_apply(state, grads, MOE_TX), {'loss': loss, 'dropped': dropped}


# why: top-1 routing with expert capacity over the flattened batch: whether a token is
# dropped depends on how many EARLIER tokens (any example) the router sent to its expert.
add('moe_top1_capacity_drop_cumsum_over_batch', moe_top1_capacity_step,
    lambda: moe_make(60), expect_split=False)


def moe_top2_balance_step(state, x, y):
  def loss_fn(p):
    B, T, D = x.shape
    tok = x.reshape(-1, D)
    logits = tok @ p['router']
    probs = jax.nn.softmax(logits)
    top_p, top_i = lax.top_k(probs, 2)
    gates = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    dispatch = jnp.sum(jax.nn.one_hot(top_i, E_MOE) * gates[..., None], axis=1)  # [N, E]
    out = jnp.einsum('ne,ned->nd', dispatch, _experts_dense(p, tok))
    h = (tok + out) @ p['head']
    task = jnp.mean((h.reshape(B, T, D) - y) ** 2)
    # Switch/GShard load-balancing loss: E * sum_e f_e * P_e over the batch's tokens
    f = jnp.mean(jax.nn.one_hot(top_i[:, 0], E_MOE), axis=0)
    P = jnp.mean(probs, axis=0)
    balance = E_MOE * jnp.sum(f * P)
    return task + 0.01 * balance, (task, balance)
  (loss, (task, bal)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  return opt_apply(state, grads, MOE_TX), {'loss': loss, 'task': task, 'balance': bal}


# why: no capacity, so the task loss is per token. The balance loss is E*sum_e f_e*P_e, a
# function of two sums over tokens (f has no gradient), i.e. a function of sums over
# examples -- exactly computable from per-microbatch sums, though not additive.
add('moe_top2_load_balancing_loss_no_capacity', moe_top2_balance_step,
    lambda: moe_make(61), expect_split=True)


def moe_zloss_step(state, x, y):
  def loss_fn(p):
    B, T, D = x.shape
    tok = x.reshape(-1, D)
    logits = tok @ p['router']
    probs = jax.nn.softmax(logits)
    idx = jnp.argmax(probs, axis=-1)
    out = jnp.einsum('ne,ned->nd', jax.nn.one_hot(idx, E_MOE) * probs, _experts_dense(p, tok))
    h = (tok + out) @ p['head']
    task = jnp.mean((h.reshape(B, T, D) - y) ** 2)
    z_loss = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    return task + 1e-3 * z_loss, z_loss
  (loss, z), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  return opt_apply(state, grads, MOE_TX), {'loss': loss, 'router_z': z}


# why: top-1 routing without capacity, router z-loss is a per-token mean.
add('moe_top1_router_zloss_no_capacity', moe_zloss_step, lambda: moe_make(62),
    expect_split=True)


def moe_expert_choice_step(state, x, y):
  def loss_fn(p):
    B, T, D = x.shape
    tok = x.reshape(-1, D)
    n = tok.shape[0]
    probs = jax.nn.softmax(tok @ p['router'])            # [N, E]
    k = n // E_MOE                                      # each expert picks k tokens
    g, idx = lax.top_k(probs.T, k)                     # [E, k]
    expert_out = _experts_dense(p, tok)                # [N, E, D]
    picked = expert_out[idx, jnp.arange(E_MOE)[:, None]]  # [E, k, D]
    out = jnp.zeros_like(tok).at[idx.reshape(-1)].add((g[..., None] * picked).reshape(-1, D))
    h = (tok + out) @ p['head']
    return jnp.mean((h.reshape(B, T, D) - y) ** 2)
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, MOE_TX), {'loss': loss}


# why: expert-choice routing: each expert takes its top-k tokens across the WHOLE batch, so
# whether a token is processed depends on other examples' router scores.
add('moe_expert_choice_topk_tokens_across_batch', moe_expert_choice_step,
    lambda: moe_make(63), expect_split=False)


# ========================================================================================
# 7. contrastive & metric learning
# ========================================================================================

CON_TX = optax.adam(3e-3)


def simclr_step(state, x1, x2):
  def loss_fn(p):
    z = l2norm(mlp(p, jnp.concatenate([x1, x2], axis=0)))
    n = z.shape[0]
    B = n // 2
    sim = z @ z.T / 0.2
    sim = jnp.where(jnp.eye(n, dtype=bool), -1e9, sim)
    labels = (jnp.arange(n) + B) % n
    return optax.softmax_cross_entropy_with_integer_labels(sim, labels).mean()
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, CON_TX), {'loss': loss}


def simclr_make():
  r = R(64)
  x = r.normal(size=(16, 8))
  return (opt_init(init_mlp(64, [8, 16, 8]), CON_TX), f32(x + 0.1 * r.normal(size=x.shape)),
          f32(x + 0.1 * r.normal(size=x.shape)))


# why: NT-Xent: every other view in the batch is a negative (in-batch negatives).
add('simclr_ntxent_in_batch_negatives', simclr_step, simclr_make, expect_split=False)


def clip_step(state, images, texts):
  def loss_fn(p):
    ie = l2norm(mlp(p['img'], images))
    te = l2norm(jnp.mean(p['tok'][texts], axis=1) @ p['txt_proj'])
    logits = jnp.exp(p['logit_scale']) * ie @ te.T
    labels = jnp.arange(logits.shape[0])
    li = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    lt = optax.softmax_cross_entropy_with_integer_labels(logits.T, labels).mean()
    return 0.5 * (li + lt)
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, CON_TX), {'loss': loss}


def clip_make():
  r = R(65)
  p = {'img': init_mlp(65, [10, 16, 8]), 'tok': w(r, 20, 8, scale=0.5),
       'txt_proj': w(r, 8, 8), 'logit_scale': f32(np.log(1 / 0.07))}
  return opt_init(p, CON_TX), f32(r.normal(size=(16, 10))), i32(r.integers(0, 20, size=(16, 5)))


# why: CLIP symmetric loss: softmax over the batch in both directions, learnable scale.
add('clip_symmetric_contrastive_learnable_scale', clip_step, clip_make, expect_split=False)


def triplet_given_step(state, batch):
  anchor, pos, neg = batch
  def loss_fn(p):
    ea, ep, en = (l2norm(mlp(p, t)) for t in (anchor, pos, neg))
    dp = jnp.sum((ea - ep) ** 2, -1)
    dn = jnp.sum((ea - en) ** 2, -1)
    return jnp.mean(jnp.maximum(dp - dn + 0.2, 0.0))
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, CON_TX), {'loss': loss}


def triplet_given_make():
  r = R(66)
  a = r.normal(size=(24, 8))
  return (opt_init(init_mlp(66, [8, 16, 8]), CON_TX),
          (f32(a), f32(a + 0.3 * r.normal(size=a.shape)), f32(r.normal(size=a.shape))))


# why: triplets are supplied per example; each hinge term involves only its own triplet.
add('triplet_loss_given_triplets_tuple_batch', triplet_given_step, triplet_given_make,
    expect_split=True)


def batch_hard_step(state, x, y):
  def loss_fn(p):
    e = mlp(p, x)
    d = jnp.sqrt(jnp.sum((e[:, None] - e[None]) ** 2, -1) + 1e-9)
    same = y[:, None] == y[None, :]
    eye = jnp.eye(y.shape[0], dtype=bool)
    hardest_pos = jnp.max(jnp.where(same & ~eye, d, 0.0), axis=1)
    hardest_neg = jnp.min(jnp.where(same, 1e9, d), axis=1)
    return jnp.mean(jax.nn.softplus(hardest_pos - hardest_neg))
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, CON_TX), {'loss': loss}


def batch_hard_make():
  r = R(67)
  y = np.repeat(np.arange(6), 4)
  x = r.normal(size=(6, 8))[y] + 0.5 * r.normal(size=(24, 8))
  return opt_init(init_mlp(67, [8, 16, 8]), CON_TX), f32(x), i32(y)


# why: batch-hard mining: each anchor's positive/negative are the hardest OTHER examples in
# the batch, chosen by the current embedding.
add('batch_hard_triplet_mining', batch_hard_step, batch_hard_make, expect_split=False)


class MocoState(struct.PyTreeNode):
  params: list
  key_params: list
  opt_state: optax.OptState


def moco_step(state, batch):
  """batch = {'q': [B, D], 'k': [B, D], 'queue': [K, d]} -- the queue is a non-batch entry."""
  def loss_fn(params):
    q = l2norm(mlp(params, batch['q']))
    k = lax.stop_gradient(l2norm(mlp(state.key_params, batch['k'])))
    l_pos = jnp.sum(q * k, axis=-1, keepdims=True)
    l_neg = q @ batch['queue'].T
    logits = jnp.concatenate([l_pos, l_neg], axis=1) / 0.1
    labels = jnp.zeros((q.shape[0],), jnp.int32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  updates, opt_state = CON_TX.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  key_params = jax.tree_util.tree_map(lambda kp, p: 0.99 * kp + 0.01 * p, state.key_params, params)
  return state.replace(params=params, key_params=key_params, opt_state=opt_state), {'loss': loss}


def moco_make():
  r = R(68)
  p = init_mlp(68, [8, 16, 8])
  x = r.normal(size=(16, 8))
  queue = r.normal(size=(16, 8))
  queue /= np.linalg.norm(queue, axis=1, keepdims=True)
  st = MocoState(params=p, key_params=jax.tree_util.tree_map(jnp.array, p),
                 opt_state=CON_TX.init(p))
  return st, {'q': f32(x + 0.1 * r.normal(size=x.shape)), 'k': f32(x + 0.1 * r.normal(size=x.shape)),
              'queue': f32(queue)}


# why: negatives come from a fixed queue (non-batch, but 16 rows like the batch), positives
# from each example's own key; the positive is column 0 (jnp.zeros labels). No in-batch
# negatives, so per example.
add('moco_fixed_queue_in_batch_dict_first_is_positive', moco_step, moco_make,
    expect_split=True)


def proxy_nca_step(state, x, y):
  def loss_fn(p):
    e = l2norm(mlp(p['net'], x))
    proxies = l2norm(p['proxies'])
    d = jnp.sum((e[:, None] - proxies[None]) ** 2, -1)
    return optax.softmax_cross_entropy_with_integer_labels(-d / 0.1, y).mean()
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, CON_TX), {'loss': loss}


def proxy_nca_make():
  r = R(69)
  p = {'net': init_mlp(69, [8, 16, 8]), 'proxies': w(r, 7, 8, scale=1.0)}
  return opt_init(p, CON_TX), f32(r.normal(size=(32, 8))), i32(r.integers(0, 7, size=32))


# why: softmax over learned proxies, not over the batch.
add('proxy_nca_learned_proxies', proxy_nca_step, proxy_nca_make, expect_split=True)


def arcface_step(state, x, y):
  def loss_fn(p):
    e = l2norm(mlp(p['net'], x))
    Wn = l2norm(p['W'], axis=0)
    cos = jnp.clip(e @ Wn, -1 + 1e-6, 1 - 1e-6)
    theta = jnp.arccos(cos)
    onehot = jax.nn.one_hot(y, Wn.shape[1])
    logits = 16.0 * jnp.where(onehot > 0, jnp.cos(theta + 0.3), cos)
    return optax.softmax_cross_entropy(logits, onehot).mean()
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, CON_TX), {'loss': loss}


def arcface_make():
  r = R(70)
  p = {'net': init_mlp(70, [8, 16, 8]), 'W': w(r, 8, 6, scale=1.0)}
  return opt_init(p, CON_TX), f32(r.normal(size=(24, 8))), i32(r.integers(0, 6, size=24))


# why: additive angular margin per example against class weights.
add('arcface_angular_margin', arcface_step, arcface_make, expect_split=True)


def center_loss_step(state, x, y):
  def loss_fn(p):
    e = mlp(p['net'], x)
    logits = e @ p['cls']
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    C = p['cls'].shape[1]
    sums = jax.ops.segment_sum(e, y, num_segments=C)
    counts = jax.ops.segment_sum(jnp.ones_like(y, jnp.float32), y, num_segments=C)
    centres = sums / jnp.maximum(counts, 1.0)[:, None]
    return ce + 0.1 * jnp.mean(jnp.sum((e - centres[y]) ** 2, -1))
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, CON_TX), {'loss': loss}


def center_loss_make():
  r = R(71)
  p = {'net': init_mlp(71, [8, 16, 8]), 'cls': w(r, 8, 5)}
  return opt_init(p, CON_TX), f32(r.normal(size=(32, 8))), i32(r.integers(0, 5, size=32))


# why: class centres are the means of THIS batch's embeddings; each example is pulled
# towards a centre made of the other examples' embeddings.
add('center_loss_with_in_batch_class_means', center_loss_step, center_loss_make,
    expect_split=False)


def ranknet_step(state, x, rel):
  def loss_fn(p):
    s = mlp(p, x)[:, 0]
    diff = s[:, None] - s[None, :]
    better = (rel[:, None] > rel[None, :]).astype(jnp.float32)
    return jnp.sum(better * jax.nn.softplus(-diff)) / jnp.maximum(jnp.sum(better), 1.0)
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, CON_TX), {'loss': loss}


def ranknet_make():
  r = R(72)
  x = r.normal(size=(32, 6))
  rel = np.clip(np.round(x[:, 0] + 0.5 * r.normal(size=32) + 1), 0, 3)
  return opt_init(init_mlp(72, [6, 16, 1]), CON_TX), f32(x), f32(rel)


# why: RankNet over ALL pairs of examples in the batch: pairwise terms between examples.
add('ranknet_all_pairs_in_batch', ranknet_step, ranknet_make, expect_split=False)


def rkd_step(state, x):
  def loss_fn(p):
    s = mlp(p, x)
    t = lax.stop_gradient(mlp(state['teacher'], x))
    def pdist(e):
      d = jnp.sqrt(jnp.sum((e[:, None] - e[None]) ** 2, -1) + 1e-9)
      off = 1.0 - jnp.eye(e.shape[0])
      return d / (jnp.sum(d * off) / jnp.sum(off))
    return jnp.mean(optax.huber_loss(pdist(s), pdist(t)))
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, CON_TX), {'loss': loss}


def rkd_make():
  r = R(73)
  st = opt_init(init_mlp(73, [8, 16, 6]), CON_TX, teacher=init_mlp(74, [8, 32, 6]))
  return st, f32(r.normal(size=(16, 8)))


# why: relational KD matches the student's pairwise-distance matrix over the batch
# (normalised by its batch mean) to the teacher's: pairwise terms through the params.
add('relational_kd_pairwise_distance_matrix', rkd_step, rkd_make, expect_split=False)


def swav_step(state, x1, x2):
  def sinkhorn(scores, iters=3, eps=0.05):
    Q = jnp.exp(scores / eps).T              # [K, B]
    Q = Q / jnp.sum(Q)
    K, B = Q.shape
    def body(_, Q):
      Q = Q / jnp.sum(Q, axis=1, keepdims=True) / K
      Q = Q / jnp.sum(Q, axis=0, keepdims=True) / B
      return Q
    Q = lax.fori_loop(0, iters, body, Q)
    return (Q * B).T

  def loss_fn(p):
    protos = l2norm(p['protos'])
    z1 = l2norm(mlp(p['net'], x1))
    z2 = l2norm(mlp(p['net'], x2))
    s1, s2 = z1 @ protos.T, z2 @ protos.T
    q1 = lax.stop_gradient(sinkhorn(s1))
    q2 = lax.stop_gradient(sinkhorn(s2))
    l12 = optax.softmax_cross_entropy(s2 / 0.1, q1).mean()
    l21 = optax.softmax_cross_entropy(s1 / 0.1, q2).mean()
    return 0.5 * (l12 + l21)
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, CON_TX), {'loss': loss}


def swav_make():
  r = R(75)
  x = r.normal(size=(32, 8))
  p = {'net': init_mlp(75, [8, 16, 8]), 'protos': w(r, 6, 8, scale=1.0)}
  return (opt_init(p, CON_TX), f32(x + 0.1 * r.normal(size=x.shape)),
          f32(x + 0.1 * r.normal(size=x.shape)))


# why: Sinkhorn-Knopp (fori_loop) equipartitions the codes ACROSS the batch; each
# example's target depends on every other example's (parameter-dependent) scores.
add('swav_sinkhorn_codes_across_batch', swav_step, swav_make, expect_split=False)


def vicreg_step(state, x1, x2):
  def loss_fn(p):
    z1, z2 = mlp(p, x1), mlp(p, x2)
    inv = jnp.mean(jnp.sum((z1 - z2) ** 2, -1))
    def var_cov(z):
      z = z - jnp.mean(z, axis=0)
      std = jnp.sqrt(jnp.var(z, axis=0) + 1e-4)
      var = jnp.mean(jax.nn.relu(1.0 - std))
      n, d = z.shape
      cov = z.T @ z / (n - 1)
      off = cov * (1.0 - jnp.eye(d))
      return var, jnp.sum(off ** 2) / d
    v1, c1 = var_cov(z1)
    v2, c2 = var_cov(z2)
    return 25.0 * inv + 25.0 * (v1 + v2) + (c1 + c2)
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, CON_TX), {'loss': loss}


def vicreg_make():
  r = R(76)
  x = r.normal(size=(32, 8))
  return (opt_init(init_mlp(76, [8, 16, 8]), CON_TX), f32(x + 0.1 * r.normal(size=x.shape)),
          f32(x + 0.1 * r.normal(size=x.shape)))


# why: variance term is a hinge on the per-dimension std over the batch (sqrt of a centred
# second moment) and the covariance term squares batch covariances: examples interact.
add('vicreg_variance_covariance_over_batch', vicreg_step, vicreg_make, expect_split=False)


# ========================================================================================
# 8. normalisation across the batch
# ========================================================================================

class BNNet(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Dense(16)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
    x = nn.relu(x)
    return nn.Dense(3)(x)


class BNTrainState(train_state.TrainState):
  batch_stats: dict


def bn_linen_step(state, x, y):
  def loss_fn(params):
    logits, updates = state.apply_fn({'params': params, 'batch_stats': state.batch_stats},
                                     x, train=True, mutable=['batch_stats'])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, updates
  (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  state = state.apply_gradients(grads=grads)
  state = state.replace(batch_stats=updates['batch_stats'])
  return state, {'loss': loss}


def bn_linen_make():
  r = R(77)
  x = f32(r.normal(size=(32, 6)))
  model = BNNet()
  variables = model.init(key0(77), x, train=False)
  st = BNTrainState.create(apply_fn=model.apply, params=variables['params'],
                           batch_stats=variables['batch_stats'], tx=optax.adam(3e-3))
  return st, x, i32(r.integers(0, 3, size=32))


# why: BatchNorm in training mode normalises each activation with the batch's mean/var.
add('linen_batchnorm_trainstate_batch_stats', bn_linen_step, bn_linen_make,
    expect_split=False)


class NnxBNNet(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(6, 16, rngs=rngs)
    self.bn = nnx.BatchNorm(16, rngs=rngs)
    self.l2 = nnx.Linear(16, 1, rngs=rngs)

  def __call__(self, x):
    return self.l2(nnx.relu(self.bn(self.l1(x))))


def nnx_bn_step(state, x, y):
  model, optimizer = state
  model.train()
  def loss_fn(model):
    return jnp.mean((model(x)[:, 0] - y) ** 2)
  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return (model, optimizer), {'loss': loss}


def nnx_bn_make():
  r = R(78)
  model = NnxBNNet(nnx.Rngs(0))
  return ((model, nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)),
          f32(r.normal(size=(24, 6))), f32(r.normal(size=24)))


# why: nnx.BatchNorm in train mode: batch statistics of activations.
add('nnx_batchnorm_nnx_optimizer', nnx_bn_step, nnx_bn_make, expect_split=False)


CENTER_TX = optax.adam(3e-3)


def center_act_step(state, x, y):
  def loss_fn(p):
    h = x @ p['w1'] + p['b1']
    h = h - jnp.mean(h, axis=0, keepdims=True)   # "mean-only batch norm"
    h = jnp.tanh(h)
    return optax.softmax_cross_entropy_with_integer_labels(h @ p['w2'], y).mean()
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, CENTER_TX), {'loss': loss}


def center_act_make():
  r = R(79)
  p = {'w1': w(r, 6, 16), 'b1': f32(0.5 * np.ones(16)), 'w2': w(r, 16, 4)}
  return opt_init(p, CENTER_TX), f32(r.normal(size=(24, 6)) + 1.0), i32(r.integers(0, 4, size=24))


# why: activations centred by their batch mean before a nonlinearity.
add('mean_only_batchnorm_centre_activations', center_act_step, center_act_make,
    expect_split=False)


def set_attention_step(state, x, y):
  def loss_fn(p):
    h = jnp.tanh(x @ p['w_in'])
    a = jax.nn.softmax((h @ p['wq']) @ (h @ p['wk']).T / math.sqrt(h.shape[1]), axis=-1)
    h = h + a @ (h @ p['wv'])        # every example attends to every other in the batch
    return optax.softmax_cross_entropy_with_integer_labels(h @ p['out'], y).mean()
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, CENTER_TX), {'loss': loss}


def set_attention_make():
  r = R(80)
  p = {'w_in': w(r, 6, 12), 'wq': w(r, 12, 12), 'wk': w(r, 12, 12), 'wv': w(r, 12, 12),
       'out': w(r, 12, 3)}
  return opt_init(p, CENTER_TX), f32(r.normal(size=(16, 6))), i32(r.integers(0, 3, size=16))


# why: self-attention ACROSS the batch axis (a set model over the batch): softmax over
# other examples' keys, pairwise terms through the parameters.
add('self_attention_across_batch_examples', set_attention_step, set_attention_make,
    expect_split=False)


# ========================================================================================
# 9. reinforcement learning
# ========================================================================================

RL_TX = optax.adam(3e-3)


def reinforce_step(state, obs, actions, returns):
  def loss_fn(p):
    logp = jax.nn.log_softmax(mlp(p, obs))
    logp_a = jnp.take_along_axis(logp, actions[:, None], axis=1)[:, 0]
    adv = returns - jnp.mean(returns)                 # batch-mean baseline
    ent = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    return -jnp.mean(adv * logp_a) - 0.01 * jnp.mean(ent)
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, RL_TX), {'loss': loss}


def reinforce_make():
  r = R(81)
  return (opt_init(init_mlp(81, [6, 16, 4]), RL_TX), f32(r.normal(size=(32, 6))),
          i32(r.integers(0, 4, size=32)), f32(r.normal(size=32) + 1.0))


# why: the baseline is the batch mean of the GIVEN returns (parameter-free preprocessing),
# so the loss is -mean(adv_i * logp_i) with fixed adv: a sum over examples.
add('reinforce_batch_mean_baseline_of_returns', reinforce_step, reinforce_make,
    expect_split=True)


def ppo_step(state, batch):
  def loss_fn(params):
    logits, value = state.apply_fn({'params': params}, batch['obs'])
    logp = jax.nn.log_softmax(logits)
    logp_a = jnp.take_along_axis(logp, batch['actions'][:, None], axis=1)[:, 0]
    adv = batch['advantages']
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    ratio = jnp.exp(logp_a - batch['old_logp'])
    pg = -jnp.mean(jnp.minimum(ratio * adv, jnp.clip(ratio, 0.8, 1.2) * adv))
    v_loss = 0.5 * jnp.mean((value[:, 0] - batch['returns']) ** 2)
    ent = jnp.mean(-jnp.sum(jnp.exp(logp) * logp, -1))
    return pg + 0.5 * v_loss - 0.01 * ent, (pg, v_loss, ent)
  (loss, (pg, vl, ent)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss, 'pg': pg, 'v': vl, 'ent': ent}


class ActorCritic(nn.Module):
  n_actions: int = 4

  @nn.compact
  def __call__(self, x):
    h = nn.tanh(nn.Dense(16)(x))
    return nn.Dense(self.n_actions)(h), nn.Dense(1)(h)


def ppo_make():
  r = R(82)
  obs = f32(r.normal(size=(32, 6)))
  batch = {'obs': obs, 'actions': i32(r.integers(0, 4, size=32)),
           'old_logp': f32(np.log(0.25) + 0.1 * r.normal(size=32)),
           'advantages': f32(r.normal(size=32)), 'returns': f32(r.normal(size=32))}
  tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(3e-4))
  return make_ts(ActorCritic(), obs, tx), batch


# why: advantages normalised by the batch mean/std of GIVEN advantages (parameter-free);
# clipped-ratio objective, value loss and entropy are per-example means.
add('ppo_clip_advantage_norm_over_batch', ppo_step, ppo_make, expect_split=True)


def grpo_step(state, seqs, rewards, ref_logp):
  """seqs [B, G, L] (G sampled completions per prompt), rewards [B, G], ref_logp [B, G, L-1]."""
  def loss_fn(params):
    B, G, L = seqs.shape
    flat = seqs.reshape(B * G, L)
    logits = lm_apply(params, flat, jnp.tri(L, dtype=bool))[:, :-1]
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits), flat[:, 1:, None], axis=-1)[..., 0]
    logp = logp.reshape(B, G, L - 1)
    adv = (rewards - rewards.mean(axis=1, keepdims=True)) / (rewards.std(axis=1, keepdims=True) + 1e-4)
    ratio = jnp.exp(logp - lax.stop_gradient(logp))
    pg = -ratio * adv[..., None]
    kl = jnp.exp(ref_logp - logp) - (ref_logp - logp) - 1.0
    per_tok = pg + 0.04 * kl
    return jnp.mean(jnp.mean(per_tok, axis=-1))
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, LM_TX), {'loss': loss}


def grpo_make():
  r = R(83)
  seqs = i32(r.integers(1, V, size=(16, 4, 6)))
  return (lm_state(83), seqs, f32(r.normal(size=(16, 4))),
          f32(np.log(1.0 / V) + 0.1 * r.normal(size=(16, 4, 5))))


# why: advantages normalised WITHIN each prompt's group of G completions (axis 1), so each
# prompt is its own unit; KL to a given reference per token.
add('grpo_group_relative_advantages_kl_to_ref', grpo_step, grpo_make, expect_split=True)


def a2c_gae_step(state, obs, actions, rewards, dones, last_obs):
  """Time-major rollouts: obs [T, B, D], actions/rewards/dones [T, B], last_obs [B, D]."""
  gamma, lam = 0.99, 0.95
  def loss_fn(params):
    logits, values = state.apply_fn({'params': params}, obs)
    values = values[..., 0]
    _, last_v = state.apply_fn({'params': params}, last_obs)
    v_sg = lax.stop_gradient(values)
    next_v = jnp.concatenate([v_sg[1:], lax.stop_gradient(last_v[:, 0])[None]], axis=0)
    deltas = rewards + gamma * next_v * (1.0 - dones) - v_sg
    def gae_body(carry, inp):
      delta, done = inp
      carry = delta + gamma * lam * (1.0 - done) * carry
      return carry, carry
    _, adv = lax.scan(gae_body, jnp.zeros_like(deltas[0]), (deltas, dones), reverse=True)
    returns = adv + v_sg
    logp = jax.nn.log_softmax(logits)
    logp_a = jnp.take_along_axis(logp, actions[..., None], axis=-1)[..., 0]
    pg = -jnp.mean(adv * logp_a)
    vf = 0.5 * jnp.mean((values - returns) ** 2)
    ent = jnp.mean(-jnp.sum(jnp.exp(logp) * logp, -1))
    return pg + 0.5 * vf - 0.01 * ent
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


def a2c_gae_make():
  r = R(84)
  T, B = 8, 16
  obs = f32(r.normal(size=(T, B, 6)))
  return (make_ts(ActorCritic(), obs, optax.rmsprop(1e-3)), obs,
          i32(r.integers(0, 4, size=(T, B))), f32(r.normal(size=(T, B))),
          f32(r.random(size=(T, B)) < 0.1), f32(r.normal(size=(B, 6))))


# why: time-major [T, B] rollouts; GAE is a reverse lax.scan over time per environment
# (batch axis 1) with stop_gradient values; the last observation is [B, D] (batch axis 0).
add('a2c_gae_reverse_scan_time_major_rollouts', a2c_gae_step, a2c_gae_make,
    expect_split=True)


class DqnState(struct.PyTreeNode):
  params: list
  target: list
  opt_state: optax.OptState
  step: jax.Array


DQN_TX = optax.adam(1e-3)


def double_dqn_step(state, obs, actions, rewards, next_obs, dones):
  def loss_fn(params):
    q = mlp(params, obs)
    q_a = jnp.take_along_axis(q, actions[:, None], axis=1)[:, 0]
    next_a = jnp.argmax(mlp(params, next_obs), axis=1)
    next_q = jnp.take_along_axis(mlp(state.target, next_obs), next_a[:, None], axis=1)[:, 0]
    target = lax.stop_gradient(rewards + 0.99 * (1.0 - dones) * next_q)
    return jnp.mean(optax.huber_loss(q_a, target))
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  updates, opt_state = DQN_TX.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  target = lax.cond(state.step % 2 == 1, lambda: params, lambda: state.target)
  return state.replace(params=params, target=target, opt_state=opt_state,
                       step=state.step + 1), {'loss': loss}


def double_dqn_make():
  r = R(85)
  p = init_mlp(85, [6, 16, 3])
  st = DqnState(params=p, target=init_mlp(86, [6, 16, 3]), opt_state=DQN_TX.init(p),
                step=jnp.int32(0))
  return (st, f32(r.normal(size=(32, 6))), i32(r.integers(0, 3, size=32)),
          f32(r.normal(size=32)), f32(r.normal(size=(32, 6))), f32(r.random(32) < 0.1))


# why: double DQN with Huber loss per transition; target net swapped by lax.cond on step.
add('double_dqn_target_net_lax_cond_sync', double_dqn_step, double_dqn_make,
    expect_split=True)


# ========================================================================================
# 10. generative models
# ========================================================================================

GEN_TX = optax.adam(3e-3)


def vae_step(state, x):
  key = jax.random.fold_in(state.key, state.step)
  def loss_fn(p):
    h = mlp(p['enc'], x)
    mu, logvar = jnp.split(h, 2, axis=-1)
    eps = jax.random.normal(key, mu.shape)
    z = mu + jnp.exp(0.5 * logvar) * eps
    logits = mlp(p['dec'], z)
    rec = jnp.sum(optax.sigmoid_binary_cross_entropy(logits, x), axis=-1)
    kl = -0.5 * jnp.sum(1 + logvar - mu ** 2 - jnp.exp(logvar), axis=-1)
    return jnp.mean(rec + kl), (jnp.mean(rec), jnp.mean(kl))
  (loss, (rec, kl)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  updates, opt_state = GEN_TX.update(grads, state.opt_state, state.params)
  return state.replace(params=optax.apply_updates(state.params, updates), opt_state=opt_state,
                       step=state.step + 1), {'loss': loss, 'rec': rec, 'kl': kl}


def vae_make():
  r = R(87)
  p = {'enc': init_mlp(87, [12, 16, 8]), 'dec': init_mlp(88, [4, 16, 12])}
  st = KeyedState(params=p, opt_state=GEN_TX.init(p), key=key0(87), step=jnp.int32(0))
  return st, f32(r.random(size=(32, 12)) < 0.4)


# why: reparameterised VAE; per-example ELBO with per-example noise.
add('vae_reparameterisation_bernoulli_elbo', vae_step, vae_make, stochastic=True,
    expect_split=True)


def diffusion_step(state, x0):
  key = jax.random.fold_in(state.key, state.step)
  kt, kn = jax.random.split(key)
  n_steps = 100
  s = 0.008
  t_grid = jnp.arange(n_steps + 1) / n_steps
  abar = jnp.cos((t_grid + s) / (1 + s) * jnp.pi / 2) ** 2
  abar = abar / abar[0]

  def loss_fn(p):
    B = x0.shape[0]
    t = jax.random.randint(kt, (B,), 1, n_steps + 1)
    noise = jax.random.normal(kn, x0.shape)
    a = abar[t][:, None]
    xt = jnp.sqrt(a) * x0 + jnp.sqrt(1 - a) * noise
    freqs = jnp.exp(-jnp.arange(4) * 1.0)
    temb = jnp.concatenate([jnp.sin(t[:, None] * freqs), jnp.cos(t[:, None] * freqs)], -1)
    eps_hat = mlp(p, jnp.concatenate([xt, temb], axis=-1), act=jax.nn.silu)
    return jnp.mean((eps_hat - noise) ** 2)
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  updates, opt_state = GEN_TX.update(grads, state.opt_state, state.params)
  return state.replace(params=optax.apply_updates(state.params, updates), opt_state=opt_state,
                       step=state.step + 1), {'loss': loss}


def diffusion_make():
  r = R(89)
  p = init_mlp(89, [8 + 8, 32, 8])
  st = KeyedState(params=p, opt_state=GEN_TX.init(p), key=key0(89), step=jnp.int32(0))
  return st, f32(r.normal(size=(32, 8)))


# why: DDPM eps-prediction: per-example timestep and noise, per-example MSE.
add('diffusion_eps_prediction_cosine_schedule', diffusion_step, diffusion_make,
    stochastic=True, expect_split=True)


FLOW_TX = optax.adam(3e-3)


def flow_step(state, x):
  def loss_fn(layers):
    z = x
    logdet = jnp.zeros(x.shape[0])
    for i, layer in enumerate(layers):
      mask = jnp.arange(x.shape[1]) % 2 == (i % 2)
      z_cond = jnp.where(mask, z, 0.0)
      st = mlp(layer, z_cond)
      log_s, t = jnp.split(st, 2, axis=-1)
      log_s = jnp.tanh(log_s)
      z = jnp.where(mask, z, z * jnp.exp(log_s) + t)
      logdet = logdet + jnp.sum(jnp.where(mask, 0.0, log_s), axis=-1)
    logpz = -0.5 * jnp.sum(z ** 2, -1) - 0.5 * x.shape[1] * jnp.log(2 * jnp.pi)
    return -jnp.mean(logpz + logdet)
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, FLOW_TX), {'nll': loss}


def flow_make():
  r = R(90)
  layers = [init_mlp(90 + i, [4, 16, 8], scale=0.5) for i in range(4)]
  x = r.normal(size=(32, 4)) @ np.array([[1, .5, 0, 0], [0, 1, .3, 0], [0, 0, 1, .2], [0, 0, 0, 1.]])
  return opt_init(layers, FLOW_TX), f32(x)


# why: RealNVP-style affine coupling (masks from jnp.arange over FEATURES); per-example NLL.
add('realnvp_affine_coupling_flow_nll', flow_step, flow_make, expect_split=True)


class GanState(struct.PyTreeNode):
  g: list
  d: list
  g_opt: optax.OptState
  d_opt: optax.OptState
  key: jax.Array
  step: jax.Array


G_TX = optax.adam(2e-3, b1=0.5)
D_TX = optax.adam(2e-3, b1=0.5)


def gan_make(seed, d_in=4):
  r = R(seed)
  g = init_mlp(seed, [3, 16, 4])
  d = init_mlp(seed + 1, [d_in, 16, 1])
  st = GanState(g=g, d=d, g_opt=G_TX.init(g), d_opt=D_TX.init(d), key=key0(seed),
                step=jnp.int32(0))
  return st, f32(r.normal(size=(32, 4)) * 0.5 + 1.0)


def gan_simultaneous_step(state, real):
  key = jax.random.fold_in(state.key, state.step)
  z = jax.random.normal(key, (real.shape[0], 3))
  D = lambda d, x: mlp(d, x, act=jax.nn.leaky_relu)[:, 0]

  def d_loss_fn(d, g):
    fake = lax.stop_gradient(mlp(g, z))
    lr = D(d, real)
    lf = D(d, fake)
    real_t = jnp.full(lr.shape, 0.9)   # one-sided label smoothing
    return (optax.sigmoid_binary_cross_entropy(lr, real_t).mean()
            + optax.sigmoid_binary_cross_entropy(lf, jnp.zeros_like(lf)).mean())

  def g_loss_fn(g, d):
    lf = D(d, mlp(g, z))
    return optax.sigmoid_binary_cross_entropy(lf, jnp.ones_like(lf)).mean()

  d_loss, d_grads = jax.value_and_grad(d_loss_fn)(state.d, state.g)
  g_loss, g_grads = jax.value_and_grad(g_loss_fn)(state.g, state.d)   # same (old) D
  du, d_opt = D_TX.update(d_grads, state.d_opt, state.d)
  gu, g_opt = G_TX.update(g_grads, state.g_opt, state.g)
  return state.replace(d=optax.apply_updates(state.d, du), g=optax.apply_updates(state.g, gu),
                       d_opt=d_opt, g_opt=g_opt, step=state.step + 1), {
                           'd_loss': d_loss, 'g_loss': g_loss}


# why: two gradients at the same parameters, each a mean over examples (labels from
# jnp.full / jnp.ones / jnp.zeros of the shapes). Noise per example.
add('gan_simultaneous_d_and_g_gradients', gan_simultaneous_step, lambda: gan_make(91),
    stochastic=True, expect_split=True)


def gan_sequential_step(state, real):
  key = jax.random.fold_in(state.key, state.step)
  z = jax.random.normal(key, (real.shape[0], 3))
  D = lambda d, x: mlp(d, x, act=jax.nn.leaky_relu)[:, 0]

  def d_loss_fn(d):
    lr, lf = D(d, real), D(d, lax.stop_gradient(mlp(state.g, z)))
    return (optax.sigmoid_binary_cross_entropy(lr, jnp.ones_like(lr)).mean()
            + optax.sigmoid_binary_cross_entropy(lf, jnp.zeros_like(lf)).mean())
  d_loss, d_grads = jax.value_and_grad(d_loss_fn)(state.d)
  du, d_opt = D_TX.update(d_grads, state.d_opt, state.d)
  new_d = optax.apply_updates(state.d, du)

  def g_loss_fn(g):
    lf = D(new_d, mlp(g, z))      # generator sees the UPDATED discriminator
    return -jnp.mean(jax.nn.log_sigmoid(lf))
  g_loss, g_grads = jax.value_and_grad(g_loss_fn)(state.g)
  gu, g_opt = G_TX.update(g_grads, state.g_opt, state.g)
  return state.replace(d=new_d, g=optax.apply_updates(state.g, gu), d_opt=d_opt, g_opt=g_opt,
                       step=state.step + 1), {'d_loss': d_loss, 'g_loss': g_loss}


# why: the G gradient is taken at the D updated with the WHOLE batch's D gradient: two
# passes would do it exactly, a single accumulated pass would not. Unsure how to class.
add('gan_sequential_g_sees_updated_d', gan_sequential_step, lambda: gan_make(93),
    stochastic=True, expect_split=None)


def gan_mbstd_step(state, real):
  key = jax.random.fold_in(state.key, state.step)
  z = jax.random.normal(key, (real.shape[0], 3))

  def D(d, x):
    h = jax.nn.leaky_relu(x @ d[0]['w'] + d[0]['b'])
    mbstd = jnp.mean(jnp.std(h, axis=0)) * jnp.ones((h.shape[0], 1))  # minibatch stddev
    h = jnp.concatenate([h, mbstd], axis=-1)
    return (h @ d[1]['w'] + d[1]['b'])[:, 0]

  def d_loss_fn(d):
    lr, lf = D(d, real), D(d, lax.stop_gradient(mlp(state.g, z)))
    return jnp.mean(jax.nn.softplus(-lr)) + jnp.mean(jax.nn.softplus(lf))
  d_loss, d_grads = jax.value_and_grad(d_loss_fn)(state.d)
  du, d_opt = D_TX.update(d_grads, state.d_opt, state.d)
  return state.replace(d=optax.apply_updates(state.d, du), d_opt=d_opt,
                       step=state.step + 1), {'d_loss': d_loss}


def gan_mbstd_make():
  st, real = gan_make(95)
  r = R(95)
  d = [{'w': w(r, 4, 16), 'b': f32(np.zeros(16))}, {'w': w(r, 17, 1), 'b': f32(np.zeros(1))}]
  return st.replace(d=d, d_opt=D_TX.init(d)), real


# why: ProGAN minibatch-stddev feature: the std of discriminator activations over the batch
# is fed back into every example's logit.
add('gan_discriminator_minibatch_stddev_feature', gan_mbstd_step, gan_mbstd_make,
    stochastic=True, expect_split=False)


# ========================================================================================
# 11. structured prediction
# ========================================================================================

CRF_TX = optax.adam(1e-2)
N_TAGS = 5


def crf_step(state, tokens, tags, lengths):
  def crf_nll(p, tok, tag, length):
    emis = jnp.tanh(p['emb'][tok]) @ p['proj']          # [T, K]
    trans = p['trans']
    T = tok.shape[0]
    mask = jnp.arange(T) < length
    def fwd(alpha, inp):
      e, m = inp
      new = jax.nn.logsumexp(alpha[:, None] + trans, axis=0) + e
      return jnp.where(m, new, alpha), None
    alpha0 = p['start'] + emis[0]
    alpha, _ = lax.scan(fwd, alpha0, (emis[1:], mask[1:]))
    log_z = jax.nn.logsumexp(alpha)
    gold = p['start'][tag[0]] + emis[0, tag[0]]
    gold += jnp.sum(jnp.where(mask[1:], trans[tag[:-1], tag[1:]] + emis[jnp.arange(1, T), tag[1:]], 0.0))
    return log_z - gold
  def loss_fn(p):
    nll = jax.vmap(crf_nll, in_axes=(None, 0, 0, 0))(p, tokens, tags, lengths)
    return jnp.sum(nll) / jnp.sum(lengths)
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, CRF_TX), {'nll_per_token': loss}


def crf_make():
  r = R(97)
  p = {'emb': w(r, 20, 8, scale=0.5), 'proj': w(r, 8, N_TAGS), 'trans': w(r, N_TAGS, N_TAGS, scale=0.1),
       'start': f32(np.zeros(N_TAGS))}
  return (opt_init(p, CRF_TX), i32(r.integers(0, 20, size=(16, 10))),
          i32(r.integers(0, N_TAGS, size=(16, 10))), i32(r.integers(3, 11, size=16)))


# why: linear-chain CRF forward algorithm (lax.scan) per sequence under jax.vmap; the
# partition function is per sequence; normalised by the batch's total length (param-free).
add('linear_chain_crf_forward_algorithm_vmap', crf_step, crf_make, expect_split=True)


# ========================================================================================
# 12. stochastic regularisers, repeated / tiled batches
# ========================================================================================

class DropMLP(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.relu(nn.Dense(32)(x))
    x = nn.Dropout(0.3, deterministic=not train)(x)
    return nn.Dense(4)(x)


def linen_dropout_step(state, x, y):
  dropout_key = jax.random.fold_in(state.key, state.step)
  def loss_fn(params):
    logits = state.apply_fn({'params': params}, x, train=True, rngs={'dropout': dropout_key})
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


def linen_dropout_make():
  r = R(98)
  x = f32(r.normal(size=(32, 8)))
  model = DropMLP()
  params = model.init(key0(98), x, train=False)['params']
  st = RngTrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(3e-3), key=key0(99))
  return st, x, i32(r.integers(0, 4, size=32))


# why: dropout with a key folded from the step counter; independent masks per example.
add('linen_dropout_key_in_trainstate', linen_dropout_step, linen_dropout_make,
    stochastic=True, expect_split=True)


def multisample_dropout_step(state, x, y):
  key = jax.random.fold_in(state.key, state.step)
  S = 4
  def loss_fn(p):
    xr = jnp.repeat(x, S, axis=0)                      # [B*S, D]
    h = jax.nn.relu(xr @ p['w1'] + p['b1'])
    keep = jax.random.bernoulli(key, 0.7, h.shape)
    h = jnp.where(keep, h / 0.7, 0.0)
    logits = (h @ p['w2'] + p['b2']).reshape(x.shape[0], S, -1)
    logp = jax.nn.log_softmax(logits).mean(axis=1)      # average over dropout samples
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  updates, opt_state = GEN_TX.update(grads, state.opt_state, state.params)
  return state.replace(params=optax.apply_updates(state.params, updates), opt_state=opt_state,
                       step=state.step + 1), {'loss': loss}


def multisample_dropout_make():
  r = R(100)
  p = {'w1': w(r, 8, 16), 'b1': f32(np.zeros(16)), 'w2': w(r, 16, 4), 'b2': f32(np.zeros(4))}
  st = KeyedState(params=p, opt_state=GEN_TX.init(p), key=key0(100), step=jnp.int32(0))
  return st, f32(r.normal(size=(16, 8))), i32(r.integers(0, 4, size=16))


# why: the batch is jnp.repeat-ed S times then reshaped back to [B, S, ...]: each example's
# S dropout samples stay with it.
add('multisample_dropout_jnp_repeat_batch', multisample_dropout_step,
    multisample_dropout_make, stochastic=True, expect_split=True)


def tile_consistency_step(state, x, y):
  key = jax.random.fold_in(state.key, state.step)
  def loss_fn(p):
    B = x.shape[0]
    views = jnp.tile(x, (2, 1)) + 0.2 * jax.random.normal(key, (2 * B, x.shape[1]))
    logits = mlp(p, views)
    l1, l2 = logits[:B], logits[B:]
    ce = optax.softmax_cross_entropy_with_integer_labels(l1, y).mean()
    cons = jnp.mean(jnp.sum((jax.nn.softmax(l1) - jax.nn.softmax(l2)) ** 2, -1))
    return ce + cons
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  updates, opt_state = GEN_TX.update(grads, state.opt_state, state.params)
  return state.replace(params=optax.apply_updates(state.params, updates), opt_state=opt_state,
                       step=state.step + 1), {'loss': loss}


def tile_consistency_make():
  r = R(101)
  p = init_mlp(101, [6, 16, 3])
  st = KeyedState(params=p, opt_state=GEN_TX.init(p), key=key0(101), step=jnp.int32(0))
  return st, f32(r.normal(size=(24, 6))), i32(r.integers(0, 3, size=24))


# why: jnp.tile(x, (2, 1)) makes two noisy views; view 1 of example i is row i, view 2 is
# row i + B; the consistency term pairs only an example with itself.
add('two_view_consistency_jnp_tile_batch', tile_consistency_step, tile_consistency_make,
    stochastic=True, expect_split=True)


# ========================================================================================
# 13. optimizer plumbing
# ========================================================================================

def multisteps_step(state, x, y):
  def loss_fn(params):
    logits = state.apply_fn({'params': params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


def multisteps_make():
  r = R(102)
  x = f32(r.normal(size=(24, 6)))
  tx = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2)
  return make_ts(MLP((16, 3)), x, tx), x, i32(r.integers(0, 3, size=24))


# why: optax.MultiSteps accumulates whole-batch gradients across steps; the per-step
# gradient is an ordinary mean.
add('optax_multisteps_every_2', multisteps_step, multisteps_make, expect_split=True)


INJ_TX = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9)
INJ_SCHED = optax.warmup_cosine_decay_schedule(0.0, 0.2, 2, 10)


def inject_hparams_step(state, x, y):
  def loss_fn(p):
    return jnp.mean((mlp(p, x) - y) ** 2)
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  opt_state = state['opt_state']
  opt_state.hyperparams['learning_rate'] = INJ_SCHED(state['step'])
  updates, opt_state = INJ_TX.update(grads, opt_state, state['params'])
  return {'params': optax.apply_updates(state['params'], updates), 'opt_state': opt_state,
          'step': state['step'] + 1}, {'loss': loss, 'lr': opt_state.hyperparams['learning_rate']}


def inject_hparams_make():
  r = R(103)
  return (opt_init(init_mlp(103, [5, 16, 2]), INJ_TX, step=jnp.int32(0)),
          f32(r.normal(size=(32, 5))), f32(r.normal(size=(32, 2))))


# why: learning rate set in the injected hyperparams from a schedule of the step counter.
add('optax_inject_hyperparams_lr_from_schedule', inject_hparams_step, inject_hparams_make,
    expect_split=True)


def _label_fn(params):
  return {'backbone': jax.tree_util.tree_map(lambda _: 'frozen', params['backbone']),
          'head': jax.tree_util.tree_map(lambda _: 'train', params['head'])}


MASKED_TX = optax.multi_transform({'train': optax.adam(5e-3), 'frozen': optax.set_to_zero()},
                                  _label_fn)


def masked_opt_step(state, x, y):
  def loss_fn(p):
    h = mlp(p['backbone'], x)
    return optax.softmax_cross_entropy_with_integer_labels(mlp(p['head'], jax.nn.relu(h)), y).mean()
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, MASKED_TX), {'loss': loss}


def masked_opt_make():
  r = R(104)
  p = {'backbone': init_mlp(104, [8, 16, 16]), 'head': init_mlp(105, [16, 4])}
  return opt_init(p, MASKED_TX), f32(r.normal(size=(16, 8))), i32(r.integers(0, 4, size=16))


# why: optax.multi_transform freezes the backbone (set_to_zero), trains the head.
add('optax_multi_transform_frozen_backbone', masked_opt_step, masked_opt_make,
    expect_split=True)


class EmaTrainState(train_state.TrainState):
  ema_params: dict


def ema_step(state, x, y):
  def loss_fn(params):
    return jnp.mean(optax.huber_loss(state.apply_fn({'params': params}, x), y))
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  state = state.apply_gradients(grads=grads)
  ema = optax.incremental_update(state.params, state.ema_params, step_size=0.1)
  ema_loss = loss_fn(ema)
  return state.replace(ema_params=ema), {'loss': loss, 'ema_loss': ema_loss}


def ema_make():
  r = R(106)
  x = f32(r.normal(size=(32, 6)))
  model = MLP((16, 2))
  params = model.init(key0(106), x)['params']
  st = EmaTrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(3e-3),
                            ema_params=jax.tree_util.tree_map(jnp.array, params))
  return st, x, f32(r.normal(size=(32, 2)))


# why: EMA of parameters in the state; the gradient is a plain mean. The EMA-model loss is a
# metric evaluated at the UPDATED EMA params -- a mean over examples at params fixed by the
# whole-batch update (needs the update first, but is then a plain mean).
add('ema_params_trainstate_with_ema_eval_metric', ema_step, ema_make, expect_split=True)


def clip_adamw_step(state, x, y):
  def loss_fn(params):
    logits = state.apply_fn({'params': params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  gnorm = optax.global_norm(grads)
  return state.apply_gradients(grads=grads), {'loss': loss, 'grad_norm': gnorm}


def clip_adamw_make():
  r = R(107)
  x = f32(r.normal(size=(32, 8)) * 3.0)
  sched = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 20)
  tx = optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(sched, weight_decay=0.05))
  return make_ts(MLP((32, 5)), x, tx), x, i32(r.integers(0, 5, size=32))


# why: clipping by the global norm of the (whole-batch) gradient happens in the optimizer
# after the gradient is formed; the loss is a plain mean.
add('clip_by_global_norm_adamw_warmup_cosine', clip_adamw_step, clip_adamw_make,
    expect_split=True)


LS_OPT = optax.adam(3e-3)


def loss_scale_step(state, x, y):
  scale = state['loss_scale']
  def loss_fn(p):
    loss = optax.softmax_cross_entropy_with_integer_labels(mlp(p, x), y).mean()
    return loss * scale, loss
  (_, loss), sgrads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  grads = jax.tree_util.tree_map(lambda g: g / scale, sgrads)
  finite = jnp.all(jnp.array([jnp.all(jnp.isfinite(g)) for g in jax.tree_util.tree_leaves(grads)]))
  updates, new_opt = LS_OPT.update(grads, state['opt_state'], state['params'])
  new_params = optax.apply_updates(state['params'], updates)
  params = jax.tree_util.tree_map(lambda a, b: jnp.where(finite, a, b), new_params, state['params'])
  opt_state = jax.tree_util.tree_map(lambda a, b: jnp.where(finite, a, b), new_opt, state['opt_state'])
  good = jnp.where(finite, state['good_steps'] + 1, 0)
  grow = good >= 2
  new_scale = jnp.where(finite, jnp.where(grow, scale * 2.0, scale), scale / 2.0)
  good = jnp.where(grow, 0, good)
  return {'params': params, 'opt_state': opt_state, 'loss_scale': new_scale,
          'good_steps': good}, {'loss': loss, 'loss_scale': new_scale}


def loss_scale_make():
  r = R(108)
  return (opt_init(init_mlp(108, [8, 16, 4]), LS_OPT, loss_scale=f32(2.0 ** 12),
                   good_steps=jnp.int32(0)),
          f32(r.normal(size=(32, 8))), i32(r.integers(0, 4, size=32)))


# why: dynamic loss scaling (scale, unscale, finite check, grow/shrink) wraps a mean loss.
add('dynamic_loss_scaling_finite_check', loss_scale_step, loss_scale_make,
    expect_split=True)


ACC_TX = optax.adam(3e-3)
N_MICRO = 4


def manual_accum_step(state, x, y):
  """The user already microbatches: reshape to [N_MICRO, B/N_MICRO, ...] and scan."""
  def loss_fn(p, xb, yb):
    return optax.softmax_cross_entropy_with_integer_labels(mlp(p, xb), yb).mean()
  xs = x.reshape(N_MICRO, -1, x.shape[-1])
  ys = y.reshape(N_MICRO, -1)
  def body(carry, mb):
    loss_sum, g_sum = carry
    l, g = jax.value_and_grad(loss_fn)(state['params'], *mb)
    return (loss_sum + l, jax.tree_util.tree_map(jnp.add, g_sum, g)), None
  zeros = jax.tree_util.tree_map(jnp.zeros_like, state['params'])
  (loss_sum, g_sum), _ = lax.scan(body, (jnp.zeros(()), zeros), (xs, ys))
  grads = jax.tree_util.tree_map(lambda g: g / N_MICRO, g_sum)
  return opt_apply(state, grads, ACC_TX), {'loss': loss_sum / N_MICRO}


def manual_accum_make():
  r = R(109)
  return (opt_init(init_mlp(109, [6, 16, 3]), ACC_TX), f32(r.normal(size=(32, 6))),
          i32(r.integers(0, 3, size=32)))


# why: hand-written gradient accumulation via lax.scan over a fixed number of chunks:
# the result equals the mean over all 32 examples (equal-sized chunks).
add('manual_grad_accumulation_lax_scan_reshape', manual_accum_step, manual_accum_make,
    expect_split=True)


def nnx_basic_step(state, x, y):
  model, optimizer = state
  def loss_fn(model):
    logits = model(x)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, logits
  (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
  optimizer.update(model, grads)
  acc = jnp.mean(jnp.argmax(logits, -1) == y)
  return (model, optimizer), {'loss': loss, 'accuracy': acc}


class NnxMLP(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(8, 32, rngs=rngs)
    self.l2 = nnx.Linear(32, 5, rngs=rngs)

  def __call__(self, x):
    return self.l2(nnx.relu(self.l1(x)))


def nnx_basic_make():
  r = R(110)
  model = NnxMLP(nnx.Rngs(0))
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3, weight_decay=1e-4))
  return ((model, nnx.Optimizer(model, tx, wrt=nnx.Param)), f32(r.normal(size=(32, 8))),
          i32(r.integers(0, 5, size=32)))


# why: plain nnx with nnx.value_and_grad(has_aux) and an accuracy metric (a mean).
add('nnx_value_and_grad_has_aux_accuracy_metric', nnx_basic_step, nnx_basic_make,
    expect_split=True)


# ========================================================================================
# 14. more batch-statistic / metric / state traps
# ========================================================================================

MORE_TX = optax.adam(3e-3)


def median_metric_step(state, x, y):
  def loss_fn(p):
    per_ex = optax.softmax_cross_entropy_with_integer_labels(mlp(p, x), y)
    return jnp.mean(per_ex), per_ex
  (loss, per_ex), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  metrics = {'loss': loss, 'loss_median': jnp.median(per_ex), 'loss_max': jnp.max(per_ex),
             'loss_p90': jnp.percentile(per_ex, 90.0)}
  return opt_apply(state, grads, MORE_TX), metrics


def median_metric_make():
  r = R(111)
  return (opt_init(init_mlp(111, [8, 16, 4]), MORE_TX), f32(r.normal(size=(32, 8))),
          i32(r.integers(0, 4, size=32)))


# why: loss/gradient are a plain mean, but the reported metrics (median, p90, max of the
# per-example losses) are order statistics of the whole batch. The training itself splits;
# unsure whether the metrics count.
add('mean_loss_with_median_p90_max_metrics', median_metric_step, median_metric_make,
    expect_split=None)


class XbmState(struct.PyTreeNode):
  params: list
  opt_state: optax.OptState
  memory: jax.Array   # embeddings of the PREVIOUS batch (cross-batch memory)


def xbm_step(state, anchor, positive):
  def loss_fn(p):
    a = l2norm(mlp(p, anchor))
    pos = l2norm(mlp(p, positive))
    l_pos = jnp.sum(a * pos, -1, keepdims=True)
    l_mem = a @ state.memory.T                 # negatives from the memory, not the batch
    logits = jnp.concatenate([l_pos, l_mem], axis=1) / 0.1
    labels = jnp.zeros(a.shape[0], jnp.int32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), pos
  (loss, pos), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  updates, opt_state = MORE_TX.update(grads, state.opt_state, state.params)
  return state.replace(params=optax.apply_updates(state.params, updates), opt_state=opt_state,
                       memory=lax.stop_gradient(pos)), {'loss': loss}


def xbm_make():
  r = R(112)
  p = init_mlp(112, [8, 16, 8])
  x = r.normal(size=(16, 8))
  mem = r.normal(size=(16, 8))
  st = XbmState(params=p, opt_state=MORE_TX.init(p),
                memory=f32(mem / np.linalg.norm(mem, axis=1, keepdims=True)))
  return st, f32(x + 0.1 * r.normal(size=x.shape)), f32(x + 0.1 * r.normal(size=x.shape))


# why: negatives come from the memory in the STATE (last step's batch), not from this batch,
# so this step's loss/gradient are per example; the new memory is this batch's positive
# embeddings at the old params, row by row (a per-example output kept in the state).
add('cross_batch_memory_negatives_from_state', xbm_step, xbm_make, expect_split=True)


def nmse_step(state, x, y):
  def loss_fn(p):
    pred = mlp(p, x)
    # normalised MSE: divide by the variance of the (given) targets in this batch
    return jnp.mean((pred - y) ** 2) / (jnp.var(y) + 1e-6)
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, MORE_TX), {'nmse': loss}


def nmse_make():
  r = R(113)
  return (opt_init(init_mlp(113, [6, 16, 1]), MORE_TX), f32(r.normal(size=(24, 6))),
          f32(3.0 * r.normal(size=(24, 1)) + 1.0))


# why: the denominator is the batch variance of the GIVEN targets (parameter-free).
add('nmse_normalised_by_batch_target_variance', nmse_step, nmse_make, expect_split=True)


def pearson_step(state, x, y):
  def loss_fn(p):
    pred = mlp(p, x)[:, 0]
    pc = pred - jnp.mean(pred)
    yc = y - jnp.mean(y)
    corr = jnp.sum(pc * yc) / jnp.sqrt(jnp.sum(pc ** 2) * jnp.sum(yc ** 2) + 1e-8)
    return 1.0 - corr
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, MORE_TX), {'loss': loss}


def pearson_make():
  r = R(114)
  x = r.normal(size=(32, 6))
  return (opt_init(init_mlp(114, [6, 16, 1]), MORE_TX), f32(x),
          f32(x[:, 0] - 0.5 * x[:, 1] + 0.3 * r.normal(size=32)))


# why: 1 - Pearson correlation over the batch: predictions are centred by their batch mean,
# but the whole loss is a function of five sums over examples (sum p, sum p^2, sum p*y,
# sum y, sum y^2) -- no per-example nonlinearity after the centring.
add('pearson_correlation_loss_over_batch', pearson_step, pearson_make, expect_split=True)


def dict_denominator_step(state, batch):
  """batch = {'x', 'y', 'weight': [B], 'global_weight_sum': scalar from the data loader}."""
  def loss_fn(p):
    ce = optax.softmax_cross_entropy_with_integer_labels(mlp(p['net'], batch['x']), batch['y'])
    return jnp.sum(batch['weight'] * ce) / batch['global_weight_sum']
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, MORE_TX), {'loss': loss}


def dict_denominator_make():
  r = R(115)
  wt = r.random(size=32) + 0.5
  batch = {'x': f32(r.normal(size=(32, 8))), 'y': i32(r.integers(0, 4, size=32)),
           'weight': f32(wt), 'global_weight_sum': f32(wt.sum())}
  return opt_init({'net': init_mlp(115, [8, 16, 4])}, MORE_TX), batch


# why: per-example weights over a scalar denominator that rides in the batch dict.
add('dict_batch_weights_over_scalar_denominator_entry', dict_denominator_step,
    dict_denominator_make, expect_split=True)


def max_len_norm_step(state, tokens, lengths):
  def loss_fn(params):
    B, T = tokens.shape
    logits = lm_apply(params, tokens, jnp.tri(T, dtype=bool))[:, :-1]
    mask = (jnp.arange(T - 1)[None, :] < (lengths[:, None] - 1)).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    # "tokens per batch" taken as batch size times the longest sequence in the batch
    return jnp.sum(ce * mask) / (B * (jnp.max(lengths) - 1))
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, LM_TX), {'loss': loss}


def max_len_norm_make():
  r = R(116)
  lengths = r.integers(3, 11, size=16)
  lengths[5] = 12
  toks = np.where(np.arange(12)[None] < lengths[:, None], r.integers(1, V, size=(16, 12)), PAD)
  return lm_state(116), i32(toks), i32(lengths)


# why: normaliser = B * (max length in the batch - 1): a parameter-free batch statistic
# (a max of the given lengths), after which the loss is a sum over tokens.
add('lm_norm_by_batch_size_times_batch_max_len', max_len_norm_step, max_len_norm_make,
    expect_split=True)


def standardise_inputs_step(state, x, y):
  def loss_fn(p):
    xs = (x - jnp.mean(x, axis=0)) / (jnp.std(x, axis=0) + 1e-5)   # per-batch input scaling
    return optax.softmax_cross_entropy_with_integer_labels(mlp(p, xs), y).mean()
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  return opt_apply(state, grads, MORE_TX), {'loss': loss}


def standardise_inputs_make():
  r = R(117)
  x = r.normal(size=(32, 6)) * np.array([1, 5, 0.2, 3, 1, 10]) + np.array([0, 2, -1, 5, 0, 3])
  return opt_init(init_mlp(117, [6, 16, 3]), MORE_TX), f32(x), i32(r.integers(0, 3, size=32))


# why: the INPUTS (not activations) are standardised by batch statistics -- parameter-free
# preprocessing of the whole batch; after it the loss is a per-example mean. (Contrast with
# mean_only_batchnorm_centre_activations, where the centred quantity depends on params.)
add('input_standardised_by_batch_stats_in_loss', standardise_inputs_step,
    standardise_inputs_make, expect_split=True)

"""An outside corpus of JAX/Flax training steps, written the way people write them.

Each Case is `step(state, *args) -> (new_state, metrics)` plus `make() -> (state, *args)`.
`expect_split` is this author's judgement, made without reading the library:

  True  -- the loss and its gradient over the whole batch are exactly a function of sums over
           examples (possibly several sums, possibly combined nonlinearly afterwards), so an
           exact microbatch split exists.
  False -- examples interact inside a differentiated nonlinearity (softmax/ranking across the
           batch, BatchNorm statistics of activations, pairwise distances, hard mining, capacity
           by cumsum over the batch's tokens, ...): no exact split.
  None  -- an exact split needs a parameter-free pre-pass over the whole batch (a statistic of
           the inputs, a detached batch statistic) or the batch axis is ambiguous; splitting
           exactly or refusing are both honest answers.

Models are tiny; batch sizes are multiples of 8.
"""

from __future__ import annotations

import functools

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P
import optax
import flax.linen as nn
from flax import nnx
from flax.training import train_state

from tests.exactness.harness import Case

CASES: list = []


def _add(name, step, make, *, stochastic=False, expect_split=None):
  CASES.append(Case(name=name, step=step, make=make, stochastic=stochastic,
                    expect_split=expect_split))


# ----------------------------------------------------------------------------- helpers

def _rng(seed):
  return np.random.default_rng(seed)


def _n(r, *shape, scale=1.0):
  return jnp.asarray(r.standard_normal(shape) * scale, jnp.float32)


def _u(r, *shape, lo=0.0, hi=1.0):
  return jnp.asarray(r.uniform(lo, hi, shape), jnp.float32)


def _i(r, high, *shape):
  return jnp.asarray(r.integers(0, high, shape), jnp.int32)


def mlp_init(r, sizes):
  return [{"w": _n(r, a, b, scale=1.0 / np.sqrt(a)), "b": jnp.zeros((b,), jnp.float32)}
          for a, b in zip(sizes[:-1], sizes[1:])]


def mlp(params, x, act=jnp.tanh):
  for i, p in enumerate(params):
    x = x @ p["w"] + p["b"]
    if i < len(params) - 1:
      x = act(x)
  return x


def sgd(params, grads, lr=0.05):
  return jax.tree.map(lambda p, g: p - lr * g, params, grads)


def _opt_apply(tx, params, opt_state, grads):
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


ADAM = optax.adam(1e-2)


def _gd(holder, make):
  """The graphdef an nnx case's make() stores; built on demand if step runs before make."""
  if holder[0] is None:
    make()
  return holder[0]


def lm_init(r, V=32, D=16):
  return {"emb": _n(r, V, D, scale=0.3), "w1": _n(r, D, D, scale=0.25),
          "wprev": _n(r, D, D, scale=0.25), "out": _n(r, D, V, scale=0.25),
          "b": jnp.zeros((V,), jnp.float32)}


def lm_logits(p, tok):
  """[N, L] int -> [N, L, V]; a one-step causal mixer, so every position sees its past."""
  h = p["emb"][tok]
  prev = jnp.pad(h, ((0, 0), (1, 0), (0, 0)))[:, :-1]
  h = jnp.tanh(h @ p["w1"] + prev @ p["wprev"])
  return h @ p["out"] + p["b"]


class MLP(nn.Module):
  features: tuple = (16, 16, 4)

  @nn.compact
  def __call__(self, x):
    for f in self.features[:-1]:
      x = nn.gelu(nn.Dense(f)(x))
    return nn.Dense(self.features[-1])(x)


# ============================================================================ A. supervised / LM

def _ts_make(seed=0, B=16, D=8, C=4, tx=None, model=None):
  r = _rng(seed)
  model = model or MLP((16, 16, C))
  x = _n(r, B, D)
  y = _i(r, C, B)
  params = model.init(jax.random.PRNGKey(seed), x[:1])["params"]
  state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=tx or optax.adam(1e-2))
  return state, {"image": x, "label": y}


# why: TrainState, apply_fn handed to the loss as an argument; plain mean CE -> sum over examples.
def _loss_apply_arg(params, apply_fn, batch):
  logits = apply_fn({"params": params}, batch["image"])
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
  return loss, logits


def step_ts_apply_arg(state, batch):
  (loss, logits), grads = jax.value_and_grad(_loss_apply_arg, has_aux=True)(
      state.params, state.apply_fn, batch)
  acc = jnp.mean(jnp.argmax(logits, -1) == batch["label"])
  return state.apply_gradients(grads=grads), {"loss": loss, "accuracy": acc}


_add("trainstate_apply_fn_as_argument", step_ts_apply_arg, lambda: _ts_make(0),
     expect_split=True)


# why: same, apply_fn closed over inside the step; mean CE + L2 on params (param-only term).
def step_ts_closed(state, batch):
  def loss_fn(params):
    logits = state.apply_fn({"params": params}, batch["image"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    l2 = sum(jnp.sum(w ** 2) for w in jax.tree.leaves(params))
    return ce + 1e-4 * l2
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {"loss": loss}


_add("trainstate_apply_fn_closed_over_l2", step_ts_closed,
     lambda: _ts_make(1, tx=optax.sgd(0.1, momentum=0.9)), expect_split=True)


def _lm_make(seed, B=16, L=9, V=32):
  r = _rng(seed)
  params = lm_init(r, V=V)
  return (params, ADAM.init(params)), _i(r, V, B, L)


# why: per-token CE over the flattened [B*L] axis, padding mask over the flattened axis
# (valid = arange(B*L) < n_valid*L with n_valid from the shape): sum(l*valid)/sum(valid).
def step_lm_flat_prefix(state, tokens):
  params, opt = state

  def loss_fn(p):
    B, L1 = tokens.shape[0], tokens.shape[1] - 1
    logits = lm_logits(p, tokens[:, :-1]).reshape(B * L1, -1)
    per_tok = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:].reshape(-1))
    n_valid = B - B // 4
    valid = (jnp.arange(B * L1) < n_valid * L1).astype(jnp.float32)
    return jnp.sum(per_tok * valid) / jnp.sum(valid)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


_add("lm_flat_tokens_prefix_valid_from_shape", step_lm_flat_prefix, lambda: _lm_make(2),
     expect_split=True)


# why: as above, but n_valid is a 0-d leaf inside the batch dict (no batch axis).
def step_lm_flat_nvalid_arg(state, batch):
  params, opt = state
  tokens, n_valid = batch["tokens"], batch["n_valid"]

  def loss_fn(p):
    B, L = tokens.shape
    logits = lm_logits(p, batch["inputs"]).reshape(B * L, -1)
    per_tok = optax.softmax_cross_entropy_with_integer_labels(logits, tokens.reshape(-1))
    valid = jnp.arange(B * L) < n_valid * L
    return jnp.sum(jnp.where(valid, per_tok, 0.0)) / jnp.maximum(jnp.sum(valid), 1)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss, "tokens": jnp.sum(jnp.arange(tokens.size) < n_valid * tokens.shape[1])}


def _make_lm_nvalid():
  (state, tokens) = _lm_make(3, B=16, L=9)
  return state, {"inputs": tokens[:, :-1], "tokens": tokens[:, 1:],
                 "n_valid": jnp.asarray(11, jnp.int32)}


_add("lm_flat_tokens_n_valid_scalar_in_batch", step_lm_flat_nvalid_arg, _make_lm_nvalid,
     expect_split=True)


# why: lengths -> [B, L] mask flattened to [B*L]; CE + z-loss, normalised by total valid tokens.
def step_lm_lengths_zloss(state, tokens, lengths):
  params, opt = state

  def loss_fn(p):
    B, L = tokens.shape
    logits = lm_logits(p, tokens[:, :-1])
    flat = logits.reshape(-1, logits.shape[-1])
    tgt = tokens[:, 1:].reshape(-1)
    mask = (jnp.arange(L - 1)[None, :] < (lengths[:, None] - 1)).reshape(-1)
    lse = jax.nn.logsumexp(flat, -1)
    ce = lse - jnp.take_along_axis(flat, tgt[:, None], -1)[:, 0]
    z = 1e-3 * lse ** 2
    denom = jnp.maximum(mask.sum(), 1)
    return jnp.sum((ce + z) * mask) / denom, (jnp.sum(ce * mask) / denom)

  (loss, ce), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss, "ce": ce}


def _make_lm_lengths():
  state, tokens = _lm_make(4, B=16, L=10)
  lengths = jnp.asarray(_rng(40).integers(3, 11, (16,)), jnp.int32)
  return state, tokens, lengths


_add("lm_lengths_mask_zloss", step_lm_lengths_zloss, _make_lm_lengths, expect_split=True)


# why: label smoothing with optax.smooth_labels, per-token mask, token-mean.
def step_lm_label_smoothing(state, batch):
  params, opt = state

  def loss_fn(p):
    logits = lm_logits(p, batch["input_ids"])
    V = logits.shape[-1]
    onehot = optax.smooth_labels(jax.nn.one_hot(batch["labels"], V), 0.1)
    per_tok = optax.softmax_cross_entropy(logits, onehot)
    m = batch["mask"]
    return (per_tok * m).sum() / m.sum()

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


def _make_lm_ls():
  state, tokens = _lm_make(5, B=16, L=9)
  mask = (_rng(50).uniform(size=(16, 8)) > 0.2).astype(np.float32)
  return state, {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "mask": jnp.asarray(mask)}


_add("lm_label_smoothing_masked", step_lm_label_smoothing, _make_lm_ls, expect_split=True)


# why: packed sequences: segment ids -> block-diagonal causal attention within each row;
# padding where segment_id == 0; loss sums over rows' tokens -> per-example sums.
def _attn_init(r, V=32, D=16):
  return {"emb": _n(r, V, D, scale=0.3), "pos": _n(r, 16, D, scale=0.1),
          "wq": _n(r, D, D, scale=0.25), "wk": _n(r, D, D, scale=0.25),
          "wv": _n(r, D, D, scale=0.25), "out": _n(r, D, V, scale=0.25)}


def _packed_logits(p, tok, seg, pos):
  h = p["emb"][tok] + p["pos"][pos]
  q, k, v = h @ p["wq"], h @ p["wk"], h @ p["wv"]
  L = tok.shape[1]
  causal = jnp.tril(jnp.ones((L, L), bool))
  same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0)
  mask = same & causal[None]
  s = jnp.einsum("bqd,bkd->bqk", q, k) / np.sqrt(q.shape[-1])
  s = jnp.where(mask, s, -1e9)
  a = jax.nn.softmax(s, -1)
  h = h + jnp.einsum("bqk,bkd->bqd", a, v)
  return h @ p["out"]


def step_lm_packed(state, batch):
  params, opt = state

  def loss_fn(p):
    logits = _packed_logits(p, batch["inputs"], batch["segment_ids"], batch["positions"])
    l = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    w = (batch["segment_ids"] > 0) & batch["loss_mask"]
    return jnp.sum(l * w) / jnp.sum(w)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


def _make_lm_packed():
  r = _rng(6)
  B, L, V = 16, 12, 32
  params = _attn_init(r, V=V)
  seg = np.zeros((B, L), np.int32)
  pos = np.zeros((B, L), np.int32)
  for b in range(B):
    t, s = 0, 1
    while t < L - 2:
      n = int(r.integers(2, 6))
      n = min(n, L - t - int(r.integers(0, 2)))
      if n <= 0:
        break
      seg[b, t:t + n] = s
      pos[b, t:t + n] = np.arange(n)
      t += n
      s += 1
  toks = r.integers(0, V, (B, L + 1))
  loss_mask = np.ones((B, L), bool)
  loss_mask[:, 0] = False
  return (params, ADAM.init(params)), {
      "inputs": jnp.asarray(toks[:, :-1], jnp.int32), "targets": jnp.asarray(toks[:, 1:], jnp.int32),
      "segment_ids": jnp.asarray(seg), "positions": jnp.asarray(pos),
      "loss_mask": jnp.asarray(loss_mask)}


_add("lm_packed_sequences_segment_ids", step_lm_packed, _make_lm_packed, expect_split=True)


# why: per-sequence mean first (each row normalised by its own length), then batch mean.
def step_lm_per_seq_mean(state, tokens, mask):
  params, opt = state

  def loss_fn(p):
    lp = jax.nn.log_softmax(lm_logits(p, tokens[:, :-1]))
    nll = -jnp.take_along_axis(lp, tokens[:, 1:, None], -1)[..., 0]
    per_seq = (nll * mask).sum(-1) / jnp.maximum(mask.sum(-1), 1.0)
    return per_seq.mean()

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss, "ppl": jnp.exp(loss)}


def _make_lm_per_seq():
  state, tokens = _lm_make(7, B=16, L=9)
  mask = jnp.asarray((_rng(70).uniform(size=(16, 8)) > 0.3).astype(np.float32))
  return state, tokens, mask


_add("lm_per_sequence_mean_then_batch_mean", step_lm_per_seq_mean, _make_lm_per_seq,
     expect_split=True)


# why: a tiny linen transformer decoder (causal MultiHeadDotProductAttention, LayerNorm is
# per-token); token-mean CE with a padding mask.
class TinyDecoder(nn.Module):
  vocab: int = 32
  dim: int = 16

  @nn.compact
  def __call__(self, tok, pad_mask):
    L = tok.shape[1]
    h = nn.Embed(self.vocab, self.dim)(tok)
    h = h + self.param("pos", nn.initializers.normal(0.02), (L, self.dim), jnp.float32)
    mask = nn.combine_masks(nn.make_causal_mask(tok), nn.make_attention_mask(pad_mask, pad_mask))
    y = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=self.dim)(nn.LayerNorm()(h), mask=mask)
    h = h + y
    h = h + nn.Dense(self.dim)(nn.gelu(nn.Dense(2 * self.dim)(nn.LayerNorm()(h))))
    return nn.Dense(self.vocab)(nn.LayerNorm()(h))


def step_linen_transformer(state, tokens, pad_mask):
  def loss_fn(params):
    logits = state.apply_fn({"params": params}, tokens[:, :-1], pad_mask[:, :-1])
    l = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    m = pad_mask[:, 1:] * pad_mask[:, :-1]
    return jnp.sum(l * m) / jnp.sum(m)
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {"loss": loss}


def _make_linen_transformer():
  r = _rng(8)
  B, L = 16, 9
  tok = _i(r, 32, B, L)
  lengths = r.integers(4, L + 1, (B,))
  pad = jnp.asarray((np.arange(L)[None] < lengths[:, None]).astype(np.float32))
  model = TinyDecoder()
  params = model.init(jax.random.PRNGKey(8), tok[:1, :-1], pad[:1, :-1])["params"]
  st = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(3e-3))
  return st, tok, pad


_add("linen_transformer_causal_padding", step_linen_transformer, _make_linen_transformer,
     expect_split=True)


# why: encoder-decoder with cross attention, teacher forcing; per-example attention only.
def _s2s_init(r, V=24, D=16):
  return {"src_emb": _n(r, V, D, scale=0.3), "tgt_emb": _n(r, V, D, scale=0.3),
          "enc": mlp_init(r, [D, D]), "wq": _n(r, D, D, scale=0.25), "wk": _n(r, D, D, scale=0.25),
          "wv": _n(r, D, D, scale=0.25), "out": _n(r, D, V, scale=0.25)}


def step_seq2seq(state, src, src_mask, tgt_in, tgt_out, tgt_mask):
  params, opt = state

  def loss_fn(p):
    e = jnp.tanh(mlp(p["enc"], p["src_emb"][src]))
    d = p["tgt_emb"][tgt_in]
    s = jnp.einsum("btd,bsd->bts", d @ p["wq"], e @ p["wk"]) / 4.0
    s = jnp.where(src_mask[:, None, :] > 0, s, -1e9)
    ctx = jnp.einsum("bts,bsd->btd", jax.nn.softmax(s, -1), e @ p["wv"])
    logits = (d + ctx) @ p["out"]
    l = optax.softmax_cross_entropy_with_integer_labels(logits, tgt_out)
    return jnp.sum(l * tgt_mask) / jnp.sum(tgt_mask)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


def _make_s2s():
  r = _rng(9)
  B, S, T, V = 16, 7, 6, 24
  p = _s2s_init(r, V=V)
  src_len = r.integers(2, S + 1, (B,))
  tgt_len = r.integers(2, T + 1, (B,))
  tgt = _i(r, V, B, T + 1)
  return ((p, ADAM.init(p)), _i(r, V, B, S),
          jnp.asarray((np.arange(S)[None] < src_len[:, None]).astype(np.float32)),
          tgt[:, :-1], tgt[:, 1:],
          jnp.asarray((np.arange(T)[None] < tgt_len[:, None]).astype(np.float32)))


_add("seq2seq_cross_attention_teacher_forcing", step_seq2seq, _make_s2s, expect_split=True)


# why: linen LSTM via nn.RNN over [B, T, D] with seq_lengths, last-state classifier.
class LSTMClassifier(nn.Module):
  @nn.compact
  def __call__(self, x, lengths):
    h = nn.RNN(nn.OptimizedLSTMCell(12))(x, seq_lengths=lengths)
    last = jnp.take_along_axis(h, (lengths - 1)[:, None, None], 1)[:, 0]
    return nn.Dense(3)(last)


def step_linen_lstm(state, x, lengths, y):
  def loss_fn(params):
    logits = state.apply_fn({"params": params}, x, lengths)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {"loss": loss}


def _make_linen_lstm():
  r = _rng(10)
  B, T, D = 16, 6, 5
  x = _n(r, B, T, D)
  lengths = jnp.asarray(r.integers(2, T + 1, (B,)), jnp.int32)
  y = _i(r, 3, B)
  m = LSTMClassifier()
  params = m.init(jax.random.PRNGKey(10), x[:1], lengths[:1])["params"]
  return train_state.TrainState.create(apply_fn=m.apply, params=params, tx=optax.adam(1e-2)), x, lengths, y


_add("linen_lstm_nn_rnn_seq_lengths", step_linen_lstm, _make_linen_lstm, expect_split=True)


# why: conv net with GroupNorm (statistics within one example), NHWC images.
class ConvGN(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Conv(8, (3, 3))(x)
    x = nn.relu(nn.GroupNorm(num_groups=4)(x))
    x = nn.Conv(8, (3, 3), strides=(2, 2))(x)
    x = nn.relu(nn.LayerNorm()(x))
    return nn.Dense(5)(x.mean((1, 2)))


def step_conv_groupnorm(state, images, labels):
  def loss_fn(params):
    logits = state.apply_fn({"params": params}, images)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {"loss": loss}


def _make_conv_gn():
  r = _rng(11)
  x = _n(r, 16, 8, 8, 3)
  y = _i(r, 5, 16)
  m = ConvGN()
  params = m.init(jax.random.PRNGKey(11), x[:1])["params"]
  return train_state.TrainState.create(apply_fn=m.apply, params=params, tx=optax.sgd(0.05)), x, y


_add("linen_conv_groupnorm_images", step_conv_groupnorm, _make_conv_gn, expect_split=True)


# why: focal loss, per-example; mean over the batch.
def step_focal(state, x, y):
  params, opt = state

  def loss_fn(p):
    logits = mlp(p, x)
    logp = jax.nn.log_softmax(logits)
    lp_t = jnp.take_along_axis(logp, y[:, None], -1)[:, 0]
    pt = jnp.exp(lp_t)
    return jnp.mean(-((1 - pt) ** 2.0) * lp_t)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


def _make_focal():
  r = _rng(12)
  p = mlp_init(r, [6, 16, 5])
  return (p, ADAM.init(p)), _n(r, 32, 6), _i(r, 5, 32)


_add("focal_loss_mlp", step_focal, _make_focal, expect_split=True)


# why: quantile (pinball) regression for three quantiles at once + Huber aux; per-example.
QUANTILES = jnp.asarray([0.1, 0.5, 0.9], jnp.float32)


def step_quantile(state, x, y):
  params, opt = state

  def loss_fn(p):
    pred = mlp(p, x)                                  # [B, 3]
    err = y[:, None] - pred
    pin = jnp.maximum(QUANTILES * err, (QUANTILES - 1) * err)
    hub = optax.huber_loss(pred[:, 1], y, delta=0.5)
    return pin.mean() + 0.1 * hub.mean()

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


def _make_quantile():
  r = _rng(13)
  p = mlp_init(r, [4, 16, 3])
  x = _n(r, 32, 4)
  return (p, ADAM.init(p)), x, jnp.sin(x[:, 0]) + 0.1 * _n(r, 32)


_add("quantile_pinball_regression", step_quantile, _make_quantile, expect_split=True)


# ============================================================================ B. remat / scan

class Block(nn.Module):
  dim: int = 16

  @nn.compact
  def __call__(self, x):
    y = nn.Dense(2 * self.dim)(nn.LayerNorm()(x))
    return x + nn.Dense(self.dim)(nn.gelu(y))


class RematNet(nn.Module):
  depth: int = 3
  policy: object = None
  use_policy: bool = False

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(16)(x)
    if self.use_policy:
      B = nn.remat(Block, policy=self.policy)
    else:
      B = nn.remat(Block)
    for _ in range(self.depth):
      x = B()(x)
    return nn.Dense(4)(x)


def _remat_make(seed, model):
  r = _rng(seed)
  x = _n(r, 16, 8)
  y = _i(r, 4, 16)
  params = model.init(jax.random.PRNGKey(seed), x[:1])["params"]
  return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(3e-3)), x, y


def step_remat_generic(state, x, y):
  def loss_fn(params):
    logits = state.apply_fn({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {"loss": loss, "gnorm": optax.global_norm(grads)}


# why: linen nn.remat(Block), default policy; per-example CE.
_add("linen_remat_block_no_policy", step_remat_generic,
     lambda: _remat_make(20, RematNet()), expect_split=True)
# why: nn.remat with nothing_saveable policy; per-example CE.
_add("linen_remat_nothing_saveable", step_remat_generic,
     lambda: _remat_make(21, RematNet(policy=jax.checkpoint_policies.nothing_saveable,
                                      use_policy=True)), expect_split=True)
# why: nn.remat with dots_with_no_batch_dims_saveable; per-example CE.
_add("linen_remat_dots_no_batch_dims_saveable", step_remat_generic,
     lambda: _remat_make(22, RematNet(policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                                      use_policy=True)), expect_split=True)


class ScanBlock(nn.Module):
  dim: int = 16

  @nn.compact
  def __call__(self, x, _):
    y = nn.Dense(self.dim)(nn.LayerNorm()(x))
    return x + nn.tanh(y), None


class ScanNet(nn.Module):
  depth: int = 4

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(16)(x)
    Stack = nn.scan(nn.remat(ScanBlock, prevent_cse=False), variable_axes={"params": 0},
                    split_rngs={"params": True}, length=self.depth)
    x, _ = Stack()(x, None)
    return nn.Dense(4)(x)


# why: nn.scan over layers with nn.remat inside; per-example CE.
_add("linen_scan_layers_remat_inside", step_remat_generic,
     lambda: _remat_make(23, ScanNet()), expect_split=True)


class NnxBlock(nnx.Module):
  def __init__(self, dim, rngs):
    self.norm = nnx.LayerNorm(dim, rngs=rngs)
    self.lin1 = nnx.Linear(dim, 2 * dim, rngs=rngs)
    self.lin2 = nnx.Linear(2 * dim, dim, rngs=rngs)

  def __call__(self, x):
    return x + self.lin2(nnx.gelu(self.lin1(self.norm(x))))


class NnxRematNet(nnx.Module):
  def __init__(self, rngs, din=8, dim=16, depth=3, nout=4):
    self.inp = nnx.Linear(din, dim, rngs=rngs)
    self.blocks = nnx.List([NnxBlock(dim, rngs) for _ in range(depth)])
    self.out = nnx.Linear(dim, nout, rngs=rngs)

  def __call__(self, x):
    x = self.inp(x)
    for b in self.blocks:
      x = nnx.remat(lambda blk, h: blk(h))(b, x)
    return self.out(x)


NNX_TX = optax.adam(3e-3)


def _nnx_make(seed, ctor, B=16, D=8, C=4):
  r = _rng(seed)
  model = ctor(nnx.Rngs(seed))
  graphdef, params = nnx.split(model, nnx.Param)
  return graphdef, (params, NNX_TX.init(params)), _n(r, B, D), _i(r, C, B)


def _make_nnx_step(graphdef_holder, make):
  def step(state, x, y):
    params, opt = state
    graphdef = _gd(graphdef_holder, make)

    def loss_fn(p):
      model = nnx.merge(graphdef, p)
      logits = model(x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    params, opt = _opt_apply(NNX_TX, params, opt, grads)
    return (params, opt), {"loss": loss}
  return step


_NNX_REMAT_GD = [None]


def _make_nnx_remat():
  gd, st, x, y = _nnx_make(24, NnxRematNet)
  _NNX_REMAT_GD[0] = gd
  return st, x, y


# why: nnx model, nnx.remat per block, functional split/merge; per-example CE.
_add("nnx_remat_blocks_split_merge", _make_nnx_step(_NNX_REMAT_GD, lambda: _make_nnx_remat()), _make_nnx_remat,
     expect_split=True)


class NnxScanNet(nnx.Module):
  def __init__(self, rngs, din=8, dim=16, depth=4, nout=4):
    self.inp = nnx.Linear(din, dim, rngs=rngs)

    @nnx.split_rngs(splits=depth)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make_block(rngs):
      return NnxBlock(dim, rngs)

    self.blocks = make_block(rngs)
    self.out = nnx.Linear(dim, nout, rngs=rngs)

  def __call__(self, x):
    x = self.inp(x)

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    @nnx.remat
    def body(h, blk):
      return blk(h)

    x = body(x, self.blocks)
    return self.out(x)


_NNX_SCAN_GD = [None]


def _make_nnx_scan():
  gd, st, x, y = _nnx_make(25, NnxScanNet)
  _NNX_SCAN_GD[0] = gd
  return st, x, y


# why: nnx.vmap-created stacked layers applied with nnx.scan (+ nnx.remat); per-example CE.
_add("nnx_scan_stacked_layers_remat", _make_nnx_step(_NNX_SCAN_GD, lambda: _make_nnx_scan()), _make_nnx_scan,
     expect_split=True)


# why: nnx.value_and_grad on the module itself and nnx.Optimizer; the (model, optimizer)
# pair travels as an nnx.State split off a graphdef.
class NnxMLP(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(8, 16, rngs=rngs)
    self.l2 = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    return self.l2(nnx.relu(self.l1(x)))


_NNX_OPT_GD = [None]


def _make_nnx_opt():
  model = NnxMLP(nnx.Rngs(26))
  optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
  gd, st = nnx.split((model, optimizer))
  _NNX_OPT_GD[0] = gd
  r = _rng(26)
  return st, _n(r, 16, 8), _i(r, 4, 16)


def step_nnx_optimizer(state, x, y):
  model, optimizer = nnx.merge(_gd(_NNX_OPT_GD, _make_nnx_opt), state)

  def loss_fn(m):
    return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  _, new_state = nnx.split((model, optimizer))
  return new_state, {"loss": loss}


_add("nnx_value_and_grad_optimizer_update", step_nnx_optimizer, _make_nnx_opt, expect_split=True)


# why: plain jax.checkpoint around an MLP block inside the loss; per-example MSE.
def step_jax_checkpoint(state, x, y):
  params, opt = state

  @jax.checkpoint
  def block(p, h):
    return h + jnp.tanh(h @ p["w"] + p["b"])

  def loss_fn(p):
    h = x @ p["inp"]
    for blk in p["blocks"]:
      h = block(blk, h)
    return jnp.mean((h @ p["out"] - y) ** 2)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


def _make_jax_ckpt():
  r = _rng(27)
  p = {"inp": _n(r, 6, 16, scale=0.4), "blocks": [{"w": _n(r, 16, 16, scale=0.25), "b": jnp.zeros(16, jnp.float32)}
                                                  for _ in range(3)], "out": _n(r, 16, 2, scale=0.25)}
  return (p, ADAM.init(p)), _n(r, 16, 6), _n(r, 16, 2)


_add("jax_checkpoint_block_in_loss", step_jax_checkpoint, _make_jax_ckpt, expect_split=True)


# why: jax.checkpoint with a policy around a lax.scan over layers inside the loss.
def step_checkpoint_scan(state, x, y):
  params, opt = state

  def layer(h, w):
    return jnp.tanh(h @ w["w"] + w["b"]) + h, None

  def loss_fn(p):
    h = x @ p["inp"]
    h, _ = lax.scan(jax.checkpoint(layer, policy=jax.checkpoint_policies.dots_saveable), h, p["stack"])
    logits = h @ p["out"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


def _make_ckpt_scan():
  r = _rng(28)
  p = {"inp": _n(r, 6, 16, scale=0.4), "stack": {"w": _n(r, 4, 16, 16, scale=0.2), "b": jnp.zeros((4, 16), jnp.float32)},
       "out": _n(r, 16, 3, scale=0.25)}
  return (p, ADAM.init(p)), _n(r, 16, 6), _i(r, 3, 16)


_add("jax_checkpoint_policy_scan_layers", step_checkpoint_scan, _make_ckpt_scan, expect_split=True)


# why: the user already accumulates by hand: reshape the batch to [M, B/M] and lax.scan
# value_and_grad over the chunks, averaging; still a mean over examples.
def step_manual_accum(state, x, y):
  params, opt = state
  M = 4

  def loss_fn(p, xb, yb):
    return optax.softmax_cross_entropy_with_integer_labels(mlp(p, xb), yb).mean()

  xs = x.reshape(M, x.shape[0] // M, *x.shape[1:])
  ys = y.reshape(M, -1)

  def body(carry, xy):
    l, g = jax.value_and_grad(loss_fn)(params, *xy)
    return jax.tree.map(jnp.add, carry, (l, g)), None

  zero = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
  (loss, grads), _ = lax.scan(body, zero, (xs, ys))
  loss, grads = loss / M, jax.tree.map(lambda g: g / M, grads)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


def _make_manual_accum():
  r = _rng(29)
  p = mlp_init(r, [6, 16, 4])
  return (p, ADAM.init(p)), _n(r, 32, 6), _i(r, 4, 32)


_add("manual_grad_accumulation_scan", step_manual_accum, _make_manual_accum, expect_split=True)


# ============================================================================ C. optax wrappers

def _simple_make(seed, tx, B=16, D=6, C=4):
  r = _rng(seed)
  p = mlp_init(r, [D, 16, C])
  return (p, tx.init(p)), _n(r, B, D), _i(r, C, B)


def _ce_loss(p, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(mlp(p, x), y).mean()


MULTI = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2)


# why: optax.MultiSteps (accumulates over calls, applies every 2nd); mean CE.
def step_multisteps(state, x, y):
  params, opt = state
  loss, grads = jax.value_and_grad(_ce_loss)(params, x, y)
  params, opt = _opt_apply(MULTI, params, opt, grads)
  return (params, opt), {"loss": loss, "mini_step": opt.mini_step}


_add("optax_multisteps_every_2", step_multisteps, lambda: _simple_make(30, MULTI), expect_split=True)

FINITE = optax.apply_if_finite(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)), 3)


# why: optax.apply_if_finite around chain(clip_by_global_norm, adam); mean CE.
def step_apply_if_finite(state, x, y):
  params, opt = state
  loss, grads = jax.value_and_grad(_ce_loss)(params, x, y)
  params, opt = _opt_apply(FINITE, params, opt, grads)
  return (params, opt), {"loss": loss, "notfinite": opt.notfinite_count}


_add("optax_apply_if_finite_clip_adam", step_apply_if_finite, lambda: _simple_make(31, FINITE),
     expect_split=True)

CLIP_ADAMW = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=1e-2))


# why: clip_by_global_norm needs the whole-batch gradient, which is a sum over examples.
def step_clip_adamw(state, batch):
  params, opt = state
  loss, grads = jax.value_and_grad(lambda p: _ce_loss(p, batch["x"], batch["y"]))(params)
  params, opt = _opt_apply(CLIP_ADAMW, params, opt, grads)
  return (params, opt), {"loss": loss, "grad_norm": optax.global_norm(grads)}


def _make_clip_adamw():
  st, x, y = _simple_make(32, CLIP_ADAMW)
  return st, {"x": x, "y": y}


_add("optax_chain_clip_global_norm_adamw", step_clip_adamw, _make_clip_adamw, expect_split=True)

INJECT = optax.inject_hyperparams(optax.adamw)(
    learning_rate=optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10), weight_decay=1e-3)


# why: inject_hyperparams with a schedule; lr read back into metrics; mean CE.
def step_inject(state, x, y):
  params, opt = state
  loss, grads = jax.value_and_grad(_ce_loss)(params, x, y)
  params, opt = _opt_apply(INJECT, params, opt, grads)
  return (params, opt), {"loss": loss, "lr": opt.hyperparams["learning_rate"]}


_add("optax_inject_hyperparams_schedule", step_inject, lambda: _simple_make(33, INJECT),
     expect_split=True)

MULTI_TX = optax.multi_transform({"train": optax.adam(1e-2), "frozen": optax.set_to_zero()},
                                 {"emb": "frozen", "mlp": "train"})


# why: multi_transform freezing an embedding table; bag-of-embeddings classifier, mean CE.
def step_multi_transform(state, ids, y):
  params, opt = state

  def loss_fn(p):
    h = p["emb"][ids].mean(1)
    return optax.softmax_cross_entropy_with_integer_labels(mlp(p["mlp"], h), y).mean()

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(MULTI_TX, params, opt, grads)
  return (params, opt), {"loss": loss}


def _make_multi_transform():
  r = _rng(34)
  p = {"emb": _n(r, 20, 8, scale=0.5), "mlp": mlp_init(r, [8, 16, 3])}
  return (p, MULTI_TX.init(p)), _i(r, 20, 16, 5), _i(r, 3, 16)


_add("optax_multi_transform_frozen_embedding", step_multi_transform, _make_multi_transform,
     expect_split=True)


# why: EMA of params kept in state beside the optimizer (param-only update).
def step_ema(state, x, y):
  params, ema, opt = state
  loss, grads = jax.value_and_grad(_ce_loss)(params, x, y)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  ema = optax.incremental_update(params, ema, step_size=0.1)
  return (params, ema, opt), {"loss": loss}


def _make_ema():
  (p, o), x, y = _simple_make(35, ADAM)
  return (p, jax.tree.map(jnp.copy, p), o), x, y


_add("ema_params_in_state", step_ema, _make_ema, expect_split=True)


# why: lax.cond on the optimizer step count inside the loss (aux term only after warmup).
def step_cond_on_step(state, x, y):
  def loss_fn(params):
    logits = state.apply_fn({"params": params}, x)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    ent = -jnp.mean(jnp.sum(jax.nn.softmax(logits) * jax.nn.log_softmax(logits), -1))
    return lax.cond(state.step < 1, lambda: ce, lambda: ce - 0.1 * ent)
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {"loss": loss, "step": state.step}


def _make_cond_step():
  st, b = _ts_make(36)
  return st, b["image"], b["label"]


_add("lax_cond_on_trainstate_step_in_loss", step_cond_on_step, _make_cond_step, expect_split=True)


# ============================================================================ D. GANs

G_TX = optax.adam(2e-3, b1=0.5)
D_TX = optax.adam(2e-3, b1=0.5)


def _gan_make(seed, B=16, Z=4, X=6, extra=None):
  r = _rng(seed)
  g = mlp_init(r, [Z, 16, X])
  d = mlp_init(r, [X, 16, 1])
  st = {"g": g, "d": d, "g_opt": G_TX.init(g), "d_opt": D_TX.init(d)}
  if extra:
    st.update(extra(r))
  return st, _n(r, B, X) + 1.0, _n(r, B, Z)


def _disc(d, x):
  return mlp(d, x, act=jax.nn.leaky_relu)[..., 0]


# why: non-saturating GAN, two value_and_grad calls in one step (D then G), each a mean over
# examples of softplus terms.
def step_gan_ns(state, real, z):
  g, d = state["g"], state["d"]

  def d_loss(d):
    fake = lax.stop_gradient(mlp(g, z))
    return jnp.mean(jax.nn.softplus(-_disc(d, real))) + jnp.mean(jax.nn.softplus(_disc(d, fake)))

  def g_loss(g, d):
    return jnp.mean(jax.nn.softplus(-_disc(d, mlp(g, z))))

  dl, dg = jax.value_and_grad(d_loss)(d)
  d, d_opt = _opt_apply(D_TX, d, state["d_opt"], dg)
  gl, gg = jax.value_and_grad(g_loss)(g, d)
  g, g_opt = _opt_apply(G_TX, g, state["g_opt"], gg)
  return {"g": g, "d": d, "g_opt": g_opt, "d_opt": d_opt}, {"d_loss": dl, "g_loss": gl}


_add("gan_non_saturating_two_grads", step_gan_ns, lambda: _gan_make(40), expect_split=True)


# why: WGAN-GP with interpolation eps drawn per example from a key carried in state; the
# penalty is a grad of sum(D(x_hat)) w.r.t. x_hat, which is per example (D has no batch coupling).
def step_wgan_gp(state, real, z):
  g, d = state["g"], state["d"]
  key, k_eps = jax.random.split(state["key"])
  B = real.shape[0]

  def d_loss(d):
    fake = lax.stop_gradient(mlp(g, z))
    eps = jax.random.uniform(k_eps, (B, 1))
    x_hat = eps * real + (1 - eps) * fake
    gx = jax.grad(lambda xh: jnp.sum(_disc(d, xh)))(x_hat)
    gp = jnp.mean((jnp.sqrt(jnp.sum(gx ** 2, -1) + 1e-12) - 1.0) ** 2)
    w = jnp.mean(_disc(d, fake)) - jnp.mean(_disc(d, real))
    return w + 10.0 * gp, (w, gp)

  (dl, (w, gp)), dg = jax.value_and_grad(d_loss, has_aux=True)(d)
  d, d_opt = _opt_apply(D_TX, d, state["d_opt"], dg)
  gl, gg = jax.value_and_grad(lambda g: -jnp.mean(_disc(d, mlp(g, z))))(g)
  g, g_opt = _opt_apply(G_TX, g, state["g_opt"], gg)
  return ({"g": g, "d": d, "g_opt": g_opt, "d_opt": d_opt, "key": key},
          {"d_loss": dl, "g_loss": gl, "wasserstein": w, "gp": gp})


_add("wgan_gp_eps_key_in_state", step_wgan_gp,
     lambda: _gan_make(41, extra=lambda r: {"key": jax.random.key(41)}),
     stochastic=True, expect_split=True)


# why: WGAN-GP with the interpolation eps given per example as a batch arg (deterministic).
def step_wgan_gp_eps_arg(state, real, z, eps):
  g, d = state["g"], state["d"]

  def d_loss(d):
    fake = lax.stop_gradient(mlp(g, z))
    x_hat = eps[:, None] * real + (1 - eps[:, None]) * fake
    gx = jax.vmap(jax.grad(lambda xh: _disc(d, xh)))(x_hat)
    gp = jnp.mean((jnp.linalg.norm(gx + 1e-9, axis=-1) - 1.0) ** 2)
    return jnp.mean(_disc(d, fake)) - jnp.mean(_disc(d, real)) + 10.0 * gp

  dl, dg = jax.value_and_grad(d_loss)(d)
  d, d_opt = _opt_apply(D_TX, d, state["d_opt"], dg)
  gl, gg = jax.value_and_grad(lambda g: -jnp.mean(_disc(d, mlp(g, z))))(g)
  g, g_opt = _opt_apply(G_TX, g, state["g_opt"], gg)
  return {"g": g, "d": d, "g_opt": g_opt, "d_opt": d_opt}, {"d_loss": dl, "g_loss": gl}


def _make_wgan_eps():
  st, real, z = _gan_make(42)
  return st, real, z, _u(_rng(420), 16)


_add("wgan_gp_eps_batch_arg_vmap_grad", step_wgan_gp_eps_arg, _make_wgan_eps, expect_split=True)


# why: LSGAN with two linen TrainStates in a tuple; least squares per example.
class LinG(nn.Module):
  @nn.compact
  def __call__(self, z):
    return nn.Dense(6)(nn.relu(nn.Dense(16)(z)))


class LinD(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(1)(nn.leaky_relu(nn.Dense(16)(x), 0.2))[..., 0]


def step_lsgan(state, real, z):
  gs, ds = state

  def d_loss(dp):
    fake = gs.apply_fn({"params": gs.params}, z)
    return 0.5 * jnp.mean((ds.apply_fn({"params": dp}, real) - 1) ** 2) + \
        0.5 * jnp.mean(ds.apply_fn({"params": dp}, lax.stop_gradient(fake)) ** 2)

  dl, dg = jax.value_and_grad(d_loss)(ds.params)
  ds = ds.apply_gradients(grads=dg)

  def g_loss(gp):
    fake = gs.apply_fn({"params": gp}, z)
    return 0.5 * jnp.mean((ds.apply_fn({"params": ds.params}, fake) - 1) ** 2)

  gl, gg = jax.value_and_grad(g_loss)(gs.params)
  gs = gs.apply_gradients(grads=gg)
  return (gs, ds), {"d_loss": dl, "g_loss": gl}


def _make_lsgan():
  r = _rng(43)
  z = _n(r, 16, 4)
  real = _n(r, 16, 6) + 1.0
  G, D = LinG(), LinD()
  gs = train_state.TrainState.create(apply_fn=G.apply, params=G.init(jax.random.PRNGKey(0), z[:1])["params"],
                                     tx=optax.adam(2e-3, b1=0.5))
  ds = train_state.TrainState.create(apply_fn=D.apply, params=D.init(jax.random.PRNGKey(1), real[:1])["params"],
                                     tx=optax.adam(2e-3, b1=0.5))
  return (gs, ds), real, z


_add("lsgan_two_linen_trainstates", step_lsgan, _make_lsgan, expect_split=True)


# why: hinge GAN with R1 penalty on real data (per-example input gradient) and a spectral-norm
# power iteration on D's first weight (params only, u vector in state).
def step_hinge_r1_sn(state, real, z):
  g, d = state["g"], state["d"]
  u = state["u"]
  w0 = d[0]["w"]
  v = w0 @ u
  v = v / (jnp.linalg.norm(v) + 1e-12)
  u_new = w0.T @ v
  u_new = lax.stop_gradient(u_new / (jnp.linalg.norm(u_new) + 1e-12))

  def sn(dp):
    sigma = jnp.dot(lax.stop_gradient(v), dp[0]["w"] @ u_new)
    return [{"w": dp[0]["w"] / sigma, "b": dp[0]["b"]}] + dp[1:]

  def d_loss(dp):
    dn = sn(dp)
    fake = lax.stop_gradient(mlp(g, z))
    real_s = _disc(dn, real)
    r1 = jnp.mean(jnp.sum(jax.grad(lambda x: jnp.sum(_disc(dn, x)))(real) ** 2, -1))
    return jnp.mean(jax.nn.relu(1 - real_s)) + jnp.mean(jax.nn.relu(1 + _disc(dn, fake))) + 0.5 * r1

  dl, dg = jax.value_and_grad(d_loss)(d)
  d, d_opt = _opt_apply(D_TX, d, state["d_opt"], dg)
  gl, gg = jax.value_and_grad(lambda gp: -jnp.mean(_disc(sn(d), mlp(gp, z))))(g)
  g, g_opt = _opt_apply(G_TX, g, state["g_opt"], gg)
  return {"g": g, "d": d, "g_opt": g_opt, "d_opt": d_opt, "u": u_new}, {"d_loss": dl, "g_loss": gl}


_add("gan_hinge_r1_spectral_norm", step_hinge_r1_sn,
     lambda: _gan_make(44, extra=lambda r: {"u": _n(r, 16) / 4.0}), expect_split=True)


# why: StyleGAN minibatch-stddev feature: the std of D's features across the batch is appended
# to every example before the head -> examples interact through a nonlinear batch statistic.
def step_gan_mbstd(state, real, z):
  g, d = state["g"], state["d"]

  def disc(dp, x):
    h = jax.nn.leaky_relu(x @ dp[0]["w"] + dp[0]["b"])
    sd = jnp.mean(jnp.sqrt(jnp.var(h, axis=0) + 1e-8))
    h = jnp.concatenate([h, jnp.broadcast_to(sd, (h.shape[0], 1))], -1)
    return (h @ dp[1]["w"] + dp[1]["b"])[..., 0]

  def d_loss(dp):
    fake = lax.stop_gradient(mlp(g, z))
    return jnp.mean(jax.nn.softplus(-disc(dp, real))) + jnp.mean(jax.nn.softplus(disc(dp, fake)))

  dl, dg = jax.value_and_grad(d_loss)(d)
  d, d_opt = _opt_apply(D_TX, d, state["d_opt"], dg)
  gl, gg = jax.value_and_grad(lambda gp: jnp.mean(jax.nn.softplus(-disc(d, mlp(gp, z)))))(g)
  g, g_opt = _opt_apply(G_TX, g, state["g_opt"], gg)
  return {"g": g, "d": d, "g_opt": g_opt, "d_opt": d_opt}, {"d_loss": dl, "g_loss": gl}


def _make_mbstd():
  r = _rng(45)
  g = mlp_init(r, [4, 16, 6])
  d = [{"w": _n(r, 6, 16, scale=0.4), "b": jnp.zeros(16, jnp.float32)}, {"w": _n(r, 17, 1, scale=0.25), "b": jnp.zeros(1, jnp.float32)}]
  return {"g": g, "d": d, "g_opt": G_TX.init(g), "d_opt": D_TX.init(d)}, _n(r, 16, 6) + 1.0, _n(r, 16, 4)


_add("gan_minibatch_stddev_layer", step_gan_mbstd, _make_mbstd, expect_split=False)


# why: relativistic average GAN: each real logit is compared with the batch mean of the fake
# logits inside a softplus -> per-example terms depend nonlinearly on a param-dependent batch mean.
def step_ragan(state, real, z):
  g, d = state["g"], state["d"]

  def d_loss(dp):
    fr = _disc(dp, real)
    ff = _disc(dp, lax.stop_gradient(mlp(g, z)))
    return jnp.mean(jax.nn.softplus(-(fr - ff.mean()))) + jnp.mean(jax.nn.softplus(ff - fr.mean()))

  def g_loss(gp):
    fr = _disc(d, real)
    ff = _disc(d, mlp(gp, z))
    return jnp.mean(jax.nn.softplus(-(ff - fr.mean()))) + jnp.mean(jax.nn.softplus(fr - ff.mean()))

  dl, dg = jax.value_and_grad(d_loss)(d)
  d, d_opt = _opt_apply(D_TX, d, state["d_opt"], dg)
  gl, gg = jax.value_and_grad(g_loss)(g)
  g, g_opt = _opt_apply(G_TX, g, state["g_opt"], gg)
  return {"g": g, "d": d, "g_opt": g_opt, "d_opt": d_opt}, {"d_loss": dl, "g_loss": gl}


_add("ragan_relativistic_average", step_ragan, lambda: _gan_make(46), expect_split=False)


# why: MMD-GAN style generator loss: Gaussian-kernel MMD between the generated and real batch
# -> all pairs of examples inside exp(-|xi-xj|^2).
def step_mmd_gen(state, real, z):
  g, opt = state

  def k(a, b):
    d2 = jnp.sum((a[:, None] - b[None]) ** 2, -1)
    return jnp.exp(-d2 / 2.0)

  def loss_fn(gp):
    fake = mlp(gp, z)
    return k(fake, fake).mean() + k(real, real).mean() - 2 * k(fake, real).mean()

  loss, grads = jax.value_and_grad(loss_fn)(g)
  g, opt = _opt_apply(G_TX, g, opt, grads)
  return (g, opt), {"mmd": loss}


def _make_mmd():
  r = _rng(47)
  g = mlp_init(r, [4, 16, 6])
  return (g, G_TX.init(g)), _n(r, 16, 6) + 1.0, _n(r, 16, 4)


_add("mmd_gaussian_kernel_generator", step_mmd_gen, _make_mmd, expect_split=False)


# ============================================================================ E. ranking

def _rank_make(seed, B=16, Lst=6, D=5):
  r = _rng(seed)
  p = mlp_init(r, [D, 16, 1])
  feats = _n(r, B, Lst, D)
  rel = jnp.asarray(r.integers(0, 4, (B, Lst)), jnp.float32)
  return (p, ADAM.init(p)), feats, rel


# why: RankNet pairwise logistic loss between documents inside each query's own list.
def step_ranknet(state, feats, rel):
  params, opt = state

  def loss_fn(p):
    s = mlp(p, feats)[..., 0]                              # [B, L]
    ds = s[:, :, None] - s[:, None, :]
    pref = (rel[:, :, None] > rel[:, None, :]).astype(jnp.float32)
    per_q = jnp.sum(pref * jax.nn.softplus(-ds), (1, 2)) / jnp.maximum(pref.sum((1, 2)), 1.0)
    return per_q.mean()

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


_add("ranknet_pairwise_within_query_list", step_ranknet, lambda: _rank_make(50), expect_split=True)


# why: ListNet softmax over each query's own list, with a per-list document mask.
def step_listnet(state, feats, rel, doc_mask):
  params, opt = state

  def loss_fn(p):
    s = mlp(p, feats)[..., 0]
    s = jnp.where(doc_mask, s, -1e9)
    t = jax.nn.softmax(jnp.where(doc_mask, rel, -1e9), -1)
    return -jnp.mean(jnp.sum(t * jax.nn.log_softmax(s, -1) * doc_mask, -1))

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


def _make_listnet():
  st, f, rel = _rank_make(51)
  n = _rng(510).integers(2, 7, (16,))
  return st, f, rel, jnp.asarray(np.arange(6)[None] < n[:, None])


_add("listnet_softmax_per_query_masked", step_listnet, _make_listnet, expect_split=True)


# why: LambdaRank-style: pairwise logistic weighted by |delta NDCG| computed within each list
# (sort along the list axis, not the batch).
def step_lambdarank(state, feats, rel):
  params, opt = state

  def loss_fn(p):
    s = mlp(p, feats)[..., 0]
    Lst = s.shape[1]
    order = jnp.argsort(-lax.stop_gradient(s), axis=1)
    rank = jnp.argsort(order, axis=1)
    disc = 1.0 / jnp.log2(rank + 2.0)
    gain = 2.0 ** rel - 1
    ideal = jnp.sum(-jnp.sort(-gain, 1) / jnp.log2(jnp.arange(Lst) + 2.0), 1, keepdims=True)
    dndcg = jnp.abs((gain[:, :, None] - gain[:, None, :]) * (disc[:, :, None] - disc[:, None, :])) / jnp.maximum(ideal[..., None], 1e-6)
    pref = (rel[:, :, None] > rel[:, None, :]).astype(jnp.float32)
    ds = s[:, :, None] - s[:, None, :]
    return jnp.sum(pref * dndcg * jax.nn.softplus(-ds)) / s.shape[0]

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


_add("lambdarank_delta_ndcg_within_list", step_lambdarank, lambda: _rank_make(52), expect_split=True)


# why: ListMLE (Plackett-Luce) over the whole batch treated as one ranked list: suffix
# logsumexps over the batch sorted by label -> every example sees the others.
def step_listmle_batch(state, x, rel):
  params, opt = state

  def loss_fn(p):
    s = mlp(p, x)[..., 0]                           # [B]
    order = jnp.argsort(-rel)
    s_sorted = s[order]
    suffix_lse = lax.cumlogsumexp(s_sorted, reverse=True)
    return jnp.mean(suffix_lse - s_sorted)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


def _make_listmle():
  r = _rng(53)
  p = mlp_init(r, [5, 16, 1])
  return (p, ADAM.init(p)), _n(r, 16, 5), _u(r, 16)


_add("listmle_across_batch", step_listmle_batch, _make_listmle, expect_split=False)


# why: pairwise margin ranking over all (i, j) pairs of the batch with y_i > y_j.
def step_pairwise_batch(state, x, y):
  params, opt = state

  def loss_fn(p):
    s = mlp(p, x)[..., 0]
    pref = (y[:, None] > y[None, :]).astype(jnp.float32)
    h = jax.nn.relu(1.0 - (s[:, None] - s[None, :]))
    return jnp.sum(pref * h) / jnp.maximum(pref.sum(), 1.0)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


_add("pairwise_hinge_ranking_across_batch", step_pairwise_batch, _make_listmle, expect_split=False)


# why: AUC surrogate: squared hinge between every positive and every negative of the batch.
def step_auc(state, x, y):
  params, opt = state

  def loss_fn(p):
    s = mlp(p, x)[..., 0]
    pos = (y > 0.5).astype(jnp.float32)
    pairs = pos[:, None] * (1 - pos)[None, :]
    return jnp.sum(pairs * jax.nn.relu(1.0 - (s[:, None] - s[None, :])) ** 2) / jnp.maximum(pairs.sum(), 1.0)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


_add("auc_pairwise_surrogate_pos_neg", step_auc, _make_listmle, expect_split=False)


# why: Cox partial likelihood: each event's risk set is every example in the batch with a
# later-or-equal time -> logsumexp over other examples.
def step_cox(state, x, time, event):
  params, opt = state

  def loss_fn(p):
    risk = mlp(p, x)[..., 0]
    at_risk = time[None, :] >= time[:, None]
    lse = jax.nn.logsumexp(jnp.where(at_risk, risk[None, :], -jnp.inf), axis=1)
    return -jnp.sum(event * (risk - lse)) / jnp.maximum(event.sum(), 1.0)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


def _make_cox():
  r = _rng(54)
  p = mlp_init(r, [5, 16, 1])
  return (p, ADAM.init(p)), _n(r, 16, 5), _u(r, 16, hi=10.0), jnp.asarray(r.uniform(size=16) < 0.7, jnp.float32)


_add("cox_partial_likelihood_risk_sets", step_cox, _make_cox, expect_split=False)


# ============================================================================ F. mixture of experts

def _moe_init(r, D=8, E=4, H=12, C=5):
  return {"inp": _n(r, 6, D, scale=0.4), "router": _n(r, D, E, scale=0.5),
          "w_in": _n(r, E, D, H, scale=0.35), "w_out": _n(r, E, H, D, scale=0.3),
          "head": _n(r, D, C, scale=0.3)}


def _experts(p, x):
  h = jax.nn.gelu(jnp.einsum("nd,edh->neh", x, p["w_in"]))
  return jnp.einsum("neh,ehd->ned", h, p["w_out"])      # [N, E, D]


def _moe_make(seed, B=16, L=6, C=5):
  r = _rng(seed)
  p = _moe_init(r, C=C)
  return (p, ADAM.init(p)), _n(r, B, L, 6), _i(r, C, B, L)


# why: Switch top-1 routing; aux = E * sum_e f_e * P_e with f_e the argmax one-hot fraction and
# P_e the mean router prob over all B*L tokens. A function of two sums over tokens -> splittable.
def step_moe_switch(state, x, y):
  params, opt = state

  def loss_fn(p):
    B, L, _ = x.shape
    h = (x @ p["inp"]).reshape(B * L, -1)
    logits = h @ p["router"]
    probs = jax.nn.softmax(logits, -1)
    E = probs.shape[-1]
    idx = jnp.argmax(probs, -1)
    onehot = jax.nn.one_hot(idx, E)
    gate = jnp.sum(probs * onehot, -1)
    out = jnp.einsum("ned,ne->nd", _experts(p, h), onehot) * gate[:, None]
    h = h + out
    f = jnp.mean(onehot, 0)
    P_e = jnp.mean(probs, 0)
    aux = E * jnp.sum(f * P_e)
    ce = optax.softmax_cross_entropy_with_integer_labels(h @ p["head"], y.reshape(-1)).mean()
    return ce + 0.01 * aux, (ce, aux)

  (loss, (ce, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss, "ce": ce, "aux": aux}


_add("moe_switch_top1_load_balance_aux", step_moe_switch, lambda: _moe_make(60), expect_split=True)


# why: GShard-style top-2 per token (lax.top_k along experts), renormalised gates,
# aux = E^2 * mean_e(me*ce) (ce from top-1 one-hot), plus router z-loss. Sums over tokens.
def step_moe_top2(state, x, y):
  params, opt = state

  def loss_fn(p):
    h = x @ p["inp"]                                     # [B, L, D]
    logits = h @ p["router"]
    E = logits.shape[-1]
    probs = jax.nn.softmax(logits, -1)
    top_v, top_i = lax.top_k(probs, 2)
    gates = top_v / jnp.sum(top_v, -1, keepdims=True)
    disp = jnp.sum(jax.nn.one_hot(top_i, E) * gates[..., None], -2)    # [B, L, E]
    flat = h.reshape(-1, h.shape[-1])
    out = jnp.einsum("ned,ne->nd", _experts(p, flat), disp.reshape(-1, E)).reshape(h.shape)
    h = h + out
    me = probs.mean((0, 1))
    ce_frac = jax.nn.one_hot(top_i[..., 0], E).mean((0, 1))
    aux = jnp.mean(me * ce_frac) * E * E
    z = jnp.mean(jax.nn.logsumexp(logits, -1) ** 2)
    task = optax.softmax_cross_entropy_with_integer_labels(h @ p["head"], y).mean()
    return task + 1e-2 * aux + 1e-3 * z, {"aux": aux, "z": z}

  (loss, m), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss, **m}


_add("moe_gshard_top2_aux_router_zloss", step_moe_top2, lambda: _moe_make(61), expect_split=True)


# why: linen MoE layer that sows its aux and z losses into 'intermediates'; the loss applies with
# mutable=['intermediates'] and sums what was sown. Switch aux again -> sums over tokens.
class SownMoE(nn.Module):
  experts: int = 4
  dim: int = 8

  @nn.compact
  def __call__(self, x):
    B, L, D = x.shape
    t = x.reshape(B * L, D)
    logits = nn.Dense(self.experts, use_bias=False, name="router")(t)
    probs = jax.nn.softmax(logits)
    onehot = jax.nn.one_hot(jnp.argmax(logits, -1), self.experts)
    w_in = self.param("w_in", nn.initializers.lecun_normal(), (self.experts, D, 2 * D), jnp.float32)
    w_out = self.param("w_out", nn.initializers.lecun_normal(), (self.experts, 2 * D, D), jnp.float32)
    eo = jnp.einsum("neh,ehd->ned", nn.relu(jnp.einsum("nd,edh->neh", t, w_in)), w_out)
    out = jnp.einsum("ned,ne->nd", eo, onehot * probs)
    self.sow("intermediates", "aux_loss", self.experts * jnp.sum(onehot.mean(0) * probs.mean(0)))
    self.sow("intermediates", "z_loss", jnp.mean(jax.nn.logsumexp(logits, -1) ** 2))
    return x + out.reshape(B, L, D)


class SownMoENet(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(8)(x)
    h = SownMoE()(h)
    h = SownMoE()(nn.LayerNorm()(h))
    return nn.Dense(5)(h)


def step_moe_sow(state, x, y):
  def loss_fn(params):
    logits, inter = state.apply_fn({"params": params}, x, mutable=["intermediates"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    aux = sum(v for _, v in _find(inter, "aux_loss"))
    z = sum(v for _, v in _find(inter, "z_loss"))
    return ce + 0.01 * aux + 0.001 * z, (ce, aux)
  (loss, (ce, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads), {"loss": loss, "ce": ce, "aux": aux}


def _find(tree, key):
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return [(jax.tree_util.keystr(path), v) for path, v in flat
          if any(getattr(k, "key", None) == key for k in path)]


def _make_moe_sow():
  r = _rng(62)
  x = _n(r, 16, 6, 6)
  y = _i(r, 5, 16, 6)
  m = SownMoENet()
  params = m.init(jax.random.PRNGKey(62), x[:1])["params"]
  return train_state.TrainState.create(apply_fn=m.apply, params=params, tx=optax.adam(3e-3)), x, y


_add("moe_linen_sown_aux_and_z_loss", step_moe_sow, _make_moe_sow, expect_split=True)


# why: capacity-limited top-1 dispatch: position in expert = cumsum of one-hot over ALL B*L
# tokens of the batch, capacity from the token count; overflowing tokens are dropped. Whether a
# token is processed depends on earlier examples in the batch -> no exact split.
def step_moe_capacity_flat(state, x, y):
  params, opt = state

  def loss_fn(p):
    B, L, _ = x.shape
    h = (x @ p["inp"]).reshape(B * L, -1)
    logits = h @ p["router"]
    probs = jax.nn.softmax(logits, -1)
    N, E = probs.shape
    capacity = int(1.0 * N / E)
    onehot = jax.nn.one_hot(jnp.argmax(probs, -1), E)
    pos = jnp.cumsum(onehot, axis=0) * onehot
    keep = onehot * (pos <= capacity)
    out = jnp.einsum("ned,ne->nd", _experts(p, h), keep * probs)
    h = h + out
    aux = E * jnp.sum(onehot.mean(0) * probs.mean(0))
    ce = optax.softmax_cross_entropy_with_integer_labels(h @ p["head"], y.reshape(-1)).mean()
    return ce + 0.01 * aux, keep.sum() / N

  (loss, kept), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss, "kept_fraction": kept}


def _make_moe_cap():
  st, x, y = _moe_make(63)
  (p, o) = st
  p = dict(p, router=p["router"].at[:, 0].add(0.6))     # a skewed router so capacity binds
  return (p, ADAM.init(p)), x, y


_add("moe_capacity_cumsum_over_batch_tokens", step_moe_capacity_flat, _make_moe_cap,
     expect_split=False)


# why: capacity per sequence: cumsum along each example's own tokens ([B, L, E], axis 1),
# capacity from L -> examples stay independent.
def step_moe_capacity_per_seq(state, x, y):
  params, opt = state

  def loss_fn(p):
    B, L, _ = x.shape
    h = x @ p["inp"]
    logits = h @ p["router"]
    probs = jax.nn.softmax(logits, -1)
    E = probs.shape[-1]
    capacity = max(1, int(1.0 * L / E))
    onehot = jax.nn.one_hot(jnp.argmax(probs, -1), E)
    pos = jnp.cumsum(onehot, axis=1) * onehot
    keep = onehot * (pos <= capacity)
    flat = h.reshape(B * L, -1)
    out = jnp.einsum("ned,ne->nd", _experts(p, flat), (keep * probs).reshape(B * L, E))
    h = h + out.reshape(h.shape)
    return optax.softmax_cross_entropy_with_integer_labels(h @ p["head"], y).mean()

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


_add("moe_capacity_cumsum_within_each_sequence", step_moe_capacity_per_seq, _make_moe_cap,
     expect_split=True)


# why: nnx MoE with top-k routing per token and the switch aux loss, nnx.value_and_grad on a
# merged module; aux is a function of sums over tokens.
class NnxMoE(nnx.Module):
  def __init__(self, rngs, din=6, dim=8, experts=4, k=2, classes=5):
    self.k = k
    self.inp = nnx.Linear(din, dim, rngs=rngs)
    self.router = nnx.Linear(dim, experts, use_bias=False, rngs=rngs)
    init = nnx.initializers.lecun_normal()
    self.w_in = nnx.Param(init(rngs.params(), (experts, dim, 2 * dim), jnp.float32))
    self.w_out = nnx.Param(init(rngs.params(), (experts, 2 * dim, dim), jnp.float32))
    self.head = nnx.Linear(dim, classes, rngs=rngs)

  def __call__(self, x):
    B, L, _ = x.shape
    h = self.inp(x).reshape(B * L, -1)
    logits = self.router(h)
    probs = jax.nn.softmax(logits)
    E = probs.shape[-1]
    v, i = lax.top_k(probs, self.k)
    disp = jnp.sum(jax.nn.one_hot(i, E) * v[..., None], 1)
    eo = jnp.einsum("neh,ehd->ned", nnx.relu(jnp.einsum("nd,edh->neh", h, self.w_in[...])), self.w_out[...])
    h = h + jnp.einsum("ned,ne->nd", eo, disp)
    aux = E * jnp.sum(jax.nn.one_hot(i[:, 0], E).mean(0) * probs.mean(0))
    return self.head(h).reshape(B, L, -1), aux


_NNX_MOE_GD = [None]
NNX_MOE_TX = optax.adamw(3e-3)


def _make_nnx_moe():
  m = NnxMoE(nnx.Rngs(64))
  gd, params = nnx.split(m, nnx.Param)
  _NNX_MOE_GD[0] = gd
  r = _rng(64)
  return (params, NNX_MOE_TX.init(params)), {"x": _n(r, 16, 6, 6), "y": _i(r, 5, 16, 6)}


def step_nnx_moe(state, batch):
  params, opt = state

  def loss_fn(model):
    logits, aux = model(batch["x"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return ce + 0.01 * aux, aux

  model = nnx.merge(_gd(_NNX_MOE_GD, _make_nnx_moe), params)
  (loss, aux), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
  params, opt = _opt_apply(NNX_MOE_TX, params, opt, grads)
  return (params, opt), {"loss": loss, "aux": aux}


_add("moe_nnx_topk_per_token_aux", step_nnx_moe, _make_nnx_moe, expect_split=True)


# ============================================================================ G. preference optimisation

def _seq_logp(p, tokens, mask):
  """Sum of next-token log-probs over the response mask; tokens [N, L], mask [N, L-1]."""
  lp = jax.nn.log_softmax(lm_logits(p, tokens[:, :-1]))
  tok = jnp.take_along_axis(lp, tokens[:, 1:, None], -1)[..., 0]
  return jnp.sum(tok * mask, -1), jnp.sum(mask, -1)


def _pref_batch(r, B=16, L=9, V=32):
  prompt = r.integers(3, L - 3, (B,))
  lc = r.integers(1, L - 1, (B,))
  lr_ = r.integers(1, L - 1, (B,))
  pos = np.arange(L - 1)[None]
  mc = ((pos >= prompt[:, None] - 1) & (pos < np.minimum(prompt + lc, L - 1)[:, None])).astype(np.float32)
  mr = ((pos >= prompt[:, None] - 1) & (pos < np.minimum(prompt + lr_, L - 1)[:, None])).astype(np.float32)
  chosen = r.integers(0, V, (B, L))
  rejected = r.integers(0, V, (B, L))
  rejected[:, :3] = chosen[:, :3]
  return {"chosen": jnp.asarray(chosen, jnp.int32), "rejected": jnp.asarray(rejected, jnp.int32),
          "chosen_mask": jnp.asarray(mc), "rejected_mask": jnp.asarray(mr)}


DPO_TX = optax.adamw(5e-3)


# why: DPO with the concatenated forward (concat chosen+rejected, one forward, [:B] / [B:],
# B from the array's shape) and precomputed reference log-probs in the batch. Per-pair loss.
def step_dpo_precomputed(state, batch):
  params, opt = state
  beta = 0.1

  def loss_fn(p):
    B = batch["chosen"].shape[0]
    toks = jnp.concatenate([batch["chosen"], batch["rejected"]], axis=0)
    masks = jnp.concatenate([batch["chosen_mask"], batch["rejected_mask"]], axis=0)
    logps, _ = _seq_logp(p, toks, masks)
    pc, pr = logps[:B], logps[B:]
    logits = beta * ((pc - batch["ref_chosen_logps"]) - (pr - batch["ref_rejected_logps"]))
    loss = -jax.nn.log_sigmoid(logits).mean()
    return loss, {"reward_acc": jnp.mean(logits > 0), "margin": jnp.mean(logits) / beta}

  (loss, m), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  params, opt = _opt_apply(DPO_TX, params, opt, grads)
  return (params, opt), {"loss": loss, **m}


def _make_dpo_pre():
  r = _rng(70)
  p = lm_init(r)
  ref = lm_init(_rng(700))
  b = _pref_batch(r)
  b["ref_chosen_logps"] = _seq_logp(ref, b["chosen"], b["chosen_mask"])[0]
  b["ref_rejected_logps"] = _seq_logp(ref, b["rejected"], b["rejected_mask"])[0]
  return (p, DPO_TX.init(p)), b


_add("dpo_concat_forward_precomputed_ref", step_dpo_precomputed, _make_dpo_pre, expect_split=True)


# why: DPO with a frozen reference model passed as another (unbatched) argument; the reference
# also runs the concatenated forward, under stop_gradient. Per-pair loss.
def step_dpo_ref_arg(state, ref_params, batch):
  params, opt = state
  beta = 0.2

  def loss_fn(p):
    B = batch["chosen"].shape[0]
    toks = jnp.concatenate([batch["chosen"], batch["rejected"]])
    masks = jnp.concatenate([batch["chosen_mask"], batch["rejected_mask"]])
    pol, _ = _seq_logp(p, toks, masks)
    ref, _ = _seq_logp(ref_params, toks, masks)
    ref = lax.stop_gradient(ref)
    h = (pol[:B] - ref[:B]) - (pol[B:] - ref[B:])
    return -jnp.mean(jax.nn.log_sigmoid(beta * h)), h

  (loss, h), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  params, opt = _opt_apply(DPO_TX, params, opt, grads)
  return (params, opt), {"loss": loss, "acc": jnp.mean(h > 0)}


def _make_dpo_ref():
  r = _rng(71)
  p = lm_init(r)
  return (p, DPO_TX.init(p)), lm_init(_rng(710)), _pref_batch(r)


_add("dpo_concat_forward_frozen_ref_model_arg", step_dpo_ref_arg, _make_dpo_ref, expect_split=True)


# why: IPO (squared loss on the log-ratio gap) with the reference params held in state; concat
# forward with explicit B = chosen.shape[0]; length-averaged log-probs. Per-pair.
def step_ipo(state, chosen, rejected, chosen_mask, rejected_mask):
  params, ref, opt = state
  tau = 0.1

  def loss_fn(p):
    B = chosen.shape[0]
    toks = jnp.concatenate([chosen, rejected])
    masks = jnp.concatenate([chosen_mask, rejected_mask])
    s, n = _seq_logp(p, toks, masks)
    sr, _ = _seq_logp(ref, toks, masks)
    avg = (s - lax.stop_gradient(sr)) / jnp.maximum(n, 1.0)
    h = avg[:B] - avg[B:]
    return jnp.mean((h - 1.0 / (2 * tau)) ** 2)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(DPO_TX, params, opt, grads)
  return (params, ref, opt), {"loss": loss}


def _make_ipo():
  r = _rng(72)
  p = lm_init(r)
  b = _pref_batch(r)
  return ((p, jax.tree.map(jnp.copy, p), DPO_TX.init(p)), b["chosen"], b["rejected"],
          b["chosen_mask"], b["rejected_mask"])


_add("ipo_concat_forward_ref_in_state", step_ipo, _make_ipo, expect_split=True)


# why: SimPO (reference-free, length-normalised, target margin) via concat forward; per-pair.
def step_simpo(state, batch):
  params, opt = state
  beta, gamma = 2.0, 0.5

  def loss_fn(p):
    B = batch["chosen"].shape[0]
    s, n = _seq_logp(p, jnp.concatenate([batch["chosen"], batch["rejected"]]),
                     jnp.concatenate([batch["chosen_mask"], batch["rejected_mask"]]))
    r = beta * s / jnp.maximum(n, 1.0)
    return -jnp.mean(jax.nn.log_sigmoid(r[:B] - r[B:] - gamma))

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(DPO_TX, params, opt, grads)
  return (params, opt), {"loss": loss}


def _make_simpo():
  r = _rng(73)
  p = lm_init(r)
  return (p, DPO_TX.init(p)), _pref_batch(r)


_add("simpo_concat_forward_reference_free", step_simpo, _make_simpo, expect_split=True)


# why: KTO: the reference point z is the detached, clamped batch mean of the policy/reference
# KL estimate; each example then goes through sigmoid(beta*(r - z)). Exact only with a pre-pass
# computing z over the whole batch (z carries no gradient) -> None.
def step_kto(state, ref_params, batch):
  params, opt = state
  beta = 0.1

  def loss_fn(p):
    pol, _ = _seq_logp(p, batch["tokens"], batch["mask"])
    ref, _ = _seq_logp(ref_params, batch["tokens"], batch["mask"])
    kl_pol, _ = _seq_logp(p, batch["kl_tokens"], batch["kl_mask"])
    kl_ref, _ = _seq_logp(ref_params, batch["kl_tokens"], batch["kl_mask"])
    z = lax.stop_gradient(jnp.maximum(jnp.mean(kl_pol - kl_ref), 0.0))
    r = pol - lax.stop_gradient(ref)
    des = batch["desirable"]
    losses = jnp.where(des, 1 - jax.nn.sigmoid(beta * (r - z)), 1 - jax.nn.sigmoid(beta * (z - r)))
    return losses.mean(), z

  (loss, z), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  params, opt = _opt_apply(DPO_TX, params, opt, grads)
  return (params, opt), {"loss": loss, "kl": z}


def _make_kto():
  r = _rng(74)
  p = lm_init(r)
  b = _pref_batch(r)
  batch = {"tokens": b["chosen"], "mask": b["chosen_mask"], "kl_tokens": b["rejected"],
           "kl_mask": b["rejected_mask"], "desirable": jnp.asarray(r.uniform(size=16) < 0.5)}
  return (p, DPO_TX.init(p)), lm_init(_rng(740)), batch


_add("kto_detached_batch_kl_reference_point", step_kto, _make_kto, expect_split=None)


# ============================================================================ H. contrastive / metric

def _l2n(x, axis=-1):
  return x / jnp.sqrt(jnp.sum(x ** 2, axis, keepdims=True) + 1e-8)


def _enc_make(seed, extra=(), B=16, D=8, d=6):
  r = _rng(seed)
  p = mlp_init(r, [D, 16, d])
  return r, (p, ADAM.init(p))


# why: InfoNCE where every example brings its own candidate list [B, 1+K, D] with the positive at
# index 0; labels = jnp.zeros(B, int). Negatives are per-example -> splittable.
def step_infonce_own_candidates(state, query, candidates):
  params, opt = state

  def loss_fn(p):
    q = _l2n(mlp(p, query))                              # [B, d]
    c = _l2n(mlp(p, candidates))                         # [B, 1+K, d]
    logits = jnp.einsum("bd,bkd->bk", q, c) / 0.1
    labels = jnp.zeros(q.shape[0], dtype=jnp.int32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), logits

  (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss, "acc": jnp.mean(jnp.argmax(logits, -1) == 0)}


def _make_infonce_own():
  r, st = _enc_make(80)
  q = _n(r, 16, 8)
  cand = _n(r, 16, 5, 8)
  cand = cand.at[:, 0].set(q + 0.3 * _n(r, 16, 8))
  return st, q, cand


_add("infonce_per_example_candidates_label_zero", step_infonce_own_candidates, _make_infonce_own,
     expect_split=True)


# why: MoCo v2: query encoder trained, key encoder EMA (no grad), negatives from a queue held in
# state, labels zeros(B). The queue update enqueues this batch's keys (a per-example output
# placed in state in batch order) -> still exactly reconstructible from microbatches.
def step_moco(state, view1, view2):
  pq, pk, queue, opt = state

  def loss_fn(p):
    q = _l2n(mlp(p, view1))
    k = lax.stop_gradient(_l2n(mlp(pk, view2)))
    l_pos = jnp.sum(q * k, -1, keepdims=True)
    l_neg = q @ queue.T
    logits = jnp.concatenate([l_pos, l_neg], 1) / 0.2
    labels = jnp.zeros((q.shape[0],), jnp.int32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), k

  (loss, k), grads = jax.value_and_grad(loss_fn, has_aux=True)(pq)
  pq, opt = _opt_apply(ADAM, pq, opt, grads)
  pk = jax.tree.map(lambda a, b: 0.99 * a + 0.01 * b, pk, pq)
  queue = jnp.concatenate([k, queue], 0)[: queue.shape[0]]
  return (pq, pk, queue, opt), {"loss": loss}


def _make_moco():
  r, (p, o) = _enc_make(81)
  x = _n(r, 16, 8)
  queue = _l2n(_n(r, 40, 6))
  return (p, jax.tree.map(jnp.copy, p), queue, o), x + 0.1 * _n(r, 16, 8), x + 0.1 * _n(r, 16, 8)


_add("moco_queue_negatives_enqueue_batch_keys", step_moco, _make_moco, expect_split=True)


# why: SimCLR NT-Xent over 2B views: each view's softmax runs over every other view in the batch.
def step_simclr(state, v1, v2):
  params, opt = state

  def loss_fn(p):
    z = _l2n(mlp(p, jnp.concatenate([v1, v2])))
    n = z.shape[0]
    B = n // 2
    sim = z @ z.T / 0.5
    sim = jnp.where(jnp.eye(n, dtype=bool), -1e9, sim)
    labels = (jnp.arange(n) + B) % n
    return optax.softmax_cross_entropy_with_integer_labels(sim, labels).mean()

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


def _make_two_views(seed):
  r, st = _enc_make(seed)
  x = _n(r, 16, 8)
  return st, x + 0.2 * _n(r, 16, 8), x + 0.2 * _n(r, 16, 8)


_add("simclr_nt_xent_2b_views", step_simclr, lambda: _make_two_views(82), expect_split=False)


# why: CLIP: image and text towers, B x B logits with a learned temperature, symmetric CE.
def step_clip(state, images, texts):
  params, opt = state

  def loss_fn(p):
    i = _l2n(mlp(p["img"], images))
    t = _l2n(mlp(p["txt"], p["tok"][texts].mean(1)))
    logits = i @ t.T * jnp.exp(p["logit_scale"])
    labels = jnp.arange(logits.shape[0])
    return 0.5 * (optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean() +
                  optax.softmax_cross_entropy_with_integer_labels(logits.T, labels).mean())

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss, "temp": jnp.exp(params["logit_scale"])}


def _make_clip():
  r = _rng(83)
  p = {"img": mlp_init(r, [10, 16, 6]), "txt": mlp_init(r, [8, 16, 6]), "tok": _n(r, 30, 8, scale=0.5),
       "logit_scale": jnp.asarray(np.log(1 / 0.07), jnp.float32)}
  return (p, ADAM.init(p)), _n(r, 16, 10), _i(r, 30, 16, 5)


_add("clip_symmetric_contrastive", step_clip, _make_clip, expect_split=False)


# why: dense retrieval with in-batch negatives: q @ p.T, labels arange(B).
def step_inbatch(state, batch):
  params, opt = state

  def loss_fn(p):
    q = mlp(p["q"], batch["query"])
    d = mlp(p["d"], batch["passage"])
    scores = q @ d.T
    return optax.softmax_cross_entropy_with_integer_labels(scores, jnp.arange(q.shape[0])).mean()

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


def _make_inbatch():
  r = _rng(84)
  p = {"q": mlp_init(r, [8, 16, 6]), "d": mlp_init(r, [8, 16, 6])}
  x = _n(r, 16, 8)
  return (p, ADAM.init(p)), {"query": x, "passage": x + 0.3 * _n(r, 16, 8)}


_add("dense_retrieval_in_batch_negatives", step_inbatch, _make_inbatch, expect_split=False)


# why: in-batch negatives PLUS one hard negative per example (DPR style): logits [B, 2B].
def step_dpr_hardneg(state, q_in, pos_in, neg_in):
  params, opt = state

  def loss_fn(p):
    q = mlp(p, q_in)
    d = mlp(p, jnp.concatenate([pos_in, neg_in]))
    return optax.softmax_cross_entropy_with_integer_labels(q @ d.T, jnp.arange(q.shape[0])).mean()

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


def _make_dpr():
  r, st = _enc_make(85)
  x = _n(r, 16, 8)
  return st, x, x + 0.3 * _n(r, 16, 8), _n(r, 16, 8)


_add("dpr_in_batch_plus_hard_negatives", step_dpr_hardneg, _make_dpr, expect_split=False)


# why: triplet loss on given (anchor, positive, negative) triples: per example.
def step_triplet_given(state, a, pos, neg):
  params, opt = state

  def loss_fn(p):
    ea, ep, en = (_l2n(mlp(p, v)) for v in (a, pos, neg))
    dap = jnp.sum((ea - ep) ** 2, -1)
    dan = jnp.sum((ea - en) ** 2, -1)
    return jnp.mean(jax.nn.relu(dap - dan + 0.3))

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


def _make_triplet():
  r, st = _enc_make(86)
  a = _n(r, 16, 8)
  return st, a, a + 0.5 * _n(r, 16, 8), _n(r, 16, 8)


_add("triplet_given_triples", step_triplet_given, _make_triplet, expect_split=True)


# why: batch-hard triplet mining: hardest positive/negative for each anchor searched across the
# batch's pairwise distance matrix.
def step_batch_hard(state, x, labels):
  params, opt = state

  def loss_fn(p):
    e = mlp(p, x)
    d = jnp.sqrt(jnp.sum((e[:, None] - e[None]) ** 2, -1) + 1e-9)
    same = labels[:, None] == labels[None]
    eye = jnp.eye(x.shape[0], dtype=bool)
    hp = jnp.max(jnp.where(same & ~eye, d, 0.0), 1)
    hn = jnp.min(jnp.where(same, jnp.inf, d), 1)
    return jnp.mean(jax.nn.softplus(hp - hn))

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


def _make_batch_hard():
  r, st = _enc_make(87)
  return st, _n(r, 32, 8), jnp.asarray(np.repeat(np.arange(8), 4), jnp.int32)


_add("batch_hard_triplet_mining", step_batch_hard, _make_batch_hard, expect_split=False)


# why: supervised contrastive (SupCon): positives are same-label examples anywhere in the batch.
def step_supcon(state, x, labels):
  params, opt = state

  def loss_fn(p):
    z = _l2n(mlp(p, x))
    n = z.shape[0]
    eye = jnp.eye(n, dtype=bool)
    logits = jnp.where(eye, -1e9, z @ z.T / 0.1)
    logp = jax.nn.log_softmax(logits, -1)
    pos = (labels[:, None] == labels[None]) & ~eye
    return -jnp.mean(jnp.sum(jnp.where(pos, logp, 0.0), 1) / jnp.maximum(pos.sum(1), 1))

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


_add("supcon_same_label_positives_in_batch", step_supcon,
     lambda: _make_batch_hard(), expect_split=False)


# why: contrastive loss over ALL pairs of the batch (relu(margin - d_ij)^2 for different labels).
def step_all_pairs_contrastive(state, x, labels):
  params, opt = state

  def loss_fn(p):
    e = mlp(p, x)
    d2 = jnp.sum((e[:, None] - e[None]) ** 2, -1)
    same = (labels[:, None] == labels[None]).astype(jnp.float32)
    d = jnp.sqrt(d2 + 1e-9)
    return jnp.mean(same * d2 + (1 - same) * jax.nn.relu(1.0 - d) ** 2)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


_add("pairwise_distance_all_pairs_contrastive", step_all_pairs_contrastive,
     lambda: _make_batch_hard(), expect_split=False)


# why: soft nearest-neighbour classification: each example's class probability is a softmax
# over the OTHER batch examples' similarities (softmax over the batch).
def step_soft_nn(state, x, labels):
  params, opt = state

  def loss_fn(p):
    z = mlp(p, x)
    n = z.shape[0]
    eye = jnp.eye(n, dtype=bool)
    s = -jnp.sum((z[:, None] - z[None]) ** 2, -1)
    w = jax.nn.softmax(jnp.where(eye, -1e9, s), axis=1)
    same = (labels[:, None] == labels[None]).astype(jnp.float32)
    return -jnp.mean(jnp.log(jnp.sum(w * same, 1) + 1e-6))

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


_add("soft_nearest_neighbour_softmax_over_batch", step_soft_nn, lambda: _make_batch_hard(),
     expect_split=False)


# why: siamese contrastive loss on given pairs (x1_i, x2_i, same_i): per example.
def step_siamese(state, x1, x2, same):
  params, opt = state

  def loss_fn(p):
    d = jnp.sqrt(jnp.sum((mlp(p, x1) - mlp(p, x2)) ** 2, -1) + 1e-9)
    return jnp.mean(same * d ** 2 + (1 - same) * jax.nn.relu(1.0 - d) ** 2)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


def _make_siamese():
  r, st = _enc_make(88)
  x = _n(r, 16, 8)
  same = jnp.asarray(r.uniform(size=16) < 0.5, jnp.float32)
  x2 = jnp.where(same[:, None] > 0, x + 0.1 * _n(r, 16, 8), _n(r, 16, 8))
  return st, x, x2, same


_add("siamese_given_pairs_contrastive", step_siamese, _make_siamese, expect_split=True)


# why: VICReg: invariance (per example) + variance (per-dim std over the batch) + covariance
# (over the batch). Batch-coupled, but only through first/second moments of the embeddings,
# i.e. sums over examples (sum z, sum z z^T) -> by the function-of-sums criterion, splittable.
def step_vicreg(state, v1, v2):
  params, opt = state

  def loss_fn(p):
    z1, z2 = mlp(p, v1), mlp(p, v2)
    inv = jnp.mean((z1 - z2) ** 2)

    def var_cov(z):
      z = z - z.mean(0)
      n, d = z.shape
      std = jnp.sqrt(z.var(0) + 1e-4)
      cov = (z.T @ z) / (n - 1)
      off = cov - jnp.diag(jnp.diag(cov))
      return jnp.mean(jax.nn.relu(1 - std)), jnp.sum(off ** 2) / d

    va, ca = var_cov(z1)
    vb, cb = var_cov(z2)
    return 25 * inv + 25 * (va + vb) + (ca + cb)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


_add("vicreg_variance_covariance_moments", step_vicreg, lambda: _make_two_views(89), expect_split=True)


# why: ArcFace additive angular margin against a class-weight matrix; per example.
def step_arcface(state, x, y):
  params, opt = state

  def loss_fn(p):
    f = _l2n(mlp(p["body"], x))
    w = _l2n(p["classes"], axis=0)
    cos = jnp.clip(f @ w, -1 + 1e-6, 1 - 1e-6)
    theta = jnp.arccos(cos)
    target = jax.nn.one_hot(y, w.shape[1])
    logits = 16.0 * jnp.where(target > 0, jnp.cos(theta + 0.3), cos)
    return optax.softmax_cross_entropy(logits, target).mean()

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


def _make_arcface():
  r = _rng(90)
  p = {"body": mlp_init(r, [8, 16, 6]), "classes": _n(r, 6, 7)}
  return (p, ADAM.init(p)), _n(r, 16, 8), _i(r, 7, 16)


_add("arcface_angular_margin", step_arcface, _make_arcface, expect_split=True)


# why: prototypical networks where each batch element is a whole episode
# [B, ways, shots+queries, D]; prototypes are means inside the episode.
def step_protonet(state, episodes):
  params, opt = state

  def loss_fn(p):
    e = mlp(p, episodes)                             # [B, W, S+Q, d]
    S = 3
    protos = e[:, :, :S].mean(2)                     # [B, W, d]
    q = e[:, :, S:]                                  # [B, W, Q, d]
    d = -jnp.sum((q[:, :, :, None] - protos[:, None, None]) ** 2, -1)   # [B, W, Q, W]
    W = e.shape[1]
    labels = jnp.broadcast_to(jnp.arange(W)[None, :, None], d.shape[:3])
    return optax.softmax_cross_entropy_with_integer_labels(d, labels).mean()

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


def _make_protonet():
  r, st = _enc_make(91)
  centers = _n(r, 16, 4, 1, 8)
  return st, centers + 0.5 * _n(r, 16, 4, 5, 8)


_add("prototypical_network_per_episode", step_protonet, _make_protonet, expect_split=True)


# ============================================================================ I. reinforcement learning

def _ac_init(r, D=6, A=4):
  return {"torso": mlp_init(r, [D, 16]), "pi": mlp_init(r, [16, A]), "v": mlp_init(r, [16, 1])}


def _ac_apply(p, obs):
  h = jnp.tanh(mlp(p["torso"], obs))
  return mlp(p["pi"], h), mlp(p["v"], h)[..., 0]


PPO_TX = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(3e-3, eps=1e-5))


def _ppo_batch(r, B=32, D=6, A=4, normalise=True):
  adv = r.standard_normal(B).astype(np.float32)
  if normalise:
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
  return {"obs": _n(r, B, D), "actions": _i(r, A, B), "old_logp": jnp.asarray(np.log(np.full(B, 0.25)) + 0.1 * r.standard_normal(B), jnp.float32),
          "advantages": jnp.asarray(adv), "returns": _n(r, B), "old_values": _n(r, B, scale=0.5)}


def _ppo_loss(p, batch, normalise_in_loss):
  logits, v = _ac_apply(p, batch["obs"])
  logp_all = jax.nn.log_softmax(logits)
  logp = jnp.take_along_axis(logp_all, batch["actions"][:, None], -1)[:, 0]
  adv = batch["advantages"]
  if normalise_in_loss:
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
  ratio = jnp.exp(logp - batch["old_logp"])
  pg = -jnp.minimum(ratio * adv, jnp.clip(ratio, 0.8, 1.2) * adv).mean()
  v_clip = batch["old_values"] + jnp.clip(v - batch["old_values"], -0.2, 0.2)
  vf = 0.5 * jnp.maximum((v - batch["returns"]) ** 2, (v_clip - batch["returns"]) ** 2).mean()
  ent = -jnp.mean(jnp.sum(jax.nn.softmax(logits) * logp_all, -1))
  approx_kl = jnp.mean((ratio - 1) - (logp - batch["old_logp"]))
  clipfrac = jnp.mean(jnp.abs(ratio - 1) > 0.2)
  return pg + 0.5 * vf - 0.01 * ent, {"pg": pg, "vf": vf, "entropy": ent, "approx_kl": approx_kl,
                                      "clipfrac": clipfrac}


# why: PPO clipped objective + clipped value loss + entropy with advantages already normalised
# by the data pipeline; every term is a mean over examples.
def step_ppo(state, batch):
  params, opt = state
  (loss, m), grads = jax.value_and_grad(_ppo_loss, has_aux=True)(params, batch, False)
  params, opt = _opt_apply(PPO_TX, params, opt, grads)
  return (params, opt), {"loss": loss, **m}


def _make_ppo(seed, normalise):
  r = _rng(seed)
  p = _ac_init(r)
  return (p, PPO_TX.init(p)), _ppo_batch(r, normalise=normalise)


_add("ppo_clip_pre_normalised_advantages", step_ppo, lambda: _make_ppo(100, True), expect_split=True)


# why: PPO normalising advantages inside the loss by the minibatch mean/std (parameter-free
# statistic of the inputs), then min(ratio*A, clip*A): exact only with a pre-pass for mean/std.
def step_ppo_norm_in_loss(state, batch):
  params, opt = state
  (loss, m), grads = jax.value_and_grad(_ppo_loss, has_aux=True)(params, batch, True)
  params, opt = _opt_apply(PPO_TX, params, opt, grads)
  return (params, opt), {"loss": loss, **m}


_add("ppo_advantage_normalised_inside_loss", step_ppo_norm_in_loss, lambda: _make_ppo(101, False),
     expect_split=None)


# why: A2C with per-example discounted returns supplied; advantage = R - stop_grad(V).
def step_a2c(state, obs, actions, returns):
  params, opt = state

  def loss_fn(p):
    logits, v = _ac_apply(p, obs)
    logp = jax.nn.log_softmax(logits)
    a_lp = jnp.take_along_axis(logp, actions[:, None], -1)[:, 0]
    adv = returns - lax.stop_gradient(v)
    ent = -jnp.sum(jax.nn.softmax(logits) * logp, -1)
    return jnp.mean(-a_lp * adv + 0.5 * (returns - v) ** 2 - 0.01 * ent)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(optax.rmsprop(1e-3), params, opt, grads)
  return (params, opt), {"loss": loss}


def _make_a2c():
  r = _rng(102)
  p = _ac_init(r)
  return (p, optax.rmsprop(1e-3).init(p)), _n(r, 32, 6), _i(r, 4, 32), _n(r, 32)


_add("a2c_per_example_returns", step_a2c, _make_a2c, expect_split=True)


# why: GAE computed inside the loss by a reverse lax.scan over time of time-major [T, B]
# rollouts (values from the network, detached); batch axis is axis 1; per env column.
def step_gae_time_major(state, obs, actions, rewards, dones, last_obs):
  params, opt = state
  gamma, lam = 0.99, 0.95

  def loss_fn(p):
    logits, v = _ac_apply(p, obs)                       # [T, B, A], [T, B]
    _, v_last = _ac_apply(p, last_obs)                  # [B]
    vs = lax.stop_gradient(v)
    v_next = jnp.concatenate([vs[1:], lax.stop_gradient(v_last)[None]], 0)
    deltas = rewards + gamma * (1 - dones) * v_next - vs

    def back(carry, xs):
      d, done = xs
      carry = d + gamma * lam * (1 - done) * carry
      return carry, carry

    _, adv = lax.scan(back, jnp.zeros_like(v_last), (deltas, dones), reverse=True)
    ret = adv + vs
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits), actions[..., None], -1)[..., 0]
    return jnp.mean(-logp * adv) + 0.5 * jnp.mean((v - ret) ** 2)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


def _make_gae():
  r = _rng(103)
  p = _ac_init(r)
  T, B = 5, 16
  return ((p, ADAM.init(p)), _n(r, T, B, 6), _i(r, 4, T, B), _n(r, T, B),
          jnp.asarray(r.uniform(size=(T, B)) < 0.1, jnp.float32), _n(r, B, 6))


_add("gae_reverse_scan_time_major_rollouts", step_gae_time_major, _make_gae, expect_split=True)


# why: DQN with a target network in state (hard update every 2 steps via optax.periodic_update),
# Huber TD loss; per transition.
def step_dqn(state, batch):
  params, target, opt, step = state
  gamma = 0.99

  def loss_fn(p):
    q = mlp(p, batch["obs"])
    q_a = jnp.take_along_axis(q, batch["action"][:, None], -1)[:, 0]
    q_next = mlp(target, batch["next_obs"]).max(-1)
    y = batch["reward"] + gamma * (1 - batch["done"]) * q_next
    return optax.huber_loss(q_a, lax.stop_gradient(y)).mean(), q_a.mean()

  (loss, qm), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  step = step + 1
  target = optax.periodic_update(params, target, step, 2)
  return (params, target, opt, step), {"loss": loss, "q": qm}


def _dqn_batch(r, B=32):
  return {"obs": _n(r, B, 6), "action": _i(r, 3, B), "reward": _n(r, B), "next_obs": _n(r, B, 6),
          "done": jnp.asarray(r.uniform(size=B) < 0.1, jnp.float32)}


def _make_dqn():
  r = _rng(104)
  p = mlp_init(r, [6, 16, 3])
  return (p, jax.tree.map(jnp.copy, p), ADAM.init(p), jnp.zeros((), jnp.int32)), _dqn_batch(r)


_add("dqn_target_network_periodic_update", step_dqn, _make_dqn, expect_split=True)


# why: double DQN (argmax from online net, value from target net) with importance weights from a
# prioritized replay given per example; new priorities returned as metrics. Per transition.
def step_double_dqn(state, batch, is_weights):
  params, target, opt = state

  def loss_fn(p):
    q = mlp(p, batch["obs"])
    q_a = jnp.take_along_axis(q, batch["action"][:, None], -1)[:, 0]
    a_star = jnp.argmax(mlp(p, batch["next_obs"]), -1)
    q_t = jnp.take_along_axis(mlp(target, batch["next_obs"]), a_star[:, None], -1)[:, 0]
    y = lax.stop_gradient(batch["reward"] + 0.99 * (1 - batch["done"]) * q_t)
    td = q_a - y
    return jnp.mean(is_weights * optax.huber_loss(td)), jnp.abs(td)

  (loss, td), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  target = optax.incremental_update(params, target, 0.05)
  return (params, target, opt), {"loss": loss, "priorities": td}


def _make_ddqn():
  r = _rng(105)
  p = mlp_init(r, [6, 16, 3])
  return (p, jax.tree.map(jnp.copy, p), ADAM.init(p)), _dqn_batch(r), _u(r, 32, lo=0.3, hi=1.0)


_add("double_dqn_prioritized_is_weights", step_double_dqn, _make_ddqn, expect_split=True)


# why: REINFORCE with a parameter-free baseline = batch mean of returns. The loss is linear in
# the baseline: -(1/B)sum R_i lp_i + mean(R) (1/B) sum lp_i -> a function of sums.
def step_reinforce(state, obs, actions, returns):
  params, opt = state

  def loss_fn(p):
    logp = jax.nn.log_softmax(mlp(p, obs))
    lp = jnp.take_along_axis(logp, actions[:, None], -1)[:, 0]
    baseline = returns.mean()
    return -jnp.mean((returns - baseline) * lp)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


def _make_reinforce():
  r = _rng(106)
  p = mlp_init(r, [6, 16, 4])
  return (p, ADAM.init(p)), _n(r, 32, 6), _i(r, 4, 32), _n(r, 32) + 2.0


_add("reinforce_batch_mean_return_baseline", step_reinforce, _make_reinforce, expect_split=True)


# why: SAC: critic and actor updated in one step (two value_and_grad calls), reparameterised
# tanh-Gaussian actions with noise from a key in state, twin critics, polyak target. Per example.
SAC_TX = optax.adam(3e-3)


def _actor(p, obs, noise):
  out = mlp(p, obs)
  mu, log_std = jnp.split(out, 2, -1)
  log_std = jnp.clip(log_std, -5, 2)
  u = mu + jnp.exp(log_std) * noise
  a = jnp.tanh(u)
  logp = jnp.sum(-0.5 * noise ** 2 - log_std - 0.5 * np.log(2 * np.pi) - jnp.log(1 - a ** 2 + 1e-6), -1)
  return a, logp


def _critic(p, obs, a):
  x = jnp.concatenate([obs, a], -1)
  return mlp(p[0], x)[..., 0], mlp(p[1], x)[..., 0]


def step_sac(state, batch):
  actor, critic, target, a_opt, c_opt, key = state
  key, k1, k2 = jax.random.split(key, 3)
  B, A = batch["action"].shape
  alpha = 0.2

  def critic_loss(c):
    na, nlp = _actor(actor, batch["next_obs"], jax.random.normal(k1, (B, A)))
    tq = jnp.minimum(*_critic(target, batch["next_obs"], na)) - alpha * nlp
    y = lax.stop_gradient(batch["reward"] + 0.99 * (1 - batch["done"]) * tq)
    q1, q2 = _critic(c, batch["obs"], batch["action"])
    return jnp.mean((q1 - y) ** 2) + jnp.mean((q2 - y) ** 2)

  cl, cg = jax.value_and_grad(critic_loss)(critic)
  critic, c_opt = _opt_apply(SAC_TX, critic, c_opt, cg)

  def actor_loss(ap):
    a, lp = _actor(ap, batch["obs"], jax.random.normal(k2, (B, A)))
    return jnp.mean(alpha * lp - jnp.minimum(*_critic(critic, batch["obs"], a)))

  al, ag = jax.value_and_grad(actor_loss)(actor)
  actor, a_opt = _opt_apply(SAC_TX, actor, a_opt, ag)
  target = optax.incremental_update(critic, target, 0.005)
  return (actor, critic, target, a_opt, c_opt, key), {"critic_loss": cl, "actor_loss": al}


def _make_sac():
  r = _rng(107)
  actor = mlp_init(r, [5, 16, 4])
  critic = (mlp_init(r, [7, 16, 1]), mlp_init(r, [7, 16, 1]))
  batch = {"obs": _n(r, 16, 5), "action": jnp.tanh(_n(r, 16, 2)), "reward": _n(r, 16),
           "next_obs": _n(r, 16, 5), "done": jnp.zeros(16, jnp.float32)}
  return (actor, critic, jax.tree.map(jnp.copy, critic), SAC_TX.init(actor), SAC_TX.init(critic),
          jax.random.PRNGKey(107)), batch


_add("sac_actor_critic_reparam_key_in_state", step_sac, _make_sac, stochastic=True, expect_split=True)


# ============================================================================ J. speech / density models

CTC_TX = optax.adam(3e-3)


# why: optax.ctc_loss with logit and label paddings from lengths; mean of per-utterance loss
# normalised by label length.
def step_ctc(state, feats, feat_lens, labels, label_lens):
  params, opt = state

  def loss_fn(p):
    T, S = feats.shape[1], labels.shape[1]
    logits = mlp(p, feats)
    logit_pad = (jnp.arange(T)[None] >= feat_lens[:, None]).astype(jnp.float32)
    label_pad = (jnp.arange(S)[None] >= label_lens[:, None]).astype(jnp.float32)
    per = optax.ctc_loss(logits, logit_pad, labels, label_pad)
    return jnp.mean(per / jnp.maximum(label_lens, 1))

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(CTC_TX, params, opt, grads)
  return (params, opt), {"loss": loss}


def _make_ctc():
  r = _rng(110)
  B, T, F, K, S = 16, 12, 5, 6, 4
  p = mlp_init(r, [F, 16, K])
  return ((p, CTC_TX.init(p)), _n(r, B, T, F), jnp.asarray(r.integers(8, T + 1, B), jnp.int32),
          jnp.asarray(r.integers(1, K, (B, S)), jnp.int32), jnp.asarray(r.integers(1, S + 1, B), jnp.int32))


_add("ctc_loss_padding_masks", step_ctc, _make_ctc, expect_split=True)


# why: RealNVP with two affine couplings; log-likelihood with log|det|; per example.
def step_realnvp(state, x):
  params, opt = state

  def loss_fn(p):
    z = x
    logdet = 0.0
    for i, layer in enumerate(p):
      a, b = (z[:, :2], z[:, 2:]) if i % 2 == 0 else (z[:, 2:], z[:, :2])
      st = mlp(layer, a)
      s, t = jnp.tanh(st[:, :2]), st[:, 2:]
      b = b * jnp.exp(s) + t
      logdet = logdet + jnp.sum(s, -1)
      z = jnp.concatenate([a, b], -1) if i % 2 == 0 else jnp.concatenate([b, a], -1)
    logp = -0.5 * jnp.sum(z ** 2, -1) - 2 * np.log(2 * np.pi) + logdet
    return -jnp.mean(logp)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"nll": loss}


def _make_realnvp():
  r = _rng(111)
  p = [mlp_init(r, [2, 16, 4]) for _ in range(4)]
  x = _n(r, 32, 4)
  return (p, ADAM.init(p)), x.at[:, 1].multiply(0.3) + x[:, :1] ** 2 * jnp.asarray([0, 0, 0.5, 0], jnp.float32)


_add("realnvp_affine_coupling_logdet", step_realnvp, _make_realnvp, expect_split=True)


# why: VAE with analytic KL and reparameterisation noise from a key carried (and split) in state.
def _vae_init(r, D=10, Z=3):
  return {"enc": mlp_init(r, [D, 16, 2 * Z]), "dec": mlp_init(r, [Z, 16, D])}


def step_vae(state, x):
  params, opt, key = state
  key, sub = jax.random.split(key)

  def loss_fn(p):
    mu, logvar = jnp.split(mlp(p["enc"], x), 2, -1)
    eps = jax.random.normal(sub, mu.shape)
    z = mu + jnp.exp(0.5 * logvar) * eps
    logits = mlp(p["dec"], z)
    rec = jnp.sum(optax.sigmoid_binary_cross_entropy(logits, x), -1)
    kl = -0.5 * jnp.sum(1 + logvar - mu ** 2 - jnp.exp(logvar), -1)
    return jnp.mean(rec + kl), (rec.mean(), kl.mean())

  (loss, (rec, kl)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt, key), {"elbo": -loss, "rec": rec, "kl": kl}


def _make_vae():
  r = _rng(112)
  p = _vae_init(r)
  return (p, ADAM.init(p), jax.random.key(112)), jnp.asarray(r.uniform(size=(16, 10)) < 0.3, jnp.float32)


_add("vae_reparam_key_in_state_analytic_kl", step_vae, _make_vae, stochastic=True, expect_split=True)


# why: VAE with per-example keys: keys = jax.random.split(key, B) passed to the loss and vmapped
# over examples with the data; each example draws 2 samples (IWAE-style bound per example).
def step_vae_per_example_keys(state, x):
  params, opt, key = state
  key, sub = jax.random.split(key)
  keys = jax.random.split(sub, x.shape[0])

  def one(p, xi, ki):
    mu, logvar = jnp.split(mlp(p["enc"], xi), 2, -1)
    eps = jax.random.normal(ki, (2,) + mu.shape)
    z = mu + jnp.exp(0.5 * logvar) * eps
    logits = mlp(p["dec"], z)
    log_px = -jnp.sum(optax.sigmoid_binary_cross_entropy(logits, xi), -1)
    log_pz = -0.5 * jnp.sum(z ** 2, -1)
    log_qz = -0.5 * jnp.sum(eps ** 2 + logvar, -1)
    return -(jax.nn.logsumexp(log_px + log_pz - log_qz) - np.log(2.0))

  def loss_fn(p, x, keys):
    return jnp.mean(jax.vmap(one, in_axes=(None, 0, 0))(p, x, keys))

  loss, grads = jax.value_and_grad(loss_fn)(params, x, keys)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt, key), {"loss": loss}


def _make_vae_keys():
  r = _rng(113)
  p = _vae_init(r)
  return (p, ADAM.init(p), jax.random.PRNGKey(113)), jnp.asarray(r.uniform(size=(16, 10)) < 0.3, jnp.float32)


_add("iwae_per_example_split_keys_vmapped", step_vae_per_example_keys, _make_vae_keys,
     stochastic=True, expect_split=True)


# why: mixture density network (K Gaussians, 1-D target) with logsumexp over components.
def step_mdn(state, x, y):
  params, opt = state

  def loss_fn(p):
    out = mlp(p, x)
    K = out.shape[-1] // 3
    logit_pi, mu, log_sigma = out[:, :K], out[:, K:2 * K], jnp.clip(out[:, 2 * K:], -5, 5)
    log_n = -0.5 * ((y[:, None] - mu) / jnp.exp(log_sigma)) ** 2 - log_sigma - 0.5 * np.log(2 * np.pi)
    return -jnp.mean(jax.nn.logsumexp(jax.nn.log_softmax(logit_pi) + log_n, -1))

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"nll": loss}


def _make_mdn():
  r = _rng(114)
  p = mlp_init(r, [2, 16, 9])
  x = _n(r, 32, 2)
  return (p, ADAM.init(p)), x, jnp.sin(3 * x[:, 0]) + 0.1 * _n(r, 32)


_add("mixture_density_network", step_mdn, _make_mdn, expect_split=True)


# why: DDPM epsilon-prediction: per-example timesteps and noise drawn from a key in state;
# per-example MSE, mean.
def step_diffusion(state, x0):
  params, opt, key = state
  key, kt, kn = jax.random.split(key, 3)
  B = x0.shape[0]
  betas = jnp.linspace(1e-4, 0.05, 50)
  abar = jnp.cumprod(1 - betas)

  def loss_fn(p):
    t = jax.random.randint(kt, (B,), 0, 50)
    noise = jax.random.normal(kn, x0.shape)
    a = abar[t][:, None]
    xt = jnp.sqrt(a) * x0 + jnp.sqrt(1 - a) * noise
    temb = jnp.stack([jnp.sin(t / 8.0), jnp.cos(t / 8.0)], -1)
    pred = mlp(p, jnp.concatenate([xt, temb], -1))
    return jnp.mean(jnp.sum((pred - noise) ** 2, -1))

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt, key), {"loss": loss}


def _make_diffusion():
  r = _rng(115)
  p = mlp_init(r, [6, 16, 4])
  return (p, ADAM.init(p), jax.random.key(115)), _n(r, 16, 4)


_add("ddpm_per_example_timesteps_from_key", step_diffusion, _make_diffusion, stochastic=True,
     expect_split=True)


# why: masked autoencoder: per-example random masks via argsort of uniform noise [B, L] drawn
# from a key in state; reconstruction loss only on masked patches, normalised by masked count.
def step_mae(state, patches):
  params, opt, key = state
  key, sub = jax.random.split(key)

  def loss_fn(p):
    B, L, D = patches.shape
    noise = jax.random.uniform(sub, (B, L))
    rank = jnp.argsort(jnp.argsort(noise, 1), 1)
    masked = (rank < L // 2).astype(jnp.float32)
    inp = patches * (1 - masked)[..., None]
    h = jnp.tanh(mlp(p["enc"], inp))
    ctx = h.mean(1, keepdims=True)
    rec = mlp(p["dec"], h + ctx + masked[..., None] * p["mask_token"])
    err = jnp.mean((rec - patches) ** 2, -1)
    return jnp.sum(err * masked) / jnp.sum(masked)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt, key), {"loss": loss}


def _make_mae():
  r = _rng(116)
  p = {"enc": mlp_init(r, [5, 12]), "dec": mlp_init(r, [12, 16, 5]), "mask_token": _n(r, 12, scale=0.1)}
  return (p, ADAM.init(p), jax.random.key(116)), _n(r, 16, 8, 5)


_add("masked_autoencoder_per_example_random_masks", step_mae, _make_mae, stochastic=True,
     expect_split=True)


# ============================================================================ K. batch layouts & idioms

# why: batch dict where one leaf (a class-embedding table [C, d], C != B) has no batch axis;
# logits = f(x) @ table.T; per-example CE.
def step_class_table(state, batch):
  params, opt = state

  def loss_fn(p):
    f = mlp(p, batch["x"])
    logits = f @ batch["class_emb"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


def _make_class_table(C=10, seed=120):
  r = _rng(seed)
  p = mlp_init(r, [8, 16, 6])
  return (p, ADAM.init(p)), {"x": _n(r, 16, 8), "y": _i(r, C, 16), "class_emb": _n(r, C, 6)}


_add("batch_dict_unbatched_class_embedding_table", step_class_table, _make_class_table,
     expect_split=True)
# why: the same, but the table has exactly B rows, so its leading axis looks like a batch axis.
# Mathematically splittable (the table is shared); a shape-based guess would slice it -> None.
_add("batch_dict_class_table_rows_equal_batch", step_class_table,
     lambda: _make_class_table(C=16, seed=121), expect_split=None)


# why: batch tuple (x, y, class_weights[C]) with an unbatched config array; weighted CE
# normalised by the sum of the examples' weights -> ratio of two sums.
def step_class_weights(state, batch):
  params, opt = state
  x, y, cw = batch

  def loss_fn(p):
    l = optax.softmax_cross_entropy_with_integer_labels(mlp(p, x), y)
    w = cw[y]
    return jnp.sum(w * l) / jnp.sum(w)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


def _make_class_weights():
  r = _rng(122)
  p = mlp_init(r, [8, 16, 4])
  return (p, ADAM.init(p)), (_n(r, 16, 8), _i(r, 4, 16), jnp.asarray([1.0, 2.0, 0.5, 3.0], jnp.float32))


_add("batch_tuple_unbatched_class_weights_config", step_class_weights, _make_class_weights,
     expect_split=True)


# why: time-major inputs [T, B, D] with labels [B]: an Elman RNN by lax.scan over T; per column.
def step_time_major_rnn(state, x_tbd, y_b):
  params, opt = state

  def loss_fn(p):
    def cell(h, xt):
      h = jnp.tanh(xt @ p["wx"] + h @ p["wh"] + p["b"])
      return h, h
    h0 = jnp.zeros((x_tbd.shape[1], p["wh"].shape[0]))
    h, hs = lax.scan(cell, h0, x_tbd)
    pooled = 0.5 * h + 0.5 * hs.mean(0)
    return optax.softmax_cross_entropy_with_integer_labels(pooled @ p["out"], y_b).mean()

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


def _make_time_major():
  r = _rng(123)
  p = {"wx": _n(r, 5, 12, scale=0.4), "wh": _n(r, 12, 12, scale=0.25), "b": jnp.zeros(12, jnp.float32),
       "out": _n(r, 12, 3, scale=0.3)}
  return (p, ADAM.init(p)), _n(r, 7, 16, 5), _i(r, 3, 16)


_add("time_major_rnn_inputs_TBD_labels_B", step_time_major_rnn, _make_time_major, expect_split=True)


# why: .at[:, i].set(...) on per-example arrays beside the batch axis (a constant bias feature,
# zeroing the last position of each sequence) then a per-example model.
def step_at_set(state, x, seq, y):
  params, opt = state

  def loss_fn(p):
    xx = x.at[:, 0].set(1.0)
    s = seq.at[:, -1].set(0.0).at[:, 0].add(xx[:, 1])
    feats = jnp.concatenate([xx, s], -1)
    return jnp.mean((mlp(p, feats)[:, 0] - y) ** 2)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


def _make_at_set():
  r = _rng(124)
  p = mlp_init(r, [10, 16, 1])
  return (p, ADAM.init(p)), _n(r, 16, 4), _n(r, 16, 6), _n(r, 16)


_add("at_index_set_beside_batch_axis", step_at_set, _make_at_set, expect_split=True)


# why: a per-example Gaussian-process marginal likelihood: each example's kernel matrix
# [n, n] is Cholesky-factored (batched jnp.linalg.cholesky) and solved with
# jax.scipy.linalg.solve_triangular; learnable length scale/amplitude/noise + a feature map.
def step_gp_cholesky(state, X, Y):
  params, opt = state

  def loss_fn(p):
    F = jnp.tanh(X @ p["proj"])                          # [B, n, d]
    ls, amp, noise = jnp.exp(p["log_ls"]), jnp.exp(p["log_amp"]), jnp.exp(p["log_noise"])
    d2 = jnp.sum((F[:, :, None] - F[:, None]) ** 2, -1)
    n = X.shape[1]
    K = amp * jnp.exp(-0.5 * d2 / ls ** 2) + (noise + 1e-4) * jnp.eye(n)
    Lc = jnp.linalg.cholesky(K)
    alpha = jax.scipy.linalg.solve_triangular(Lc, Y[..., None], lower=True)[..., 0]
    nll = 0.5 * jnp.sum(alpha ** 2, -1) + jnp.sum(jnp.log(jnp.diagonal(Lc, axis1=-2, axis2=-1)), -1)
    return jnp.mean(nll)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"nll": loss}


def _make_gp():
  r = _rng(125)
  p = {"proj": _n(r, 3, 4, scale=0.5), "log_ls": jnp.zeros((), jnp.float32), "log_amp": jnp.zeros((), jnp.float32),
       "log_noise": jnp.asarray(-2.0, jnp.float32)}
  X = _n(r, 16, 6, 3)
  return (p, ADAM.init(p)), X, jnp.sin(X[..., 0]) + 0.1 * _n(r, 16, 6)


_add("gp_marginal_likelihood_cholesky_solve_triangular", step_gp_cholesky, _make_gp,
     expect_split=True)


# why: per-example weights built from the batch size, w = jnp.full(B, 1/B), sum(w * l): a mean.
def step_full_weights(state, x, y):
  params, opt = state

  def loss_fn(p):
    B = x.shape[0]
    w = jnp.full((B,), 1.0 / B)
    l = optax.sigmoid_binary_cross_entropy(mlp(p, x)[:, 0], y)
    return jnp.sum(w * l)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


def _make_full_w():
  r = _rng(126)
  p = mlp_init(r, [8, 16, 1])
  return (p, ADAM.init(p)), _n(r, 32, 8), jnp.asarray(r.uniform(size=32) < 0.5, jnp.float32)


_add("per_example_weights_full_one_over_B", step_full_weights, _make_full_w, expect_split=True)


# why: inputs normalised by the batch's own mean/std inside the loss (a parameter-free
# statistic), then a nonlinear net: exact only if the statistic is computed over the whole batch
# first -> None.
def step_input_batch_norm(state, x, y):
  params, opt = state

  def loss_fn(p):
    xn = (x - x.mean(0)) / (x.std(0) + 1e-5)
    return optax.softmax_cross_entropy_with_integer_labels(mlp(p, xn), y).mean()

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


def _make_input_norm():
  r = _rng(127)
  p = mlp_init(r, [8, 16, 4])
  return (p, ADAM.init(p)), 3.0 + 2.0 * _n(r, 16, 8), _i(r, 4, 16)


_add("inputs_normalised_by_batch_mean_std", step_input_batch_norm, _make_input_norm,
     expect_split=None)


# why: loss truncation: drop examples whose loss exceeds 1.5x the batch mean loss
# (jnp.where with a param-dependent batch statistic) -> which examples count depends on others.
def step_where_loss_stat(state, x, y):
  params, opt = state

  def loss_fn(p):
    l = optax.softmax_cross_entropy_with_integer_labels(mlp(p, x), y)
    keep = l <= 1.5 * jnp.mean(l)
    return jnp.sum(jnp.where(keep, l, 0.0)) / jnp.maximum(jnp.sum(keep), 1)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


def _make_where_stat():
  r = _rng(128)
  p = mlp_init(r, [8, 16, 4])
  return (p, ADAM.init(p)), 2.0 * _n(r, 16, 8), _i(r, 4, 16)


_add("where_loss_truncation_by_batch_mean_loss", step_where_loss_stat, _make_where_stat,
     expect_split=False)


# why: binarised regression targets: target = where(y > batch median/mean of y) (a
# parameter-free statistic of the labels) -> exact only with a pre-pass -> None.
def step_where_label_stat(state, x, y):
  params, opt = state

  def loss_fn(p):
    t = jnp.where(y > jnp.mean(y), 1.0, 0.0)
    return optax.sigmoid_binary_cross_entropy(mlp(p, x)[:, 0], t).mean()

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


def _make_where_label():
  r = _rng(129)
  p = mlp_init(r, [8, 16, 1])
  x = _n(r, 16, 8)
  return (p, ADAM.init(p)), x, x[:, 0] + 0.5 * _n(r, 16)


_add("where_targets_binarised_by_batch_mean_label", step_where_label_stat, _make_where_label,
     expect_split=None)


# why: OHEM: keep the top-k (k = B//4) per-example losses of the batch -> hard selection across
# examples.
def step_ohem(state, x, y):
  params, opt = state

  def loss_fn(p):
    l = optax.softmax_cross_entropy_with_integer_labels(mlp(p, x), y)
    top, _ = lax.top_k(l, x.shape[0] // 4)
    return top.mean()

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


_add("ohem_topk_hardest_losses_in_batch", step_ohem, _make_where_stat, expect_split=False)


# why: class-balanced loss with weights 1/count_c from this batch's label histogram:
# = sum_c (S_c / n_c) / #present -> a function of per-class sums (S_c, n_c) -> splittable.
def step_class_balanced(state, x, y):
  params, opt = state

  def loss_fn(p):
    l = optax.softmax_cross_entropy_with_integer_labels(mlp(p, x), y)
    counts = jnp.sum(jax.nn.one_hot(y, 4), 0)
    w = 1.0 / counts[y]
    return jnp.sum(w * l) / jnp.sum(w)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


def _make_class_bal():
  r = _rng(130)
  p = mlp_init(r, [8, 16, 4])
  return (p, ADAM.init(p)), _n(r, 32, 8), jnp.asarray(r.choice(4, 32, p=[0.5, 0.25, 0.15, 0.1]), jnp.int32)


_add("class_balanced_weights_from_batch_counts", step_class_balanced, _make_class_bal,
     expect_split=True)


# why: mixup pairing each example with the batch reversed (jnp.flip over the batch axis), a fixed
# lambda: inputs of different examples mix, but only parameter-free inputs -> None.
def step_mixup_flip(state, x, y):
  params, opt = state
  lam = 0.7

  def loss_fn(p):
    xm = lam * x + (1 - lam) * jnp.flip(x, 0)
    ym = lam * jax.nn.one_hot(y, 4) + (1 - lam) * jax.nn.one_hot(jnp.flip(y, 0), 4)
    return optax.softmax_cross_entropy(mlp(p, xm), ym).mean()

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


_add("mixup_with_reversed_batch", step_mixup_flip, _make_input_norm, expect_split=None)


# why: mixup with a random permutation of the batch from a key in state (stochastic): example i
# is mixed with example perm[i] elsewhere in the batch -> None (parameter-free, but cross-example).
def step_mixup_perm(state, x, y):
  params, opt, key = state
  key, kp, kl = jax.random.split(key, 3)

  def loss_fn(p):
    perm = jax.random.permutation(kp, x.shape[0])
    lam = jax.random.beta(kl, 0.4, 0.4)
    xm = lam * x + (1 - lam) * x[perm]
    l = optax.softmax_cross_entropy_with_integer_labels(mlp(p, xm), y)
    l2 = optax.softmax_cross_entropy_with_integer_labels(mlp(p, xm), y[perm])
    return jnp.mean(lam * l + (1 - lam) * l2)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt, key), {"loss": loss}


def _make_mixup_perm():
  (st, x, y) = _make_input_norm()
  return (st[0], st[1], jax.random.key(131)), x, y


_add("mixup_random_batch_permutation", step_mixup_perm, _make_mixup_perm, stochastic=True,
     expect_split=None)


# why: data-parallel jax.shard_map inside the loss over a mesh of the local devices: each shard
# sums its examples' losses and psums; divided by the global B.
def step_shard_map(state, x, y):
  params, opt = state
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))

  def loss_fn(p):
    def local(p, xs, ys):
      l = optax.softmax_cross_entropy_with_integer_labels(mlp(p, xs), ys)
      return lax.psum(jnp.sum(l), "data")

    total = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P())(p, x, y)
    return total / x.shape[0]

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


def _make_shard_map():
  r = _rng(132)
  p = mlp_init(r, [8, 16, 4])
  return (p, ADAM.init(p)), _n(r, 16, 8), _i(r, 4, 16)


_add("shard_map_data_parallel_psum_in_loss", step_shard_map, _make_shard_map, expect_split=True)


# why: hand-written dropout with per-example keys: keys = split(key, B) passed to the loss and
# vmapped together with the examples.
def step_per_example_dropout(state, x, y):
  params, opt, key = state
  key, sub = jax.random.split(key)
  keys = jax.random.split(sub, x.shape[0])

  def loss_fn(p, x, y, keys):
    def one(xi, yi, ki):
      h = jnp.tanh(xi @ p[0]["w"] + p[0]["b"])
      keep = jax.random.bernoulli(ki, 0.8, h.shape)
      h = jnp.where(keep, h / 0.8, 0.0)
      logits = h @ p[1]["w"] + p[1]["b"]
      return optax.softmax_cross_entropy_with_integer_labels(logits, yi)
    return jnp.mean(jax.vmap(one)(x, y, keys))

  loss, grads = jax.value_and_grad(loss_fn)(params, x, y, keys)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt, key), {"loss": loss}


def _make_pe_dropout():
  r = _rng(133)
  p = mlp_init(r, [8, 16, 4])
  return (p, ADAM.init(p), jax.random.PRNGKey(133)), _n(r, 16, 8), _i(r, 4, 16)


_add("per_example_keys_split_B_vmapped_dropout", step_per_example_dropout, _make_pe_dropout,
     stochastic=True, expect_split=True)


# why: linen nn.Dropout with rngs={'dropout': key}, key folded with the TrainState step.
class DropMLP(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.relu(nn.Dense(16)(x))
    x = nn.Dropout(0.3, deterministic=not train)(x)
    return nn.Dense(4)(x)


class KeyState(train_state.TrainState):
  key: jax.Array = None


def step_linen_dropout(state, x, y):
  dkey = jax.random.fold_in(state.key, state.step)

  def loss_fn(params):
    logits = state.apply_fn({"params": params}, x, train=True, rngs={"dropout": dkey})
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {"loss": loss}


def _make_linen_dropout():
  r = _rng(134)
  x = _n(r, 16, 8)
  m = DropMLP()
  params = m.init(jax.random.PRNGKey(0), x[:1], train=False)["params"]
  st = KeyState.create(apply_fn=m.apply, params=params, tx=optax.adam(3e-3), key=jax.random.PRNGKey(134))
  return st, x, _i(r, 4, 16)


_add("linen_dropout_rngs_fold_in_step", step_linen_dropout, _make_linen_dropout, stochastic=True,
     expect_split=True)


# why: nnx model with nnx.Dropout and its own Rngs stream (RngState split off with the params and
# threaded through state); nnx.value_and_grad w.r.t. params only.
class NnxDropNet(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(8, 16, rngs=rngs)
    self.drop = nnx.Dropout(0.3, rngs=rngs)
    self.l2 = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    return self.l2(self.drop(nnx.relu(self.l1(x))))


_NNX_DROP_GD = [None]


def _make_nnx_drop():
  m = NnxDropNet(nnx.Rngs(params=0, dropout=135))
  gd, params, rest = nnx.split(m, nnx.Param, ...)
  _NNX_DROP_GD[0] = gd
  r = _rng(135)
  return (params, rest, NNX_TX.init(params)), _n(r, 16, 8), _i(r, 4, 16)


def step_nnx_dropout(state, x, y):
  params, rest, opt = state
  model = nnx.merge(_gd(_NNX_DROP_GD, _make_nnx_drop), params, rest)

  def loss_fn(m):
    return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()

  loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.Param))(model)
  _, _, rest = nnx.split(model, nnx.Param, ...)
  params, opt = _opt_apply(NNX_TX, params, opt, grads)
  return (params, rest, opt), {"loss": loss}


_add("nnx_dropout_rng_stream_in_state", step_nnx_dropout, _make_nnx_drop, stochastic=True,
     expect_split=True)


# why: DP-SGD: per-example grads by vmap(grad), each clipped to norm 1, summed, Gaussian noise
# from a key in state, divided by B -> a sum over examples plus noise.
DPSGD_TX = optax.sgd(0.1)


def step_dpsgd(state, x, y):
  params, opt, key = state
  key, nk = jax.random.split(key)

  def one(p, xi, yi):
    return optax.softmax_cross_entropy_with_integer_labels(mlp(p, xi[None]), yi[None])[0]

  losses, g = jax.vmap(jax.value_and_grad(one), in_axes=(None, 0, 0))(params, x, y)
  norms = jnp.sqrt(sum(jnp.sum(l.reshape(l.shape[0], -1) ** 2, 1) for l in jax.tree.leaves(g)))
  factor = jnp.minimum(1.0, 1.0 / (norms + 1e-6))
  summed = jax.tree.map(lambda l: jnp.tensordot(factor, l, 1), g)
  leaves, tdef = jax.tree.flatten(summed)
  keys = jax.random.split(nk, len(leaves))
  noisy = [l + 0.5 * jax.random.normal(k, l.shape) for l, k in zip(leaves, keys)]
  grads = jax.tree.map(lambda l: l / x.shape[0], jax.tree.unflatten(tdef, noisy))
  params, opt = _opt_apply(DPSGD_TX, params, opt, grads)
  return (params, opt, key), {"loss": losses.mean(), "clipped": jnp.mean(norms > 1.0)}


def _make_dpsgd():
  r = _rng(136)
  p = mlp_init(r, [8, 16, 4])
  return (p, DPSGD_TX.init(p), jax.random.key(136)), _n(r, 16, 8), _i(r, 4, 16)


_add("dp_sgd_per_example_clip_vmap_grad_noise", step_dpsgd, _make_dpsgd, stochastic=True,
     expect_split=True)


# why: SAM: gradient at params, ascend by rho*g/||g|| (whole-batch g), gradient again at the
# perturbed params. Each gradient is a mean over examples, so each splits.
def step_sam(state, x, y):
  params, opt = state
  rho = 0.05
  g1 = jax.grad(_ce_loss)(params, x, y)
  gn = optax.global_norm(g1)
  perturbed = jax.tree.map(lambda p, g: p + rho * g / (gn + 1e-12), params, g1)
  loss, g2 = jax.value_and_grad(_ce_loss)(perturbed, x, y)
  params, opt = _opt_apply(ADAM, params, opt, g2)
  return (params, opt), {"loss": loss, "g1_norm": gn}


_add("sam_two_gradients_perturbed_params", step_sam, lambda: _simple_make(137, ADAM), expect_split=True)


# why: knowledge distillation with the teacher's params passed as an unbatched argument;
# temperature-scaled KL + hard-label CE; per example.
def step_distill(state, teacher, x, y):
  params, opt = state
  T = 2.0

  def loss_fn(p):
    s = mlp(p, x)
    t = lax.stop_gradient(mlp(teacher, x))
    kl = jnp.sum(jax.nn.softmax(t / T) * (jax.nn.log_softmax(t / T) - jax.nn.log_softmax(s / T)), -1)
    ce = optax.softmax_cross_entropy_with_integer_labels(s, y)
    return jnp.mean(0.5 * T * T * kl + 0.5 * ce)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


def _make_distill():
  r = _rng(138)
  p = mlp_init(r, [8, 12, 4])
  return (p, ADAM.init(p)), mlp_init(r, [8, 32, 4]), _n(r, 16, 8), _i(r, 4, 16)


_add("distillation_teacher_params_as_argument", step_distill, _make_distill, expect_split=True)


# why: FixMatch: weak/strong views of each unlabeled example; pseudo-label and confidence mask
# come from that example's weak view; supervised CE on a labeled batch of another size (8 vs 16).
def step_fixmatch(state, xl, yl, xu_weak, xu_strong):
  params, opt = state

  def loss_fn(p):
    sup = optax.softmax_cross_entropy_with_integer_labels(mlp(p, xl), yl).mean()
    pw = jax.nn.softmax(lax.stop_gradient(mlp(p, xu_weak)))
    conf, pseudo = pw.max(-1), pw.argmax(-1)
    mask = (conf >= 0.4).astype(jnp.float32)
    unsup = jnp.mean(mask * optax.softmax_cross_entropy_with_integer_labels(mlp(p, xu_strong), pseudo))
    return sup + unsup, mask.mean()

  (loss, mr), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss, "mask_rate": mr}


def _make_fixmatch():
  r = _rng(139)
  p = mlp_init(r, [8, 16, 4])
  xu = 2 * _n(r, 32, 8)
  return ((p, ADAM.init(p)), _n(r, 8, 8), _i(r, 4, 8), xu + 0.1 * _n(r, 32, 8), xu + 0.5 * _n(r, 32, 8))


_add("fixmatch_weak_strong_two_batch_sizes", step_fixmatch, _make_fixmatch, expect_split=True)


# why: multi-task with learned homoscedastic uncertainty weights (params only); each task loss
# is a batch mean.
def step_multitask(state, x, y_cls, y_reg):
  params, opt = state

  def loss_fn(p):
    h = jnp.tanh(mlp(p["trunk"], x))
    l1 = optax.softmax_cross_entropy_with_integer_labels(mlp(p["cls"], h), y_cls).mean()
    l2 = jnp.mean((mlp(p["reg"], h)[:, 0] - y_reg) ** 2)
    s = p["log_vars"]
    return jnp.exp(-s[0]) * l1 + s[0] + 0.5 * jnp.exp(-s[1]) * l2 + 0.5 * s[1]

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


def _make_multitask():
  r = _rng(140)
  p = {"trunk": mlp_init(r, [8, 16]), "cls": mlp_init(r, [16, 3]), "reg": mlp_init(r, [16, 1]),
       "log_vars": jnp.zeros(2, jnp.float32)}
  return (p, ADAM.init(p)), _n(r, 16, 8), _i(r, 3, 16), _n(r, 16)


_add("multitask_learned_uncertainty_weights", step_multitask, _make_multitask, expect_split=True)


# why: matrix factorisation: user/item ids gather rows of embedding tables; MSE + L2 on the
# gathered rows (per example).
def step_mf(state, users, items, ratings):
  params, opt = state

  def loss_fn(p):
    u, v = p["U"][users], p["V"][items]
    pred = jnp.sum(u * v, -1) + p["bu"][users] + p["bi"][items] + p["mu"]
    return jnp.mean((pred - ratings) ** 2) + 1e-3 * jnp.mean(jnp.sum(u ** 2 + v ** 2, -1))

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(optax.adagrad(0.1), params, opt, grads)
  return (params, opt), {"rmse": jnp.sqrt(loss)}


def _make_mf():
  r = _rng(141)
  p = {"U": _n(r, 20, 4, scale=0.1), "V": _n(r, 15, 4, scale=0.1), "bu": jnp.zeros(20, jnp.float32), "bi": jnp.zeros(15, jnp.float32),
       "mu": jnp.asarray(3.0, jnp.float32)}
  return (p, optax.adagrad(0.1).init(p)), _i(r, 20, 32), _i(r, 15, 32), _u(r, 32, lo=1, hi=5)


_add("matrix_factorisation_embedding_gathers", step_mf, _make_mf, expect_split=True)


# why: GNN on padded per-example graphs [B, N, F] with adjacency [B, N, N] and node masks;
# masked mean pooling; graph classification.
def step_gnn_padded(state, nodes, adj, node_mask, y):
  params, opt = state

  def loss_fn(p):
    h = nodes
    deg = jnp.maximum(adj.sum(-1, keepdims=True), 1.0)
    for layer in p["layers"]:
      msg = jnp.einsum("bij,bjf->bif", adj, h) / deg
      h = jnp.tanh(jnp.concatenate([h, msg], -1) @ layer["w"] + layer["b"]) * node_mask[..., None]
    pooled = h.sum(1) / jnp.maximum(node_mask.sum(1, keepdims=True), 1.0)
    return optax.softmax_cross_entropy_with_integer_labels(pooled @ p["out"], y).mean()

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


def _make_gnn_padded():
  r = _rng(142)
  B, N, F = 16, 7, 4
  nn_ = r.integers(3, N + 1, B)
  mask = (np.arange(N)[None] < nn_[:, None]).astype(np.float32)
  a = (r.uniform(size=(B, N, N)) < 0.35).astype(np.float32)
  a = np.maximum(a, a.transpose(0, 2, 1)) * mask[:, :, None] * mask[:, None, :]
  p = {"layers": [{"w": _n(r, 2 * F, F, scale=0.4), "b": jnp.zeros(F, jnp.float32)} for _ in range(2)],
       "out": _n(r, F, 3, scale=0.4)}
  return (p, ADAM.init(p)), _n(r, B, N, F) * mask[..., None], jnp.asarray(a), jnp.asarray(mask), _i(r, 3, B)


_add("gnn_padded_dense_adjacency_per_graph", step_gnn_padded, _make_gnn_padded, expect_split=True)


# why: jraph-style flat batch of graphs: nodes [total_nodes, F], edges as global senders /
# receivers, node->graph ids, labels [num_graphs]. Leading axes differ (nodes 64, edges 96,
# graphs 8) and the edge indices are global: the examples (graphs) are independent, but no
# leading axis is the example axis -> None.
def step_gnn_flat(state, nodes, senders, receivers, node_graph, y):
  params, opt = state
  G = y.shape[0]

  def loss_fn(p):
    h = nodes
    for layer in p["layers"]:
      msg = jax.ops.segment_sum(h[senders], receivers, num_segments=h.shape[0])
      h = jnp.tanh(jnp.concatenate([h, msg], -1) @ layer["w"] + layer["b"])
    pooled = jax.ops.segment_sum(h, node_graph, num_segments=G)
    cnt = jax.ops.segment_sum(jnp.ones(h.shape[0]), node_graph, num_segments=G)
    return optax.softmax_cross_entropy_with_integer_labels((pooled / cnt[:, None]) @ p["out"], y).mean()

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


def _make_gnn_flat():
  r = _rng(143)
  G, per, F = 8, 8, 4
  senders, receivers = [], []
  for g in range(G):
    for _ in range(12):
      a, b = r.integers(0, per, 2)
      senders.append(g * per + a)
      receivers.append(g * per + b)
  p = {"layers": [{"w": _n(r, 2 * F, F, scale=0.4), "b": jnp.zeros(F, jnp.float32)} for _ in range(2)],
       "out": _n(r, F, 3, scale=0.4)}
  return ((p, ADAM.init(p)), _n(r, G * per, F), jnp.asarray(senders, jnp.int32), jnp.asarray(receivers, jnp.int32),
          jnp.asarray(np.repeat(np.arange(G), per), jnp.int32), _i(r, 3, G))


_add("gnn_jraph_style_flat_graph_batch", step_gnn_flat, _make_gnn_flat, expect_split=None)


# ============================================================================ L. BatchNorm (must not split)

class BNNet(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Dense(16)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
    x = nn.relu(x)
    return nn.Dense(4)(x)


class BNState(train_state.TrainState):
  batch_stats: dict = None


# why: linen BatchNorm in train mode: activations normalised by this batch's statistics, then a
# nonlinearity -> examples interact; running stats updated in state.
def step_linen_bn(state, x, y):
  def loss_fn(params):
    logits, updates = state.apply_fn({"params": params, "batch_stats": state.batch_stats}, x,
                                     train=True, mutable=["batch_stats"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), updates

  (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  state = state.apply_gradients(grads=grads).replace(batch_stats=updates["batch_stats"])
  return state, {"loss": loss}


def _make_linen_bn():
  r = _rng(150)
  x = _n(r, 16, 8)
  m = BNNet()
  v = m.init(jax.random.PRNGKey(0), x[:1], train=False)
  st = BNState.create(apply_fn=m.apply, params=v["params"], batch_stats=v["batch_stats"], tx=optax.sgd(0.1))
  return st, x, _i(r, 4, 16)


_add("linen_batchnorm_train_mode", step_linen_bn, _make_linen_bn, expect_split=False)


# why: nnx.BatchNorm in train mode (batch statistics of activations); BatchStat state threaded.
class NnxBN(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(8, 16, rngs=rngs)
    self.bn = nnx.BatchNorm(16, rngs=rngs)
    self.l2 = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    return self.l2(nnx.relu(self.bn(self.l1(x))))


_NNX_BN_GD = [None]


def _make_nnx_bn():
  m = NnxBN(nnx.Rngs(151))
  m.train()
  gd, params, stats = nnx.split(m, nnx.Param, nnx.BatchStat)
  _NNX_BN_GD[0] = gd
  r = _rng(151)
  return (params, stats, NNX_TX.init(params)), _n(r, 16, 8), _i(r, 4, 16)


def step_nnx_bn(state, x, y):
  params, stats, opt = state
  model = nnx.merge(_gd(_NNX_BN_GD, _make_nnx_bn), params, stats)

  def loss_fn(m):
    return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()

  loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.Param))(model)
  stats = nnx.state(model, nnx.BatchStat)
  params, opt = _opt_apply(NNX_TX, params, opt, grads)
  return (params, stats, opt), {"loss": loss}


_add("nnx_batchnorm_train_mode", step_nnx_bn, _make_nnx_bn, expect_split=False)


# why: BYOL-like projector with BatchNorm written by hand (batch mean/var of activations inside a
# per-example MLP), EMA target network; the BN couples examples.
def step_byol_bn(state, v1, v2):
  online, target, opt = state

  def proj(p, x):
    h = x @ p[0]["w"] + p[0]["b"]
    h = (h - h.mean(0)) / jnp.sqrt(h.var(0) + 1e-5)
    return jax.nn.relu(h) @ p[1]["w"] + p[1]["b"]

  def loss_fn(p):
    a = _l2n(mlp(p["pred"], proj(p["proj"], v1)))
    b = lax.stop_gradient(_l2n(proj(target, v2)))
    return jnp.mean(2 - 2 * jnp.sum(a * b, -1))

  loss, grads = jax.value_and_grad(loss_fn)(online)
  online, opt = _opt_apply(ADAM, online, opt, grads)
  target = optax.incremental_update(online["proj"], target, 0.01)
  return (online, target, opt), {"loss": loss}


def _make_byol():
  r = _rng(152)
  online = {"proj": mlp_init(r, [8, 16, 6]), "pred": mlp_init(r, [6, 12, 6])}
  x = _n(r, 16, 8)
  return ((online, jax.tree.map(jnp.copy, online["proj"]), ADAM.init(online)),
          x + 0.2 * _n(r, 16, 8), x + 0.2 * _n(r, 16, 8))


_add("byol_projector_hand_written_batchnorm", step_byol_bn, _make_byol, expect_split=False)


# ============================================================================ M. a few more layouts

# why: per-example PRNG keys made by the data pipeline and passed as a batch argument (a key
# array with a batch axis): each example keeps its own key under any split, so the step is
# deterministic given the arguments and splits exactly.
def step_key_array_batch_arg(state, x, y, keys):
  params, opt = state

  def loss_fn(p):
    def one(xi, yi, ki):
      noise = 0.1 * jax.random.normal(ki, xi.shape)
      return optax.softmax_cross_entropy_with_integer_labels(mlp(p, xi + noise), yi)
    return jnp.mean(jax.vmap(one)(x, y, keys))

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  return (params, opt), {"loss": loss}


def _make_key_array_arg():
  r = _rng(160)
  p = mlp_init(r, [8, 16, 4])
  return (p, ADAM.init(p)), _n(r, 16, 8), _i(r, 4, 16), jax.random.split(jax.random.key(160), 16)


_add("per_example_key_array_as_batch_argument", step_key_array_batch_arg, _make_key_array_arg,
     expect_split=True)


# why: PPO-style running observation normaliser in state: the loss normalises with the OLD
# running stats (per example), and the new stats are updated from the batch's count/sum/sum of
# squares (parallel Welford) -> loss and state update are functions of sums.
def step_running_obs_norm(state, obs, actions, returns):
  params, opt, rs = state

  def loss_fn(p):
    o = jnp.clip((obs - rs["mean"]) / jnp.sqrt(rs["var"] + 1e-8), -5, 5)
    logits, v = _ac_apply(p, o)
    lp = jnp.take_along_axis(jax.nn.log_softmax(logits), actions[:, None], -1)[:, 0]
    adv = returns - lax.stop_gradient(v)
    return jnp.mean(-lp * adv + 0.5 * (returns - v) ** 2)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt = _opt_apply(ADAM, params, opt, grads)
  n_b = obs.shape[0]
  b_mean, b_var = obs.mean(0), obs.var(0)
  tot = rs["count"] + n_b
  delta = b_mean - rs["mean"]
  new_mean = rs["mean"] + delta * n_b / tot
  m2 = rs["var"] * rs["count"] + b_var * n_b + delta ** 2 * rs["count"] * n_b / tot
  rs = {"mean": new_mean, "var": m2 / tot, "count": tot}
  return (params, opt, rs), {"loss": loss}


def _make_running_norm():
  r = _rng(161)
  p = _ac_init(r)
  rs = {"mean": jnp.zeros(6, jnp.float32), "var": jnp.ones(6, jnp.float32), "count": jnp.asarray(1e-4, jnp.float32)}
  return (p, ADAM.init(p), rs), 2.0 + 3.0 * _n(r, 32, 6), _i(r, 4, 32), _n(r, 32)


_add("rl_running_obs_normaliser_welford_state", step_running_obs_norm, _make_running_norm,
     expect_split=True)

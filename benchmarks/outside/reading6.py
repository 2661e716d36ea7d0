"""A sixth outside corpus of JAX/Flax train steps for hbm_guard's exactness harness.

Every case is a step `step(state, *args) -> (new_state, metrics)` written the way people
write them, plus `make()` giving concrete arguments. `expect_split` is the author's own
mathematical judgement (see the `# why` comment on each case):
  True  -- loss and gradient over the batch are computable exactly from per-microbatch
           pieces (sums over examples, functions of such sums, batch statistics computed
           in an earlier pass over the microbatches, parameter-free batch preprocessing
           that can be done on the whole batch first);
  False -- examples interact in a way no microbatch split reproduces exactly;
  None  -- the author is unsure.
BatchNorm in train mode (batch statistics read by later layers) is counted as False.

Judged by `benchmarks/bench_outside.py`.
"""
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import flax.linen as nn
from flax import nnx
from flax.training import train_state

from tests.exactness.harness import Case

CASES: list = []


def add(name, step, make, *, stochastic=False, expect_split=None, options=()):
  CASES.append(Case(name=name, step=step, make=make, stochastic=stochastic,
                    expect_split=expect_split, options=tuple(options)))


# ----------------------------------------------------------------------------------------
# small shared helpers
# ----------------------------------------------------------------------------------------

def _f(a):
  return jnp.asarray(np.asarray(a, np.float32))


def _randn(seed, *shape, scale=1.0):
  return _f(np.random.RandomState(seed).randn(*shape) * scale)


def _rand(seed, *shape):
  return _f(np.random.RandomState(seed).rand(*shape))


def _randint(seed, hi, *shape):
  return jnp.asarray(np.random.RandomState(seed).randint(0, hi, size=shape), jnp.int32)


def _dense(rs, n_in, n_out, scale=1.0):
  return {'w': _f(rs.randn(n_in, n_out) * scale / np.sqrt(n_in)), 'b': _f(np.zeros(n_out))}


def _mlp_params(seed, sizes, scale=1.0):
  rs = np.random.RandomState(seed)
  return [_dense(rs, a, b, scale) for a, b in zip(sizes[:-1], sizes[1:])]


def _mlp(layers, x, act=jax.nn.relu):
  for layer in layers[:-1]:
    x = act(x @ layer['w'] + layer['b'])
  return x @ layers[-1]['w'] + layers[-1]['b']


def _rms(h, scale=None, eps=1e-6):
  h = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + eps)
  return h if scale is None else h * scale


def _ln(h, eps=1e-5):
  mu = h.mean(-1, keepdims=True)
  return (h - mu) * jax.lax.rsqrt(((h - mu) ** 2).mean(-1, keepdims=True) + eps)


def _unit(z, eps=1e-8):
  return z / jnp.sqrt(jnp.sum(z * z, -1, keepdims=True) + eps)


def _apply_tx(tx, params, opt_state, grads):
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


def _len_mask(seed, b, t, lo=2):
  lens = np.random.RandomState(seed).randint(lo, t + 1, size=b)
  return _f(np.arange(t)[None] < lens[:, None])


def _w(rs, *shape, scale=1.0):
  return _f(rs.randn(*shape) * scale / np.sqrt(shape[0]))


def _sinusoid(t, d):
  pos = np.arange(t)[:, None]
  i = np.arange(d // 2)[None]
  ang = pos / (10000.0 ** (2 * i / d))
  return _f(np.concatenate([np.sin(ang), np.cos(ang)], -1))


def _rotary(x, pos):
  """Rotary embedding over the last axis of x (..., T, D); pos (T,) or broadcastable."""
  half = x.shape[-1] // 2
  freq = 1.0 / (10000.0 ** (jnp.arange(half) / half))
  ang = pos[..., None].astype(jnp.float32) * freq
  c, s = jnp.cos(ang), jnp.sin(ang)
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], -1)


def _masked_token_ce(logits, targets, mask):
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  return jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1.0)


class _KeyTrainState(train_state.TrainState):
  key: Any = None


class _BNTrainState(train_state.TrainState):
  batch_stats: Any = None


_V, _T, _D = 16, 10, 16   # vocab, sequence length, width


# ========================================================================================
# 1. sequence architectures: Whisper, Perceiver, Mamba, RWKV, linear / windowed / ALiBi /
#    grouped-query attention, mixture of depths, speculative drafts
# ========================================================================================

class _TinyWhisper(nn.Module):
  d: int = _D
  vocab: int = _V

  @nn.compact
  def __call__(self, mel, tokens):
    x = nn.gelu(nn.Conv(self.d, (3,), padding='SAME')(mel))
    x = nn.gelu(nn.Conv(self.d, (3,), strides=(2,), padding='SAME')(x))
    x = x + _sinusoid(x.shape[1], self.d)[None]
    y = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=2)(y, y)
    x = x + nn.Dense(self.d)(nn.gelu(nn.Dense(2 * self.d)(nn.LayerNorm()(x))))
    enc = nn.LayerNorm()(x)
    embed = nn.Embed(self.vocab, self.d)
    pos = self.param('dec_pos', nn.initializers.normal(0.02), (16, self.d))
    h = embed(tokens) + pos[:tokens.shape[1]]
    y = nn.LayerNorm()(h)
    h = h + nn.MultiHeadDotProductAttention(num_heads=2)(
        y, y, mask=nn.make_causal_mask(tokens))
    y = nn.LayerNorm()(h)
    h = h + nn.MultiHeadDotProductAttention(num_heads=2)(y, enc)
    h = h + nn.Dense(self.d)(nn.gelu(nn.Dense(2 * self.d)(nn.LayerNorm()(h))))
    return embed.attend(nn.LayerNorm()(h))


def whisper_step(state, batch):
  tokens, tmask = batch['tokens'], batch['token_mask']
  dec_in, targets, tgt_mask = tokens[:, :-1], tokens[:, 1:], tmask[:, 1:]

  def loss_fn(params):
    logits = state.apply_fn({'params': params}, batch['mel'], dec_in)
    return _masked_token_ce(logits, targets, tgt_mask), logits

  (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  acc = jnp.sum((logits.argmax(-1) == targets) * tgt_mask) / tgt_mask.sum()
  return state.apply_gradients(grads=grads), {'loss': loss, 'acc': acc}


def whisper_make():
  model = _TinyWhisper()
  batch = {'mel': _randn(10, 8, 16, 8), 'tokens': _randint(11, _V, 8, 9),
           'token_mask': _len_mask(12, 8, 9, 3)}
  params = model.init(jax.random.PRNGKey(10), batch['mel'], batch['tokens'][:, :-1])['params']
  tx = optax.adamw(optax.linear_schedule(1e-4, 1e-3, 5), b2=0.98, weight_decay=0.01)
  return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx), batch


# why: the strided conv front end and encoder self-attention run over one clip's frames,
# the decoder's causal and cross attention stay inside one example; token CE summed over
# the batch's unpadded target tokens and divided by their count (a ratio of two sums).
add('whisper_conv_frontend_encoder_text_decoder', whisper_step, whisper_make,
    expect_split=True)


class _Perceiver(nnx.Module):
  def __init__(self, rngs, d_in=6, d=16, n_latents=4, classes=5):
    self.inp = nnx.Linear(d_in, d, rngs=rngs)
    self.latents = nnx.Param(jax.random.normal(rngs.params(), (n_latents, d)) * 0.1)
    self.ln_q = nnx.LayerNorm(d, rngs=rngs)
    self.ln_kv = nnx.LayerNorm(d, rngs=rngs)
    self.cross = nnx.MultiHeadAttention(num_heads=1, in_features=d, decode=False, rngs=rngs)
    self.ln_s = nnx.LayerNorm(d, rngs=rngs)
    self.self_attn = nnx.MultiHeadAttention(num_heads=2, in_features=d, decode=False,
                                            rngs=rngs)
    self.ff = nnx.Linear(d, d, rngs=rngs)
    self.head = nnx.Linear(d, classes, rngs=rngs)

  def __call__(self, x, mask):
    b = x.shape[0]
    kv = self.ln_kv(self.inp(x))
    lat = jnp.broadcast_to(self.latents[...], (b,) + self.latents.shape)
    cmask = jnp.broadcast_to(mask[:, None, None, :] > 0, (b, 1, lat.shape[1], x.shape[1]))
    lat = lat + self.cross(self.ln_q(lat), kv, kv, mask=cmask)
    y = self.ln_s(lat)
    lat = lat + self.self_attn(y, y, y)
    lat = lat + nnx.gelu(self.ff(lat))
    return self.head(lat.mean(1))


def perceiver_step(state, inputs, mask, labels):
  model, optimizer = state

  def loss_fn(model):
    logits = model(inputs, mask)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), logits

  (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
  optimizer.update(model, grads)
  return (model, optimizer), {'loss': loss, 'acc': jnp.mean(logits.argmax(-1) == labels)}


def perceiver_make():
  model = _Perceiver(nnx.Rngs(20))
  opt = nnx.Optimizer(model, optax.lamb(1e-3), wrt=nnx.Param)
  return (model, opt), _randn(21, 8, 12, 6), _len_mask(22, 8, 12, 4), _randint(23, 5, 8)


# why: learned latents (parameters, not data) cross-attend to one example's masked inputs;
# latent self-attention is within the example; mean CE over examples.
add('perceiver_latent_cross_attention_nnx', perceiver_step, perceiver_make,
    expect_split=True)


def _mamba_init(seed, d=8, e=16, n=4, r=2, vocab=_V, layers=2):
  rs = np.random.RandomState(seed)
  blocks = []
  for _ in range(layers):
    blocks.append({
        'norm': _f(np.ones(d)), 'in_proj': _w(rs, d, 2 * e), 'conv': _f(rs.randn(3, e) * 0.3),
        'conv_b': _f(np.zeros(e)), 'x_proj': _w(rs, e, r + 2 * n), 'dt_proj': _w(rs, r, e),
        'dt_bias': _f(np.log(np.expm1(np.full(e, 0.05)))),
        'A_log': _f(np.log(np.tile(np.arange(1, n + 1), (e, 1)))), 'D': _f(np.ones(e)),
        'out_proj': _w(rs, e, d)})
  return {'embed': _f(rs.randn(vocab, d) * 0.5), 'blocks': blocks, 'norm_f': _f(np.ones(d))}


def _ssm_combine(left, right):
  a_l, b_l = left
  a_r, b_r = right
  return a_r * a_l, a_r * b_l + b_r


def _mamba_block(p, h):
  r = p['dt_proj'].shape[0]
  n = p['A_log'].shape[1]
  xz = _rms(h, p['norm']) @ p['in_proj']
  x, z = jnp.split(xz, 2, -1)
  t = x.shape[1]
  xp = jnp.pad(x, ((0, 0), (2, 0), (0, 0)))                     # causal depthwise conv
  x = sum(xp[:, k:k + t] * p['conv'][k] for k in range(3)) + p['conv_b']
  x = jax.nn.silu(x)
  dbc = x @ p['x_proj']
  dt = jax.nn.softplus(dbc[..., :r] @ p['dt_proj'] + p['dt_bias'])   # (B, T, E)
  bmat, cmat = dbc[..., r:r + n], dbc[..., r + n:]
  a = -jnp.exp(p['A_log'])                                             # (E, N)
  da = jnp.exp(dt[..., None] * a)                                      # (B, T, E, N)
  dbx = dt[..., None] * bmat[:, :, None, :] * x[..., None]
  _, hs = jax.lax.associative_scan(_ssm_combine, (da, dbx), axis=1)
  y = jnp.einsum('bten,btn->bte', hs, cmat) + p['D'] * x
  return h + (y * jax.nn.silu(z)) @ p['out_proj']


_tx_mamba = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(2e-3, weight_decay=0.1))


def mamba_step(state, batch):
  inputs, targets = batch

  def loss_fn(params):
    h = params['embed'][inputs]
    for blk in params['blocks']:
      h = _mamba_block(blk, h)
    logits = _rms(h, params['norm_f']) @ params['embed'].T
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  params, opt = _apply_tx(_tx_mamba, state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt, 'step': state['step'] + 1}, {
      'loss': loss, 'ppl': jnp.exp(loss)}


def mamba_make():
  p = _mamba_init(30)
  toks = np.asarray(_randint(31, _V, 8, _T + 1))
  return ({'params': p, 'opt': _tx_mamba.init(p), 'step': jnp.zeros((), jnp.int32)},
          (jnp.asarray(toks[:, :-1]), jnp.asarray(toks[:, 1:])))


# why: the selective scan (lax.associative_scan on axis 1) and the causal depthwise conv
# run along each sequence's time axis only; mean next-token CE over all tokens.
add('mamba_selective_scan_associative_scan_lm', mamba_step, mamba_make, expect_split=True)


def _rwkv_init(seed, d=_D, vocab=_V, ff=32):
  rs = np.random.RandomState(seed)
  return {'emb': _f(rs.randn(vocab, d) * 0.5), 'ln1': _f(np.ones(d)), 'ln2': _f(np.ones(d)),
          'mix_k': _f(rs.rand(d)), 'mix_v': _f(rs.rand(d)), 'mix_r': _f(rs.rand(d)),
          'decay': _f(rs.randn(d) * 0.3 - 0.5), 'bonus': _f(rs.randn(d) * 0.3),
          'wk': _w(rs, d, d), 'wv': _w(rs, d, d), 'wr': _w(rs, d, d), 'wo': _w(rs, d, d),
          'cm_k': _w(rs, d, ff), 'cm_v': _w(rs, ff, d), 'cm_r': _w(rs, d, d),
          'mix_ck': _f(rs.rand(d)), 'ln_f': _f(np.ones(d)), 'head': _w(rs, d, vocab)}


def _token_shift(x):
  return jnp.pad(x, ((0, 0), (1, 0), (0, 0)))[:, :-1]


def _rwkv_apply(p, tokens):
  x = p['emb'][tokens]
  h = _rms(x, p['ln1'])
  hs = _token_shift(h)
  k = (h * p['mix_k'] + hs * (1 - p['mix_k'])) @ p['wk']
  v = (h * p['mix_v'] + hs * (1 - p['mix_v'])) @ p['wv']
  r = jax.nn.sigmoid((h * p['mix_r'] + hs * (1 - p['mix_r'])) @ p['wr'])
  w = jnp.exp(-jnp.exp(p['decay']))
  u = p['bonus']

  def wkv(carry, kv):
    num, den = carry
    kt, vt = kv
    ek = jnp.exp(kt)
    out = (num + jnp.exp(u) * ek * vt) / (den + jnp.exp(u) * ek)
    return (w * num + ek * vt, w * den + ek), out

  b, _, d = k.shape
  init = (jnp.zeros((b, d)), jnp.zeros((b, d)))
  _, out = jax.lax.scan(wkv, init, (jnp.swapaxes(k, 0, 1), jnp.swapaxes(v, 0, 1)))
  x = x + (r * jnp.swapaxes(out, 0, 1)) @ p['wo']
  h = _rms(x, p['ln2'])
  hs = _token_shift(h)
  kk = jnp.square(jax.nn.relu((h * p['mix_ck'] + hs * (1 - p['mix_ck'])) @ p['cm_k']))
  x = x + jax.nn.sigmoid(h @ p['cm_r']) * (kk @ p['cm_v'])
  return _rms(x, p['ln_f']) @ p['head']


def rwkv_step(state, batch):
  toks = batch['tokens']

  def loss_fn(params):
    logits = state.apply_fn(params, toks[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, toks[:, 1:]).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


def rwkv_make():
  p = _rwkv_init(40)
  st = train_state.TrainState.create(apply_fn=_rwkv_apply, params=p,
                                     tx=optax.adam(1e-3, b1=0.9, b2=0.99))
  return st, {'tokens': _randint(41, _V, 8, _T + 1)}


# why: token shift and the WKV recurrence (lax.scan over time, batch carried in the
# state) keep each sequence separate; mean next-token CE.
add('rwkv_token_shift_wkv_recurrent_scan', rwkv_step, rwkv_make, expect_split=True)


def linattn_step(state, x, y):
  params, opt_state = state
  b, t, _ = x.shape

  def loss_fn(p):
    h = x @ p['inp']
    q = jax.nn.elu(h @ p['wq']) + 1.0
    k = jax.nn.elu(h @ p['wk']) + 1.0
    v = h @ p['wv']
    kv = jnp.cumsum(jnp.einsum('btd,bte->btde', k, v), axis=1)      # causal prefix sums
    z = jnp.cumsum(k, axis=1)
    out = jnp.einsum('btd,btde->bte', q, kv) / (jnp.einsum('btd,btd->bt', q, z)[..., None] + 1e-6)
    h = h + out @ p['wo']
    pred = (jax.nn.gelu(h @ p['f1']) @ p['f2'])[..., 0]
    return jnp.sum((pred - y) ** 2) / (b * t)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt_state = _apply_tx(optax.adam(1e-3), params, opt_state, grads)
  return (params, opt_state), {'mse': loss}


def linattn_make():
  rs = np.random.RandomState(50)
  p = {'inp': _w(rs, 3, 8), 'wq': _w(rs, 8, 8), 'wk': _w(rs, 8, 8), 'wv': _w(rs, 8, 8),
       'wo': _w(rs, 8, 8), 'f1': _w(rs, 8, 16), 'f2': _w(rs, 16, 1)}
  x = _randn(51, 16, 12, 3)
  return (p, optax.adam(1e-3).init(p)), x, x[:, :, 0] * 0.5 + _randn(52, 16, 12, scale=0.1)


# why: the causal kernelised attention is a cumulative sum over each sequence's own time
# axis; `b * t` read from x.shape is the full batch's size, a constant normaliser, so
# the loss is a sum of squared errors over examples divided by a fixed count.
add('linear_attention_elu_cumsum_causal_b_t_from_shape', linattn_step, linattn_make,
    expect_split=True)


def _mha_init(seed, d=_D, ff=32, vocab=_V, n_kv=None):
  rs = np.random.RandomState(seed)
  kv = d if n_kv is None else n_kv
  return {'emb': _f(rs.randn(vocab, d) * 0.5), 'g1': _f(np.ones(d)), 'g2': _f(np.ones(d)),
          'gf': _f(np.ones(d)), 'wq': _w(rs, d, d), 'wk': _w(rs, d, kv), 'wv': _w(rs, d, kv),
          'wo': _w(rs, d, d), 'w1': _w(rs, d, ff), 'w2': _w(rs, ff, d), 'out': _w(rs, d, vocab)}


def _heads(x, h):
  b, t, d = x.shape
  return x.reshape(b, t, h, d // h).transpose(0, 2, 1, 3)


def _block_with_bias(p, x, bias, mask, n_heads=2):
  """Pre-RMSNorm MHA with an additive (H or 1, T, T) bias and (B, 1, T, T) mask + MLP."""
  b, t, d = x.shape
  y = _rms(x, p['g1'])
  q, k, v = (_heads(y @ p[n], n_heads) for n in ('wq', 'wk', 'wv'))
  s = jnp.einsum('bhtd,bhsd->bhts', q, k) / np.sqrt(d // n_heads) + bias
  a = jax.nn.softmax(jnp.where(mask, s, -1e9), -1)
  o = jnp.einsum('bhts,bhsd->bhtd', a, v).transpose(0, 2, 1, 3).reshape(b, t, d)
  x = x + o @ p['wo']
  return x + jax.nn.gelu(_rms(x, p['g2']) @ p['w1']) @ p['w2']


_tx_lm = optax.adamw(1e-3, weight_decay=0.01)


def swa_step(state, tokens, pad_mask):
  window = 4
  inputs, targets, tmask = tokens[:, :-1], tokens[:, 1:], pad_mask[:, 1:]
  t = inputs.shape[1]
  i, j = jnp.arange(t)[:, None], jnp.arange(t)[None]
  band = (j <= i) & (i - j < window)
  mask = band[None, None] & (pad_mask[:, :-1] > 0)[:, None, None, :]

  def loss_fn(p):
    x = p['emb'][inputs]
    x = _block_with_bias(p, x, 0.0, mask)
    return _masked_token_ce(_rms(x, p['gf']) @ p['out'], targets, tmask)

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  params, opt = _apply_tx(_tx_lm, state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'loss': loss}


def swa_make():
  p = _mha_init(60)
  return ({'params': p, 'opt': _tx_lm.init(p)}, _randint(61, _V, 8, _T + 1),
          _len_mask(62, 8, _T + 1, 4))


# why: the sliding-window band and the key-padding mask are built per example (the band
# is shared, the padding is each row's own); masked token CE as a ratio of two sums.
add('sliding_window_attention_band_mask_lm', swa_step, swa_make, expect_split=True)


def _alibi_slopes(n):
  return jnp.asarray([2.0 ** (-8.0 * (h + 1) / n) for h in range(n)], jnp.float32)


def alibi_step(state, batch):
  params, opt_state, step = state['params'], state['opt'], state['step']
  tokens = batch['input_ids']
  b, t = tokens.shape
  t = t - 1
  rel = jnp.arange(t)[None, :] - jnp.arange(t)[:, None]              # j - i
  bias = _alibi_slopes(4)[:, None, None] * jnp.minimum(rel, 0)[None]
  mask = jnp.tril(jnp.ones((t, t), bool))[None, None]

  def loss_fn(p):
    x = p['emb'][tokens[:, :-1]]
    x = _block_with_bias(p, x, bias, mask, n_heads=4)
    logits = _rms(x, p['gf']) @ p['out']
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return ce.sum() / (b * t)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt_state = _apply_tx(_tx_lm, params, opt_state, grads)
  return {'params': params, 'opt': opt_state, 'step': step + 1}, {'loss': loss}


def alibi_make():
  p = _mha_init(70)
  return ({'params': p, 'opt': _tx_lm.init(p), 'step': jnp.zeros((), jnp.int32)},
          {'input_ids': _randint(71, _V, 8, _T + 1)})


# why: ALiBi's per-head linear distance penalty and the causal mask are position-only;
# `b, t` are read at the top and the loss is the token CE sum over the batch divided by
# that fixed token count.
add('alibi_bias_causal_lm_sizes_read_at_top', alibi_step, alibi_make, expect_split=True)


class _GQABlock(nn.Module):
  d: int = _D
  n_q: int = 4
  n_kv: int = 2

  @nn.compact
  def __call__(self, x, positions):
    b, t, _ = x.shape
    hd = self.d // self.n_q
    y = nn.RMSNorm()(x)
    q = nn.DenseGeneral((self.n_q, hd), use_bias=False, name='q')(y)
    k = nn.DenseGeneral((self.n_kv, hd), use_bias=False, name='k')(y)
    v = nn.DenseGeneral((self.n_kv, hd), use_bias=False, name='v')(y)
    q = _rotary(q.swapaxes(1, 2), positions[:, None])
    k = _rotary(k.swapaxes(1, 2), positions[:, None])
    rep = self.n_q // self.n_kv
    k = jnp.repeat(k, rep, axis=1)
    v = jnp.repeat(v.swapaxes(1, 2), rep, axis=1)
    s = jnp.einsum('bhtd,bhsd->bhts', q, k) / np.sqrt(hd)
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, jnp.finfo(s.dtype).min)
    o = jnp.einsum('bhts,bhsd->bthd', jax.nn.softmax(s, -1), v)
    x = x + nn.DenseGeneral(self.d, axis=(-2, -1), use_bias=False, name='o')(o)
    y = nn.RMSNorm()(x)
    gate = nn.Dense(2 * self.d, use_bias=False)(y)
    up = nn.Dense(2 * self.d, use_bias=False)(y)
    return x + nn.Dense(self.d, use_bias=False)(nn.silu(gate) * up)


class _GQALM(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    emb = nn.Embed(_V, _D)
    x = emb(tokens)
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    for _ in range(2):
      x = _GQABlock()(x, pos)
    return emb.attend(nn.RMSNorm()(x))


def gqa_step(state, inputs, targets, loss_mask):
  def loss_fn(params):
    logits = state.apply_fn({'params': params}, inputs)
    return _masked_token_ce(logits.astype(jnp.float32), targets, loss_mask)

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  gnorm = optax.global_norm(grads)
  return state.apply_gradients(grads=grads), {'loss': loss, 'grad_norm': gnorm}


def gqa_make():
  model = _GQALM()
  toks = np.asarray(_randint(80, _V, 8, _T + 1))
  params = model.init(jax.random.PRNGKey(80), jnp.asarray(toks[:, :-1]))['params']
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   optax.adamw(optax.cosine_decay_schedule(1e-3, 50), b2=0.95))
  st = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
  return st, jnp.asarray(toks[:, :-1]), jnp.asarray(toks[:, 1:]), _len_mask(81, 8, _T, 5)


# why: grouped-query attention only shares key/value heads across query heads, never
# across examples; RoPE positions and the causal mask are per position; masked token CE.
add('gqa_rope_repeat_kv_heads_linen', gqa_step, gqa_make, expect_split=True)


def _mod_apply(p, tokens, capacity, over_batch):
  x = p['emb'][tokens]
  b, t, d = x.shape
  for blk in p['blocks']:
    score = (x @ blk['router'])[..., 0]                              # (B, T)
    if over_batch:
      flat = score.reshape(-1)
      _, idx = jax.lax.top_k(flat, capacity * b)
      keep = jnp.zeros_like(flat).at[idx].set(1.0).reshape(b, t)
      upd = _block_with_bias(blk, x, 0.0, jnp.tril(jnp.ones((t, t), bool))[None, None]) - x
      x = x + keep[..., None] * jax.nn.sigmoid(score)[..., None] * upd
    else:
      _, idx = jax.lax.top_k(score, capacity)                        # per sequence
      idx = jnp.sort(idx, -1)
      sel = jnp.take_along_axis(x, idx[..., None], 1)
      pos = idx
      cmask = (pos[:, :, None] >= pos[:, None, :])[:, None]
      upd = _block_with_bias(blk, sel, 0.0, cmask) - sel
      w = jax.nn.sigmoid(jnp.take_along_axis(score, idx, 1))[..., None]
      x = jax.vmap(lambda xx, i, u: xx.at[i].add(u))(x, idx, w * upd)
  return _rms(x, p['gf']) @ p['out']


def _mod_init(seed):
  p = _mha_init(seed)
  rs = np.random.RandomState(seed + 1)
  blocks = []
  for _ in range(2):
    blk = {k: p[k] for k in ('g1', 'g2', 'wq', 'wk', 'wv', 'wo', 'w1', 'w2')}
    blk = dict(blk, router=_w(rs, _D, 1))
    blocks.append(blk)
  return {'emb': p['emb'], 'gf': p['gf'], 'out': p['out'], 'blocks': blocks}


def _mod_step(state, tokens, *, over_batch):
  def loss_fn(params):
    logits = _mod_apply(params, tokens[:, :-1], capacity=_T // 2, over_batch=over_batch)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


def _mod_make(seed):
  def make():
    st = train_state.TrainState.create(apply_fn=None, params=_mod_init(seed),
                                       tx=optax.adam(1e-3))
    return st, _randint(seed + 5, _V, 8, _T + 1)
  return make


# why: mixture-of-depths routing takes the top half of each sequence's own tokens
# (lax.top_k along the time axis of one row); the routed block is causal among the
# chosen tokens of that row; mean token CE.
add('mixture_of_depths_topk_per_sequence',
    functools.partial(_mod_step, over_batch=False), _mod_make(90), expect_split=True)

# why: here the router's capacity is spent over all B*T tokens of the batch at once (top_k
# over the flattened batch), so whether one example's token gets the block depends on
# the other examples' router scores; no microbatch split selects the same tokens.
add('mixture_of_depths_topk_over_flattened_batch',
    functools.partial(_mod_step, over_batch=True), _mod_make(95), expect_split=False)


def spec_draft_step(state, batch):
  tokens, mask = batch['tokens'], batch['mask']
  temp = 2.0
  target_logits = _rms(_block_with_bias(state['target'], state['target']['emb'][tokens],
                                        0.0, jnp.tril(jnp.ones((_T, _T), bool))[None, None]),
                       state['target']['gf']) @ state['target']['out']
  p_t = jax.nn.softmax(target_logits / temp, -1)

  def loss_fn(dp):
    x = dp['emb'][tokens]
    x = _block_with_bias(dp, x, 0.0, jnp.tril(jnp.ones((_T, _T), bool))[None, None])
    q_logits = _rms(x, dp['gf']) @ dp['out']
    logq = jax.nn.log_softmax(q_logits / temp, -1)
    kl = jnp.sum(p_t * (jnp.log(p_t + 1e-9) - logq), -1)
    accept = jnp.sum(jnp.minimum(p_t, jnp.exp(logq)), -1)              # expected acceptance
    n = mask.sum()
    return (temp ** 2) * jnp.sum(kl * mask) / n, jnp.sum(accept * mask) / n

  (loss, acc_rate), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['draft'])
  draft, opt = _apply_tx(_tx_lm, state['draft'], state['opt'], grads)
  return dict(state, draft=draft, opt=opt), {'kd': loss, 'accept_rate': acc_rate}


def spec_draft_make():
  draft = _mha_init(100, d=8, ff=16)
  target = _mha_init(101, d=_D, ff=32)
  return ({'draft': draft, 'target': target, 'opt': _tx_lm.init(draft)},
          {'tokens': _randint(102, _V, 8, _T), 'mask': _len_mask(103, 8, _T, 4)})


# why: the frozen target model's distribution is computed per token from that token's own
# sequence (outside the gradient); the draft's temperature-scaled KL and the acceptance
# estimate are masked token sums over the batch divided by the batch's token count.
add('speculative_draft_distill_frozen_target_kl', spec_draft_step, spec_draft_make,
    expect_split=True)


# ========================================================================================
# 2. reinforcement learning: reward-weighted regression, AWR, IQL, CQL, Decision
#    Transformer, Dreamer world models, MuZero unrolls, prioritised replay
# ========================================================================================

_S, _A = 6, 3   # state and action sizes


def _gauss_nll(mu, log_std, a):
  return jnp.sum(0.5 * ((a - mu) / jnp.exp(log_std)) ** 2 + log_std + 0.9189385, -1)


def rwr_step(state, obs, actions, advantages):
  beta = 1.0
  weights = jnp.minimum(jnp.exp(advantages / beta), 20.0)

  def loss_fn(p):
    out = _mlp(p['pi'], obs, jnp.tanh)
    mu, log_std = out[:, :_A], jnp.clip(out[:, _A:], -4.0, 1.0)
    nll = _gauss_nll(mu, log_std, actions)
    return jnp.mean(weights * nll), nll.mean()

  (loss, nll), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  params, opt = _apply_tx(optax.adam(3e-4), state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'loss': loss, 'nll': nll,
                                          'mean_weight': weights.mean()}


def rwr_make():
  p = {'pi': _mlp_params(110, [_S, 32, 2 * _A])}
  return ({'params': p, 'opt': optax.adam(3e-4).init(p)}, _randn(111, 16, _S),
          _randn(112, 16, _A, scale=0.5), _randn(113, 16))


# why: each transition's weight exp(A/beta), clipped, comes with its own advantage input;
# weighted Gaussian NLL averaged over the batch.
add('reward_weighted_regression_exp_advantage_clip', rwr_step, rwr_make, expect_split=True)


def awr_softmax_weights_step(state, batch):
  obs, act, ret = batch['obs'], batch['act'], batch['ret']

  def loss_fn(p):
    v = _mlp(p['v'], obs, jnp.tanh)[:, 0]
    adv = jax.lax.stop_gradient(ret - v)
    w = jax.nn.softmax(adv / 0.5)                                   # normalised over batch
    out = _mlp(p['pi'], obs, jnp.tanh)
    nll = _gauss_nll(out[:, :_A], jnp.clip(out[:, _A:], -4.0, 1.0), act)
    pi_loss = jnp.sum(w * nll)
    v_loss = 0.5 * jnp.mean((ret - v) ** 2)
    return pi_loss + v_loss, {'pi_loss': pi_loss, 'v_loss': v_loss,
                              'ess': 1.0 / jnp.sum(w ** 2)}

  (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads), dict(aux, loss=loss)


def awr_softmax_weights_make():
  p = {'v': _mlp_params(120, [_S, 32, 1]), 'pi': _mlp_params(121, [_S, 32, 2 * _A])}
  st = train_state.TrainState.create(apply_fn=None, params=p, tx=optax.adam(3e-4))
  return st, {'obs': _randn(122, 16, _S), 'act': _randn(123, 16, _A, scale=0.5),
              'ret': _randn(124, 16)}


# why: the advantage weights are a softmax over the batch, but with the advantage under
# stop_gradient the policy term is sum_i e_i * nll_i / sum_j e_j (e = exp(A/beta)): a
# ratio of two sums over examples; the value loss is a plain mean.
add('awr_softmax_over_batch_advantage_weights', awr_softmax_weights_step,
    awr_softmax_weights_make, expect_split=True)


def _expectile(diff, tau):
  w = jnp.where(diff > 0, tau, 1 - tau)
  return w * diff ** 2


def iql_step(state, batch):
  s, a, r, s2, d = (batch[k] for k in ('obs', 'act', 'rew', 'next_obs', 'done'))
  tq = state['target_q']

  def q_fn(qp, s, a):
    sa = jnp.concatenate([s, a], -1)
    return _mlp(qp[0], sa)[:, 0], _mlp(qp[1], sa)[:, 0]

  q1_t, q2_t = q_fn(tq, s, a)
  q_min_t = jnp.minimum(q1_t, q2_t)

  def loss_fn(p):
    v = _mlp(p['v'], s)[:, 0]
    v_loss = jnp.mean(_expectile(q_min_t - v, 0.7))
    v_next = jax.lax.stop_gradient(_mlp(p['v'], s2)[:, 0])
    target = r + 0.99 * (1.0 - d) * v_next
    q1, q2 = q_fn(p['q'], s, a)
    q_loss = jnp.mean((q1 - target) ** 2 + (q2 - target) ** 2)
    adv = jax.lax.stop_gradient(q_min_t - v)
    w = jnp.minimum(jnp.exp(3.0 * adv), 100.0)
    out = _mlp(p['pi'], s, jnp.tanh)
    pi_loss = jnp.mean(w * _gauss_nll(out[:, :_A], jnp.clip(out[:, _A:], -5.0, 2.0), a))
    return v_loss + q_loss + pi_loss, {'v_loss': v_loss, 'q_loss': q_loss,
                                       'pi_loss': pi_loss}

  (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  params, opt = _apply_tx(optax.adam(3e-4), state['params'], state['opt'], grads)
  target_q = optax.incremental_update(params['q'], tq, 0.005)
  return {'params': params, 'opt': opt, 'target_q': target_q}, dict(aux, loss=loss)


def iql_make():
  q = [_mlp_params(130, [_S + _A, 32, 1]), _mlp_params(131, [_S + _A, 32, 1])]
  p = {'q': q, 'v': _mlp_params(132, [_S, 32, 1]), 'pi': _mlp_params(133, [_S, 32, 2 * _A])}
  batch = {'obs': _randn(134, 16, _S), 'act': _randn(135, 16, _A, scale=0.5),
           'rew': _randn(136, 16), 'next_obs': _randn(137, 16, _S),
           'done': _f(np.random.RandomState(138).rand(16) < 0.1)}
  return {'params': p, 'opt': optax.adam(3e-4).init(p),
          'target_q': jax.tree.map(jnp.copy, q)}, batch


# why: expectile value regression, TD targets from the (stop-gradient) next-state value
# and the advantage-weighted policy are all per transition; each term a batch mean; the
# Polyak target update touches only parameters.
add('iql_expectile_v_twin_q_awr_policy_polyak', iql_step, iql_make, expect_split=True)


def cql_step(state, s, a, r, s2, done, rand_actions, pi_noise):
  params, opt_state, target = state

  def q(p, s, a):
    return _mlp(p, jnp.concatenate([s, a], -1))[..., 0]

  def loss_fn(p):
    out = _mlp(p['pi'], s2, jnp.tanh)
    a2 = jnp.tanh(out[:, :_A] + jnp.exp(jnp.clip(out[:, _A:], -5, 2)) * pi_noise)
    tgt = r + 0.99 * (1 - done) * jax.lax.stop_gradient(q(target, s2, a2))
    q_data = q(p['q'], s, a)
    td = jnp.mean((q_data - tgt) ** 2)
    n = rand_actions.shape[1]
    s_rep = jnp.broadcast_to(s[:, None], (s.shape[0], n, s.shape[1]))
    q_rand = q(p['q'], s_rep, rand_actions)                           # (B, N)
    cql = jnp.mean(jax.nn.logsumexp(q_rand, 1) - jnp.log(n) - q_data)
    a_pi = jnp.tanh(_mlp(p['pi'], s, jnp.tanh)[:, :_A])
    actor = -jnp.mean(q(jax.lax.stop_gradient(p['q']), s, a_pi))
    return td + 5.0 * cql + actor, {'td': td, 'cql': cql, 'actor': actor}

  (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  tx = optax.adam(3e-4)
  params, opt_state = _apply_tx(tx, params, opt_state, grads)
  target = jax.tree.map(lambda t, o: 0.995 * t + 0.005 * o, target, params['q'])
  return (params, opt_state, target), dict(aux, loss=loss)


def cql_make():
  p = {'q': _mlp_params(140, [_S + _A, 32, 1]), 'pi': _mlp_params(141, [_S, 32, 2 * _A])}
  rs = np.random.RandomState(142)
  return ((p, optax.adam(3e-4).init(p), jax.tree.map(jnp.copy, p['q'])),
          _randn(143, 16, _S), _f(rs.uniform(-1, 1, (16, _A))), _randn(144, 16),
          _randn(145, 16, _S), _f(rs.rand(16) < 0.1), _f(rs.uniform(-1, 1, (16, 5, _A))),
          _randn(146, 16, _A))


# why: the conservative penalty's logsumexp runs over each state's own sampled actions
# (given as input, shape (B, N, A)); the policy noise is an input too; TD, CQL and actor
# terms are all means over transitions.
add('cql_logsumexp_over_given_random_actions', cql_step, cql_make, expect_split=True)


class _DecisionTransformer(nn.Module):
  d: int = _D
  max_t: int = 32

  @nn.compact
  def __call__(self, rtg, states, actions, timesteps, mask):
    b, t = rtg.shape
    te = nn.Embed(self.max_t, self.d)(timesteps)
    r = nn.Dense(self.d)(rtg[..., None]) + te
    s = nn.Dense(self.d)(states) + te
    a = nn.Dense(self.d)(actions) + te
    h = jnp.stack([r, s, a], 2).reshape(b, 3 * t, self.d)            # R_1 s_1 a_1 R_2 ...
    h = nn.LayerNorm()(h)
    m3 = jnp.repeat(mask, 3, axis=1)
    attn_mask = nn.combine_masks(nn.make_causal_mask(m3), nn.make_attention_mask(m3 > 0,
                                                                                  m3 > 0))
    for _ in range(2):
      y = nn.LayerNorm()(h)
      h = h + nn.MultiHeadDotProductAttention(num_heads=2)(y, y, mask=attn_mask)
      h = h + nn.Dense(self.d)(nn.gelu(nn.Dense(2 * self.d)(nn.LayerNorm()(h))))
    h = h.reshape(b, t, 3, self.d)
    return jnp.tanh(nn.Dense(actions.shape[-1])(h[:, :, 1]))          # predict a_t from s_t


def dt_step(state, rewards, states, actions, timesteps, mask):
  rtg = jnp.flip(jnp.cumsum(jnp.flip(rewards * mask, 1), 1), 1) / 10.0   # returns-to-go

  def loss_fn(params):
    pred = state.apply_fn({'params': params}, rtg, states, actions, timesteps, mask)
    err = jnp.sum((pred - actions) ** 2, -1)
    return jnp.sum(err * mask) / jnp.sum(mask)

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'action_mse': loss}


def dt_make():
  model = _DecisionTransformer()
  b, t = 8, 6
  args = (_randn(150, b, t), _randn(151, b, t, _S), _f(np.tanh(np.random.RandomState(152)
                                                                .randn(b, t, _A))),
          jnp.asarray(np.arange(t)[None] + np.random.RandomState(153).randint(0, 20, (b, 1)),
                      jnp.int32), _len_mask(154, b, t, 3))
  params = model.init(jax.random.PRNGKey(150), args[0], *args[1:])['params']
  tx = optax.chain(optax.clip_by_global_norm(0.25),
                   optax.adamw(optax.linear_schedule(1e-5, 1e-4, 10), weight_decay=1e-4))
  return (train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx),) + args


# why: returns-to-go are a reverse cumulative sum along each trajectory's own time axis
# (parameter-free); the interleaved (R, s, a) tokens attend causally within a trajectory;
# masked action MSE as a ratio of two sums.
add('decision_transformer_returns_to_go_interleaved', dt_step, dt_make, expect_split=True)


def _rssm_init(seed, obs=8, deter=16, cls=4, cats=4, act=2):
  rs = np.random.RandomState(seed)
  z = cls * cats
  return {'enc': _mlp_params(seed, [obs, 16]), 'gru_x': _w(rs, z + act, 3 * deter),
          'gru_h': _w(rs, deter, 3 * deter), 'gru_b': _f(np.zeros(3 * deter)),
          'prior': _mlp_params(seed + 1, [deter, 16, z]),
          'post': _mlp_params(seed + 2, [deter + 16, 16, z]),
          'dec': _mlp_params(seed + 3, [deter + z, 16, obs]),
          'rew': _mlp_params(seed + 4, [deter + z, 16, 1])}


def _rssm_observe(p, obs, act, gumbel):
  """obs (B, T, O), act (B, T, A), gumbel (B, T, cats, cls) given; scan over time."""
  b = obs.shape[0]
  deter = p['gru_h'].shape[0]
  cats, cls = gumbel.shape[-2:]
  emb = _mlp(p['enc'], obs, jax.nn.silu)

  def step(carry, inp):
    h, z = carry
    e, a, g = inp
    gates = jnp.concatenate([z, a], -1) @ p['gru_x'] + p['gru_b']
    hh = h @ p['gru_h']
    r = jax.nn.sigmoid(gates[:, :deter] + hh[:, :deter])
    u = jax.nn.sigmoid(gates[:, deter:2 * deter] + hh[:, deter:2 * deter])
    c = jnp.tanh(gates[:, 2 * deter:] + r * hh[:, 2 * deter:])
    h = u * h + (1 - u) * c
    prior = _mlp(p['prior'], h, jax.nn.silu).reshape(b, cats, cls)
    post = _mlp(p['post'], jnp.concatenate([h, e], -1), jax.nn.silu).reshape(b, cats, cls)
    probs = jax.nn.softmax(post, -1)
    hard = jax.nn.one_hot(jnp.argmax(post + g, -1), cls)
    z = (hard + probs - jax.lax.stop_gradient(probs)).reshape(b, cats * cls)   # straight-through
    return (h, z), (h, z, prior, post)

  init = (jnp.zeros((b, deter)), jnp.zeros((b, cats * cls)))
  xs = (emb.swapaxes(0, 1), act.swapaxes(0, 1), gumbel.swapaxes(0, 1))
  _, (hs, zs, priors, posts) = jax.lax.scan(step, init, xs)
  return tuple(x.swapaxes(0, 1) for x in (hs, zs, priors, posts))


def _cat_kl(lp, lq):
  p = jax.nn.softmax(lp, -1)
  return jnp.sum(p * (jax.nn.log_softmax(lp, -1) - jax.nn.log_softmax(lq, -1)), (-2, -1))


def _dreamer_step(state, batch, *, v3):
  def loss_fn(p):
    hs, zs, priors, posts = _rssm_observe(p, batch['obs'], batch['act'], batch['gumbel'])
    feat = jnp.concatenate([hs, zs], -1)
    recon = jnp.sum((_mlp(p['dec'], feat, jax.nn.silu) - batch['obs']) ** 2, -1)
    rew = (_mlp(p['rew'], feat, jax.nn.silu)[..., 0] - batch['rew']) ** 2
    sg = jax.lax.stop_gradient
    dyn = _cat_kl(sg(posts), priors)                                  # (B, T)
    rep = _cat_kl(posts, sg(priors))
    if v3:   # DreamerV3: free bits clip each (example, step) KL at 1 nat
      kl_loss = 0.5 * jnp.maximum(dyn, 1.0) + 0.1 * jnp.maximum(rep, 1.0)
      loss = jnp.mean(recon + rew + kl_loss)
    else:    # DreamerV2: KL balancing, free nats applied to the batch-mean KL
      kl_bal = 0.8 * jnp.mean(dyn) + 0.2 * jnp.mean(rep)
      loss = jnp.mean(recon + rew) + jnp.maximum(kl_bal, 0.5)
    return loss, {'recon': recon.mean(), 'kl': dyn.mean()}

  (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads), dict(aux, loss=loss)


def _dreamer_make(seed):
  def make():
    p = _rssm_init(seed)
    tx = optax.chain(optax.clip_by_global_norm(100.0), optax.adam(1e-4, eps=1e-8))
    st = train_state.TrainState.create(apply_fn=None, params=p, tx=tx)
    rs = np.random.RandomState(seed + 10)
    batch = {'obs': _randn(seed + 11, 8, 6, 8), 'act': _f(rs.uniform(-1, 1, (8, 6, 2))),
             'rew': _randn(seed + 12, 8, 6),
             'gumbel': _f(-np.log(-np.log(rs.uniform(1e-6, 1 - 1e-6, (8, 6, 4, 4)))))}
    return st, batch
  return make


# why: the RSSM scan runs over each sequence's time steps, the straight-through samples
# use Gumbel noise given per example; DreamerV3 free bits clip each (example, step) KL
# separately before the batch mean.
add('dreamerv3_rssm_kl_balance_free_bits_per_step',
    functools.partial(_dreamer_step, v3=True), _dreamer_make(160), expect_split=True)

# why: DreamerV2-style free nats are applied to the balanced KL after averaging over the
# batch: max(mean KL, 0.5) is a function of a sum over examples, and the reconstruction
# and reward terms are means.
add('dreamerv2_kl_balance_free_nats_on_batch_mean',
    functools.partial(_dreamer_step, v3=False), _dreamer_make(170), expect_split=True)


def dreamer_actor_step(state, start_feat, imag_noise):
  """Actor/critic update in imagination with DreamerV3 return normalisation."""
  params = state['params']
  horizon = imag_noise.shape[1]

  def rollout(p):
    def step(f, eps):
      out = _mlp(p['actor'], f, jax.nn.silu)
      a = jnp.tanh(out[:, :2] + jnp.exp(jnp.clip(out[:, 2:], -4, 1)) * eps)
      f2 = jnp.tanh(_mlp(state['world'], jnp.concatenate([f, a], -1), jax.nn.silu))
      return f2, (f2, -_gauss_nll(out[:, :2], jnp.clip(out[:, 2:], -4, 1), a))
    _, (feats, logp) = jax.lax.scan(step, start_feat, imag_noise.swapaxes(0, 1))
    return feats.swapaxes(0, 1), logp.swapaxes(0, 1)

  def loss_fn(p):
    feats, logp = rollout(p)
    rew = (feats @ state['reward_head'])[..., 0]
    v = _mlp(p['critic'], feats, jax.nn.silu)[..., 0]
    ret = jax.lax.stop_gradient(jnp.flip(jnp.cumsum(jnp.flip(rew, 1) * 0.99, 1), 1) + v)
    lo, hi = jnp.percentile(ret, 5), jnp.percentile(ret, 95)           # over the batch
    scale = jnp.maximum(1.0, state['ret_scale'] * 0.99 + 0.01 * (hi - lo))
    adv = jax.lax.stop_gradient((ret - v) / scale)
    actor = -jnp.mean(adv * logp) - 3e-4 * jnp.mean(-logp)
    critic = 0.5 * jnp.mean((v - ret) ** 2)
    return actor + critic, (scale, {'actor': actor, 'critic': critic})

  (loss, (scale, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  params, opt = _apply_tx(optax.adam(3e-5), params, state['opt'], grads)
  return dict(state, params=params, opt=opt, ret_scale=jax.lax.stop_gradient(scale)), dict(
      aux, loss=loss)


def dreamer_actor_make():
  p = {'actor': _mlp_params(180, [8, 16, 4]), 'critic': _mlp_params(181, [8, 16, 1])}
  return ({'params': p, 'opt': optax.adam(3e-5).init(p),
           'world': _mlp_params(182, [10, 16, 8]), 'reward_head': _randn(183, 8, 1, scale=0.3),
           'ret_scale': jnp.ones(())}, _randn(184, 16, 8), _randn(185, 16, 5, 2))


# why: the imagined rollouts are per start state, but the return scale uses the 5th and
# 95th percentiles of the lambda-returns over the whole batch; the returns are
# stop-gradient values that depend on the parameters, so a forward pass over all
# microbatches first could gather them, yet percentiles are not sums -- unsure.
add('dreamerv3_actor_critic_percentile_return_scale', dreamer_actor_step,
    dreamer_actor_make, expect_split=None)


def _scale_grad(x, s):
  return x * s + jax.lax.stop_gradient(x) * (1 - s)


def _minmax(h):
  lo, hi = h.min(-1, keepdims=True), h.max(-1, keepdims=True)
  return (h - lo) / (hi - lo + 1e-5)


def muzero_step(state, batch):
  obs, actions = batch['obs'], batch['actions']                       # (B, O), (B, K)
  k = actions.shape[1]

  def loss_fn(p):
    s = _minmax(_mlp(p['repr'], obs))

    def predict(s):
      out = _mlp(p['pred'], s)
      return out[:, :_A], out[:, _A]

    def unroll(s, a):
      sa = jnp.concatenate([s, jax.nn.one_hot(a, _A)], -1)
      out = _mlp(p['dyn'], sa)
      s2 = _minmax(out[:, :-1])
      logits, v = predict(s2)
      return _scale_grad(s2, 0.5), (out[:, -1], logits, v)

    logits0, v0 = predict(s)
    _, (r_hat, logits_k, v_k) = jax.lax.scan(unroll, s, actions.T)
    logits = jnp.concatenate([logits0[None], logits_k], 0).swapaxes(0, 1)   # (B, K+1, A)
    values = jnp.concatenate([v0[None], v_k], 0).T
    pol = optax.softmax_cross_entropy(logits, batch['target_policy'])
    val = (values - batch['target_value']) ** 2
    rew = (r_hat.T - batch['target_reward']) ** 2
    per_ex = pol.sum(-1) + 0.25 * val.sum(-1) + rew.sum(-1)
    return jnp.mean(batch['is_weight'] * per_ex) / (k + 1), per_ex

  (loss, per_ex), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss, 'new_priority': per_ex}


def muzero_make():
  h = 12
  p = {'repr': _mlp_params(190, [_S, 24, h]), 'dyn': _mlp_params(191, [h + _A, 24, h + 1]),
       'pred': _mlp_params(192, [h, 24, _A + 1])}
  st = train_state.TrainState.create(apply_fn=None, params=p,
                                     tx=optax.sgd(0.02, momentum=0.9))
  rs = np.random.RandomState(193)
  b, k = 8, 3
  pol = rs.rand(b, k + 1, _A)
  batch = {'obs': _randn(194, b, _S), 'actions': _randint(195, _A, b, k),
           'target_policy': _f(pol / pol.sum(-1, keepdims=True)),
           'target_value': _randn(196, b, k + 1), 'target_reward': _randn(197, b, k),
           'is_weight': _f(rs.uniform(0.3, 1.0, b))}
  return st, batch


# why: the dynamics unroll (lax.scan over the K given actions) and the per-state min-max
# normalisation act on one example's hidden state; the 0.5 gradient scaling is per step;
# the importance-weighted loss is a batch mean, the new priorities are per example.
add('muzero_unrolled_dynamics_scan_scale_gradient', muzero_step, muzero_make,
    expect_split=True)


def per_dqn_step(state, s, a, r, s2, done, probs):
  n_total = 1000.0
  beta = 0.4
  w = (n_total * probs) ** (-beta)
  w = w / jnp.max(w)                                                  # max over the batch

  def loss_fn(p):
    q = jnp.take_along_axis(_mlp(p, s), a[:, None], 1)[:, 0]
    a2 = jnp.argmax(_mlp(p, s2), -1)
    q2 = jnp.take_along_axis(_mlp(state['target'], s2), a2[:, None], 1)[:, 0]
    td = q - jax.lax.stop_gradient(r + 0.99 * (1 - done) * q2)
    return jnp.mean(w * optax.huber_loss(td, delta=1.0)), jnp.abs(td)

  (loss, td), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  params, opt = _apply_tx(optax.adam(6.25e-5, eps=1.5e-4), state['params'], state['opt'],
                          grads)
  target = jax.lax.cond(state['step'] % 4 == 0, lambda: params, lambda: state['target'])
  return {'params': params, 'opt': opt, 'target': target, 'step': state['step'] + 1}, {
      'loss': loss, 'priorities': td + 1e-6}


def per_dqn_make():
  p = _mlp_params(200, [_S, 32, 4])
  rs = np.random.RandomState(201)
  return ({'params': p, 'opt': optax.adam(6.25e-5, eps=1.5e-4).init(p),
           'target': jax.tree.map(jnp.copy, p), 'step': jnp.zeros((), jnp.int32)},
          _randn(202, 16, _S), _randint(203, 4, 16), _randn(204, 16), _randn(205, 16, _S),
          _f(rs.rand(16) < 0.1), _f(rs.uniform(1e-4, 1e-2, 16)))


# why: the importance weights are normalised by their maximum over the batch, but they come
# from the given sampling probabilities only (parameter-free preprocessing of the whole
# batch); double-DQN Huber TD losses are per transition; batch mean.
add('prioritized_replay_is_weights_over_batch_max', per_dqn_step, per_dqn_make,
    expect_split=True)


# ========================================================================================
# 3. self-supervised, audio and vision: CPC, audio MAE, DINO, whitening, style transfer,
#    perceptual super-resolution, latent diffusion, segmentation, keypoints, detection,
#    OCR, NeRF, point clouds
# ========================================================================================

def _cpc_parts(p, frames):
  z = _mlp(p['enc'], frames, jax.nn.gelu)                             # (B, T, d)
  t = z.shape[1]
  c = jnp.cumsum(z @ p['ar'], 1) / jnp.arange(1, t + 1)[None, :, None]   # causal context
  return z, jnp.tanh(c)


def cpc_within_step(state, frames):
  def loss_fn(p):
    z, c = _cpc_parts(p, frames)
    t = z.shape[1]
    total = 0.0
    for k, wk in enumerate(p['heads'], start=1):
      pred = c[:, :t - k] @ wk                                        # (B, T-k, d)
      logits = jnp.einsum('btd,bsd->bts', pred, z[:, k:])             # negatives: same clip
      labels = jnp.broadcast_to(jnp.arange(t - k), logits.shape[:2])
      total = total + optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return total / len(p['heads'])

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  params, opt = _apply_tx(optax.adam(2e-4), state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'infonce': loss}


def cpc_across_step(state, frames):
  def loss_fn(p):
    z, c = _cpc_parts(p, frames)
    t = z.shape[1]
    total = 0.0
    for k, wk in enumerate(p['heads'], start=1):
      pred = c[:, :t - k] @ wk
      logits = jnp.einsum('btd,ctd->tbc', pred, z[:, k:])             # negatives: other clips
      labels = jnp.broadcast_to(jnp.arange(z.shape[0]), logits.shape[:2])
      total = total + optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return total / len(p['heads'])

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  params, opt = _apply_tx(optax.adam(2e-4), state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'infonce': loss}


def _cpc_make(seed):
  def make():
    rs = np.random.RandomState(seed)
    p = {'enc': _mlp_params(seed, [10, 16, 8]), 'ar': _w(rs, 8, 8),
         'heads': [_w(rs, 8, 8), _w(rs, 8, 8)]}
    return {'params': p, 'opt': optax.adam(2e-4).init(p)}, _randn(seed + 1, 8, 12, 10)
  return make


# why: contrastive predictive coding with negatives drawn from other time steps of the
# same clip: each clip's logits matrix is (T-k, T-k) over its own frames; CE averaged.
add('cpc_infonce_negatives_within_each_sequence', cpc_within_step, _cpc_make(210),
    expect_split=True)

# why: here the negatives for a clip's prediction at time t are the other clips' frames
# at t: a softmax over the batch axis couples every example with the rest.
add('cpc_infonce_negatives_across_batch', cpc_across_step, _cpc_make(215),
    expect_split=False)


class _AudioMAE(nn.Module):
  d: int = 16
  keep: int = 3

  @nn.compact
  def __call__(self, patches, ids_shuffle):
    b, n, pd = patches.shape
    pos = self.param('pos', nn.initializers.normal(0.02), (n, self.d))
    x = nn.Dense(self.d)(patches) + pos
    ids_restore = jnp.argsort(ids_shuffle, axis=1)
    vis = jnp.take_along_axis(x, ids_shuffle[:, :self.keep, None], 1)
    y = nn.LayerNorm()(vis)
    vis = vis + nn.SelfAttention(num_heads=2)(y)
    vis = vis + nn.Dense(self.d)(nn.gelu(nn.Dense(2 * self.d)(nn.LayerNorm()(vis))))
    vis = nn.Dense(self.d)(nn.LayerNorm()(vis))
    mask_tok = self.param('mask_token', nn.initializers.zeros, (1, 1, self.d))
    full = jnp.concatenate([vis, jnp.broadcast_to(mask_tok, (b, n - self.keep, self.d))], 1)
    full = jnp.take_along_axis(full, ids_restore[..., None], 1) + pos
    y = nn.LayerNorm()(full)
    full = full + nn.SelfAttention(num_heads=2)(y)
    return nn.Dense(pd)(nn.LayerNorm()(full))


def audio_mae_step(state, spec, noise):
  b, t, f = spec.shape
  patches = spec.reshape(b, t // 4, 4, f // 4, 4).transpose(0, 1, 3, 2, 4).reshape(b, -1, 16)
  ids_shuffle = jnp.argsort(noise, axis=1)                            # per clip
  n = patches.shape[1]
  keep = 3
  mask = jnp.ones((b, n)).at[:, :keep].set(0.0)
  mask = jnp.take_along_axis(mask, jnp.argsort(ids_shuffle, 1), 1)    # 1 = masked
  mu = patches.mean(-1, keepdims=True)
  target = (patches - mu) / jnp.sqrt(patches.var(-1, keepdims=True) + 1e-6)

  def loss_fn(params):
    pred = state.apply_fn({'params': params}, patches, ids_shuffle)
    per_patch = jnp.mean((pred - target) ** 2, -1)
    return jnp.sum(per_patch * mask) / jnp.sum(mask)

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


def audio_mae_make():
  model = _AudioMAE()
  spec = _randn(220, 8, 16, 8)
  noise = _rand(221, 8, 8)
  patches = spec.reshape(8, 4, 4, 2, 4).transpose(0, 1, 3, 2, 4).reshape(8, -1, 16)
  params = model.init(jax.random.PRNGKey(220), patches, jnp.argsort(noise, 1))['params']
  tx = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 2e-4, 3, 30), b2=0.95,
                   weight_decay=0.05)
  return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx), spec, noise


# why: spectrogram patching is a reshape per clip; the shuffle comes from argsort of the
# given per-clip noise along its own patch axis; the loss is the masked-patch MSE summed
# over the batch and divided by the batch's masked-patch count.
add('audio_mae_spectrogram_patches_argsort_noise_given', audio_mae_step, audio_mae_make,
    expect_split=True)


_tx_dino = optax.chain(optax.clip_by_global_norm(3.0), optax.adamw(5e-4, weight_decay=0.04))


def dino_batch_centre_step(state, view1, view2):
  t_net = state['teacher']
  t1, t2 = _mlp(t_net, view1, jax.nn.gelu), _mlp(t_net, view2, jax.nn.gelu)
  batch_centre = jnp.concatenate([t1, t2], 0).mean(0)                 # this batch's mean
  tp1 = jax.nn.softmax((t1 - batch_centre) / 0.04, -1)
  tp2 = jax.nn.softmax((t2 - batch_centre) / 0.04, -1)

  def loss_fn(p):
    ls1 = jax.nn.log_softmax(_mlp(p, view1, jax.nn.gelu) / 0.1, -1)
    ls2 = jax.nn.log_softmax(_mlp(p, view2, jax.nn.gelu) / 0.1, -1)
    return 0.5 * (jnp.mean(-jnp.sum(tp1 * ls2, -1)) + jnp.mean(-jnp.sum(tp2 * ls1, -1)))

  loss, grads = jax.value_and_grad(loss_fn)(state['student'])
  student, opt = _apply_tx(_tx_dino, state['student'], state['opt'], grads)
  teacher = jax.tree.map(lambda t, s: 0.996 * t + 0.004 * s, t_net, student)
  centre = 0.9 * state['centre'] + 0.1 * batch_centre
  return {'student': student, 'teacher': teacher, 'opt': opt, 'centre': centre}, {
      'loss': loss, 'teacher_entropy': -jnp.mean(jnp.sum(tp1 * jnp.log(tp1 + 1e-9), -1))}


def dino_batch_centre_make():
  s = _mlp_params(230, [10, 32, 16])
  return ({'student': s, 'teacher': jax.tree.map(jnp.copy, s), 'opt': _tx_dino.init(s),
           'centre': jnp.zeros(16)}, _randn(231, 16, 10), _randn(232, 16, 10))


# why: the centre subtracted from the teacher logits is the mean over THIS batch, not the
# EMA; but the teacher is a separate EMA copy, not differentiated, so its outputs and
# their batch mean can be computed in an earlier pass over the microbatches; given that
# centre, the student's cross-entropy is a per-example mean.
add('dino_teacher_centred_by_current_batch_mean', dino_batch_centre_step,
    dino_batch_centre_make, expect_split=True)


def wmse_step(state, view1, view2):
  def whiten(z):
    n, d = z.shape
    zc = z - z.mean(0)
    cov = zc.T @ zc / (n - 1) + 1e-4 * jnp.eye(d)
    chol = jnp.linalg.cholesky(cov)
    return jax.scipy.linalg.solve_triangular(chol, zc.T, lower=True).T

  def loss_fn(p):
    z1, z2 = _mlp(p, view1), _mlp(p, view2)
    w1, w2 = whiten(z1), whiten(z2)
    return jnp.mean(jnp.sum((w1 - w2) ** 2, -1))

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'wmse': loss}


def wmse_make():
  st = train_state.TrainState.create(apply_fn=None, params=_mlp_params(240, [8, 16, 4]),
                                     tx=optax.adam(1e-3))
  x = _randn(241, 16, 8)
  return st, x + _randn(242, 16, 8, scale=0.2), x + _randn(243, 16, 8, scale=0.2)


# why: each view is whitened with the Cholesky factor of its batch covariance, but the
# loss mean_i |W1(z1_i - m1) - W2(z2_i - m2)|^2 expands to traces of W1 C11 W1', W2 C22
# W2' and W1 C12 W2', all functions of the first and second (cross) moments -- sums.
add('wmse_cholesky_whitening_per_view_moments', wmse_step, wmse_make, expect_split=True)


def _conv(x, w, stride=1):
  return jax.lax.conv_general_dilated(x, w, (stride, stride), 'SAME',
                                      dimension_numbers=('NHWC', 'HWIO', 'NHWC'))


def _gram(f):
  b, h, w, c = f.shape
  f = f.reshape(b, h * w, c)
  return jnp.einsum('bnc,bnd->bcd', f, f) / (h * w)


def _frozen_features(vgg, x):
  feats = []
  for w in vgg:
    x = jax.nn.relu(_conv(x, w))
    feats.append(x)
  return feats


def style_step(state, content, style_grams, vgg):
  def loss_fn(p):
    h = jax.nn.relu(_conv(content, p['c1']))
    h = h + _conv(jax.nn.relu(_conv(h, p['r1'])), p['r2'])
    out = jax.nn.sigmoid(_conv(h, p['c2']))
    f_out, f_c = _frozen_features(vgg, out), _frozen_features(vgg, content)
    content_l = jnp.mean((f_out[-1] - f_c[-1]) ** 2)
    style_l = sum(jnp.mean(jnp.sum((_gram(fo) - g[None]) ** 2, (1, 2)))
                  for fo, g in zip(f_out, style_grams))
    tv = jnp.mean(jnp.abs(out[:, 1:] - out[:, :-1])) + jnp.mean(jnp.abs(out[:, :, 1:] -
                                                                         out[:, :, :-1]))
    return content_l + 10.0 * style_l + 0.1 * tv, {'content': content_l, 'style': style_l}

  (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  params, opt = _apply_tx(optax.adam(1e-3), state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, dict(aux, loss=loss)


def style_make():
  rs = np.random.RandomState(250)
  cw = lambda i, o: _f(rs.randn(3, 3, i, o) / np.sqrt(9 * i))
  p = {'c1': cw(3, 8), 'r1': cw(8, 8), 'r2': cw(8, 8), 'c2': cw(8, 3)}
  vgg = [cw(3, 6), cw(6, 6)]
  style_img = _rand(251, 1, 8, 8, 3)
  grams = [_gram(f)[0] for f in _frozen_features(vgg, style_img)]
  return ({'params': p, 'opt': optax.adam(1e-3).init(p)}, _rand(252, 8, 8, 8, 3), grams, vgg)


# why: Gram matrices are per image (channels x channels of that image's features) and are
# compared with fixed style Grams passed as a non-batch argument, next to the frozen
# feature weights; content, style and total-variation terms are batch means.
add('style_transfer_per_image_gram_fixed_style_args', style_step, style_make,
    expect_split=True)


class _SRNet(nnx.Module):
  def __init__(self, rngs):
    self.c1 = nnx.Conv(3, 16, (3, 3), rngs=rngs)
    self.c2 = nnx.Conv(16, 16, (3, 3), rngs=rngs)
    self.c3 = nnx.Conv(16, 3, (3, 3), rngs=rngs)

  def __call__(self, lr):
    b, h, w, c = lr.shape
    up = jax.image.resize(lr, (b, 2 * h, 2 * w, c), 'bilinear')
    x = nnx.relu(self.c1(up))
    x = nnx.relu(self.c2(x))
    return up + self.c3(x)


def sr_step(state, lr, hr, frozen_vgg):
  model, optimizer = state

  def loss_fn(model):
    sr = model(lr)
    pix = jnp.mean(jnp.abs(sr - hr))
    percep = sum(jnp.mean((a - b) ** 2) for a, b in zip(_frozen_features(frozen_vgg, sr),
                                                         _frozen_features(frozen_vgg, hr)))
    return pix + 0.1 * percep, (pix, percep)

  (loss, (pix, percep)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
  optimizer.update(model, grads)
  return (model, optimizer), {'loss': loss, 'l1': pix, 'perceptual': percep}


def sr_make():
  model = _SRNet(nnx.Rngs(260))
  opt = nnx.Optimizer(model, optax.adam(2e-4, b1=0.9, b2=0.99), wrt=nnx.Param)
  rs = np.random.RandomState(261)
  vgg = [_f(rs.randn(3, 3, 3, 8) / 5.0), _f(rs.randn(3, 3, 8, 8) / 8.0)]
  hr = _rand(262, 8, 8, 8, 3)
  lr = jax.image.resize(hr, (8, 4, 4, 3), 'linear')
  return (model, opt), lr, hr, vgg


# why: bilinear upsampling and convolutions act on one image; the perceptual loss compares
# frozen features of each output with its own high-res target; L1 + feature MSE means.
add('super_resolution_nnx_perceptual_frozen_features', sr_step, sr_make, expect_split=True)


class _LatentUNet(nn.Module):
  @nn.compact
  def __call__(self, z, t, cond):
    emb = nn.Dense(16)(jnp.concatenate([_time_embed8(t), cond], -1))
    emb = nn.silu(nn.Dense(16)(nn.silu(emb)))
    h = nn.Conv(16, (3, 3))(z)
    scale, shift = jnp.split(nn.Dense(32)(emb), 2, -1)
    h = nn.silu(nn.GroupNorm(num_groups=4)(h) * (1 + scale[:, None, None]) +
                shift[:, None, None])
    h = h + nn.Conv(16, (3, 3))(nn.silu(nn.GroupNorm(num_groups=4)(h)))
    return nn.Conv(z.shape[-1], (3, 3))(h)


def _time_embed8(t, dim=8):
  half = dim // 2
  freqs = jnp.exp(-np.log(1000.0) * jnp.arange(half) / half)
  ang = t.astype(jnp.float32)[:, None] * freqs[None]
  return jnp.concatenate([jnp.sin(ang), jnp.cos(ang)], -1)


_ab_ldm = jnp.asarray(np.cumprod(1.0 - np.linspace(8.5e-4, 0.012, 100)), jnp.float32)


def ldm_step(state, batch):
  vae = state.frozen['vae']
  lat = jnp.tanh(_conv(batch['images'], vae['enc'], stride=2)) * 0.18215    # frozen encoder
  t, noise = batch['t'], batch['noise']
  ab = _ab_ldm[t][:, None, None, None]
  zt = jnp.sqrt(ab) * lat + jnp.sqrt(1 - ab) * noise
  txt = jnp.sum(batch['text_emb'] * batch['text_mask'][..., None], 1) / jnp.maximum(
      batch['text_mask'].sum(1, keepdims=True), 1.0)

  def loss_fn(params):
    cond = jnp.where(batch['drop_cond'][:, None], params['null_cond'], txt)   # CFG dropout
    eps = state.apply_fn({'params': params['unet']}, zt, t, cond)
    return jnp.mean((eps - noise) ** 2)

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


class _FrozenTrainState(train_state.TrainState):
  frozen: Any = None


def ldm_make():
  model = _LatentUNet()
  rs = np.random.RandomState(270)
  vae = {'enc': _f(rs.randn(3, 3, 3, 4) / 5.0)}
  b = 8
  zt = jnp.zeros((b, 4, 4, 4))
  unet = model.init(jax.random.PRNGKey(270), zt, jnp.zeros(b, jnp.int32),
                    jnp.zeros((b, 8)))['params']
  params = {'unet': unet, 'null_cond': jnp.zeros(8)}
  st = _FrozenTrainState.create(apply_fn=model.apply, params=params,
                                tx=optax.adamw(1e-4, weight_decay=1e-2), frozen={'vae': vae})
  batch = {'images': _rand(271, b, 8, 8, 3), 't': _randint(272, 100, b),
           'noise': _randn(273, b, 4, 4, 4), 'text_emb': _randn(274, b, 5, 8),
           'text_mask': _len_mask(275, b, 5, 2),
           'drop_cond': jnp.asarray(rs.rand(b) < 0.25)}
  return st, batch


# why: the frozen VAE encodes each image on its own; classifier-free-guidance dropout is a
# per-example boolean given in the batch that swaps in the learned null embedding; the
# text pooling is within each caption; epsilon MSE averaged over the batch.
add('latent_diffusion_cfg_dropout_mask_given_frozen_vae', ldm_step, ldm_make,
    expect_split=True)


class _SegNet(nn.Module):
  classes: int = 3

  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Conv(8, (3, 3))(x))
    d = nn.relu(nn.Conv(16, (3, 3), strides=(2, 2))(h))
    u = jax.image.resize(d, h.shape[:3] + (16,), 'nearest')
    h = nn.relu(nn.Conv(8, (3, 3))(jnp.concatenate([u, h], -1)))
    return nn.Conv(self.classes, (1, 1))(h)


_segnet = _SegNet()
_tx_seg = optax.sgd(optax.polynomial_schedule(0.01, 0.0, 0.9, 100), momentum=0.9)


def _seg_step(state, batch, *, loss_kind):
  params, opt_state = state
  labels = batch['labels']
  valid = (labels >= 0).astype(jnp.float32)
  safe = jnp.where(labels >= 0, labels, 0)
  onehot = jax.nn.one_hot(safe, 3) * valid[..., None]

  def loss_fn(p):
    logits = _segnet.apply({'params': p}, batch['images'])
    probs = jax.nn.softmax(logits, -1)
    if loss_kind == 'poly1':
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, safe)
      pt = jnp.sum(probs * jax.nn.one_hot(safe, 3), -1)
      return jnp.sum((ce + 1.0 * (1.0 - pt)) * valid) / jnp.maximum(valid.sum(), 1.0)
    pm = probs * valid[..., None]
    if loss_kind == 'dice_per_image':
      inter = jnp.sum(pm * onehot, (1, 2))                            # (B, C)
      denom = jnp.sum(pm, (1, 2)) + jnp.sum(onehot, (1, 2))
      dice = 1.0 - (2 * inter + 1.0) / (denom + 1.0)
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, safe)
      return jnp.mean(dice) + jnp.sum(ce * valid) / jnp.maximum(valid.sum(), 1.0)
    inter = jnp.sum(pm * onehot, (0, 1, 2))                           # (C,) whole batch
    denom = jnp.sum(pm, (0, 1, 2)) + jnp.sum(onehot, (0, 1, 2))
    return jnp.mean(1.0 - (2 * inter + 1e-5) / (denom + 1e-5))

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt_state = _apply_tx(_tx_seg, params, opt_state, grads)
  return (params, opt_state), {'loss': loss}


def _seg_make(seed):
  def make():
    images = _randn(seed, 8, 8, 8, 3)
    labels = np.random.RandomState(seed + 1).randint(0, 3, (8, 8, 8))
    labels[np.random.RandomState(seed + 2).rand(8, 8, 8) < 0.1] = -1     # ignore pixels
    p = _segnet.init(jax.random.PRNGKey(seed), images)['params']
    return (p, _tx_seg.init(p)), {'images': images, 'labels': jnp.asarray(labels, jnp.int32)}
  return make


# why: Poly-1 adds eps * (1 - p_t) to each valid pixel's CE; summed over the batch's valid
# pixels and divided by their count (ratio of two sums).
add('segmentation_poly1_ignore_index_pixels',
    functools.partial(_seg_step, loss_kind='poly1'), _seg_make(280), expect_split=True)

# why: soft Dice is computed per image and per class, then averaged over images; the CE
# term is a valid-pixel ratio of sums.
add('segmentation_dice_per_image_plus_ce',
    functools.partial(_seg_step, loss_kind='dice_per_image'), _seg_make(285),
    expect_split=True)

# why: the Dice intersections and denominators are summed over the whole batch per class
# before the ratio: a function of per-class sums over examples, so still exact.
add('segmentation_dice_pooled_over_whole_batch',
    functools.partial(_seg_step, loss_kind='dice_batch'), _seg_make(290), expect_split=True)


class _HeatmapNet(nn.Module):
  k: int = 3

  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Conv(8, (3, 3))(x))
    h = nn.relu(nn.Conv(8, (3, 3), kernel_dilation=(2, 2))(h))
    return nn.Conv(self.k, (1, 1))(h)


def keypoint_step(state, images, keypoints, visible):
  b, hh, ww, _ = images.shape
  ys, xs = jnp.meshgrid(jnp.arange(hh), jnp.arange(ww), indexing='ij')
  d2 = ((xs[None, None] - keypoints[..., 0, None, None]) ** 2 +
        (ys[None, None] - keypoints[..., 1, None, None]) ** 2)
  target = jnp.exp(-d2 / (2 * 1.5 ** 2)).transpose(0, 2, 3, 1)        # (B, H, W, K)
  vis = visible[:, None, None, :]

  def loss_fn(params):
    hm = state.apply_fn({'params': params}, images)
    mse = jnp.sum(((hm - target) ** 2) * vis) / (jnp.maximum(visible.sum(), 1.0) * hh * ww)
    soft = jax.nn.softmax(hm.reshape(b, hh * ww, -1) * 5.0, 1)
    coords = jnp.stack([jnp.sum(soft * xs.reshape(-1, 1), 1), jnp.sum(soft * ys.reshape(-1, 1),
                                                                      1)], -1)
    l1 = jnp.sum(jnp.abs(coords - keypoints).sum(-1) * visible) / jnp.maximum(visible.sum(), 1)
    return mse + 0.01 * l1, (mse, l1)

  (loss, (mse, l1)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss, 'heatmap_mse': mse,
                                              'coord_l1': l1}


def keypoint_make():
  model = _HeatmapNet()
  images = _randn(300, 8, 8, 8, 3)
  params = model.init(jax.random.PRNGKey(300), images)['params']
  st = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                     tx=optax.rmsprop(1e-3))
  rs = np.random.RandomState(301)
  return st, images, _f(rs.uniform(0, 7, (8, 3, 2))), _f(rs.rand(8, 3) < 0.8)


# why: Gaussian target heatmaps are drawn from each image's own keypoints; the soft-argmax
# runs over one heatmap's pixels; both losses are sums over visible keypoints divided by
# the batch's visible count.
add('keypoint_heatmaps_gaussian_targets_soft_argmax', keypoint_step, keypoint_make,
    expect_split=True)


def _box_cxcywh_to_xyxy(b):
  cx, cy, w, h = jnp.split(b, 4, -1)
  return jnp.concatenate([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], -1)


def _giou(a, b):
  a, b = _box_cxcywh_to_xyxy(a), _box_cxcywh_to_xyxy(b)
  area = lambda x: (x[..., 2] - x[..., 0]) * (x[..., 3] - x[..., 1])
  lt = jnp.maximum(a[..., :2], b[..., :2])
  rb = jnp.minimum(a[..., 2:], b[..., 2:])
  inter = jnp.prod(jnp.clip(rb - lt, 0), -1)
  union = area(a) + area(b) - inter
  iou = inter / (union + 1e-7)
  lt_c = jnp.minimum(a[..., :2], b[..., :2])
  rb_c = jnp.maximum(a[..., 2:], b[..., 2:])
  hull = jnp.prod(jnp.clip(rb_c - lt_c, 0), -1)
  return iou - (hull - union) / (hull + 1e-7)


def detr_step(state, images, gt_boxes, gt_classes, gt_valid, match_idx):
  n_cls = 3
  q = 6

  def loss_fn(p):
    feat = jnp.mean(jax.nn.relu(_conv(images, p['backbone'])), (1, 2))   # (B, 8)
    h = jax.nn.relu(feat[:, None, :] @ p['proj'] + p['queries'][None])  # (B, Q, 16)
    boxes = jax.nn.sigmoid(h @ p['box'])                                 # (B, Q, 4)
    logits = h @ p['cls']                                                # (B, Q, C+1)
    matched = jnp.take_along_axis(boxes, match_idx[..., None], 1)        # (B, M, 4)
    num_boxes = jnp.maximum(gt_valid.sum(), 1.0)
    l1 = jnp.sum(jnp.abs(matched - gt_boxes).sum(-1) * gt_valid) / num_boxes
    giou = jnp.sum((1.0 - _giou(matched, gt_boxes)) * gt_valid) / num_boxes
    tgt = jnp.full((images.shape[0], q), n_cls)
    tgt = jax.vmap(lambda t, i, c, v: t.at[i].set(jnp.where(v > 0, c, t[i])))(
        tgt, match_idx, gt_classes, gt_valid)
    w = jnp.where(tgt == n_cls, 0.1, 1.0)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tgt)
    cls_loss = jnp.sum(w * ce) / jnp.sum(w)
    return cls_loss + 5.0 * l1 + 2.0 * giou, {'cls': cls_loss, 'l1': l1, 'giou': giou}

  (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  tx = optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(1e-4, weight_decay=1e-4))
  params, opt = _apply_tx(tx, state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, dict(aux, loss=loss)


def detr_make():
  rs = np.random.RandomState(310)
  p = {'backbone': _f(rs.randn(3, 3, 3, 8) / 5.0), 'proj': _w(rs, 8, 16),
       'queries': _f(rs.randn(6, 16) * 0.1), 'box': _w(rs, 16, 4), 'cls': _w(rs, 16, 4)}
  tx = optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(1e-4, weight_decay=1e-4))
  b, m = 8, 4
  boxes = np.concatenate([rs.uniform(0.2, 0.8, (b, m, 2)), rs.uniform(0.05, 0.4, (b, m, 2))], -1)
  match = np.stack([rs.permutation(6)[:m] for _ in range(b)])
  n_valid = rs.randint(1, m + 1, b)
  return ({'params': p, 'opt': tx.init(p)}, _randn(311, b, 8, 8, 3), _f(boxes),
          _randint(312, 3, b, m), _f(np.arange(m)[None] < n_valid[:, None]),
          jnp.asarray(match, jnp.int32))


# why: the Hungarian matching is done outside and arrives as per-image query indices; L1
# and GIoU are summed over the batch's valid boxes and divided by num_boxes (the whole
# batch's box count); the no-object-weighted CE is sum(w*ce)/sum(w): ratios of sums.
add('detr_padded_boxes_matching_indices_given', detr_step, detr_make, expect_split=True)


class _CRNN(nn.Module):
  vocab: int = 8

  @nn.compact
  def __call__(self, images, widths):
    h = nn.relu(nn.Conv(8, (3, 3))(images))
    h = nn.relu(nn.Conv(8, (3, 3))(h))
    h = jnp.max(h, axis=1)                                            # collapse height: (B, W, C)
    h = nn.Bidirectional(nn.RNN(nn.GRUCell(features=8)), nn.RNN(nn.GRUCell(features=8)))(
        h, seq_lengths=widths)
    return nn.Dense(self.vocab + 1)(h)


def ocr_ctc_step(state, images, widths, labels, label_len):
  frames = images.shape[2]
  logit_pad = (jnp.arange(frames)[None] >= widths[:, None]).astype(jnp.float32)
  label_pad = (jnp.arange(labels.shape[1])[None] >= label_len[:, None]).astype(jnp.float32)

  def loss_fn(params):
    logits = state.apply_fn({'params': params}, images, widths)
    per_seq = optax.ctc_loss(logits, logit_pad, labels, label_pad, blank_id=0)
    return jnp.mean(per_seq / jnp.maximum(label_len, 1)), logits

  (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads), {'ctc': loss}


def ocr_ctc_make():
  model = _CRNN()
  rs = np.random.RandomState(320)
  b, w = 8, 16
  images = _randn(321, b, 8, w, 1)
  widths = jnp.asarray(rs.randint(10, w + 1, b), jnp.int32)
  label_len = jnp.asarray(rs.randint(2, 5, b), jnp.int32)
  labels = jnp.asarray(rs.randint(1, 9, (b, 5)), jnp.int32)
  params = model.init(jax.random.PRNGKey(320), images, widths)['params']
  st = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                     tx=optax.adadelta(1.0))
  return st, images, widths, labels, label_len


# why: convolutions and the bidirectional GRU (with per-image seq_lengths) read one text
# line; CTC is per sequence, normalised by that line's label length, then averaged.
add('ocr_crnn_bidirectional_gru_ctc_head', ocr_ctc_step, ocr_ctc_make, expect_split=True)


def _posenc(x, n_freq):
  freqs = 2.0 ** jnp.arange(n_freq)
  ang = x[..., None] * freqs
  return jnp.concatenate([x, jnp.sin(ang).reshape(*x.shape[:-1], -1),
                          jnp.cos(ang).reshape(*x.shape[:-1], -1)], -1)


def nerf_step(state, rays):
  o, d, t_vals, target = rays['origins'], rays['dirs'], rays['t_vals'], rays['rgb']

  def loss_fn(p):
    pts = o[:, None] + d[:, None] * t_vals[..., None]                 # (R, S, 3)
    h = _mlp(p['trunk'], _posenc(pts, 3))
    sigma = jax.nn.relu(h[..., 0])
    rgb = jax.nn.sigmoid(_mlp(p['color'], jnp.concatenate(
        [h[..., 1:], jnp.broadcast_to(_posenc(d, 2)[:, None], h.shape[:2] + (15,))], -1)))
    delta = jnp.concatenate([jnp.diff(t_vals, axis=-1),
                             jnp.full(t_vals.shape[:1] + (1,), 1e10)], -1)
    delta = delta * jnp.linalg.norm(d, axis=-1, keepdims=True)
    alpha = 1.0 - jnp.exp(-sigma * delta)
    trans = jnp.cumprod(1.0 - alpha + 1e-10, axis=-1)
    trans = jnp.concatenate([jnp.ones_like(trans[:, :1]), trans[:, :-1]], -1)
    weights = alpha * trans
    color = jnp.sum(weights[..., None] * rgb, 1)
    acc = weights.sum(-1, keepdims=True)
    color = color + (1.0 - acc)                                       # white background
    mse = jnp.mean((color - target) ** 2)
    return mse, mse

  (loss, mse), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads), {'mse': mse, 'psnr': -10.0 * jnp.log10(mse)}


def nerf_make():
  p = {'trunk': _mlp_params(330, [21, 32, 32, 9]), 'color': _mlp_params(331, [8 + 15, 16, 3])}
  st = train_state.TrainState.create(apply_fn=None, params=p,
                                     tx=optax.adam(optax.exponential_decay(5e-4, 100, 0.1)))
  rs = np.random.RandomState(332)
  n, s = 16, 8
  base = np.linspace(2.0, 6.0, s)
  t_vals = np.sort(base[None] + rs.uniform(0, 4.0 / s, (n, s)), -1)
  d = rs.randn(n, 3)
  rays = {'origins': _f(rs.randn(n, 3) * 0.1), 'dirs': _f(d / np.linalg.norm(d, axis=-1,
                                                                               keepdims=True)),
          't_vals': _f(t_vals), 'rgb': _rand(333, n, 3)}
  return st, rays


# why: volume rendering composites one ray's samples (cumprod along its sample axis, the
# stratified sample depths are given per ray); photometric MSE averaged over rays.
add('nerf_volume_rendering_cumprod_per_ray', nerf_step, nerf_make, expect_split=True)


class _PointNet(nnx.Module):
  def __init__(self, rngs, classes=4):
    self.t1 = nnx.Linear(3, 16, rngs=rngs)
    self.t2 = nnx.Linear(16, 9, kernel_init=nnx.initializers.zeros, rngs=rngs)
    self.f1 = nnx.Linear(3, 16, rngs=rngs)
    self.f2 = nnx.Linear(16, 32, rngs=rngs)
    self.head = nnx.Linear(32, classes, rngs=rngs)

  def __call__(self, pts):
    g = jnp.max(nnx.relu(self.t1(pts)), axis=1)                       # per-cloud max-pool
    trans = self.t2(g).reshape(-1, 3, 3) + jnp.eye(3)
    x = jnp.einsum('bnc,bcd->bnd', pts, trans)
    x = nnx.relu(self.f2(nnx.relu(self.f1(x))))
    return self.head(jnp.max(x, axis=1)), trans


def pointnet_step(state, points, labels):
  model, optimizer = state

  def loss_fn(model):
    logits, trans = model(points)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    eye = jnp.eye(3)[None]
    reg = jnp.mean(jnp.sum((eye - trans @ trans.transpose(0, 2, 1)) ** 2, (1, 2)))
    return ce + 1e-3 * reg, ce

  (loss, ce), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
  optimizer.update(model, grads)
  return (model, optimizer), {'loss': loss, 'ce': ce}


def pointnet_make():
  model = _PointNet(nnx.Rngs(340))
  opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  return (model, opt), _randn(341, 8, 16, 3), _randint(342, 4, 8)


# why: the input transform is predicted from each cloud's own max-pooled features and the
# classifier max-pools over that cloud's points; CE and the orthogonality penalty are
# means over clouds.
add('pointnet_tnet_maxpool_over_points_nnx', pointnet_step, pointnet_make,
    expect_split=True)


class _PointNetBN(nn.Module):
  @nn.compact
  def __call__(self, pts, train):
    x = nn.Dense(16)(pts)
    x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
    x = nn.Dense(32)(x)
    x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
    return nn.Dense(4)(jnp.max(x, axis=1))


def pointnet_bn_step(state, points, labels):
  def loss_fn(params):
    logits, upd = state.apply_fn({'params': params, 'batch_stats': state.batch_stats},
                                 points, True, mutable=['batch_stats'])
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), upd

  (loss, upd), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  state = state.apply_gradients(grads=grads).replace(batch_stats=upd['batch_stats'])
  return state, {'loss': loss}


def pointnet_bn_make():
  model = _PointNetBN()
  pts = _randn(350, 8, 16, 3)
  v = model.init(jax.random.PRNGKey(350), pts, False)
  st = _BNTrainState.create(apply_fn=model.apply, params=v['params'],
                            batch_stats=v['batch_stats'], tx=optax.adam(1e-3))
  return st, pts, _randint(351, 4, 8)


# why: BatchNorm in train mode normalises each point's features with the mean and variance
# over all clouds and points of the batch, and later layers read them; counted as False
# here (batch statistics read by later layers).
add('pointnet_linen_batchnorm_train_mode', pointnet_bn_step, pointnet_bn_make,
    expect_split=False)


class _KWS(nnx.Module):
  def __init__(self, rngs, n_mels=8, classes=5):
    self.c1 = nnx.Conv(n_mels, 16, (3,), rngs=rngs)
    self.bn1 = nnx.BatchNorm(16, momentum=0.9, rngs=rngs)
    self.c2 = nnx.Conv(16, 16, (3,), strides=(2,), rngs=rngs)
    self.bn2 = nnx.BatchNorm(16, momentum=0.9, rngs=rngs)
    self.head = nnx.Linear(16, classes, rngs=rngs)

  def __call__(self, mel):
    x = nnx.relu(self.bn1(self.c1(mel)))
    x = nnx.relu(self.bn2(self.c2(x)))
    return self.head(x.mean(1))


_kws_graphdef, _ = nnx.split((_KWS(nnx.Rngs(0)),
                              nnx.Optimizer(_KWS(nnx.Rngs(0)), optax.adam(1e-3), wrt=nnx.Param)))


def kws_bn_step(state, mel, labels):
  model, optimizer = nnx.merge(_kws_graphdef, state)
  model.train()

  def loss_fn(model):
    logits = model(mel)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return nnx.state((model, optimizer)), {'loss': loss}


def kws_bn_make():
  model = _KWS(nnx.Rngs(360))
  opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  _, state = nnx.split((model, opt))
  return state, _randn(361, 16, 12, 8), _randint(362, 5, 16)


# why: nnx.BatchNorm in train mode (model.train()) normalises the conv features with batch
# statistics over clips and frames, read by the next conv; counted as False here.
add('keyword_spotting_nnx_batchnorm_pure_state_merge', kws_bn_step, kws_bn_make,
    expect_split=False)


# ========================================================================================
# 4. graphs, tabular, forecasting, survival, recommenders, knowledge graphs, word models
# ========================================================================================

def _gnn_layer(p, nodes, senders, receivers, edge_mask):
  n = nodes.shape[0]
  msg = jax.nn.relu(jnp.concatenate([nodes[senders], nodes[receivers]], -1) @ p['msg'])
  msg = msg * edge_mask[:, None]
  agg = jax.ops.segment_sum(msg, receivers, num_segments=n)
  deg = jax.ops.segment_sum(edge_mask, receivers, num_segments=n)
  return jax.nn.relu(jnp.concatenate([nodes, agg / jnp.maximum(deg, 1.0)[:, None]], -1)
                     @ p['upd'])


def gnn_padded_step(state, graphs):
  def loss_fn(p):
    def one_graph(nodes, senders, receivers, emask, nmask):
      h = nodes @ p['inp']
      for layer in p['layers']:
        h = _gnn_layer(layer, h, senders, receivers, emask) * nmask[:, None]
      return jnp.sum(h, 0) / jnp.maximum(nmask.sum(), 1.0) @ p['readout']

    pred = jax.vmap(one_graph)(graphs['nodes'], graphs['senders'], graphs['receivers'],
                               graphs['edge_mask'], graphs['node_mask'])[:, 0]
    return jnp.mean(optax.huber_loss(pred, graphs['y']))

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


def _gnn_params(seed, f=6, d=16):
  rs = np.random.RandomState(seed)
  return {'inp': _w(rs, f, d), 'readout': _w(rs, d, 1),
          'layers': [{'msg': _w(rs, 2 * d, d), 'upd': _w(rs, 2 * d, d)} for _ in range(2)]}


def gnn_padded_make():
  rs = np.random.RandomState(370)
  b, n, e = 8, 8, 16
  n_nodes = rs.randint(3, n + 1, b)
  n_edges = rs.randint(4, e + 1, b)
  snd = np.stack([rs.randint(0, k, e) for k in n_nodes])
  rcv = np.stack([rs.randint(0, k, e) for k in n_nodes])
  graphs = {'nodes': _randn(371, b, n, 6), 'senders': jnp.asarray(snd, jnp.int32),
            'receivers': jnp.asarray(rcv, jnp.int32),
            'edge_mask': _f(np.arange(e)[None] < n_edges[:, None]),
            'node_mask': _f(np.arange(n)[None] < n_nodes[:, None]), 'y': _randn(372, b)}
  st = train_state.TrainState.create(apply_fn=None, params=_gnn_params(370),
                                     tx=optax.adamw(1e-3, weight_decay=1e-5))
  return st, graphs


# why: each graph arrives padded to a fixed node and edge count with its own local edge
# list; message passing (segment_sum) is vmapped over graphs; Huber loss averaged.
add('gnn_vmapped_segment_sum_per_graph_padded_edges', gnn_padded_step, gnn_padded_make,
    expect_split=True)


def gnn_flat_step(state, nodes, senders, receivers, edge_mask, node_graph, y):
  n_graph = y.shape[0]

  def loss_fn(p):
    h = nodes @ p['inp']
    for layer in p['layers']:
      h = _gnn_layer(layer, h, senders, receivers, edge_mask)
    pooled = jax.ops.segment_sum(h, node_graph, num_segments=n_graph)
    count = jax.ops.segment_sum(jnp.ones(h.shape[0]), node_graph, num_segments=n_graph)
    pred = (pooled / jnp.maximum(count, 1.0)[:, None] @ p['readout'])[:, 0]
    return jnp.mean((pred - y) ** 2)

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  params, opt = _apply_tx(optax.adam(1e-3), state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'mse': loss}


def gnn_flat_make():
  rs = np.random.RandomState(380)
  b, n, e = 8, 8, 12
  offs = np.repeat(np.arange(b) * n, e)
  snd = rs.randint(0, n, b * e) + offs                                # global node indices
  rcv = rs.randint(0, n, b * e) + offs
  p = _gnn_params(380)
  return ({'params': p, 'opt': optax.adam(1e-3).init(p)}, _randn(381, b * n, 6),
          jnp.asarray(snd, jnp.int32), jnp.asarray(rcv, jnp.int32),
          _f(rs.rand(b * e) < 0.9), jnp.asarray(np.repeat(np.arange(b), n), jnp.int32),
          _randn(382, b))


# why: jraph-style batching: 8 graphs are flattened into one big graph (64 nodes, 96
# edges with global node indices, a node->graph id array) and only y has the graph axis.
# Graphs never interact, but the arrays have different leading sizes and the edge indices
# point into the flattened node array, so a plain split of leading axes would break them;
# splitting per graph would be exact -- unsure what to call it.
add('gnn_jraph_style_flattened_batch_global_indices', gnn_flat_step, gnn_flat_make,
    expect_split=None)


def gp_step(state, x, y):
  def loss_fn(p):
    phi = _mlp(p['feat'], x, jnp.tanh)
    d2 = jnp.sum((phi[:, None] - phi[None]) ** 2, -1)
    k = jnp.exp(p['log_amp']) * jnp.exp(-0.5 * d2 / jnp.exp(2 * p['log_ls']))
    n = x.shape[0]
    k = k + (jnp.exp(p['log_noise']) + 1e-4) * jnp.eye(n)
    chol = jnp.linalg.cholesky(k)
    alpha = jax.scipy.linalg.cho_solve((chol, True), y)
    nll = 0.5 * y @ alpha + jnp.sum(jnp.log(jnp.diag(chol))) + 0.5 * n * jnp.log(2 * jnp.pi)
    return nll / n

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  params, opt = _apply_tx(optax.adam(1e-2), state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'nll_per_point': loss}


def gp_make():
  p = {'feat': _mlp_params(390, [3, 16, 4]), 'log_amp': jnp.zeros(()),
       'log_ls': jnp.zeros(()), 'log_noise': jnp.asarray(-2.0)}
  x = _randn(391, 16, 3)
  return {'params': p, 'opt': optax.adam(1e-2).init(p)}, x, jnp.sin(x[:, 0]) + 0.1 * x[:, 1]


# why: an exact deep-kernel GP marginal likelihood: the B x B kernel matrix couples every
# pair of examples and enters through its inverse and log-determinant.
add('deep_kernel_gp_exact_marginal_likelihood', gp_step, gp_make, expect_split=False)


_CAT_SIZES = (5, 7, 3, 4)


class _TabTransformer(nn.Module):
  d: int = 8

  @nn.compact
  def __call__(self, cat, cont):
    offsets = jnp.asarray(np.cumsum((0,) + _CAT_SIZES[:-1]), jnp.int32)
    e = nn.Embed(sum(_CAT_SIZES), self.d)(cat + offsets)
    col = self.param('col_embed', nn.initializers.normal(0.02), (len(_CAT_SIZES), self.d))
    h = e + col
    y = nn.LayerNorm()(h)
    h = h + nn.SelfAttention(num_heads=2)(y)
    h = h + nn.Dense(self.d)(nn.gelu(nn.Dense(4 * self.d)(nn.LayerNorm()(h))))
    x = jnp.concatenate([h.reshape(h.shape[0], -1), nn.LayerNorm()(cont)], -1)
    x = nn.relu(nn.Dense(16)(x))
    return nn.Dense(1)(x)[:, 0]


def tabtransformer_step(state, batch):
  def loss_fn(params):
    logit = state.apply_fn({'params': params}, batch['cat'], batch['cont'])
    pos_weight = 3.0
    y = batch['label']
    loss = -(pos_weight * y * jax.nn.log_sigmoid(logit) + (1 - y) * jax.nn.log_sigmoid(-logit))
    return loss.mean(), logit

  (loss, logit), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads), {
      'loss': loss, 'acc': jnp.mean((logit > 0) == (batch['label'] > 0.5))}


def tabtransformer_make():
  model = _TabTransformer()
  rs = np.random.RandomState(400)
  cat = jnp.asarray(np.stack([rs.randint(0, k, 16) for k in _CAT_SIZES], -1), jnp.int32)
  batch = {'cat': cat, 'cont': _randn(401, 16, 3), 'label': _f(rs.rand(16) < 0.3)}
  params = model.init(jax.random.PRNGKey(400), cat, batch['cont'])['params']
  return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                       tx=optax.adamw(1e-3, weight_decay=1e-4)), batch


# why: column embeddings attend over one row's categorical columns; the continuous
# features are LayerNorm-ed within the row (not across rows); weighted BCE averaged.
add('tabtransformer_categorical_column_attention', tabtransformer_step, tabtransformer_make,
    expect_split=True)


_QUANTILES = jnp.asarray([0.1, 0.5, 0.9])


def quantile_step(state, context, future):
  mu = context.mean(1, keepdims=True)                                  # RevIN per series
  sd = context.std(1, keepdims=True) + 1e-5

  def loss_fn(p):
    xn = (context - mu) / sd
    out = _mlp(p, xn, jax.nn.gelu).reshape(context.shape[0], future.shape[1], 3)
    q = jnp.concatenate([out[..., :1], out[..., :1] +
                         jnp.cumsum(jax.nn.softplus(out[..., 1:]), -1)], -1)  # monotone
    q = q * sd[..., None] + mu[..., None]
    err = future[..., None] - q
    pinball = jnp.maximum(_QUANTILES * err, (_QUANTILES - 1.0) * err)
    return pinball.mean(), q

  (loss, q), grads = jax.value_and_grad(loss_fn, has_aux=True)(state[0])
  params, opt = _apply_tx(optax.adam(1e-3), state[0], state[1], grads)
  cover = jnp.mean((future >= q[..., 0]) & (future <= q[..., 2]))
  return (params, opt), {'pinball': loss, 'coverage_80': cover}


def quantile_make():
  p = _mlp_params(410, [12, 32, 12])
  t = np.arange(16)[None] + np.random.RandomState(411).rand(16, 1) * 10
  series = np.sin(t / 3.0) * 5 + 10 + np.random.RandomState(412).randn(16, 16) * 0.3
  return (p, optax.adam(1e-3).init(p)), _f(series[:, :12]), _f(series[:, 12:])


# why: reversible instance normalisation uses each series' own context mean and std; the
# pinball loss over horizons and quantiles is a mean over series.
add('quantile_forecast_pinball_revin_monotone', quantile_step, quantile_make,
    expect_split=True)


class _DeepAR(nn.Module):
  @nn.compact
  def __call__(self, inputs):
    h = nn.RNN(nn.GRUCell(features=16))(inputs)
    out = nn.Dense(2)(h)
    return out[..., 0], jax.nn.softplus(out[..., 1]) + 1e-3


def deepar_step(state, target, covariates, observed):
  ctx = 8
  scale = 1.0 + jnp.sum(jnp.abs(target[:, :ctx]) * observed[:, :ctx], 1, keepdims=True) / (
      jnp.maximum(observed[:, :ctx].sum(1, keepdims=True), 1.0))
  z = target / scale
  lagged = jnp.pad(z, ((0, 0), (1, 0)))[:, :-1]
  inputs = jnp.concatenate([lagged[..., None], covariates, jnp.log(scale)[..., None] *
                            jnp.ones_like(lagged)[..., None]], -1)

  def loss_fn(params):
    mu, sigma = state.apply_fn({'params': params}, inputs)
    nll = 0.5 * ((z - mu) / sigma) ** 2 + jnp.log(sigma) + jnp.log(scale)
    return jnp.sum(nll * observed) / jnp.sum(observed)

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'nll': loss}


def deepar_make():
  model = _DeepAR()
  rs = np.random.RandomState(420)
  b, t = 8, 12
  target = _f(np.abs(rs.randn(b, t)) * rs.uniform(1, 20, (b, 1)))
  cov = _f(np.stack([np.sin(np.arange(t) / 2.0), np.cos(np.arange(t) / 2.0)], -1)[None]
           .repeat(b, 0))
  obs = _f(rs.rand(b, t) < 0.9)
  params = model.init(jax.random.PRNGKey(420), jnp.zeros((b, t, 4)))['params']
  st = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                     tx=optax.adam(1e-3))
  return st, target, cov, obs


# why: each series is scaled by its own context mean (parameter-free), lagged within the
# series and run through the GRU along its time axis; the Gaussian NLL is a sum over
# observed points of the batch divided by their count.
add('deepar_gaussian_nll_per_series_scale_gru', deepar_step, deepar_make, expect_split=True)


def survival_step(state, x, event_bin, event):
  k = 6
  bins = jnp.arange(k)[None]
  before = (bins < event_bin[:, None]).astype(jnp.float32)
  at = (bins == event_bin[:, None]).astype(jnp.float32)

  def loss_fn(p):
    logits = _mlp(p, x)                                               # (B, K) hazard logits
    log_h, log_1mh = jax.nn.log_sigmoid(logits), jax.nn.log_sigmoid(-logits)
    ll = jnp.sum(before * log_1mh, -1) + jnp.sum(at * log_h, -1) * event + \
        jnp.sum(at * log_1mh, -1) * (1.0 - event)                     # censored: survived bin
    return -jnp.mean(ll)

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  params, opt = _apply_tx(optax.adam(1e-3), state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'nll': loss}


def survival_make():
  p = _mlp_params(430, [6, 16, 6])
  rs = np.random.RandomState(431)
  return ({'params': p, 'opt': optax.adam(1e-3).init(p)}, _randn(432, 16, 6),
          _randint(433, 6, 16), _f(rs.rand(16) < 0.6))


# why: discrete-time hazard likelihood with each subject's own event bin and censoring
# indicator; log-likelihood averaged over subjects.
add('survival_discrete_time_hazard_censoring_mask', survival_step, survival_make,
    expect_split=True)


def cox_step(state, x, times, events):
  def loss_fn(p):
    eta = _mlp(p, x)[:, 0]
    order = jnp.argsort(-times)                                       # descending time
    eta_s, ev_s = eta[order], events[order]
    log_risk = jax.lax.cumlogsumexp(eta_s)                            # risk set {j: t_j >= t_i}
    return -jnp.sum(ev_s * (eta_s - log_risk)) / jnp.maximum(ev_s.sum(), 1.0)

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'neg_partial_ll': loss}


def cox_make():
  st = train_state.TrainState.create(apply_fn=None, params=_mlp_params(440, [6, 16, 1]),
                                     tx=optax.adam(1e-3))
  rs = np.random.RandomState(441)
  return st, _randn(442, 16, 6), _f(rs.exponential(5.0, 16)), _f(rs.rand(16) < 0.7)


# why: the Cox partial likelihood's risk set for a subject is every subject in the batch
# still at risk at its event time (a logcumsumexp over the batch sorted by time); each
# term's denominator involves other examples' parameter-dependent risks.
add('cox_partial_likelihood_sorted_logcumsumexp', cox_step, cox_make, expect_split=False)


def mf_step(state, users, items, ratings):
  lam = 0.02

  def loss_fn(p):
    pu, qi = p['user'][users], p['item'][items]
    bu, bi = p['user_bias'][users], p['item_bias'][items]
    pred = p['mu'] + bu + bi + jnp.sum(pu * qi, -1)
    reg = jnp.sum(pu ** 2, -1) + jnp.sum(qi ** 2, -1) + bu ** 2 + bi ** 2
    return jnp.mean((pred - ratings) ** 2 + lam * reg), pred

  (loss, pred), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads), {
      'loss': loss, 'rmse': jnp.sqrt(jnp.mean((pred - ratings) ** 2))}


def mf_make():
  rs = np.random.RandomState(450)
  p = {'user': _f(rs.randn(20, 6) * 0.1), 'item': _f(rs.randn(30, 6) * 0.1),
       'user_bias': jnp.zeros(20), 'item_bias': jnp.zeros(30), 'mu': jnp.asarray(3.5)}
  st = train_state.TrainState.create(apply_fn=None, params=p, tx=optax.adagrad(0.05))
  return st, _randint(451, 20, 16), _randint(452, 30, 16), _f(rs.randint(1, 6, 16))


# why: each rating's prediction and its L2 penalty on the looked-up embeddings are per
# example; reported RMSE is the square root of a batch mean (a function of a sum).
add('matrix_factorisation_biases_l2_on_looked_up_rows', mf_step, mf_make,
    expect_split=True)


def _tower_params(seed):
  rs = np.random.RandomState(seed)
  return {'query': _mlp_params(seed, [6, 16, 8]), 'item_emb': _f(rs.randn(30, 8) * 0.3),
          'item': _mlp_params(seed + 1, [8, 16, 8]), 'log_temp': jnp.asarray(np.log(0.1))}


def _item_tower(p, ids):
  return _unit(_mlp(p['item'], p['item_emb'][ids]))


def sampled_softmax_step(state, query_feats, pos_items, neg_items, log_q):
  def loss_fn(p):
    q = _unit(_mlp(p['query'], query_feats))                         # (B, 8)
    cand = jnp.concatenate([pos_items[:, None], neg_items], 1)         # (B, 1 + N)
    emb = _item_tower(p, cand)
    logits = jnp.einsum('bd,bnd->bn', q, emb) / jnp.exp(p['log_temp']) - log_q
    hit = (cand[:, 1:] == pos_items[:, None])                          # accidental hits
    logits = logits.at[:, 1:].set(jnp.where(hit, -1e9, logits[:, 1:]))
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, jnp.zeros(q.shape[0], jnp.int32)).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  params, opt = _apply_tx(optax.adagrad(0.05), state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'sampled_softmax': loss}


def sampled_softmax_make():
  p = _tower_params(460)
  rs = np.random.RandomState(461)
  return ({'params': p, 'opt': optax.adagrad(0.05).init(p)}, _randn(462, 16, 6),
          _randint(463, 30, 16), _randint(464, 30, 16, 8),
          _f(np.log(rs.uniform(0.01, 0.1, (16, 9)))))


# why: each query's negatives are item ids drawn by the input pipeline and given with it,
# along with their sampling log-probabilities; the logQ-corrected softmax is over that
# row's own candidates; CE averaged over queries.
add('two_tower_sampled_softmax_negatives_given_logq', sampled_softmax_step,
    sampled_softmax_make, expect_split=True)


def inbatch_logq_step(state, query_feats, pos_items, log_q_pos):
  def loss_fn(p):
    q = _unit(_mlp(p['query'], query_feats))
    items = _item_tower(p, pos_items)
    logits = q @ items.T / jnp.exp(p['log_temp']) - log_q_pos[None, :]
    same = pos_items[:, None] == pos_items[None, :]
    logits = jnp.where(same & ~jnp.eye(q.shape[0], dtype=bool), -1e9, logits)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, jnp.arange(q.shape[0])).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  params, opt = _apply_tx(optax.adagrad(0.05), state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'in_batch_softmax': loss}


def inbatch_logq_make():
  p = _tower_params(470)
  return ({'params': p, 'opt': optax.adagrad(0.05).init(p)}, _randn(471, 16, 6),
          _randint(472, 30, 16), _f(np.log(np.random.RandomState(473).uniform(0.01, 0.1, 16))))


# why: the negatives for each query are the other queries' positive items (in-batch
# softmax with logQ correction): every row's normaliser contains the other examples'
# parameter-dependent item embeddings.
add('two_tower_in_batch_softmax_logq_correction', inbatch_logq_step, inbatch_logq_make,
    expect_split=False)


def transe_step(state, triples, corrupted):
  margin = 1.0

  def loss_fn(p):
    def dist(t):
      return jnp.sum(jnp.abs(p['ent'][t[:, 0]] + p['rel'][t[:, 1]] - p['ent'][t[:, 2]]), -1)
    return jnp.mean(jax.nn.relu(margin + dist(triples) - dist(corrupted)))

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  state = state.apply_gradients(grads=grads)
  ent = state.params['ent']
  ent = ent / jnp.linalg.norm(ent, axis=-1, keepdims=True)            # renormalise entities
  return state.replace(params=dict(state.params, ent=ent)), {'margin_loss': loss}


def transe_make():
  rs = np.random.RandomState(480)
  ent = rs.randn(20, 8)
  p = {'ent': _f(ent / np.linalg.norm(ent, axis=-1, keepdims=True)),
       'rel': _f(rs.randn(5, 8) * 0.3)}
  st = train_state.TrainState.create(apply_fn=None, params=p, tx=optax.sgd(0.01))
  h, r, t = rs.randint(0, 20, 16), rs.randint(0, 5, 16), rs.randint(0, 20, 16)
  corrupt_head = rs.rand(16) < 0.5
  rnd = rs.randint(0, 20, 16)
  corr = np.stack([np.where(corrupt_head, rnd, h), r, np.where(corrupt_head, t, rnd)], -1)
  return st, jnp.asarray(np.stack([h, r, t], -1), jnp.int32), jnp.asarray(corr, jnp.int32)


# why: each positive triple is paired with its own corrupted triple given by the input
# pipeline; hinge margin per pair, averaged; the entity renormalisation touches only
# parameters after the update.
add('transe_margin_corrupted_triples_given', transe_step, transe_make, expect_split=True)


def hsoftmax_step(state, context, context_mask, path_nodes, path_codes, path_mask):
  lr = 0.05 * jnp.maximum(1.0 - state['step'] / 1000.0, 1e-4)

  def loss_fn(p):
    h = jnp.sum(p['in'][context] * context_mask[..., None], 1) / jnp.maximum(
        context_mask.sum(1, keepdims=True), 1.0)                      # CBOW mean
    score = jnp.einsum('bd,bkd->bk', h, p['node'][path_nodes])
    ll = jax.nn.log_sigmoid(path_codes * score) * path_mask
    return -jnp.mean(jnp.sum(ll, -1))

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  params = jax.tree.map(lambda w, g: w - lr * g, state['params'], grads)
  return {'params': params, 'step': state['step'] + 1}, {'loss': loss, 'lr': lr}


def hsoftmax_make():
  rs = np.random.RandomState(490)
  p = {'in': _f(rs.uniform(-0.5, 0.5, (16, 8)) / 8), 'node': jnp.zeros((15, 8))}
  depth = rs.randint(2, 5, 16)
  return ({'params': p, 'step': jnp.zeros((), jnp.float32)}, _randint(491, 16, 16, 4),
          _len_mask(492, 16, 4, 1), _randint(493, 15, 16, 4),
          _f(rs.choice([-1.0, 1.0], (16, 4))), _f(np.arange(4)[None] < depth[:, None]))


# why: each target word's Huffman path (node ids, +-1 codes, variable depth mask) is given
# per example; the binary log-sigmoids along one path and the CBOW context mean are per
# example; plain SGD on a batch mean.
add('hierarchical_softmax_huffman_paths_cbow_manual_sgd', hsoftmax_step, hsoftmax_make,
    expect_split=True)


# ========================================================================================
# 5. training machinery: remat loops, nn.scan with sow, nnx pure state, optax.contrib
#    optimisers, masked chains, per-layer clipping, fp16 loss scaling
# ========================================================================================

def _res_conv_block(p, h):
  y = jax.nn.gelu(_conv(h, p['c1']) + p['b1'])
  y = _conv(y, p['c2']) + p['b2']
  return _ln(h + y)


def remat_loop_step(state, images, labels):
  def loss_fn(p):
    h = jax.nn.relu(_conv(images, p['stem']))
    for blk in p['blocks']:                                          # Python loop of blocks
      h = jax.checkpoint(_res_conv_block, prevent_cse=False)(blk, h)
    logits = h.mean((1, 2)) @ p['head']
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


def remat_loop_make():
  rs = np.random.RandomState(500)
  cw = lambda i, o: _f(rs.randn(3, 3, i, o) / np.sqrt(9 * i))
  p = {'stem': cw(3, 8), 'head': _w(rs, 8, 5),
       'blocks': [{'c1': cw(8, 8), 'b1': jnp.zeros(8), 'c2': cw(8, 8), 'b2': jnp.zeros(8)}
                  for _ in range(3)]}
  st = train_state.TrainState.create(apply_fn=None, params=p,
                                     tx=optax.sgd(0.05, momentum=0.9, nesterov=True))
  return st, _randn(501, 8, 8, 8, 3), _randint(502, 5, 8)


# why: jax.checkpoint only changes what is stored for the backward pass; each residual
# conv block and the per-pixel LayerNorm act on one image; CE averaged over images.
add('jax_checkpoint_python_loop_residual_conv_blocks', remat_loop_step, remat_loop_make,
    expect_split=True)


class _ScanLayer(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    y = nn.Dense(16)(nn.gelu(nn.Dense(32)(nn.LayerNorm()(x))))
    x = x + y
    self.sow('intermediates', 'act_sq', jnp.mean(x ** 2, -1))         # (B,) per layer
    return x, None


class _ScannedMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(16)(x)
    stack = nn.scan(_ScanLayer, variable_axes={'params': 0, 'intermediates': 0},
                    split_rngs={'params': True}, length=3)
    h, _ = stack(name='layers')(h, None)
    return nn.Dense(1)(nn.LayerNorm()(h))[:, 0]


def scan_sow_step(state, x, y):
  def loss_fn(params):
    pred, inter = state.apply_fn({'params': params}, x, mutable=['intermediates'])
    act_sq = inter['intermediates']['layers']['act_sq'][0]            # (L, B)
    mse = jnp.mean((pred - y) ** 2)
    return mse + 1e-3 * jnp.mean(act_sq), (mse, act_sq.mean(1))

  (loss, (mse, per_layer)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss, 'mse': mse,
                                              'act_sq_per_layer': per_layer}


def scan_sow_make():
  model = _ScannedMLP()
  x = _randn(510, 16, 5)
  params = model.init(jax.random.PRNGKey(510), x)['params']
  st = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                     tx=optax.adam(1e-3))
  return st, x, jnp.tanh(x[:, 0] - x[:, 1])


# why: nn.scan over layers carries each example's hidden state through the stack; the sown
# per-layer activation energies are per example and enter the loss as a batch mean.
add('linen_nn_scan_layers_sow_activation_penalty', scan_sow_step, scan_sow_make,
    expect_split=True)


class _BoWClassifier(nnx.Module):
  def __init__(self, rngs, vocab=24, d=16, classes=4):
    self.embed = nnx.Embed(vocab, d, rngs=rngs)
    self.norm = nnx.LayerNorm(d, rngs=rngs)
    self.fc = nnx.Linear(d, d, rngs=rngs)
    self.out = nnx.Linear(d, classes, rngs=rngs)
    self.log_temp = nnx.Param(jnp.zeros(()))

  def __call__(self, ids, mask):
    h = jnp.sum(self.embed(ids) * mask[..., None], 1) / jnp.maximum(mask.sum(1, keepdims=True),
                                                                    1.0)
    h = nnx.relu(self.fc(self.norm(h)))
    return self.out(h) / jnp.exp(self.log_temp[...])


_bow_tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3, weight_decay=0.01))
_bow_graphdef, _ = nnx.split((_BoWClassifier(nnx.Rngs(0)),
                              nnx.Optimizer(_BoWClassifier(nnx.Rngs(0)), _bow_tx,
                                            wrt=nnx.Param)))


def nnx_pure_step(state, batch):
  model, optimizer = nnx.merge(_bow_graphdef, state['nnx'])

  def loss_fn(model):
    logits = model(batch['ids'], batch['mask'])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch['label']).mean()

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  _, new = nnx.split((model, optimizer))
  return {'nnx': new, 'seen': state['seen'] + batch['ids'].shape[0]}, {'loss': loss}


def nnx_pure_make():
  model = _BoWClassifier(nnx.Rngs(520))
  _, st = nnx.split((model, nnx.Optimizer(model, _bow_tx, wrt=nnx.Param)))
  batch = {'ids': _randint(521, 24, 16, 8), 'mask': _len_mask(522, 16, 8, 2),
           'label': _randint(523, 4, 16)}
  return {'nnx': st, 'seen': jnp.zeros((), jnp.int32)}, batch


# why: a bag-of-words mean per document (masked), LayerNorm per example; CE averaged; the
# `seen` counter adds the batch size read from the shape, which is the full batch's size.
add('nnx_split_merge_optimizer_pure_state_dict', nnx_pure_step, nnx_pure_make,
    expect_split=True)


_tx_muon = optax.contrib.muon(0.02, adam_learning_rate=3e-3, weight_decay=0.01)


def muon_step(state, x, y):
  params, opt_state = state['params'], state['opt']

  def loss_fn(p):
    h = jax.nn.relu(x @ p['w1'] + p['b1'])
    h = jax.nn.relu(h @ p['w2'] + p['b2'])
    return optax.softmax_cross_entropy_with_integer_labels(h @ p['w3'], y).mean()

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params, opt_state = _apply_tx(_tx_muon, params, opt_state, grads)
  return {'params': params, 'opt': opt_state}, {'loss': loss}


def muon_make():
  rs = np.random.RandomState(530)
  p = {'w1': _w(rs, 8, 32), 'b1': jnp.zeros(32), 'w2': _w(rs, 32, 32), 'b2': jnp.zeros(32),
       'w3': _w(rs, 32, 4)}
  return {'params': p, 'opt': _tx_muon.init(p)}, _randn(531, 16, 8), _randint(532, 4, 16)


# why: Muon orthogonalises the momentum of the (summed) gradient of each weight matrix --
# a function of the full-batch gradient only; the loss is a mean CE.
add('optax_contrib_muon_newton_schulz_matrices', muon_step, muon_make, expect_split=True)


_tx_sophia = optax.contrib.sophia(1e-3, update_interval=2, weight_decay=1e-4)


def sophia_step(state, x, y):
  def loss_fn(p):
    return jnp.mean((_mlp(p, x, jnp.tanh)[:, 0] - y) ** 2)

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  updates, opt = _tx_sophia.update(grads, state['opt'], state['params'], obj_fn=loss_fn)
  params = optax.apply_updates(state['params'], updates)
  return {'params': params, 'opt': opt}, {'loss': loss}


def sophia_make():
  p = _mlp_params(540, [6, 16, 1])
  x = _randn(541, 16, 6)
  return {'params': p, 'opt': _tx_sophia.init(p)}, x, jnp.sin(x[:, 0]) + x[:, 1] ** 2


# why: besides the gradient, Sophia's Hutchinson estimator takes a Hessian-vector product
# of the batch loss (obj_fn closes over x, y) with Rademacher signs drawn from a key in
# the optimiser state -- the same signs for every example, and the Hessian of a batch
# mean is the mean of per-example Hessians, so H v is a sum over examples too.
add('optax_contrib_sophia_hutchinson_obj_fn_closure', sophia_step, sophia_make,
    expect_split=True)


_tx_sf = optax.contrib.schedule_free_adamw(2e-3, warmup_steps=5, weight_decay=1e-4)


def schedule_free_step(state, batch):
  def loss_fn(p):
    logits = _mlp(p, batch['x'], jax.nn.gelu)
    return optax.sigmoid_binary_cross_entropy(logits, batch['y']).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  new_state = state.apply_gradients(grads=grads)
  eval_params = optax.contrib.schedule_free_eval_params(new_state.opt_state, new_state.params)
  return new_state, {'loss': loss, 'eval_loss': loss_fn(eval_params)}


def schedule_free_make():
  st = train_state.TrainState.create(apply_fn=None, params=_mlp_params(550, [7, 16, 3]),
                                     tx=_tx_sf)
  rs = np.random.RandomState(551)
  return st, {'x': _randn(552, 16, 7), 'y': _f(rs.rand(16, 3) < 0.4)}


# why: schedule-free AdamW keeps interpolated parameter sequences in its state and is fed
# the full-batch gradient; the reported eval-point loss is a batch mean; multi-label BCE.
add('optax_contrib_schedule_free_adamw_eval_params', schedule_free_step,
    schedule_free_make, expect_split=True)


def _decay_mask(params):
  return jax.tree_util.tree_map_with_path(
      lambda path, x: x.ndim > 1 and 'embed' not in jax.tree_util.keystr(path), params)


def _frozen_mask(params):
  return jax.tree_util.tree_map_with_path(
      lambda path, x: 'embed' in jax.tree_util.keystr(path), params)


_tx_masked = optax.chain(
    optax.clip_by_global_norm(1.0),
    optax.scale_by_adam(b2=0.98),
    optax.masked(optax.add_decayed_weights(0.1), _decay_mask),
    optax.scale_by_learning_rate(optax.warmup_constant_schedule(0.0, 1e-3, 4)),
    optax.masked(optax.set_to_zero(), _frozen_mask))


def masked_chain_step(state, token_ids, labels):
  def loss_fn(p):
    h = p['embed'][token_ids].mean(1)
    h = _ln(h) * p['ln_scale'] + p['ln_bias']
    h = jax.nn.gelu(h @ p['dense']['kernel'] + p['dense']['bias'])
    return optax.softmax_cross_entropy_with_integer_labels(h @ p['out']['kernel'],
                                                           labels).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  params, opt = _apply_tx(_tx_masked, state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'loss': loss}


def masked_chain_make():
  rs = np.random.RandomState(560)
  p = {'embed': _f(rs.randn(20, 8) * 0.3), 'ln_scale': jnp.ones(8), 'ln_bias': jnp.zeros(8),
       'dense': {'kernel': _w(rs, 8, 16), 'bias': jnp.zeros(16)},
       'out': {'kernel': _w(rs, 16, 3)}}
  return {'params': p, 'opt': _tx_masked.init(p)}, _randint(561, 20, 16, 6), _randint(562, 3,
                                                                                      16)


# why: the decay and freeze masks are functions of parameter paths and shapes only; the
# chain is fed the full-batch gradient of a mean CE over examples.
add('optax_chain_masked_decay_and_frozen_embedding', masked_chain_step, masked_chain_make,
    expect_split=True)


def per_layer_clip_step(state, x, y):
  def loss_fn(p):
    return jnp.mean(optax.huber_loss(_mlp(p, x, jax.nn.silu), y))

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  norms = [optax.global_norm(g) for g in grads]
  grads = [jax.tree.map(lambda t, n=n: t * jnp.minimum(1.0, 0.5 / (n + 1e-6)), g)
           for g, n in zip(grads, norms)]                             # clip each layer
  tx = optax.sgd(0.05, momentum=0.9)
  params, opt = _apply_tx(tx, state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'loss': loss, 'layer_grad_norms': jnp.stack(norms)}


def per_layer_clip_make():
  p = _mlp_params(570, [5, 16, 16, 2])
  return ({'params': p, 'opt': optax.sgd(0.05, momentum=0.9).init(p)}, _randn(571, 16, 5),
          _randn(572, 16, 2))


# why: per-layer clipping rescales each layer's full-batch gradient by a function of its
# norm -- applied after the batch gradient (a sum) is formed; Huber loss mean.
add('per_layer_gradient_norm_clipping_after_grad', per_layer_clip_step, per_layer_clip_make,
    expect_split=True)


def fp16_scale_step(state, x, y):
  scale = state['loss_scale']

  def loss_fn(p):
    p16 = jax.tree.map(lambda t: t.astype(jnp.float16), p)
    h = x.astype(jnp.float16)
    for layer in p16[:-1]:
      h = jax.nn.relu(h @ layer['w'] + layer['b'])
    logits = (h @ p16[-1]['w'] + p16[-1]['b']).astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss * scale, loss

  (_, loss), sgrads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  grads = jax.tree.map(lambda g: g.astype(jnp.float32) / scale, sgrads)
  finite = jnp.all(jnp.asarray([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
  tx = optax.adam(1e-3)
  new_params, new_opt = _apply_tx(tx, state['params'], state['opt'], grads)
  params = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_params, state['params'])
  opt = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_opt, state['opt'])
  good = jnp.where(finite, state['good_steps'] + 1, 0)
  grow = good >= 3
  new_scale = jnp.where(finite, jnp.where(grow, scale * 2.0, scale), scale * 0.5)
  return {'params': params, 'opt': opt, 'loss_scale': new_scale,
          'good_steps': jnp.where(grow, 0, good)}, {'loss': loss, 'finite': finite,
                                                     'loss_scale': new_scale}


def fp16_scale_make():
  p = _mlp_params(580, [8, 16, 4])
  return ({'params': p, 'opt': optax.adam(1e-3).init(p), 'loss_scale': jnp.asarray(256.0),
           'good_steps': jnp.zeros((), jnp.int32)}, _randn(581, 16, 8), _randint(582, 4, 16))


# why: the forward pass is float16 with a dynamic loss scale from the state; the scaled
# loss is a mean CE, so the unscaled gradient is still a batch sum; the finiteness check
# and scale update read only the full-batch gradient.
add('fp16_dynamic_loss_scale_skip_nonfinite', fp16_scale_step, fp16_scale_make,
    expect_split=True)


# ========================================================================================
# 6. how the batch arrives: non-batch tables in the batch dict, arrays of different leading
#    sizes, meta-learning and GAN steps with two gradients, batch-level preprocessing
# ========================================================================================

def table_in_batch_step(state, batch):
  table = batch['pretrained_vectors']                                  # (V, E), not per example
  cw = batch['class_weights']                                          # (C,)

  def loss_fn(p):
    e = jnp.sum(table[batch['ids']] * batch['mask'][..., None], 1) / jnp.maximum(
        batch['mask'].sum(1, keepdims=True), 1.0)
    logits = _mlp(p, e, jax.nn.gelu)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch['label'])
    w = cw[batch['label']]
    return jnp.sum(w * ce) / jnp.sum(w)

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'weighted_ce': loss}


def table_in_batch_make():
  st = train_state.TrainState.create(apply_fn=None, params=_mlp_params(600, [8, 16, 5]),
                                     tx=optax.adam(1e-3))
  batch = {'ids': _randint(601, 12, 16, 6), 'mask': _len_mask(602, 16, 6, 2),
           'label': _randint(603, 5, 16), 'pretrained_vectors': _randn(604, 12, 8),
           'class_weights': _f([1.0, 2.0, 0.5, 1.0, 3.0])}
  return st, batch


# why: the batch dict also carries a frozen (12, 8) word-vector table and a (5,) class
# weight vector that are shared by all examples (not per example); class-weighted CE is
# sum(w*ce)/sum(w) over examples.
add('batch_dict_with_shared_pretrained_table_and_class_weights', table_in_batch_step,
    table_in_batch_make, expect_split=True)


def prototypes_step(state, x, labels, class_prototypes):
  def loss_fn(p):
    z = _unit(_mlp(p['enc'], x, jax.nn.gelu))                         # (B, E)
    protos = _unit(class_prototypes @ p['proj'])                       # (C, E), C == B here
    logits = z @ protos.T * jnp.exp(p['log_scale'])
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  params, opt = _apply_tx(optax.adam(1e-3), state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'loss': loss}


def prototypes_make():
  p = {'enc': _mlp_params(610, [6, 16, 8]), 'proj': _randn(611, 10, 8, scale=0.3),
       'log_scale': jnp.asarray(np.log(10.0), jnp.float32)}
  return ({'params': p, 'opt': optax.adam(1e-3).init(p)}, _randn(612, 16, 6),
          _randint(613, 16, 16), _randn(614, 16, 10))


# why: the 16 class prototypes (e.g. frozen text embeddings of 16 class names) are passed
# as an argument whose leading size happens to equal the batch size 16, but they are
# shared by every example, not examples; each row's softmax is over all 16 classes;
# mean CE over examples.
add('class_prototypes_arg_same_leading_size_as_batch', prototypes_step, prototypes_make,
    expect_split=True)


def mean_teacher_step(state, x_lab, y_lab, x_unlab, noise_s, noise_t):
  def loss_fn(p):
    sup = optax.softmax_cross_entropy_with_integer_labels(_mlp(p, x_lab), y_lab).mean()
    ps = jax.nn.softmax(_mlp(p, x_unlab + noise_s), -1)
    pt = jax.nn.softmax(_mlp(state['teacher'], x_unlab + noise_t), -1)
    cons = jnp.mean(jnp.sum((ps - pt) ** 2, -1))
    ramp = jnp.exp(-5.0 * (1.0 - jnp.minimum(state['step'] / 50.0, 1.0)) ** 2)
    return sup + 10.0 * ramp * cons, (sup, cons)

  (loss, (sup, cons)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  params, opt = _apply_tx(optax.adam(1e-3), state['params'], state['opt'], grads)
  teacher = optax.incremental_update(params, state['teacher'], 0.01)
  return dict(state, params=params, opt=opt, teacher=teacher, step=state['step'] + 1), {
      'loss': loss, 'sup': sup, 'consistency': cons}


def mean_teacher_make():
  p = _mlp_params(620, [6, 16, 4])
  return ({'params': p, 'opt': optax.adam(1e-3).init(p), 'teacher': jax.tree.map(jnp.copy, p),
           'step': jnp.zeros((), jnp.float32)}, _randn(621, 8, 6), _randint(622, 4, 8),
          _randn(623, 16, 6), _randn(624, 16, 6, scale=0.1), _randn(625, 16, 6, scale=0.1))


# why: 8 labelled and 16 unlabelled examples arrive as arrays of different leading sizes;
# the supervised CE is a mean over the 8, the consistency term (per-example noise given)
# a mean over the 16; each is a sum over its own examples.
add('mean_teacher_8_labelled_16_unlabelled_noise_given', mean_teacher_step,
    mean_teacher_make, expect_split=True)


def deep_coral_step(state, xs, ys, xt):
  def loss_fn(p):
    fs, ft = _mlp(p['feat'], xs, jax.nn.relu), _mlp(p['feat'], xt, jax.nn.relu)
    ce = optax.softmax_cross_entropy_with_integer_labels(fs @ p['cls'], ys).mean()

    def cov(f):
      n = f.shape[0]
      fc = f - f.mean(0)
      return fc.T @ fc / (n - 1)

    d = fs.shape[1]
    coral = jnp.sum((cov(fs) - cov(ft)) ** 2) / (4.0 * d * d)
    return ce + 1.0 * coral, (ce, coral)

  (loss, (ce, coral)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss, 'ce': ce, 'coral': coral}


def deep_coral_make():
  p = {'feat': _mlp_params(630, [6, 16, 8]), 'cls': _randn(631, 8, 3, scale=0.3)}
  st = train_state.TrainState.create(apply_fn=None, params=p,
                                     tx=optax.sgd(1e-3, momentum=0.9))
  return st, _randn(632, 8, 6), _randint(633, 3, 8), _randn(634, 16, 6) * 1.5 + 0.3


# why: CORAL compares the source and target feature covariances, each a function of the
# sum and the sum of outer products over that domain's examples; 8 source and 16 target
# examples; CE a mean over the source.
add('deep_coral_covariance_alignment_8_source_16_target', deep_coral_step,
    deep_coral_make, expect_split=True)


def _sine_net(p, x):
  return _mlp(p, x, jax.nn.relu)


def maml_tasks_step(state, support_x, support_y, query_x, query_y):
  inner_lr = 0.1

  def task_loss(p, x, y):
    return jnp.mean((_sine_net(p, x) - y) ** 2)

  def adapted_query_loss(p, sx, sy, qx, qy):
    g = jax.grad(task_loss)(p, sx, sy)
    fast = jax.tree.map(lambda w, gw: w - inner_lr * gw, p, g)
    return task_loss(fast, qx, qy)

  def meta_loss(p):
    return jnp.mean(jax.vmap(adapted_query_loss, (None, 0, 0, 0, 0))(
        p, support_x, support_y, query_x, query_y))

  loss, grads = jax.value_and_grad(meta_loss)(state.params)
  return state.apply_gradients(grads=grads), {'meta_loss': loss}


def maml_tasks_make():
  rs = np.random.RandomState(640)
  n_tasks, k = 8, 5
  amp, phase = rs.uniform(0.1, 5, (n_tasks, 1, 1)), rs.uniform(0, np.pi, (n_tasks, 1, 1))
  sx, qx = rs.uniform(-5, 5, (n_tasks, k, 1)), rs.uniform(-5, 5, (n_tasks, k, 1))
  st = train_state.TrainState.create(apply_fn=None, params=_mlp_params(641, [1, 32, 32, 1]),
                                     tx=optax.adam(1e-3))
  return (st, _f(sx), _f(amp * np.sin(sx + phase)), _f(qx), _f(amp * np.sin(qx + phase)))


# why: the leading axis is tasks: each task's inner SGD step uses only its own support
# set and its query loss only its adapted weights (second-order through the inner step);
# the meta-loss is a mean over tasks.
add('maml_second_order_vmapped_over_task_axis', maml_tasks_step, maml_tasks_make,
    expect_split=True)


def maml_single_task_step(state, support_x, support_y, query_x, query_y):
  def loss(p, x, y):
    return jnp.mean((_sine_net(p, x) - y) ** 2)

  def outer(p):
    g = jax.grad(loss)(p, support_x, support_y)
    fast = jax.tree.map(lambda w, gw: w - 0.05 * gw, p, g)
    return loss(fast, query_x, query_y)

  meta, grads = jax.value_and_grad(outer)(state['params'])
  params, opt = _apply_tx(optax.adam(1e-3), state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'query_loss_after_adapt': meta}


def maml_single_task_make():
  rs = np.random.RandomState(650)
  sx, qx = rs.uniform(-3, 3, (10, 1)), rs.uniform(-3, 3, (8, 1))
  p = _mlp_params(651, [1, 16, 16, 1])
  return ({'params': p, 'opt': optax.adam(1e-3).init(p)}, _f(sx), _f(2 * np.sin(sx)),
          _f(qx), _f(2 * np.sin(qx)))


# why: one task per step: the adapted weights come from the mean gradient over all 10
# support examples, and every query example's loss is taken at those weights, so all
# support and query examples interact through the inner step. It is a function of a sum
# in parameter space (computable with extra passes and Hessian-vector products), but not
# a plain per-microbatch sum; the support (10) and query (8) sizes differ -- unsure.
add('maml_single_task_inner_step_on_whole_support_set', maml_single_task_step,
    maml_single_task_make, expect_split=None)


def _gen(p, z):
  return jnp.tanh(_mlp(p, z, jax.nn.leaky_relu))


def _disc(p, x):
  return _mlp(p, x, jax.nn.leaky_relu)[:, 0]


_tx_gan = optax.adam(2e-4, b1=0.0, b2=0.99)


def gan_r1_step(state, real, z):
  gamma = 10.0

  def d_loss(dp):
    fake = jax.lax.stop_gradient(_gen(state['g'], z))
    hinge = jnp.mean(jax.nn.relu(1.0 - _disc(dp, real))) + jnp.mean(jax.nn.relu(1.0 + _disc(
        dp, fake)))
    grad_real = jax.grad(lambda x: jnp.sum(_disc(dp, x)))(real)        # per-row gradients
    r1 = jnp.mean(jnp.sum(grad_real ** 2, -1))
    return hinge + 0.5 * gamma * r1, (hinge, r1)

  (dl, (hinge, r1)), dg = jax.value_and_grad(d_loss, has_aux=True)(state['d'])
  d, d_opt = _apply_tx(_tx_gan, state['d'], state['d_opt'], dg)

  def g_loss(gp):
    return -jnp.mean(_disc(d, _gen(gp, z)))

  gl, gg = jax.value_and_grad(g_loss)(state['g'])
  g, g_opt = _apply_tx(_tx_gan, state['g'], state['g_opt'], gg)
  return {'g': g, 'd': d, 'g_opt': g_opt, 'd_opt': d_opt}, {
      'd_loss': dl, 'g_loss': gl, 'hinge': hinge, 'r1': r1}


def gan_r1_make():
  g = _mlp_params(660, [4, 16, 8])
  d = _mlp_params(661, [8, 16, 1])
  return ({'g': g, 'd': d, 'g_opt': _tx_gan.init(g), 'd_opt': _tx_gan.init(d)},
          _randn(662, 16, 8) * 0.5, _randn(663, 16, 4))


# why: two gradient steps in one train step (D, then G against the updated D); the R1
# penalty is the squared input-gradient norm of D at each real example (the gradient of
# a sum of per-row outputs is per row); every term is a mean over examples, and the G
# step's batch mean uses D's weights after a full-batch update.
add('gan_hinge_r1_penalty_d_then_g_latents_given', gan_r1_step, gan_r1_make,
    expect_split=True)


def _mbstd_disc(p, x, group=4):
  h = jax.nn.leaky_relu(x @ p['w1'] + p['b1'])
  b, f = h.shape
  g = h.reshape(group, b // group, f)                                  # StyleGAN grouping
  std = jnp.sqrt(jnp.var(g, axis=0) + 1e-8).mean(-1)                   # (B/G,)
  std = jnp.tile(std, group)[:, None]                                  # back to (B, 1)
  h = jnp.concatenate([h, std], -1)
  return (jax.nn.leaky_relu(h @ p['w2'] + p['b2']) @ p['w3'])[:, 0]


def stylegan_mbstd_step(state, real, z):
  fake = _gen(state['g'], z)

  def d_loss(dp):
    return jnp.mean(jax.nn.softplus(_mbstd_disc(dp, fake))) + jnp.mean(
        jax.nn.softplus(-_mbstd_disc(dp, real)))

  loss, grads = jax.value_and_grad(d_loss)(state['d'])
  d, opt = _apply_tx(_tx_gan, state['d'], state['d_opt'], grads)
  return dict(state, d=d, d_opt=opt), {'d_loss': loss}


def stylegan_mbstd_make():
  rs = np.random.RandomState(670)
  d = {'w1': _w(rs, 8, 16), 'b1': jnp.zeros(16), 'w2': _w(rs, 17, 16), 'b2': jnp.zeros(16),
       'w3': _w(rs, 16, 1)}
  return ({'g': _mlp_params(671, [4, 16, 8]), 'd': d, 'd_opt': _tx_gan.init(d)},
          _randn(672, 16, 8) * 0.5, _randn(673, 16, 4))


# why: the minibatch-stddev feature couples examples in groups of 4 -- and the StyleGAN
# reshape(G, -1, F) groups rows i, i+4, i+8, i+12 (strided), so contiguous microbatches
# would change the groups; a split that kept groups intact would be exact -- unsure.
add('stylegan_minibatch_stddev_strided_groups_of_4', stylegan_mbstd_step,
    stylegan_mbstd_make, expect_split=None)


def rank_target_step(state, x, raw_target):
  b = raw_target.shape[0]
  ranks = jnp.argsort(jnp.argsort(raw_target)).astype(jnp.float32) / (b - 1)   # in [0, 1]

  def loss_fn(p):
    pred = jax.nn.sigmoid(_mlp(p, x)[:, 0])
    return jnp.mean((pred - ranks) ** 2)

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  params, opt = _apply_tx(optax.adam(1e-3), state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'loss': loss}


def rank_target_make():
  p = _mlp_params(680, [5, 16, 1])
  return ({'params': p, 'opt': optax.adam(1e-3).init(p)}, _randn(681, 16, 5),
          _f(np.random.RandomState(682).lognormal(0, 2, 16)))


# why: the targets are the ranks of the raw targets within the batch -- a cross-example
# sort, but of the given targets only (parameter-free preprocessing of the whole batch,
# done once); the regression loss is then a mean over examples.
add('rank_normalised_targets_argsort_of_given_labels', rank_target_step, rank_target_make,
    expect_split=True)


def soft_spearman_step(state, x, y):
  y_rank = jnp.argsort(jnp.argsort(y)).astype(jnp.float32)

  def loss_fn(p):
    s = _mlp(p, x)[:, 0]
    soft_rank = jnp.sum(jax.nn.sigmoid((s[:, None] - s[None, :]) / 0.1), 1) - 0.5
    a, b = soft_rank - soft_rank.mean(), y_rank - y_rank.mean()
    rho = jnp.sum(a * b) / jnp.sqrt(jnp.sum(a * a) * jnp.sum(b * b) + 1e-8)
    return 1.0 - rho, rho

  (loss, rho), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  params, opt = _apply_tx(optax.adam(1e-3), state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'loss': loss, 'soft_spearman': rho}


def soft_spearman_make():
  p = _mlp_params(690, [5, 16, 1])
  x = _randn(691, 16, 5)
  return {'params': p, 'opt': optax.adam(1e-3).init(p)}, x, x[:, 0] - 0.5 * x[:, 1]


# why: each prediction's soft rank is a sum of sigmoids of its differences with every
# other prediction in the batch (pairwise, parameter dependent), then correlated with
# the label ranks: examples interact pairwise through a nonlinearity.
add('soft_rank_spearman_pairwise_sigmoid_over_batch', soft_spearman_step,
    soft_spearman_make, expect_split=False)


def stoch_depth_step(state, images, labels):
  key = jax.random.fold_in(state.key, state.step)
  b = images.shape[0]
  n_blocks = len(state.params['blocks'])
  keys = jax.random.split(key, n_blocks)

  def loss_fn(p):
    h = jax.nn.relu(_conv(images, p['stem']))
    for i, (blk, k) in enumerate(zip(p['blocks'], keys)):
      survive = 1.0 - 0.3 * (i + 1) / n_blocks
      keep = jax.random.bernoulli(k, survive, (b, 1, 1, 1)).astype(h.dtype)
      h = h + keep / survive * (_res_conv_block(blk, h) - h)           # drop-path per example
    return optax.softmax_cross_entropy_with_integer_labels(h.mean((1, 2)) @ p['head'],
                                                           labels).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


def stoch_depth_make():
  rs = np.random.RandomState(700)
  cw = lambda i, o: _f(rs.randn(3, 3, i, o) / np.sqrt(9 * i))
  p = {'stem': cw(3, 8), 'head': _w(rs, 8, 5),
       'blocks': [{'c1': cw(8, 8), 'b1': jnp.zeros(8), 'c2': cw(8, 8), 'b2': jnp.zeros(8)}
                  for _ in range(3)]}
  st = _KeyTrainState.create(apply_fn=None, params=p, tx=optax.adamw(1e-3),
                             key=jax.random.PRNGKey(701))
  return st, _randn(702, 8, 8, 8, 3), _randint(703, 5, 8)


# why: stochastic depth draws a keep/drop decision per example and block from a key in the
# state (a split draws others, same distribution); each image only uses its own draws;
# mean CE.
add('stochastic_depth_drop_path_per_example_key_in_state', stoch_depth_step,
    stoch_depth_make, stochastic=True, expect_split=True)


def prefix_lm_step(state, patches, tokens, prefix_len, pad_mask):
  n_img = patches.shape[1]
  t = tokens.shape[1] - 1
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  total = n_img + t
  pos = jnp.arange(total)
  is_prefix = pos[None, :] < (n_img + prefix_len)[:, None]             # (B, L)
  causal = pos[:, None] >= pos[None, :]
  attn = causal[None] | (is_prefix[:, None, :] & is_prefix[:, :, None])
  valid = jnp.concatenate([jnp.ones((patches.shape[0], n_img)), pad_mask[:, :-1]], 1) > 0
  attn = (attn & valid[:, None, :])[:, None]
  loss_mask = (jnp.arange(t)[None] >= (prefix_len - 1)[:, None]) * pad_mask[:, 1:]

  def loss_fn(p):
    x = jnp.concatenate([patches @ p['img_proj'], p['emb'][inputs]], 1)
    x = _block_with_bias(p, x, 0.0, attn)
    logits = _rms(x[:, n_img:], p['gf']) @ p['out']
    return _masked_token_ce(logits, targets, loss_mask)

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  params, opt = _apply_tx(_tx_lm, state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'suffix_ce': loss}


def prefix_lm_make():
  p = dict(_mha_init(710), img_proj=_randn(711, 12, _D, scale=0.3))
  rs = np.random.RandomState(712)
  return ({'params': p, 'opt': _tx_lm.init(p)}, _randn(713, 8, 4, 12),
          _randint(714, _V, 8, 9), jnp.asarray(rs.randint(1, 4, 8), jnp.int32),
          _len_mask(715, 8, 9, 6))


# why: PaliGemma-style prefix LM: image patches plus each example's prompt attend fully
# among themselves and the suffix causally, all within one example; the CE over suffix
# tokens is a masked ratio of two sums.
add('paligemma_prefix_lm_image_tokens_full_prefix_attention', prefix_lm_step,
    prefix_lm_make, expect_split=True)


def maxlen_norm_step(state, tokens, lengths):
  b, t = tokens.shape
  mask = (jnp.arange(t - 1)[None] < (lengths - 1)[:, None]).astype(jnp.float32)
  max_len = jnp.max(lengths - 1)                                       # longest in the batch

  def loss_fn(p):
    x = p['emb'][tokens[:, :-1]]
    x = _block_with_bias(p, x, 0.0, jnp.tril(jnp.ones((t - 1, t - 1), bool))[None, None])
    ce = optax.softmax_cross_entropy_with_integer_labels(_rms(x, p['gf']) @ p['out'],
                                                         tokens[:, 1:])
    return jnp.sum(ce * mask) / (b * max_len)

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  params, opt = _apply_tx(_tx_lm, state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'loss': loss}


def maxlen_norm_make():
  p = _mha_init(720)
  return ({'params': p, 'opt': _tx_lm.init(p)}, _randint(721, _V, 8, _T + 1),
          jnp.asarray(np.random.RandomState(722).randint(4, _T + 2, 8), jnp.int32))


# why: fairseq-style normalisation by batch_size * longest length in the batch: the max is
# taken over the given lengths only (parameter-free, whole batch), so the loss is a sum
# of masked token CE divided by a data-only constant.
add('token_ce_normalised_by_batch_max_length_from_lengths', maxlen_norm_step,
    maxlen_norm_make, expect_split=True)


def asl_step(state, x, y):
  gamma_pos, gamma_neg, clip = 0.0, 4.0, 0.05

  def loss_fn(p):
    prob = jax.nn.sigmoid(_mlp(p, x, jax.nn.gelu))
    p_neg = jnp.maximum(prob - clip, 0.0)                              # probability shifting
    lp = y * jnp.log(jnp.maximum(prob, 1e-8)) * (1 - prob) ** gamma_pos
    ln = (1 - y) * jnp.log(jnp.maximum(1 - p_neg, 1e-8)) * p_neg ** gamma_neg
    return -jnp.sum(lp + ln) / x.shape[0]

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'asl': loss}


def asl_make():
  st = train_state.TrainState.create(apply_fn=None, params=_mlp_params(730, [10, 32, 8]),
                                     tx=optax.adam(1e-3))
  return st, _randn(731, 16, 10), _f(np.random.RandomState(732).rand(16, 8) < 0.2)


# why: asymmetric multi-label loss with probability shifting is elementwise per
# (example, label); summed and divided by the batch size read from x.shape.
add('asymmetric_multilabel_loss_prob_shift_sum_over_b', asl_step, asl_make,
    expect_split=True)


def mdn_step(state, x, y):
  k = 3

  def loss_fn(p):
    out = _mlp(p, x, jnp.tanh)
    logit_pi, mu, log_sigma = out[:, :k], out[:, k:3 * k].reshape(-1, k, 2), out[:, 3 * k:]
    log_sigma = jnp.clip(log_sigma, -5.0, 3.0)
    d2 = jnp.sum((y[:, None, :] - mu) ** 2, -1)
    log_comp = -0.5 * d2 * jnp.exp(-2 * log_sigma) - 2 * log_sigma - jnp.log(2 * jnp.pi)
    ll = jax.nn.logsumexp(jax.nn.log_softmax(logit_pi, -1) + log_comp, -1)
    return -jnp.mean(ll)

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  params, opt = _apply_tx(optax.adam(1e-3), state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'nll': loss}


def mdn_make():
  p = _mlp_params(740, [2, 32, 12])
  x = _randn(741, 16, 2)
  return {'params': p, 'opt': optax.adam(1e-3).init(p)}, x, jnp.stack(
      [jnp.sin(2 * x[:, 0]), x[:, 1] ** 2], -1)


# why: a mixture density network's logsumexp runs over each example's own mixture
# components; NLL averaged over examples.
add('mixture_density_network_isotropic_2d_nll', mdn_step, mdn_make, expect_split=True)


def prm_step(state, batch):
  tokens, step_end, step_label = batch['tokens'], batch['step_end'], batch['step_label']
  t = tokens.shape[1]

  def loss_fn(p):
    x = p['emb'][tokens]
    x = _block_with_bias(p, x, 0.0, jnp.tril(jnp.ones((t, t), bool))[None, None])
    logit = (_rms(x, p['gf']) @ p['score'])[..., 0]
    bce = optax.sigmoid_binary_cross_entropy(logit, step_label)
    n_steps = step_end.sum(1)
    per_seq = jnp.sum(bce * step_end, 1) / jnp.maximum(n_steps, 1.0)
    has = (n_steps > 0).astype(jnp.float32)
    return jnp.sum(per_seq * has) / jnp.maximum(has.sum(), 1.0)

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'step_bce': loss}


def prm_make():
  p = dict(_mha_init(750), score=_randn(751, _D, 1, scale=0.3))
  st = train_state.TrainState.create(apply_fn=None, params=p, tx=optax.adamw(1e-4))
  rs = np.random.RandomState(752)
  ends = (rs.rand(8, 12) < 0.25).astype(np.float32)
  ends[0] = 0.0                                                        # one with no steps
  return st, {'tokens': _randint(753, _V, 8, 12), 'step_end': _f(ends),
              'step_label': _f(rs.rand(8, 12) < 0.7)}


# why: a process reward model scores each reasoning step at its step-end token within one
# sequence; BCE averaged per sequence, then over sequences that have steps (a ratio of
# two sums over sequences).
add('process_reward_model_step_end_tokens_per_sequence_mean', prm_step, prm_make,
    expect_split=True)


def lifted_step(state, x, labels):
  alpha = 1.0

  def loss_fn(p):
    z = _mlp(p, x, jax.nn.gelu)
    d = jnp.sqrt(jnp.sum((z[:, None] - z[None]) ** 2, -1) + 1e-8)
    same = labels[:, None] == labels[None, :]
    pos = same & ~jnp.eye(x.shape[0], dtype=bool)
    neg_term = jnp.where(~same, jnp.exp(alpha - d), 0.0).sum(1)        # (B,)
    j = jnp.log(neg_term[:, None] + neg_term[None, :] + 1e-8) + d
    per_pair = jnp.where(pos, jax.nn.relu(j) ** 2, 0.0)
    return jnp.sum(per_pair) / (2.0 * jnp.maximum(pos.sum(), 1.0))

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  params, opt = _apply_tx(optax.adam(1e-3), state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'lifted': loss}


def lifted_make():
  p = _mlp_params(760, [6, 16, 8])
  return ({'params': p, 'opt': optax.adam(1e-3).init(p)}, _randn(761, 16, 6),
          jnp.asarray(np.repeat(np.arange(4), 4), jnp.int32))


# why: lifted structured loss: every positive pair's term contains a log-sum over all of
# both anchors' negatives in the batch and is then hinged and squared: no per-example
# decomposition.
add('lifted_structured_embedding_loss_all_pairs', lifted_step, lifted_make,
    expect_split=False)


def reid_batch_hard_step(state, x, pids):
  def loss_fn(p):
    z = _mlp(p, x, jax.nn.relu)
    d = jnp.sqrt(jnp.sum((z[:, None] - z[None]) ** 2, -1) + 1e-12)
    same = pids[:, None] == pids[None, :]
    hardest_pos = jnp.max(jnp.where(same, d, 0.0), 1)
    hardest_neg = jnp.min(jnp.where(same, jnp.inf, d), 1)
    return jnp.mean(jax.nn.softplus(hardest_pos - hardest_neg))

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'soft_margin_triplet': loss}


def reid_batch_hard_make():
  st = train_state.TrainState.create(apply_fn=None, params=_mlp_params(770, [8, 16, 8]),
                                     tx=optax.adam(3e-4))
  return st, _randn(771, 16, 8), jnp.asarray(np.repeat(np.arange(4), 4), jnp.int32)


# why: P x K re-identification batch (4 identities x 4 images): for each anchor the hardest
# positive and hardest negative are a max / min over the other examples' embeddings.
add('reid_pk_batch_hard_soft_margin_triplet', reid_batch_hard_step, reid_batch_hard_make,
    expect_split=False)


def sinkhorn_da_step(state, xs, ys, xt):
  def sinkhorn(cost, eps=0.1, iters=20):
    n, m = cost.shape
    log_k = -cost / eps
    log_a, log_b = -jnp.log(n) * jnp.ones(n), -jnp.log(m) * jnp.ones(m)

    def body(_, uv):
      u, v = uv
      u = log_a - jax.nn.logsumexp(log_k + v[None], 1)
      v = log_b - jax.nn.logsumexp(log_k + u[:, None], 0)
      return u, v

    u, v = jax.lax.fori_loop(0, iters, body, (jnp.zeros(n), jnp.zeros(m)))
    return jnp.exp(log_k + u[:, None] + v[None])

  def loss_fn(p):
    fs, ft = _mlp(p['feat'], xs), _mlp(p['feat'], xt)
    ce = optax.softmax_cross_entropy_with_integer_labels(fs @ p['cls'], ys).mean()
    cost = jnp.sum((fs[:, None] - ft[None]) ** 2, -1)
    plan = jax.lax.stop_gradient(sinkhorn(jax.lax.stop_gradient(cost / (cost.mean() + 1e-8))))
    ot = jnp.sum(plan * cost)
    return ce + 0.1 * ot, (ce, ot)

  (loss, (ce, ot)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  params, opt = _apply_tx(optax.adam(1e-3), state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'loss': loss, 'ce': ce, 'ot': ot}


def sinkhorn_da_make():
  p = {'feat': _mlp_params(780, [6, 16, 8]), 'cls': _randn(781, 8, 3, scale=0.3)}
  return ({'params': p, 'opt': optax.adam(1e-3).init(p)}, _randn(782, 8, 6),
          _randint(783, 3, 8), _randn(784, 8, 6) + 0.5)


# why: the entropic transport plan between the source and target minibatches is solved
# with Sinkhorn over the cross-example cost matrix; each source example's transport mass
# depends on all the others.
add('sinkhorn_ot_minibatch_domain_alignment', sinkhorn_da_step, sinkhorn_da_make,
    expect_split=False)


def vq_dead_code_step(state, x):
  codebook, usage = state['codebook'], state['usage']

  def loss_fn(p):
    ze = _mlp(p['enc'], x, jax.nn.relu)                                # (B, E)
    d = jnp.sum((ze[:, None] - codebook[None]) ** 2, -1)
    idx = jnp.argmin(d, -1)
    zq = codebook[idx]
    zst = ze + jax.lax.stop_gradient(zq - ze)
    recon = jnp.mean(jnp.sum((_mlp(p['dec'], zst, jax.nn.relu) - x) ** 2, -1))
    commit = jnp.mean(jnp.sum((ze - jax.lax.stop_gradient(zq)) ** 2, -1))
    return recon + 0.25 * commit, (ze, idx)

  (loss, (ze, idx)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  params, opt = _apply_tx(optax.adam(1e-3), state['params'], state['opt'], grads)
  counts = jnp.zeros(codebook.shape[0]).at[idx].add(1.0)
  usage = 0.99 * usage + 0.01 * counts
  sums = jnp.zeros_like(codebook).at[idx].add(jax.lax.stop_gradient(ze))
  ema = jnp.where(counts[:, None] > 0, 0.9 * codebook + 0.1 * sums /
                  jnp.maximum(counts[:, None], 1.0), codebook)
  dead = usage < 0.05
  donor = jax.lax.stop_gradient(ze)[jnp.arange(codebook.shape[0]) % x.shape[0]]
  codebook = jnp.where(dead[:, None], donor, ema)                      # restart dead codes
  usage = jnp.where(dead, 1.0, usage)
  return {'params': params, 'opt': opt, 'codebook': codebook, 'usage': usage}, {
      'loss': loss, 'dead_codes': dead.sum(), 'perplexity': jnp.exp(-jnp.sum(
          (counts / counts.sum()) * jnp.log(counts / counts.sum() + 1e-9)))}


def vq_dead_code_make():
  p = {'enc': _mlp_params(790, [8, 16, 4]), 'dec': _mlp_params(791, [4, 16, 8])}
  rs = np.random.RandomState(792)
  return ({'params': p, 'opt': optax.adam(1e-3).init(p), 'codebook': _f(rs.randn(12, 4)),
           'usage': _f(rs.uniform(0.0, 0.2, 12))}, _randn(793, 16, 8))


# why: the loss and gradient (reconstruction + commitment) are per-example means, and the
# EMA codebook update uses per-code sums; but dead codes are restarted from the encodings
# of particular batch rows (code j takes row j mod B), so the state update depends on
# which rows a split puts where -- unsure whether that counts.
add('vq_ema_codebook_dead_code_restart_from_batch_rows', vq_dead_code_step,
    vq_dead_code_make, expect_split=None)

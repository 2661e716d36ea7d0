"""A fifth outside corpus of JAX/Flax train steps for hbm_guard's exactness harness.

Every case is a step `step(state, *args) -> (new_state, metrics)` written the way people
write them, plus `make()` giving concrete arguments. `expect_split` is the author's own
mathematical judgement (see the `# why` comment on each case):
  True  -- loss and gradient over the batch are computable exactly from per-microbatch
           pieces (sums over examples, functions of such sums, batch statistics computed
           in an earlier pass over the microbatches, parameter-free batch preprocessing
           that can be done on the whole batch first);
  False -- examples interact in a way no microbatch split reproduces exactly;
  None  -- the author is unsure.

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
from jax.ad_checkpoint import checkpoint_name

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


def _mlp_params(seed, sizes):
  rs = np.random.RandomState(seed)
  return [_dense(rs, a, b) for a, b in zip(sizes[:-1], sizes[1:])]


def _mlp_apply(layers, x, act=jax.nn.gelu):
  for layer in layers[:-1]:
    x = act(x @ layer['w'] + layer['b'])
  return x @ layers[-1]['w'] + layers[-1]['b']


def _rms(h, scale=None, eps=1e-6):
  h = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + eps)
  return h if scale is None else h * scale


def _lnorm(h, eps=1e-5):
  mu = h.mean(-1, keepdims=True)
  return (h - mu) * jax.lax.rsqrt(((h - mu) ** 2).mean(-1, keepdims=True) + eps)


def _unit(z, eps=1e-8):
  return z / jnp.sqrt(jnp.sum(z * z, -1, keepdims=True) + eps)


def _opt_step(tx, params, opt_state, grads):
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


def _lengths_mask(seed, b, t, lo=2):
  lens = np.random.RandomState(seed).randint(lo, t + 1, size=b)
  return _f(np.arange(t)[None] < lens[:, None])


class _RngTrainState(train_state.TrainState):
  rng: Any = None


class _StatsTrainState(train_state.TrainState):
  batch_stats: Any = None


_VOC, _SEQ, _DM = 16, 10, 16   # vocab, sequence length, model width


def _tok_params(seed, d=_DM, vocab=_VOC, ff=32):
  """Params of a one-block pre-RMSNorm transformer (functional, dict of arrays)."""
  rs = np.random.RandomState(seed)
  n = lambda *s: _f(rs.randn(*s) / np.sqrt(s[0]))
  return {'emb': _f(rs.randn(vocab, d) * 0.5), 'g1': _f(np.ones(d)), 'g2': _f(np.ones(d)),
          'gf': _f(np.ones(d)), 'wq': n(d, d), 'wk': n(d, d), 'wv': n(d, d), 'wo': n(d, d),
          'w_gate': n(d, ff), 'w_up': n(d, ff), 'w_down': n(ff, d), 'out': n(d, vocab)}


def _rope(x, positions):
  """Rotary embedding on the last axis of x (B, T, D) with integer positions (B, T)."""
  d = x.shape[-1] // 2
  freq = 1.0 / (10000.0 ** (jnp.arange(d) / d))
  ang = positions[..., None].astype(jnp.float32) * freq
  x1, x2 = x[..., :d], x[..., d:]
  c, s = jnp.cos(ang), jnp.sin(ang)
  return jnp.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], -1)


def _encoder_block(p, h, mask, positions=None, causal=False):
  """Pre-RMSNorm attention + SwiGLU; h (B, T, D), mask (B, T, T) bool."""
  t = h.shape[1]
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(t), h.shape[:2])
  if causal:
    mask = mask & jnp.tril(jnp.ones((t, t), bool))[None]
  x = _rms(h, p['g1'])
  q, k = _rope(x @ p['wq'], positions), _rope(x @ p['wk'], positions)
  s = jnp.einsum('btd,bsd->bts', q, k) / np.sqrt(h.shape[-1])
  a = jax.nn.softmax(jnp.where(mask, s, -1e9), -1)
  h = h + jnp.einsum('bts,bsd->btd', a, x @ p['wv']) @ p['wo']
  x = _rms(h, p['g2'])
  return h + (jax.nn.silu(x @ p['w_gate']) * (x @ p['w_up'])) @ p['w_down']


# ========================================================================================
# 1. architectures people train: T5, ViT, MAE, diffusion, VAE, flow matching, BERT, seq2seq
# ========================================================================================

class _TinyT5(nn.Module):
  vocab: int = _VOC
  d: int = 16

  def _mlp(self, h):
    return h + nn.Dense(self.d, use_bias=False)(
        nn.relu(nn.Dense(2 * self.d, use_bias=False)(nn.RMSNorm()(h))))

  @nn.compact
  def __call__(self, src, dec_in, src_mask, tgt_mask):
    shared = nn.Embed(self.vocab, self.d, name='shared')
    h = shared(src)
    x = nn.RMSNorm()(h)
    h = h + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=self.d)(
        x, x, mask=nn.make_attention_mask(src_mask > 0, src_mask > 0))
    enc = nn.RMSNorm()(self._mlp(h))
    g = shared(dec_in)
    y = nn.RMSNorm()(g)
    self_mask = nn.combine_masks(nn.make_causal_mask(dec_in),
                                 nn.make_attention_mask(tgt_mask > 0, tgt_mask > 0))
    g = g + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=self.d)(
        y, y, mask=self_mask)
    y = nn.RMSNorm()(g)
    g = g + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=self.d)(
        y, enc, mask=nn.make_attention_mask(tgt_mask > 0, src_mask > 0))
    g = nn.RMSNorm()(self._mlp(g))
    return shared.attend(g) * self.d ** -0.5


def t5_step(state, batch):
  targets, tmask = batch['targets'], batch['target_mask']
  dec_in = jnp.pad(targets[:, :-1], ((0, 0), (1, 0)))          # shift right, start id 0

  def loss_fn(params):
    logits = state.apply_fn({'params': params}, batch['inputs'], dec_in,
                            batch['input_mask'], tmask)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(ce * tmask) / jnp.maximum(jnp.sum(tmask), 1.0), logits

  (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  correct = (jnp.argmax(logits, -1) == targets) * tmask
  return state.apply_gradients(grads=grads), {
      'loss': loss, 'token_acc': correct.sum() / tmask.sum(), 'ntokens': tmask.sum()}


def t5_make():
  model = _TinyT5()
  b, ts, tt = 8, 12, 8
  batch = {'inputs': _randint(100, _VOC, b, ts), 'targets': _randint(101, _VOC, b, tt),
           'input_mask': _lengths_mask(102, b, ts, 4), 'target_mask': _lengths_mask(103, b, tt)}
  dec_in = jnp.zeros((b, tt), jnp.int32)
  params = model.init(jax.random.PRNGKey(100), batch['inputs'], dec_in,
                      batch['input_mask'], batch['target_mask'])['params']
  st = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                     tx=optax.adafactor(1e-2, min_dim_size_to_factor=8))
  return st, batch


# why: encoder/decoder attention is masked within each example; the loss is a token sum
# over the whole batch divided by the batch's target-token count (a ratio of two sums).
add('t5_encoder_decoder_padding_masks', t5_step, t5_make, expect_split=True)


class _ViT(nnx.Module):
  def __init__(self, rngs, patch=4, d=16, classes=5, n_patches=4):
    self.patch = nnx.Conv(3, d, kernel_size=(patch, patch), strides=(patch, patch),
                          padding='VALID', rngs=rngs)
    self.cls = nnx.Param(jnp.zeros((1, 1, d)))
    self.pos = nnx.Param(jax.random.normal(rngs.params(), (1, n_patches + 1, d)) * 0.02)
    self.ln1 = nnx.LayerNorm(d, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=d, decode=False, rngs=rngs)
    self.ln2 = nnx.LayerNorm(d, rngs=rngs)
    self.fc1 = nnx.Linear(d, 2 * d, rngs=rngs)
    self.fc2 = nnx.Linear(2 * d, d, rngs=rngs)
    self.ln_f = nnx.LayerNorm(d, rngs=rngs)
    self.head = nnx.Linear(d, classes, rngs=rngs)

  def __call__(self, images):
    x = self.patch(images)
    b, hh, ww, d = x.shape
    x = x.reshape(b, hh * ww, d)
    x = jnp.concatenate([jnp.broadcast_to(self.cls[...], (b, 1, d)), x], 1) + self.pos[...]
    y = self.ln1(x)
    x = x + self.attn(y, y, y)
    x = x + self.fc2(nnx.gelu(self.fc1(self.ln2(x))))
    return self.head(self.ln_f(x[:, 0]))


_vit_graphdef, _ = nnx.split(_ViT(nnx.Rngs(0)))
_tx_vit = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-3, 2, 20),
                                  weight_decay=0.05))


def vit_step(state, images, labels):
  def loss_fn(params):
    logits = nnx.merge(_vit_graphdef, params)(images)
    smoothed = optax.smooth_labels(jax.nn.one_hot(labels, 5), 0.1)
    return optax.softmax_cross_entropy(logits, smoothed).mean(), logits

  (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  params, opt_state = _opt_step(_tx_vit, state['params'], state['opt_state'], grads)
  return {'params': params, 'opt_state': opt_state}, {
      'loss': loss, 'top1': jnp.mean(jnp.argmax(logits, -1) == labels)}


def vit_make():
  _, params = nnx.split(_ViT(nnx.Rngs(110)))
  return ({'params': params, 'opt_state': _tx_vit.init(params)},
          _randn(111, 8, 8, 8, 3), _randint(112, 5, 8))


# why: patch embedding, class token and attention all act inside one image; mean smoothed
# cross-entropy over images.
add('vit_patch_embed_class_token_nnx_split', vit_step, vit_make, expect_split=True)


class _MAE(nnx.Module):
  def __init__(self, rngs, p_dim=12, d=16, n=8):
    self.embed = nnx.Linear(p_dim, d, rngs=rngs)
    self.pos = nnx.Param(jax.random.normal(rngs.params(), (n, d)) * 0.02)
    self.enc_ln = nnx.LayerNorm(d, rngs=rngs)
    self.enc_attn = nnx.MultiHeadAttention(num_heads=2, in_features=d, decode=False,
                                           rngs=rngs)
    self.mask_token = nnx.Param(jnp.zeros((d,)))
    self.dec_ln = nnx.LayerNorm(d, rngs=rngs)
    self.dec_attn = nnx.MultiHeadAttention(num_heads=2, in_features=d, decode=False,
                                           rngs=rngs)
    self.pred = nnx.Linear(d, p_dim, rngs=rngs)

  def __call__(self, patches, keep_idx):
    b, n, _ = patches.shape
    x = self.embed(patches) + self.pos[...]
    vis = jnp.take_along_axis(x, keep_idx[..., None], 1)
    y = self.enc_ln(vis)
    vis = vis + self.enc_attn(y, y, y)
    full = jnp.broadcast_to(self.mask_token[...], (b, n, vis.shape[-1]))
    full = jax.vmap(lambda f, i, v: f.at[i].set(v))(full, keep_idx, vis) + self.pos[...]
    y = self.dec_ln(full)
    return self.pred(full + self.dec_attn(y, y, y))


def mae_step(state, images, keep_idx):
  model, optimizer = state
  b = images.shape[0]
  patches = images.reshape(b, 2, 2, 2, 2, 3).transpose(0, 1, 3, 2, 4, 5).reshape(b, 4, 12)
  patches = jnp.concatenate([patches, patches[:, ::-1] * 0.5], 1)      # 8 "patches"
  mu = patches.mean(-1, keepdims=True)
  target = (patches - mu) / jnp.sqrt(patches.var(-1, keepdims=True) + 1e-6)
  masked = 1.0 - jax.vmap(lambda i: jnp.zeros(8).at[i].set(1.0))(keep_idx)

  def loss_fn(model):
    pred = model(patches, keep_idx)
    per_patch = jnp.mean((pred - target) ** 2, -1)
    return jnp.sum(per_patch * masked) / jnp.sum(masked)

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return (model, optimizer), {'loss': loss}


def mae_make():
  model = _MAE(nnx.Rngs(120))
  opt = nnx.Optimizer(model, optax.adamw(1.5e-4 * 8, b1=0.9, b2=0.95), wrt=nnx.Param)
  rs = np.random.RandomState(121)
  keep = np.stack([np.sort(rs.permutation(8)[:3]) for _ in range(8)])
  return (model, opt), _randn(122, 8, 4, 4, 3), jnp.asarray(keep, jnp.int32)


# why: the masking pattern is an input per image and the per-patch target normalisation is
# within each patch; masked-patch MSE summed and divided by the total masked count.
add('mae_masked_patches_keep_idx_given', mae_step, mae_make, expect_split=True)


_T_DIFF = 50
_alphas_bar = jnp.asarray(np.cumprod(1.0 - np.linspace(1e-4, 0.05, _T_DIFF)), jnp.float32)


def _time_embed(t, dim=8):
  half = dim // 2
  freqs = jnp.exp(-np.log(1000.0) * jnp.arange(half) / half)
  ang = t.astype(jnp.float32)[:, None] * freqs[None]
  return jnp.concatenate([jnp.sin(ang), jnp.cos(ang)], -1)


_tx_ddpm = optax.adamw(2e-4, weight_decay=0.0)


def ddpm_step(state, batch):
  params, opt_state = state
  x0, t, noise = batch['x0'], batch['t'], batch['noise']
  ab = _alphas_bar[t][:, None]
  xt = jnp.sqrt(ab) * x0 + jnp.sqrt(1.0 - ab) * noise

  def loss_fn(p):
    eps_hat = _mlp_apply(p, jnp.concatenate([xt, _time_embed(t)], -1), jax.nn.silu)
    return optax.l2_loss(eps_hat, noise).sum(-1).mean() * 2.0

  loss, grads = jax.value_and_grad(loss_fn)(params)
  return _opt_step(_tx_ddpm, params, opt_state, grads), {'eps_mse': loss}


def ddpm_make():
  p = _mlp_params(130, [12 + 8, 32, 32, 12])
  batch = {'x0': _randn(131, 16, 12), 't': _randint(132, _T_DIFF, 16),
           'noise': _randn(133, 16, 12)}
  return (p, _tx_ddpm.init(p)), batch


# why: timesteps and noise arrive with each example, so the noised input is fixed per row;
# epsilon-prediction MSE averaged over examples.
add('ddpm_eps_prediction_timesteps_given', ddpm_step, ddpm_make, expect_split=True)


_tx_vpred = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))


def vpred_minsnr_step(state, x0, cond):
  key = jax.random.fold_in(state['key'], state['step'])
  k_t, k_n = jax.random.split(key)
  b = x0.shape[0]
  t = jax.random.randint(k_t, (b,), 0, _T_DIFF)
  noise = jax.random.normal(k_n, x0.shape)
  ab = _alphas_bar[t]
  xt = jnp.sqrt(ab)[:, None] * x0 + jnp.sqrt(1 - ab)[:, None] * noise
  v = jnp.sqrt(ab)[:, None] * noise - jnp.sqrt(1 - ab)[:, None] * x0
  snr = ab / (1 - ab)
  w = jnp.minimum(snr, 5.0) / (snr + 1.0)                         # min-SNR-5 for v-pred

  def loss_fn(p):
    h = jnp.concatenate([xt, _time_embed(t), cond], -1)
    v_hat = _mlp_apply(p, h, jax.nn.silu)
    return jnp.mean(w * jnp.mean((v_hat - v) ** 2, -1))

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  params, opt = _opt_step(_tx_vpred, state['params'], state['opt'], grads)
  return dict(state, params=params, opt=opt, step=state['step'] + 1), {'loss': loss}


def vpred_minsnr_make():
  p = _mlp_params(140, [12 + 8 + 4, 32, 12])
  return ({'params': p, 'opt': _tx_vpred.init(p), 'key': jax.random.PRNGKey(141),
           'step': jnp.zeros((), jnp.int32)}, _randn(142, 16, 12), _randn(143, 16, 4))


# why: timesteps and noise are drawn inside the step for the batch shape (a split draws
# others), but each example's min-SNR-weighted v-loss uses only its own draw; batch mean.
add('diffusion_v_pred_min_snr_key_in_state', vpred_minsnr_step, vpred_minsnr_make,
    stochastic=True, expect_split=True)


class _TinyUNet(nn.Module):
  @nn.compact
  def __call__(self, x, t):
    temb = nn.Dense(16)(nn.silu(nn.Dense(16)(_time_embed(t))))
    h1 = nn.Conv(8, (3, 3))(x)
    h1 = nn.silu(nn.GroupNorm(num_groups=4)(h1) + nn.Dense(8)(temb)[:, None, None])
    h2 = nn.Conv(16, (3, 3), strides=(2, 2))(h1)
    h2 = nn.silu(nn.GroupNorm(num_groups=4)(h2) + nn.Dense(16)(temb)[:, None, None])
    up = jax.image.resize(h2, h1.shape[:3] + (16,), 'nearest')
    h = nn.Conv(8, (3, 3))(jnp.concatenate([up, h1], -1))
    h = nn.silu(nn.GroupNorm(num_groups=4)(h))
    return nn.Conv(1, (3, 3))(h)


def unet_step(state, x0, t, noise):
  ab = _alphas_bar[t][:, None, None, None]
  xt = jnp.sqrt(ab) * x0 + jnp.sqrt(1 - ab) * noise

  def loss_fn(params):
    return jnp.mean((state.apply_fn({'params': params}, xt, t) - noise) ** 2)

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


def unet_make():
  model = _TinyUNet()
  x0 = _randn(150, 8, 8, 8, 1)
  t = _randint(151, _T_DIFF, 8)
  params = model.init(jax.random.PRNGKey(150), x0, t)['params']
  st = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(2e-4))
  return st, x0, t, _randn(152, 8, 8, 8, 1)


# why: GroupNorm normalises within one image, the time embedding is per example; pixel
# MSE averaged over the batch.
add('unet_groupnorm_time_embedding_eps', unet_step, unet_make, expect_split=True)


class _VAE(nn.Module):
  latent: int = 4

  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(32)(x))
    mu, logvar = nn.Dense(self.latent)(h), nn.Dense(self.latent)(h)
    eps = jax.random.normal(self.make_rng('noise'), mu.shape)
    z = mu + jnp.exp(0.5 * logvar) * eps
    return nn.Dense(x.shape[-1])(nn.relu(nn.Dense(32)(z))), mu, logvar


def vae_step(state, x):
  rng = jax.random.fold_in(state.rng, state.step)

  def loss_fn(params):
    logits, mu, logvar = state.apply_fn({'params': params}, x, rngs={'noise': rng})
    rec = optax.sigmoid_binary_cross_entropy(logits, x).sum(-1)
    kl = -0.5 * jnp.sum(1 + logvar - mu ** 2 - jnp.exp(logvar), -1)
    elbo = rec + kl
    return elbo.mean(), {'rec': rec.mean(), 'kl': kl.mean()}

  (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads), dict(aux, loss=loss)


def vae_make():
  model = _VAE()
  x = _f(np.random.RandomState(160).rand(16, 12) > 0.5)
  params = model.init({'params': jax.random.PRNGKey(160), 'noise': jax.random.PRNGKey(1)},
                      x)['params']
  st = _RngTrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3),
                             rng=jax.random.PRNGKey(161))
  return st, x


# why: reparameterisation noise is drawn for the batch's shape (a split draws others); each
# example's negative ELBO (reconstruction + KL) is its own, averaged over the batch.
add('vae_reparam_kl_plus_reconstruction', vae_step, vae_make, stochastic=True,
    expect_split=True)


class _VelocityNet(nnx.Module):
  def __init__(self, rngs, d=8):
    self.l1 = nnx.Linear(d + 1, 32, rngs=rngs)
    self.l2 = nnx.Linear(32, 32, rngs=rngs)
    self.l3 = nnx.Linear(32, d, rngs=rngs)

  def __call__(self, x, t):
    h = nnx.silu(self.l1(jnp.concatenate([x, t[:, None]], -1)))
    return self.l3(nnx.silu(self.l2(h)))


def flow_matching_step(state, batch):
  x1, x0, t = batch
  xt = (1 - t[:, None]) * x0 + t[:, None] * x1
  target = x1 - x0

  def loss_fn(model):
    return jnp.mean(jnp.sum((model(xt, t) - target) ** 2, -1))

  loss, grads = nnx.value_and_grad(loss_fn)(state['model'])
  state['optimizer'].update(state['model'], grads)
  return state, {'fm_loss': loss}


def flow_matching_make():
  model = _VelocityNet(nnx.Rngs(170))
  opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  return ({'model': model, 'optimizer': opt},
          (_randn(171, 16, 8), _randn(172, 16, 8), _rand(173, 16)))


# why: rectified-flow regression on the straight path; noise and time come with the data,
# one squared error per example, averaged.
add('rectified_flow_matching_tuple_batch', flow_matching_step, flow_matching_make,
    expect_split=True)


_MASK_ID = _VOC - 1
_tx_bert = optax.adamw(1e-3, weight_decay=0.01)


def bert_mlm_step(state, tokens, attention_mask, mlm_mask):
  inputs = jnp.where(mlm_mask, _MASK_ID, tokens)
  pair = (attention_mask[:, :, None] > 0) & (attention_mask[:, None, :] > 0)

  def loss_fn(p):
    h = p['emb'][inputs]
    h = _encoder_block(p, h, pair)
    logits = _rms(h, p['gf']) @ p['out']
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens)
    w = mlm_mask.astype(jnp.float32)
    return jnp.sum(ce * w) / jnp.maximum(w.sum(), 1.0), (logits, w)

  (loss, (logits, w)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  params, opt = _opt_step(_tx_bert, state['params'], state['opt'], grads)
  acc = jnp.sum((jnp.argmax(logits, -1) == tokens) * w) / w.sum()
  return {'params': params, 'opt': opt}, {'mlm_loss': loss, 'mlm_acc': acc}


def bert_mlm_make():
  p = _tok_params(180)
  b = 16
  am = _lengths_mask(181, b, _SEQ, 4)
  mlm = (np.random.RandomState(182).rand(b, _SEQ) < 0.2) & (np.asarray(am) > 0)
  mlm[:, 0] = True
  return ({'params': p, 'opt': _tx_bert.init(p)}, _randint(183, _VOC - 1, b, _SEQ), am,
          jnp.asarray(mlm))


# why: bidirectional attention within each padded sequence; CE summed over the masked
# positions of the batch and divided by the batch's masked count.
add('bert_mlm_masked_positions_given', bert_mlm_step, bert_mlm_make, expect_split=True)


class _GRUSeq2Seq(nn.Module):
  vocab: int = _VOC
  d: int = 16

  @nn.compact
  def __call__(self, src, src_len, dec_in):
    emb = nn.Embed(self.vocab, self.d)
    carry, _ = nn.RNN(nn.GRUCell(self.d), return_carry=True)(emb(src), seq_lengths=src_len)
    out = nn.RNN(nn.GRUCell(self.d))(emb(dec_in), initial_carry=carry)
    return nn.Dense(self.vocab)(out)


def gru_seq2seq_step(state, src, src_len, tgt, tgt_mask):
  dec_in = jnp.concatenate([jnp.ones_like(tgt[:, :1]), tgt[:, :-1]], 1)   # BOS = 1

  def loss_fn(params):
    logits = state.apply_fn({'params': params}, src, src_len, dec_in)
    labels = optax.smooth_labels(jax.nn.one_hot(tgt, _VOC), alpha=0.1)
    ce = optax.softmax_cross_entropy(logits, labels)
    return jnp.sum(ce * tgt_mask) / jnp.sum(tgt_mask)

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


def gru_seq2seq_make():
  model = _GRUSeq2Seq()
  b = 8
  src = _randint(190, _VOC, b, 10)
  src_len = jnp.asarray(np.random.RandomState(191).randint(3, 11, size=b), jnp.int32)
  tgt = _randint(192, _VOC, b, 8)
  params = model.init(jax.random.PRNGKey(190), src, src_len, tgt)['params']
  st = train_state.TrainState.create(
      apply_fn=model.apply, params=params,
      tx=optax.chain(optax.clip_by_global_norm(5.0), optax.adam(1e-3)))
  return st, src, src_len, tgt, _lengths_mask(193, b, 8)


# why: nn.RNN scans over time within each sequence (seq_lengths per row); smoothed-label
# token CE summed over the batch's real tokens / their count.
add('gru_seq2seq_optax_smooth_labels', gru_seq2seq_step, gru_seq2seq_make,
    expect_split=True)


_tx_pack = optax.adam(1e-3)


def packed_pool_step(state, tokens, segment_ids, seg_targets):
  """Rows hold up to 3 packed documents; one regression target per document slot."""
  attn = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids[:, None, :] > 0)
  attn = attn | jnp.eye(tokens.shape[1], dtype=bool)[None]
  slots = jnp.arange(1, 4)
  member = (segment_ids[:, None, :] == slots[None, :, None]).astype(jnp.float32)   # B,3,T
  counts = member.sum(-1)
  valid = (counts > 0).astype(jnp.float32)
  pos = jnp.cumsum(jnp.ones_like(segment_ids), 1) - 1
  first = jnp.argmax(segment_ids[:, :, None] == segment_ids[:, None, :], -1)
  positions = pos - first                                  # restart at each document

  def loss_fn(p):
    h = _encoder_block(p['enc'], p['enc']['emb'][tokens], attn, positions)
    pooled = jnp.einsum('bst,btd->bsd', member, h) / jnp.maximum(counts, 1.0)[..., None]
    pred = (pooled @ p['head'])[..., 0]
    return jnp.sum(valid * (pred - seg_targets) ** 2) / jnp.sum(valid)

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  params, opt = _opt_step(_tx_pack, state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'loss': loss, 'n_docs': valid.sum()}


def packed_pool_make():
  b, t = 8, 12
  rs = np.random.RandomState(200)
  seg = np.zeros((b, t), np.int32)
  for i in range(b):
    cuts = np.sort(rs.choice(np.arange(2, t - 1), size=2, replace=False))
    end = rs.randint(cuts[1] + 1, t + 1)
    seg[i, :cuts[0]], seg[i, cuts[0]:cuts[1]], seg[i, cuts[1]:end] = 1, 2, 3
  p = {'enc': _tok_params(201), 'head': _randn(202, _DM, 1, scale=0.25)}
  return ({'params': p, 'opt': _tx_pack.init(p)}, _randint(203, _VOC, b, t),
          jnp.asarray(seg), _randn(204, b, 3))


# why: attention is block-diagonal by segment id within a row and pooling is per document;
# the loss is a sum over valid documents of the batch divided by their count.
add('packed_documents_segment_pooling_regression', packed_pool_step, packed_pool_make,
    expect_split=True)

# ========================================================================================
# 2. MoE, scanned / rematerialised layer stacks, speech models, checkpoint policies
# ========================================================================================

_NE, _TOPK = 4, 2
_tx_moe = optax.adamw(1e-3, weight_decay=0.1)


def _moe_init(seed, d=_DM, ff=16):
  rs = np.random.RandomState(seed)
  return {'emb': _f(rs.randn(_VOC, d) * 0.5), 'router': _f(rs.randn(d, _NE) * 0.1),
          'w_in': _f(rs.randn(_NE, d, ff) / np.sqrt(d)),
          'w_gate': _f(rs.randn(_NE, d, ff) / np.sqrt(d)),
          'w_out': _f(rs.randn(_NE, ff, d) / np.sqrt(ff)), 'g': _f(np.ones(d)),
          'out': _f(rs.randn(d, _VOC) / np.sqrt(d))}


def mixtral_moe_step(state, tokens, loss_mask):
  def loss_fn(p):
    h = p['emb'][tokens[:, :-1]]
    x = _rms(h, p['g'])
    router_logits = x @ p['router']                                   # B, T, E
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), -1)
    top_w, top_i = jax.lax.top_k(probs, _TOPK)
    top_w = top_w / top_w.sum(-1, keepdims=True)                      # Mixtral renorm
    expert_out = jnp.einsum('btef,efd->bted',
                            jax.nn.silu(jnp.einsum('btd,edf->btef', x, p['w_gate']))
                            * jnp.einsum('btd,edf->btef', x, p['w_in']), p['w_out'])
    chosen = jnp.take_along_axis(expert_out, top_i[..., None], 2)      # B, T, k, D
    h = h + jnp.sum(top_w[..., None] * chosen, 2)
    logits = h @ p['out']
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    lm = jnp.sum(ce * loss_mask) / jnp.sum(loss_mask)
    # Switch/Mixtral load balancing: E * sum_e (fraction routed to e) * (mean prob of e)
    m = loss_mask[..., None]
    routed = jax.nn.one_hot(top_i, _NE).sum(2)                         # B, T, E
    frac = jnp.sum(routed * m, (0, 1)) / (jnp.sum(loss_mask) * _TOPK)
    mean_prob = jnp.sum(probs * m, (0, 1)) / jnp.sum(loss_mask)
    lb = _NE * jnp.sum(frac * mean_prob)
    z = jnp.sum(jax.nn.logsumexp(router_logits, -1) ** 2 * loss_mask) / jnp.sum(loss_mask)
    return lm + 0.02 * lb + 1e-3 * z, {'lm': lm, 'lb': lb, 'z': z}

  (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  params, opt = _opt_step(_tx_moe, state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, dict(aux, loss=loss)


def mixtral_moe_make():
  p = _moe_init(210)
  return ({'params': p, 'opt': _tx_moe.init(p)}, _randint(211, _VOC, 16, _SEQ + 1),
          _lengths_mask(212, 16, _SEQ, 3))


# why: no capacity limit, so each token's output depends only on its own routing; the LM
# loss, the load-balancing term (product of two token-sum averages) and the router z-loss
# are all functions of sums over the batch's tokens.
add('mixtral_top2_renorm_lb_and_router_z_loss', mixtral_moe_step, mixtral_moe_make,
    expect_split=True)


class _NnxBlock(nnx.Module):
  def __init__(self, rngs, d=16):
    self.norm = nnx.RMSNorm(d, rngs=rngs)
    self.fc1 = nnx.Linear(d, 2 * d, rngs=rngs)
    self.fc2 = nnx.Linear(2 * d, d, rngs=rngs)

  def __call__(self, x):
    return x + self.fc2(nnx.gelu(self.fc1(self.norm(x))))


class _NnxScanStack(nnx.Module):
  def __init__(self, rngs, n_layers=4, remat=False):
    self.inp = nnx.Linear(8, 16, rngs=rngs)
    self.remat = remat

    @nnx.split_rngs(splits=n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make_blocks(rngs):
      return _NnxBlock(rngs)

    self.blocks = make_blocks(rngs)
    self.out = nnx.Linear(16, 3, rngs=rngs)

  def __call__(self, x):
    def body(h, block):
      return block(h)

    if self.remat:
      body = nnx.remat(body)

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def run(h, block):
      return body(h, block)

    return self.out(run(self.inp(x), self.blocks))


def nnx_scan_stack_step(state, batch):
  model, optimizer = state['model'], state['optimizer']

  def loss_fn(model):
    logits = model(batch['x'])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch['y']).mean()

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return {'model': model, 'optimizer': optimizer}, {'loss': loss}


def _nnx_scan_make(seed, remat):
  model = _NnxScanStack(nnx.Rngs(seed), remat=remat)
  opt = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
  return ({'model': model, 'optimizer': opt},
          {'x': _randn(seed + 1, 16, 8), 'y': _randint(seed + 2, 3, 16)})


# why: nnx.vmap-created layer stack applied with nnx.scan over depth; rows never meet.
add('nnx_vmap_init_scan_over_layers', nnx_scan_stack_step,
    lambda: _nnx_scan_make(220, False), expect_split=True)
# why: the same stack with nnx.remat around the scan body; recompute is value-identical.
add('nnx_remat_inside_scan_over_layers', nnx_scan_stack_step,
    lambda: _nnx_scan_make(230, True), expect_split=True)


class _ConformerBlock(nn.Module):
  d: int = 16

  @nn.compact
  def __call__(self, x, pad_mask):
    ff = lambda h: nn.Dense(self.d)(nn.swish(nn.Dense(2 * self.d)(nn.LayerNorm()(h))))
    x = x + 0.5 * ff(x)
    y = nn.LayerNorm()(x)
    att_mask = nn.make_attention_mask(pad_mask > 0, pad_mask > 0)
    x = x + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=self.d)(
        y, y, mask=att_mask)
    y = nn.glu(nn.Dense(2 * self.d)(nn.LayerNorm()(x)), axis=-1)
    y = y * pad_mask[..., None]
    y = nn.Conv(self.d, (5,), feature_group_count=self.d, padding='SAME')(y)   # depthwise
    y = nn.Dense(self.d)(nn.swish(nn.LayerNorm()(y)))
    x = x + y
    x = x + 0.5 * ff(x)
    return nn.LayerNorm()(x)


class _Conformer(nn.Module):
  classes: int = 6

  @nn.compact
  def __call__(self, feats, pad_mask):
    x = nn.Dense(16)(feats)
    for _ in range(2):
      x = nn.remat(_ConformerBlock)()(x, pad_mask)
    return nn.Dense(self.classes)(x)


def conformer_step(state, feats, frame_labels, pad_mask):
  def loss_fn(params):
    logits = state.apply_fn({'params': params}, feats, pad_mask)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, frame_labels)
    return jnp.sum(ce * pad_mask) / jnp.sum(pad_mask)

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'frame_ce': loss}


def conformer_make():
  model = _Conformer()
  feats = _randn(240, 8, 12, 8)
  mask = _lengths_mask(241, 8, 12, 5)
  params = model.init(jax.random.PRNGKey(240), feats, mask)['params']
  st = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                     tx=optax.adamw(1e-3, b2=0.98))
  return st, feats, _randint(242, 6, 8, 12), mask


# why: conformer blocks (LayerNorm, padded self-attention, depthwise conv over time) all act
# within one utterance; frame CE over the batch's real frames / their count.
add('conformer_blocks_nn_remat_frame_ce', conformer_step, conformer_make, expect_split=True)


_tx_ctc = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))


def _conv1d_frames(x, w, b):
  """Same-padded width-3 temporal conv written with shifts; x (B, T, C), w (3, C, F)."""
  xp = jnp.pad(x, ((0, 0), (1, 1), (0, 0)))
  return sum(xp[:, k:k + x.shape[1]] @ w[k] for k in range(3)) + b


def ctc_step(state, feats, feat_pad, labels, label_pad):
  params, opt_state = state

  def loss_fn(p):
    h = jax.nn.gelu(_conv1d_frames(feats, p['conv_w'], p['conv_b']))
    h = h * (1.0 - feat_pad)[..., None]
    logits = _mlp_apply(p['head'], h)
    per_seq = optax.ctc_loss(logits, feat_pad, labels, label_pad, blank_id=0)
    n_labels = jnp.maximum(jnp.sum(1.0 - label_pad, -1), 1.0)
    return jnp.mean(per_seq / n_labels), per_seq

  (loss, per_seq), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  return _opt_step(_tx_ctc, params, opt_state, grads), {'ctc': loss,
                                                         'ctc_sum': per_seq.sum()}


def ctc_make():
  rs = np.random.RandomState(250)
  b, t, c = 8, 14, 8
  p = {'conv_w': _f(rs.randn(3, c, 16) / np.sqrt(3 * c)), 'conv_b': _f(np.zeros(16)),
       'head': _mlp_params(251, [16, 16, 6])}
  feat_pad = 1.0 - _lengths_mask(252, b, t, 10)
  label_pad = 1.0 - _lengths_mask(253, b, 4, 1)
  labels = _randint(254, 5, b, 4) + 1                        # 0 is the blank
  return (p, _tx_ctc.init(p)), _randn(255, b, t, c), feat_pad, labels, label_pad


# why: optax.ctc_loss gives one loss per utterance (its own frames and labels); the step
# averages the per-utterance, label-length-normalised losses.
add('ctc_loss_optax_paddings', ctc_step, ctc_make, expect_split=True)


_tx_offload = optax.adam(1e-3)


def offload_dots_step(state, x, y):
  policy = jax.checkpoint_policies.offload_dot_with_no_batch_dims('device', 'pinned_host')

  @functools.partial(jax.checkpoint, policy=policy)
  def tower(layers, h):
    for layer in layers:
      h = h + jax.nn.silu(h @ layer['w'] + layer['b'])
    return h

  def loss_fn(p):
    h = tower(p['blocks'], x @ p['inp'])
    return jnp.mean(optax.log_cosh(h @ p['out'], y))

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  params, opt = _opt_step(_tx_offload, state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'loss': loss}


def offload_dots_make():
  rs = np.random.RandomState(260)
  p = {'inp': _f(rs.randn(6, 16) / np.sqrt(6)),
       'blocks': [_dense(rs, 16, 16, 0.5) for _ in range(3)],
       'out': _f(rs.randn(16, 2) / 4.0)}
  return {'params': p, 'opt': _tx_offload.init(p)}, _randn(261, 16, 6), _randn(262, 16, 2)


# why: the offload policy moves saved residuals to host memory; values are unchanged and the
# log-cosh loss is a mean over examples.
add('ckpt_offload_dot_no_batch_dims_policy', offload_dots_step, offload_dots_make,
    expect_split=True)


def _offload_named_block(layer, h):
  z = checkpoint_name(h @ layer['w'], 'pre_act')
  a = checkpoint_name(jax.nn.gelu(z + layer['b']), 'act')
  return h + a


_offload_named_block = jax.checkpoint(
    _offload_named_block,
    policy=jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=['pre_act'], names_which_can_be_offloaded=['act'],
        offload_src='device', offload_dst='pinned_host'))


def offload_names_step(state, x, labels):
  params, opt_state = state

  def loss_fn(p):
    h = x @ p['inp']
    for layer in p['blocks']:
      h = _offload_named_block(layer, h)
    logits = h @ p['out']
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  loss, grads = jax.value_and_grad(loss_fn)(params)
  return _opt_step(_tx_offload, params, opt_state, grads), {'loss': loss}


def offload_names_make():
  rs = np.random.RandomState(270)
  p = {'inp': _f(rs.randn(8, 16) / np.sqrt(8)),
       'blocks': [_dense(rs, 16, 16, 0.5) for _ in range(2)],
       'out': _f(rs.randn(16, 4) / 4.0)}
  return (p, _tx_offload.init(p)), _randn(271, 16, 8), _randint(272, 4, 16)


# why: save one named residual, offload the other; a memory decision only. Mean CE.
add('ckpt_save_and_offload_only_these_names', offload_names_step, offload_names_make,
    expect_split=True)


_tx_llama = optax.chain(optax.clip_by_global_norm(1.0),
                        optax.adamw(3e-4, b1=0.9, b2=0.95, weight_decay=0.1))


def llama_step(state, tokens, loss_mask):
  def named_block(p, h, mask):
    h = checkpoint_name(h, 'embed_out')
    return checkpoint_name(_encoder_block(p, h, mask, causal=True), 'block_out')

  block = jax.checkpoint(
      named_block,
      policy=jax.checkpoint_policies.save_anything_except_these_names('embed_out'))

  def loss_fn(p):
    t = tokens.shape[1] - 1
    h = p['emb'][tokens[:, :-1]]
    mask = jnp.ones((tokens.shape[0], t, t), bool)
    h = block(p, h, mask)
    logits = (_rms(h, p['gf']) @ p['out']).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return jnp.sum(ce * loss_mask) / jnp.sum(loss_mask)

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  params, opt = _opt_step(_tx_llama, state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'loss': loss, 'grad_norm': optax.global_norm(grads)}


def llama_make():
  p = _tok_params(280)
  return ({'params': p, 'opt': _tx_llama.init(p)}, _randint(281, _VOC, 16, _SEQ + 1),
          _lengths_mask(282, 16, _SEQ, 3))


# why: a causal RMSNorm + RoPE + SwiGLU block under a remat policy; causal attention stays
# inside each row; token loss sum / token count over the batch.
add('llama_rmsnorm_rope_swiglu_save_except_names', llama_step, llama_make, expect_split=True)


class _ScanGRULayer(nn.Module):
  @nn.compact
  def __call__(self, carry, x_t):
    carry, y = nn.GRUCell(16)(carry, x_t)
    return carry, y


class _LinenScanRNN(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = x.swapaxes(0, 1)                                  # time-major for the scan
    scan = nn.scan(nn.remat(_ScanGRULayer), variable_broadcast='params',
                   split_rngs={'params': False}, in_axes=0, out_axes=0)
    carry = jnp.zeros((x.shape[1], 16))
    _, ys = scan()(carry, x)
    return nn.Dense(1)(ys.swapaxes(0, 1))[..., 0]


def linen_scan_time_step(state, x, y, mask):
  def loss_fn(params):
    pred = state.apply_fn({'params': params}, x)
    return jnp.sum(mask * (pred - y) ** 2) / jnp.sum(mask)

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'mse': loss}


def linen_scan_time_make():
  model = _LinenScanRNN()
  x = _randn(290, 8, 12, 4)
  params = model.init(jax.random.PRNGKey(290), x)['params']
  st = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(3e-3))
  return st, x, _randn(291, 8, 12), _lengths_mask(292, 8, 12, 4)


# why: nn.scan over time (time-major, batch in the carry's first axis) with nn.remat on the
# cell; the recurrence never mixes rows; masked per-step MSE over the batch.
add('linen_scan_time_major_gru_remat', linen_scan_time_step, linen_scan_time_make,
    expect_split=True)

# ========================================================================================
# 3. optimiser plumbing: optax chains, wrappers, SAM, LoRA, mixed precision, user accumulation
# ========================================================================================

def _cls_batch(seed, b=16, d=8, classes=4):
  return _randn(seed, b, d), _randint(seed + 1, classes, b)


def _cls_loss(p, x, labels):
  logits = _mlp_apply(p, x)
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


_tx_multisteps = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2)


def multisteps_step(state, x, labels):
  params, opt_state = state['params'], state['opt_state']
  loss, grads = jax.value_and_grad(_cls_loss)(params, x, labels)
  updates, opt_state = _tx_multisteps.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  return {'params': params, 'opt_state': opt_state}, {
      'loss': loss, 'mini_step': opt_state.mini_step}


def multisteps_make():
  p = _mlp_params(300, [8, 16, 4])
  return ({'params': p, 'opt_state': _tx_multisteps.init(p)},) + _cls_batch(301)


# why: the user's own accumulation across calls (optax.MultiSteps); each call's gradient is
# the mean CE gradient over its batch, a sum over examples.
add('optax_multisteps_every_2_calls', multisteps_step, multisteps_make, expect_split=True)


_tx_lookahead = optax.lookahead(optax.adam(1e-2), sync_period=2, slow_step_size=0.5)


def lookahead_step(state, x, labels):
  la_params, opt_state = state
  loss, grads = jax.value_and_grad(_cls_loss)(la_params.fast, x, labels)
  updates, opt_state = _tx_lookahead.update(grads, opt_state, la_params)
  return (optax.apply_updates(la_params, updates), opt_state), {'loss': loss}


def lookahead_make():
  p = optax.LookaheadParams.init_synced(_mlp_params(310, [8, 16, 4]))
  return ((p, _tx_lookahead.init(p)),) + _cls_batch(311)


# why: lookahead keeps fast and slow weights; the gradient is the batch-mean CE gradient.
add('optax_lookahead_fast_slow_params', lookahead_step, lookahead_make, expect_split=True)


_tx_inject = optax.inject_hyperparams(optax.adamw)(
    learning_rate=optax.cosine_onecycle_schedule(20, 3e-3), weight_decay=1e-4)


def inject_hparams_step(state, x, labels):
  loss, grads = jax.value_and_grad(
      lambda p: _cls_loss(p, x, labels))(state.params)
  state = state.apply_gradients(grads=grads)
  return state, {'loss': loss, 'lr': state.opt_state.hyperparams['learning_rate']}


def inject_hparams_make():
  p = _mlp_params(320, [8, 16, 4])
  st = train_state.TrainState.create(apply_fn=None, params=p, tx=_tx_inject)
  return (st,) + _cls_batch(321)


# why: hyperparameters live in the optimiser state and follow the step count only; mean CE.
add('optax_inject_hyperparams_onecycle_trainstate', inject_hparams_step, inject_hparams_make,
    expect_split=True)


def _decay_mask(params):
  return jax.tree_util.tree_map_with_path(
      lambda path, _: not any(getattr(k, 'key', None) in ('bias', 'scale') for k in path),
      params)


class _MaskedMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.LayerNorm()(nn.gelu(nn.Dense(32)(x)))
    return nn.Dense(3)(nn.gelu(nn.Dense(16)(x)))


def adamw_mask_step(state, batch):
  def loss_fn(params):
    logits = state.apply_fn({'params': params}, batch['image'])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch['label']).mean()
    return loss, logits

  (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  state = state.apply_gradients(grads=grads)
  return state, {'loss': loss, 'accuracy': jnp.mean(logits.argmax(-1) == batch['label'])}


def adamw_mask_make():
  model = _MaskedMLP()
  x = _randn(330, 16, 10)
  params = model.init(jax.random.PRNGKey(330), x)['params']
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   optax.adamw(1e-3, weight_decay=0.05, mask=_decay_mask))
  st = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
  return st, {'image': x, 'label': _randint(331, 3, 16)}


# why: weight decay skips biases and LayerNorm scales via a mask; the data term is mean CE.
add('optax_adamw_decay_mask_no_bias_or_scale', adamw_mask_step, adamw_mask_make,
    expect_split=True)


_tx_ema_chain = optax.chain(optax.clip_by_global_norm(2.0), optax.ema(0.9, debias=True),
                            optax.scale(-5e-2))


def ema_params_step(state, x, y):
  loss, grads = jax.value_and_grad(
      lambda p: jnp.mean(optax.huber_loss(_mlp_apply(p, x), y)))(state['params'])
  params, opt = _opt_step(_tx_ema_chain, state['params'], state['opt'], grads)
  ema = optax.incremental_update(params, state['ema_params'], step_size=0.01)
  return {'params': params, 'opt': opt, 'ema_params': ema}, {'loss': loss}


def ema_params_make():
  p = _mlp_params(340, [6, 16, 2])
  return ({'params': p, 'opt': _tx_ema_chain.init(p), 'ema_params': p},
          _randn(341, 16, 6), _randn(342, 16, 2))


# why: gradient EMA in the chain and a Polyak average of the weights after the update are
# functions of the batch gradient; the loss is mean Huber.
add('optax_ema_updates_and_polyak_params', ema_params_step, ema_params_make,
    expect_split=True)


_tx_frozen = optax.multi_transform({'train': optax.adam(3e-3), 'freeze': optax.set_to_zero()},
                                   {'backbone': 'freeze', 'head': 'train'})


def frozen_backbone_step(state, x, labels):
  params, opt_state = state

  def loss_fn(p):
    feats = _mlp_apply(p['backbone'], x, jax.nn.relu)
    logits = feats @ p['head']['w'] + p['head']['b']
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  loss, grads = jax.value_and_grad(loss_fn)(params)
  return _opt_step(_tx_frozen, params, opt_state, grads), {'loss': loss}


def frozen_backbone_make():
  p = {'backbone': _mlp_params(350, [8, 16, 16]),
       'head': _dense(np.random.RandomState(351), 16, 4)}
  return ((p, _tx_frozen.init(p)),) + _cls_batch(352)


# why: optax.multi_transform freezes the backbone; the head's gradient is a batch mean.
add('optax_multi_transform_frozen_backbone', frozen_backbone_step, frozen_backbone_make,
    expect_split=True)


_tx_finite = optax.apply_if_finite(optax.chain(optax.clip(0.5), optax.adam(1e-2)),
                                   max_consecutive_errors=3)


def apply_if_finite_step(state, x, labels):
  params, opt_state = state
  loss, grads = jax.value_and_grad(_cls_loss)(params, x, labels)
  params, opt_state = _opt_step(_tx_finite, params, opt_state, grads)
  return (params, opt_state), {'loss': loss, 'notfinite_count': opt_state.notfinite_count}


def apply_if_finite_make():
  p = _mlp_params(360, [8, 32, 4])
  return ((p, _tx_finite.init(p)),) + _cls_batch(361)


# why: the finiteness check looks at the whole batch gradient (a sum); mean CE.
add('optax_apply_if_finite_elementwise_clip', apply_if_finite_step, apply_if_finite_make,
    expect_split=True)


_tx_sam = optax.sgd(5e-2, momentum=0.9)


def sam_step(state, x, labels):
  rho = 0.05
  grad_fn = jax.value_and_grad(_cls_loss)
  loss, g = grad_fn(state['params'], x, labels)
  scale = rho / (optax.global_norm(g) + 1e-12)
  perturbed = jax.tree_util.tree_map(lambda p, gg: p + scale * gg, state['params'], g)
  sam_loss, g_sam = grad_fn(perturbed, x, labels)
  params, opt = _opt_step(_tx_sam, state['params'], state['opt'], g_sam)
  return {'params': params, 'opt': opt}, {'loss': loss, 'sam_loss': sam_loss}


def sam_make():
  p = _mlp_params(370, [8, 16, 4])
  return ({'params': p, 'opt': _tx_sam.init(p)},) + _cls_batch(371)


# why: the ascent direction is the full-batch gradient (a sum, from an earlier pass); the
# descent gradient at the perturbed weights is again a batch mean of per-example terms.
add('sam_two_gradient_evaluations', sam_step, sam_make, expect_split=True)


_tx_lora = optax.adam(1e-2)


def lora_step(state, tokens, loss_mask):
  base = state['base']

  def loss_fn(lora):
    p = dict(base)
    p['wq'] = base['wq'] + 2.0 * lora['q_a'] @ lora['q_b']
    p['wv'] = base['wv'] + 2.0 * lora['v_a'] @ lora['v_b']
    h = p['emb'][tokens[:, :-1]]
    t = h.shape[1]
    h = _encoder_block(p, h, jnp.ones((h.shape[0], t, t), bool), causal=True)
    logits = _rms(h, p['gf']) @ p['out']
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return jnp.sum(ce * loss_mask) / jnp.sum(loss_mask)

  loss, grads = jax.value_and_grad(loss_fn)(state['lora'])
  lora, opt = _opt_step(_tx_lora, state['lora'], state['opt'], grads)
  return {'base': base, 'lora': lora, 'opt': opt}, {'loss': loss}


def lora_make():
  base = _tok_params(380)
  rs = np.random.RandomState(381)
  lora = {'q_a': _f(rs.randn(_DM, 2) * 0.1), 'q_b': _f(np.zeros((2, _DM))),
          'v_a': _f(rs.randn(_DM, 2) * 0.1), 'v_b': _f(np.zeros((2, _DM)))}
  return ({'base': base, 'lora': lora, 'opt': _tx_lora.init(lora)},
          _randint(382, _VOC, 8, _SEQ + 1), _lengths_mask(383, 8, _SEQ, 3))


# why: only the low-rank adapters are differentiated; the frozen base is a constant; masked
# token mean over the batch.
add('lora_adapters_frozen_base_causal_lm', lora_step, lora_make, expect_split=True)


_tx_ewc = optax.adam(3e-3)


def ewc_step(state, x, labels):
  def loss_fn(p):
    task = _cls_loss(p, x, labels)
    penalty = sum(jnp.sum(f * (a - b) ** 2) for f, a, b in zip(
        jax.tree_util.tree_leaves(state['fisher']), jax.tree_util.tree_leaves(p),
        jax.tree_util.tree_leaves(state['anchor'])))
    return task + 0.5 * 10.0 * penalty, (task, penalty)

  (loss, (task, pen)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  params, opt = _opt_step(_tx_ewc, state['params'], state['opt'], grads)
  return dict(state, params=params, opt=opt), {'loss': loss, 'task': task, 'ewc': pen}


def ewc_make():
  p = _mlp_params(390, [8, 16, 4])
  rs = np.random.RandomState(391)
  fisher = jax.tree_util.tree_map(lambda a: _f(rs.rand(*a.shape) * 0.1), p)
  anchor = jax.tree_util.tree_map(lambda a: a + _f(rs.randn(*a.shape) * 0.05), p)
  return ({'params': p, 'opt': _tx_ewc.init(p), 'fisher': fisher, 'anchor': anchor},
          ) + _cls_batch(392)


# why: the EWC penalty depends on parameters only; the data term is mean CE.
add('ewc_fisher_penalty_in_state', ewc_step, ewc_make, expect_split=True)


_tx_skip = optax.adam(1e-2)


def cond_skip_step(state, x, y):
  params, opt_state, skipped = state
  loss, grads = jax.value_and_grad(
      lambda p: jnp.mean((_mlp_apply(p, x) - y) ** 2))(params)
  gnorm = optax.global_norm(grads)
  ok = jnp.isfinite(loss) & jnp.isfinite(gnorm) & (gnorm < 1e3)

  def apply(_):
    return _opt_step(_tx_skip, params, opt_state, grads) + (skipped,)

  def skip(_):
    return params, opt_state, skipped + 1

  new_state = jax.lax.cond(ok, apply, skip, None)
  return new_state, {'loss': loss, 'gnorm': gnorm, 'applied': ok}


def cond_skip_make():
  p = _mlp_params(400, [5, 16, 1])
  return (p, _tx_skip.init(p), jnp.zeros((), jnp.int32)), _randn(401, 16, 5), _randn(402, 16, 1)


# why: lax.cond on the full-batch loss and gradient norm (functions of sums); the gradient
# itself is a mean of per-example squared-error gradients.
add('lax_cond_skip_update_on_bad_gradnorm', cond_skip_step, cond_skip_make,
    expect_split=True)


_tx_accum = optax.adam(3e-3)


def user_accum_step(state, x, labels):
  """The user already accumulates over 4 equal microbatches with a lax.scan."""
  params, opt_state = state
  xs = x.reshape(4, -1, *x.shape[1:])
  ys = labels.reshape(4, -1)

  def micro(carry, mb):
    loss_sum, g_sum = carry
    loss, g = jax.value_and_grad(_cls_loss)(params, *mb)
    return (loss_sum + loss, jax.tree_util.tree_map(jnp.add, g_sum, g)), None

  zero = jax.tree_util.tree_map(jnp.zeros_like, params)
  (loss, grads), _ = jax.lax.scan(micro, (jnp.zeros(()), zero), (xs, ys))
  grads = jax.tree_util.tree_map(lambda g: g / 4, grads)
  return _opt_step(_tx_accum, params, opt_state, grads), {'loss': loss / 4}


def user_accum_make():
  p = _mlp_params(410, [8, 16, 4])
  return ((p, _tx_accum.init(p)),) + _cls_batch(411)


# why: the mean of four equal-size microbatch means is the batch mean of per-example CE.
add('user_grad_accum_lax_scan_4_micro', user_accum_step, user_accum_make, expect_split=True)


_tx_bf16 = optax.adamw(1e-3)


def bf16_step(state, x, labels):
  def loss_fn(p):
    p16 = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), p)
    h = x.astype(jnp.bfloat16)
    for layer in p16[:-1]:
      h = jax.nn.gelu(h @ layer['w'] + layer['b'])
    logits = (h @ p16[-1]['w'] + p16[-1]['b']).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  params, opt = _opt_step(_tx_bf16, state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'loss': loss}


def bf16_make():
  p = _mlp_params(420, [8, 32, 32, 4])
  return ({'params': p, 'opt': _tx_bf16.init(p)},) + _cls_batch(421)


# why: f32 master weights, bf16 activations, f32 logits; per-example CE averaged (exact up
# to rounding).
add('bf16_activations_f32_master_params', bf16_step, bf16_make, expect_split=True)

# ========================================================================================
# 4. reward models, preference optimisation, distillation, RL
# ========================================================================================

def _reward(p, toks, mask):
  """Bidirectional encoder over a padded sequence, masked mean-pool, scalar head."""
  pair = (mask[:, :, None] > 0) & (mask[:, None, :] > 0)
  pair = pair | jnp.eye(toks.shape[1], dtype=bool)[None]
  h = _encoder_block(p['enc'], p['enc']['emb'][toks], pair)
  pooled = jnp.sum(h * mask[..., None], 1) / jnp.sum(mask, 1, keepdims=True)
  return (pooled @ p['head'])[:, 0]


def _rm_params(seed):
  return {'enc': _tok_params(seed), 'head': _randn(seed + 1, _DM, 1, scale=0.25)}


_tx_rm = optax.adamw(1e-3, weight_decay=0.0)


def bt_separate_step(state, batch):
  def loss_fn(p):
    r_c = _reward(p, batch['chosen'], batch['chosen_mask'])
    r_r = _reward(p, batch['rejected'], batch['rejected_mask'])
    loss = -jax.nn.log_sigmoid(r_c - r_r).mean() + 1e-3 * jnp.mean((r_c + r_r) ** 2)
    return loss, (r_c, r_r)

  (loss, (r_c, r_r)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  params, opt = _opt_step(_tx_rm, state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'loss': loss, 'acc': jnp.mean(r_c > r_r),
                                          'margin': jnp.mean(r_c - r_r)}


def bt_separate_make():
  p = _rm_params(500)
  b = 8
  batch = {'chosen': _randint(501, _VOC, b, _SEQ), 'rejected': _randint(502, _VOC, b, _SEQ),
           'chosen_mask': _lengths_mask(503, b, _SEQ, 3),
           'rejected_mask': _lengths_mask(504, b, _SEQ, 3)}
  return {'params': p, 'opt': _tx_rm.init(p)}, batch


# why: Bradley-Terry on pair i uses only chosen[i] and rejected[i] (separate arrays with the
# same row order), plus a per-pair centering term; batch mean.
add('bt_reward_model_chosen_rejected_dict', bt_separate_step, bt_separate_make,
    expect_split=True)


def bt_stacked_step(state, pairs, pair_mask):
  """pairs: (B, 2, T) with [:, 0] chosen and [:, 1] rejected."""
  b, _, t = pairs.shape

  def loss_fn(p):
    r = _reward(p, pairs.reshape(2 * b, t), pair_mask.reshape(2 * b, t)).reshape(b, 2)
    return -jnp.mean(jax.nn.log_sigmoid(r[:, 0] - r[:, 1])), r

  (loss, r), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  params, opt = _opt_step(_tx_rm, state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'loss': loss, 'acc': jnp.mean(r[:, 0] > r[:, 1])}


def bt_stacked_make():
  p = _rm_params(510)
  b = 8
  mask = jnp.stack([_lengths_mask(512, b, _SEQ, 3), _lengths_mask(513, b, _SEQ, 3)], 1)
  return {'params': p, 'opt': _tx_rm.init(p)}, _randint(511, _VOC, b, 2, _SEQ), mask


# why: one array with the pair on axis 1; the (B, 2, T) -> (2B, T) reshape keeps a pair's
# two rows next to each other and the reward comes back to (B, 2); mean over pairs.
add('bt_reward_pairs_stacked_on_axis1', bt_stacked_step, bt_stacked_make, expect_split=True)


def bt_interleaved_step(state, seqs, mask):
  """seqs: (2B, T) interleaved rows [c0, r0, c1, r1, ...]."""
  def loss_fn(p):
    r = _reward(p, seqs, mask)
    return -jnp.mean(jax.nn.log_sigmoid(r[0::2] - r[1::2]))

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  params, opt = _opt_step(_tx_rm, state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'loss': loss}


def bt_interleaved_make():
  p = _rm_params(520)
  return ({'params': p, 'opt': _tx_rm.init(p)}, _randint(521, _VOC, 16, _SEQ),
          _lengths_mask(522, 16, _SEQ, 3))


# why: rows 2i and 2i+1 form a pair; any contiguous split into even-sized pieces keeps the
# pairs, an odd-sized one breaks them -- depends on how the split is chosen, so unsure.
add('bt_reward_interleaved_rows_strided_pairs', bt_interleaved_step, bt_interleaved_make,
    expect_split=None)


def _token_logps(p, toks):
  """Causal LM log p(toks[:, 1:] | prefix), (B, T-1)."""
  t = toks.shape[1] - 1
  h = p['emb'][toks[:, :-1]]
  h = _encoder_block(p, h, jnp.ones((toks.shape[0], t, t), bool), causal=True)
  lp = jax.nn.log_softmax(_rms(h, p['gf']) @ p['out'])
  return jnp.take_along_axis(lp, toks[:, 1:, None], -1)[..., 0]


_tx_pref = optax.adamw(5e-4, weight_decay=0.0)


def orpo_step(state, chosen, rejected, chosen_mask, rejected_mask):
  lam = 0.1

  def loss_fn(p):
    lc = jnp.sum(_token_logps(p, chosen) * chosen_mask, -1) / chosen_mask.sum(-1)
    lr = jnp.sum(_token_logps(p, rejected) * rejected_mask, -1) / rejected_mask.sum(-1)
    log_odds = (lc - lr) - (jnp.log1p(-jnp.exp(lc)) - jnp.log1p(-jnp.exp(lr)))
    or_term = -jax.nn.log_sigmoid(log_odds)
    nll = -lc
    return jnp.mean(nll + lam * or_term), {'nll': -lc.mean(), 'log_odds': log_odds.mean()}

  (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  params, opt = _opt_step(_tx_pref, state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, dict(aux, loss=loss)


def _pref_make(seed, b=8):
  p = _tok_params(seed)
  return ({'params': p, 'opt': _tx_pref.init(p)}, _randint(seed + 1, _VOC, b, _SEQ + 1),
          _randint(seed + 2, _VOC, b, _SEQ + 1), _lengths_mask(seed + 3, b, _SEQ, 3),
          _lengths_mask(seed + 4, b, _SEQ, 3))


# why: ORPO's SFT term plus odds-ratio term per pair (length-normalised within each
# sequence, no reference model); averaged over pairs.
add('orpo_odds_ratio_plus_sft', orpo_step, lambda: _pref_make(530), expect_split=True)


def kto_fixed_ref_step(state, seqs, mask, desirable):
  beta, lam_d, lam_u = 0.1, 1.0, 1.33
  ref_lp = jax.lax.stop_gradient(jnp.sum(_token_logps(state['ref'], seqs) * mask, -1))
  z0 = state['kl_ref']                     # a running KL estimate kept outside the batch

  def loss_fn(p):
    lp = jnp.sum(_token_logps(p, seqs) * mask, -1)
    r = beta * (lp - ref_lp)
    v = jnp.where(desirable, lam_d * jax.nn.sigmoid(r - beta * z0),
                  lam_u * jax.nn.sigmoid(beta * z0 - r))
    w = jnp.where(desirable, lam_d, lam_u)
    return jnp.mean(w - v), r

  (loss, r), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  params, opt = _opt_step(_tx_pref, state['params'], state['opt'], grads)
  return dict(state, params=params, opt=opt), {'loss': loss, 'reward': r.mean()}


def kto_fixed_ref_make():
  ref = _tok_params(540)
  rs = np.random.RandomState(541)
  p = jax.tree_util.tree_map(lambda a: a + _f(0.05 * rs.randn(*a.shape)), ref)
  return ({'params': p, 'ref': ref, 'opt': _tx_pref.init(p), 'kl_ref': jnp.asarray(0.3)},
          _randint(542, _VOC, 16, _SEQ + 1), _lengths_mask(543, 16, _SEQ, 3),
          jnp.asarray(np.random.RandomState(544).rand(16) > 0.4))


# why: unpaired KTO with its reference point held in the state (not estimated from this
# batch); one value per example with a per-example desirable flag; batch mean.
add('kto_unpaired_reference_point_in_state', kto_fixed_ref_step, kto_fixed_ref_make,
    expect_split=True)


def rloo_step(state, completions, comp_mask, rewards):
  """completions (B, K, T+1): K samples per prompt; rewards (B, K)."""
  b, k, t1 = completions.shape
  baseline = (rewards.sum(1, keepdims=True) - rewards) / (k - 1)
  adv = rewards - baseline

  def loss_fn(p):
    lp = _token_logps(p, completions.reshape(b * k, t1)).reshape(b, k, t1 - 1)
    seq_lp = jnp.sum(lp * comp_mask, -1)
    return -jnp.mean(adv * seq_lp)

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  params, opt = _opt_step(_tx_pref, state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'loss': loss, 'reward': rewards.mean()}


def _group_make(seed, b=4, k=4):
  p = _tok_params(seed)
  mask = _lengths_mask(seed + 2, b * k, _SEQ, 3).reshape(b, k, _SEQ)
  return ({'params': p, 'opt': _tx_pref.init(p)}, _randint(seed + 1, _VOC, b, k, _SEQ + 1),
          mask, _randn(seed + 3, b, k))


# why: the leave-one-out baseline uses only the K samples of the same prompt, which share
# a row (axis 0 is the prompt); REINFORCE term averaged over all samples.
add('rloo_leave_one_out_group_axis', rloo_step, lambda: _group_make(550), expect_split=True)


def grpo_step(state, completions, comp_mask, rewards, old_logp):
  b, k, t1 = completions.shape
  eps, beta = 0.2, 0.04
  mu = rewards.mean(1, keepdims=True)
  sd = rewards.std(1, keepdims=True)
  adv = ((rewards - mu) / (sd + 1e-4))[..., None]
  flat = completions.reshape(b * k, t1)
  ref_lp = jax.lax.stop_gradient(_token_logps(state['ref'], flat).reshape(b, k, t1 - 1))

  def loss_fn(p):
    lp = _token_logps(p, flat).reshape(b, k, t1 - 1)
    ratio = jnp.exp(lp - old_logp)
    pg = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - eps, 1 + eps) * adv)
    kl = jnp.exp(ref_lp - lp) - (ref_lp - lp) - 1.0
    per_tok = pg + beta * kl
    per_seq = jnp.sum(per_tok * comp_mask, -1) / jnp.sum(comp_mask, -1)
    return per_seq.mean(), jnp.sum(kl * comp_mask) / comp_mask.sum()

  (loss, kl), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  params, opt = _opt_step(_tx_pref, state['params'], state['opt'], grads)
  return dict(state, params=params, opt=opt), {'loss': loss, 'kl': kl}


def grpo_make():
  (st, comps, mask, rewards) = _group_make(560)
  ref = jax.tree_util.tree_map(lambda a: a * 1.01, st['params'])
  old = _token_logps(st['params'], comps.reshape(-1, _SEQ + 1)).reshape(4, 4, _SEQ) - 0.01
  return dict(st, ref=ref), comps, mask, rewards, old


# why: group-normalised advantages use the K samples of the same prompt in the same row;
# clipped ratio + k3 KL per token, per-sequence token mean, then mean over sequences.
add('grpo_group_axis_clipped_ratio_k3_kl', grpo_step, grpo_make, expect_split=True)


def grpo_flat_step(state, completions, comp_mask, rewards):
  """completions (B*K, T+1) flat; each run of K=4 consecutive rows is one prompt's group."""
  k = 4
  r = rewards.reshape(-1, k)
  adv = ((r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-4)).reshape(-1)

  def loss_fn(p):
    lp = _token_logps(p, completions)
    seq = jnp.sum(lp * comp_mask, -1) / jnp.sum(comp_mask, -1)
    return -jnp.mean(adv * seq)

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  params, opt = _opt_step(_tx_pref, state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'loss': loss}


def grpo_flat_make():
  p = _tok_params(570)
  return ({'params': p, 'opt': _tx_pref.init(p)}, _randint(571, _VOC, 16, _SEQ + 1),
          _lengths_mask(572, 16, _SEQ, 3), _randn(573, 16))


# why: groups are runs of 4 rows of the flat batch, normalised by a reshape inside the step;
# splits aligned to multiples of 4 are exact, others mix groups -- unsure.
add('grpo_flat_rows_reshape_into_groups', grpo_flat_step, grpo_flat_make, expect_split=None)


class _Student(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(10)(nn.relu(nn.Dense(16)(x)))


class _Teacher(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(64)(x))
    return nn.Dense(10)(nn.relu(nn.Dense(64)(x)))


_teacher = _Teacher()


class _DistillState(train_state.TrainState):
  teacher_params: Any = None


def distill_step(state, x, labels):
  temp, alpha = 4.0, 0.7
  t_logits = jax.lax.stop_gradient(_teacher.apply({'params': state.teacher_params}, x))

  def loss_fn(params):
    s_logits = state.apply_fn({'params': params}, x)
    soft_t = jax.nn.softmax(t_logits / temp)
    kd = optax.kl_divergence(jax.nn.log_softmax(s_logits / temp), soft_t) * temp ** 2
    ce = optax.softmax_cross_entropy_with_integer_labels(s_logits, labels)
    return jnp.mean(alpha * kd + (1 - alpha) * ce), kd.mean()

  (loss, kd), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss, 'kd': kd}


def distill_make():
  x = _randn(580, 16, 12)
  t_params = _teacher.init(jax.random.PRNGKey(581), x)['params']
  student = _Student()
  params = student.init(jax.random.PRNGKey(580), x)['params']
  st = _DistillState.create(apply_fn=student.apply, params=params, tx=optax.adam(1e-3),
                            teacher_params=t_params)
  return st, x, _randint(582, 10, 16)


# why: the frozen teacher's logits are a per-example constant; temperature-scaled KL plus
# hard-label CE per example, averaged.
add('kd_frozen_teacher_temperature_kl', distill_step, distill_make, expect_split=True)


def _gae(rewards, values, last_value, dones, gamma=0.99, lam=0.95):
  """GAE for one environment's trajectory of length T (reverse scan)."""
  next_values = jnp.append(values[1:], last_value)

  def body(adv, xs):
    r, v, nv, d = xs
    delta = r + gamma * nv * (1 - d) - v
    adv = delta + gamma * lam * (1 - d) * adv
    return adv, adv

  _, adv = jax.lax.scan(body, 0.0, (rewards, values, next_values, dones), reverse=True)
  return adv


class _ActorCritic(nn.Module):
  actions: int = 3

  @nn.compact
  def __call__(self, obs):
    pi = nn.Dense(self.actions)(nn.tanh(nn.Dense(32)(obs)))
    v = nn.Dense(1)(nn.tanh(nn.Dense(32)(obs)))[..., 0]
    return pi, v


def ppo_step(state, batch):
  clip, vclip = 0.2, 0.2
  adv = jax.vmap(_gae)(batch['rewards'], batch['old_values'], batch['last_value'],
                       batch['dones'])
  returns = adv + batch['old_values']
  adv = (adv - adv.mean()) / (adv.std() + 1e-8)          # over the whole batch

  def loss_fn(params):
    logits, v = state.apply_fn({'params': params}, batch['obs'])
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits), batch['actions'][..., None],
                               -1)[..., 0]
    ratio = jnp.exp(logp - batch['old_logp'])
    pg = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - clip, 1 + clip) * adv).mean()
    v_clipped = batch['old_values'] + jnp.clip(v - batch['old_values'], -vclip, vclip)
    vf = 0.5 * jnp.maximum((v - returns) ** 2, (v_clipped - returns) ** 2).mean()
    ent = -jnp.sum(jax.nn.softmax(logits) * jax.nn.log_softmax(logits), -1).mean()
    return pg + 0.5 * vf - 0.01 * ent, {'pg': pg, 'vf': vf, 'entropy': ent,
                                        'approx_kl': jnp.mean(batch['old_logp'] - logp)}

  (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads), dict(aux, loss=loss)


def ppo_make():
  model = _ActorCritic()
  b, t = 8, 6
  obs = _randn(590, b, t, 5)
  params = model.init(jax.random.PRNGKey(590), obs)['params']
  st = train_state.TrainState.create(
      apply_fn=model.apply, params=params,
      tx=optax.chain(optax.clip_by_global_norm(0.5), optax.adam(2.5e-4, eps=1e-5)))
  logits, v = model.apply({'params': params}, obs)
  actions = _randint(591, 3, b, t)
  old_logp = jnp.take_along_axis(jax.nn.log_softmax(logits), actions[..., None], -1)[..., 0]
  batch = {'obs': obs, 'actions': actions, 'old_logp': old_logp, 'old_values': v,
           'rewards': _randn(592, b, t), 'last_value': _randn(593, b),
           'dones': _f(np.random.RandomState(594).rand(b, t) < 0.15)}
  return st, batch


# why: GAE is vmapped per environment (each row its own trajectory); the advantage mean/std
# over the batch is parameter-free and can be computed first; clipped policy, clipped value
# and entropy terms are token means.
add('ppo_vmap_gae_batch_adv_norm_value_clip', ppo_step, ppo_make, expect_split=True)


_tx_sac = optax.adam(3e-4)


def _q(p, obs, act):
  return _mlp_apply(p, jnp.concatenate([obs, act], -1), jax.nn.relu)[..., 0]


def _sample_action(p, obs, key):
  out = _mlp_apply(p, obs, jax.nn.relu)
  mu, log_std = out[..., :2], jnp.clip(out[..., 2:], -5.0, 2.0)
  eps = jax.random.normal(key, mu.shape)
  pre = mu + jnp.exp(log_std) * eps
  a = jnp.tanh(pre)
  logp = jnp.sum(-0.5 * eps ** 2 - log_std - 0.5 * np.log(2 * np.pi)
                 - jnp.log(1 - a ** 2 + 1e-6), -1)
  return a, logp


def sac_critic_step(state, obs, act, rew, next_obs, done):
  gamma, tau = 0.99, 0.005
  key = jax.random.fold_in(state['key'], state['step'])
  next_a, next_logp = _sample_action(state['actor'], next_obs, key)
  alpha = jnp.exp(state['log_alpha'])
  q_next = jnp.minimum(_q(state['target'][0], next_obs, next_a),
                       _q(state['target'][1], next_obs, next_a)) - alpha * next_logp
  target = jax.lax.stop_gradient(rew + gamma * (1 - done) * q_next)

  def loss_fn(qs):
    return sum(jnp.mean((_q(qp, obs, act) - target) ** 2) for qp in qs)

  loss, grads = jax.value_and_grad(loss_fn)(state['critics'])
  critics, opt = _opt_step(_tx_sac, state['critics'], state['opt'], grads)
  tgt = optax.incremental_update(critics, state['target'], tau)
  return dict(state, critics=critics, opt=opt, target=tgt, step=state['step'] + 1), {
      'q_loss': loss, 'target_q': target.mean()}


def sac_make():
  critics = (_mlp_params(600, [6, 32, 1]), _mlp_params(601, [6, 32, 1]))
  st = {'critics': critics, 'target': critics, 'opt': _tx_sac.init(critics),
        'actor': _mlp_params(602, [4, 32, 4]), 'log_alpha': jnp.asarray(-1.0),
        'key': jax.random.PRNGKey(603), 'step': jnp.zeros((), jnp.int32)}
  return (st, _randn(604, 16, 4), jnp.tanh(_randn(605, 16, 2)), _randn(606, 16),
          _randn(607, 16, 4), _f(np.random.RandomState(608).rand(16) < 0.1))


# why: next actions are sampled for the batch's shape inside the step (a split draws
# others); each transition's twin-Q TD error uses only its own row; Polyak target update.
add('sac_twin_q_critic_polyak_target', sac_critic_step, sac_make, stochastic=True,
    expect_split=True)


_tx_nstep = optax.chain(optax.clip_by_global_norm(10.0), optax.adam(1e-3))


def nstep_q_step(state, obs, actions, reward_seq, bootstrap_obs, done_seq):
  gamma = 0.97

  def discounted(rs, ds):
    def body(carry, xs):
      g, alive = carry
      r, d = xs
      return (g + alive * r, alive * gamma * (1 - d)), None

    (g, alive), _ = jax.lax.scan(body, (0.0, 1.0), (rs, ds))
    return g, alive

  ret, alive = jax.vmap(discounted)(reward_seq, done_seq)
  q_next = _mlp_apply(state['target'], bootstrap_obs, jax.nn.relu)
  online_next = _mlp_apply(state['params'], bootstrap_obs, jax.nn.relu)
  a_star = jnp.argmax(online_next, -1)
  boot = jnp.take_along_axis(q_next, a_star[:, None], -1)[:, 0]
  target = jax.lax.stop_gradient(ret + alive * boot)

  def loss_fn(p):
    q = jnp.take_along_axis(_mlp_apply(p, obs, jax.nn.relu), actions[:, None], -1)[:, 0]
    return jnp.mean(optax.huber_loss(q, target, delta=1.0))

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  params, opt = _opt_step(_tx_nstep, state['params'], state['opt'], grads)
  target_p = jax.tree_util.tree_map(
      lambda t, o: jnp.where(state['updates'] % 4 == 3, o, t), state['target'], params)
  return dict(state, params=params, opt=opt, target=target_p,
              updates=state['updates'] + 1), {'td_loss': loss}


def nstep_q_make():
  p = _mlp_params(610, [5, 32, 3])
  return ({'params': p, 'target': p, 'opt': _tx_nstep.init(p),
           'updates': jnp.zeros((), jnp.int32)}, _randn(611, 16, 5), _randint(612, 3, 16),
          _randn(613, 16, 3), _randn(614, 16, 5),
          _f(np.random.RandomState(615).rand(16, 3) < 0.1))


# why: n-step returns are a per-transition scan over its own reward sequence; double-DQN
# bootstrap from a frozen target net; Huber TD error averaged over transitions.
add('nstep_double_dqn_scan_returns_target_net', nstep_q_step, nstep_q_make,
    expect_split=True)

# ========================================================================================
# 5. assorted models and losses: graphs, flows, EBMs, GANs, metric learning, semi-supervision,
#    recurrences, implicit layers, weighting, augmentation given as inputs
# ========================================================================================

_tx_gcn = optax.adam(5e-3)


def gcn_step(state, batch):
  adj, nodes, node_mask = batch['adj'], batch['nodes'], batch['node_mask']
  a_hat = adj + jnp.eye(adj.shape[-1])[None] * node_mask[:, :, None]
  deg = a_hat.sum(-1)
  d_inv = jnp.where(deg > 0, jax.lax.rsqrt(jnp.maximum(deg, 1e-9)), 0.0)
  norm_adj = d_inv[:, :, None] * a_hat * d_inv[:, None, :]

  def loss_fn(p):
    h = jax.nn.relu(norm_adj @ (nodes @ p['w1']) + p['b1'])
    h = jax.nn.relu(norm_adj @ (h @ p['w2']) + p['b2'])
    pooled = jnp.sum(h * node_mask[..., None], 1) / node_mask.sum(1, keepdims=True)
    logits = pooled @ p['out']
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch['label']).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  params, opt = _opt_step(_tx_gcn, state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'loss': loss}


def gcn_make():
  rs = np.random.RandomState(700)
  b, n, f = 16, 6, 4
  node_mask = np.asarray(_lengths_mask(701, b, n, 3))
  adj = (rs.rand(b, n, n) < 0.4).astype(np.float32)
  adj = np.triu(adj, 1)
  adj = (adj + adj.transpose(0, 2, 1)) * node_mask[:, :, None] * node_mask[:, None, :]
  p = {'w1': _f(rs.randn(f, 16) / 2), 'b1': _f(np.zeros(16)), 'w2': _f(rs.randn(16, 16) / 4),
       'b2': _f(np.zeros(16)), 'out': _f(rs.randn(16, 3) / 4)}
  batch = {'adj': _f(adj), 'nodes': _randn(702, b, n, f), 'node_mask': _f(node_mask),
           'label': _randint(703, 3, b)}
  return {'params': p, 'opt': _tx_gcn.init(p)}, batch


# why: each graph has its own adjacency and node mask; message passing stays inside a graph;
# graph-level CE averaged over graphs.
add('gcn_per_graph_adjacency_mean_pool', gcn_step, gcn_make, expect_split=True)


_tx_flow = optax.adam(1e-3)
_COUPLING_MASKS = (np.array([1, 1, 0, 0], np.float32), np.array([0, 0, 1, 1], np.float32),
                   np.array([1, 0, 1, 0], np.float32))


def realnvp_step(state, x):
  params, opt_state = state

  def log_prob(p, x):
    z, logdet = x, jnp.zeros(x.shape[0])
    for layer, m in zip(p, _COUPLING_MASKS):
      h = _mlp_apply(layer, z * m, jnp.tanh)
      s = jnp.tanh(h[:, :4]) * (1 - m)
      t = h[:, 4:] * (1 - m)
      z = z * m + (1 - m) * (z * jnp.exp(s) + t)
      logdet = logdet + s.sum(-1)
    base = -0.5 * jnp.sum(z ** 2, -1) - 0.5 * z.shape[-1] * np.log(2 * np.pi)
    return base + logdet

  def loss_fn(p):
    return -jnp.mean(log_prob(p, x))

  loss, grads = jax.value_and_grad(loss_fn)(params)
  return _opt_step(_tx_flow, params, opt_state, grads), {'nll': loss,
                                                          'bits_per_dim': loss / (4 * np.log(2))}


def realnvp_make():
  p = [_mlp_params(710 + i, [4, 16, 8]) for i in range(3)]
  x = _randn(714, 16, 4) @ _f([[1.0, 0.5, 0, 0], [0, 1.0, 0.3, 0], [0, 0, 1.0, 0.2],
                               [0.1, 0, 0, 1.0]])
  return (p, _tx_flow.init(p)), x


# why: affine coupling layers map each example on its own; exact NLL with the log-det per
# example, averaged.
add('realnvp_affine_coupling_nll', realnvp_step, realnvp_make, expect_split=True)


class _Energy(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(6, 32, rngs=rngs)
    self.l2 = nnx.Linear(32, 32, rngs=rngs)
    self.l3 = nnx.Linear(32, 1, rngs=rngs)

  def __call__(self, x):
    return self.l3(nnx.swish(self.l2(nnx.swish(self.l1(x)))))[:, 0]


def ebm_given_neg_step(state, pos, neg):
  model, optimizer = state

  def loss_fn(model):
    e_pos, e_neg = model(pos), model(neg)
    cd = e_pos.mean() - e_neg.mean()
    reg = 0.1 * (jnp.mean(e_pos ** 2) + jnp.mean(e_neg ** 2))
    return cd + reg, cd

  (loss, cd), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
  optimizer.update(model, grads)
  return (model, optimizer), {'loss': loss, 'cd': cd}


def ebm_given_neg_make():
  model = _Energy(nnx.Rngs(720))
  opt = nnx.Optimizer(model, optax.adam(1e-3, b1=0.0, b2=0.999), wrt=nnx.Param)
  return (model, opt), _randn(721, 16, 6), _randn(722, 24, 6, scale=1.5)


# why: negatives come from a replay buffer as input (a different count than positives); the
# loss is a mean over positives minus a mean over negatives plus squared-energy means.
add('ebm_contrastive_divergence_replay_negatives', ebm_given_neg_step, ebm_given_neg_make,
    expect_split=True)


_tx_ebm_l = optax.adam(1e-3)


def ebm_langevin_step(state, pos):
  key = jax.random.fold_in(state['key'], state['step'])
  k0, k1 = jax.random.split(key)
  p_sg = jax.lax.stop_gradient(state['params'])
  energy = lambda p, x: _mlp_apply(p, x, jax.nn.swish)[:, 0]
  grad_x = jax.grad(lambda x: energy(p_sg, x).sum())          # per-example input gradients

  def langevin(i, x):
    noise = jax.random.normal(jax.random.fold_in(k1, i), x.shape)
    return x - 0.05 * grad_x(x) + 0.01 * noise

  neg = jax.lax.fori_loop(0, 5, langevin, jax.random.uniform(k0, pos.shape, minval=-2,
                                                             maxval=2))
  neg = jax.lax.stop_gradient(neg)

  def loss_fn(p):
    return energy(p, pos).mean() - energy(p, neg).mean() + 0.1 * jnp.mean(energy(p, pos) ** 2)

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  params, opt = _opt_step(_tx_ebm_l, state['params'], state['opt'], grads)
  return dict(state, params=params, opt=opt, step=state['step'] + 1), {'loss': loss}


def ebm_langevin_make():
  p = _mlp_params(730, [6, 32, 1])
  return ({'params': p, 'opt': _tx_ebm_l.init(p), 'key': jax.random.PRNGKey(731),
           'step': jnp.zeros((), jnp.int32)}, _randn(732, 16, 6))


# why: Langevin chains (lax.fori_loop) start from noise drawn for the batch's shape (a split
# draws others); grad of the summed energy gives each chain its own input gradient; the
# loss is a difference of batch means.
add('ebm_langevin_fori_loop_negatives', ebm_langevin_step, ebm_langevin_make,
    stochastic=True, expect_split=True)


_tx_arc = optax.sgd(0.1, momentum=0.9, nesterov=True)


def arcface_step(state, x, labels):
  s, m = 16.0, 0.3

  def loss_fn(p):
    emb = _unit(_mlp_apply(p['net'], x))
    w = p['classes'] / jnp.linalg.norm(p['classes'], axis=0, keepdims=True)
    cos = jnp.clip(emb @ w, -1 + 1e-6, 1 - 1e-6)
    theta = jnp.arccos(cos)
    onehot = jax.nn.one_hot(labels, w.shape[1])
    logits = s * jnp.where(onehot > 0, jnp.cos(theta + m), cos)
    return optax.softmax_cross_entropy(logits, onehot).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  params, opt = _opt_step(_tx_arc, state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'loss': loss}


def arcface_make():
  p = {'net': _mlp_params(740, [8, 32, 8]), 'classes': _randn(741, 8, 6)}
  return {'params': p, 'opt': _tx_arc.init(p)}, _randn(742, 16, 8), _randint(743, 6, 16)


# why: the margin is applied against learned class centres (parameters), not against other
# examples; mean CE.
add('arcface_additive_angular_margin', arcface_step, arcface_make, expect_split=True)


_tx_wbce = optax.adagrad(5e-2)


def weighted_bce_step(state, x, y, w):
  params, opt_state = state

  def loss_fn(p):
    logit = _mlp_apply(p, x)[:, 0]
    l = optax.sigmoid_binary_cross_entropy(logit, y)
    return jnp.sum(w * l) / jnp.sum(w)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  return _opt_step(_tx_wbce, params, opt_state, grads), {'wbce': loss}


def weighted_bce_make():
  p = _mlp_params(750, [7, 16, 1])
  return ((p, _tx_wbce.init(p)), _randn(751, 16, 7),
          _f(np.random.RandomState(752).rand(16) > 0.7), _rand(753, 16) * 2)


# why: importance weights per example; weighted sum over weighted count (two sums).
add('weighted_bce_sum_over_weight_sum', weighted_bce_step, weighted_bce_make,
    expect_split=True)


_CLASS_W = jnp.asarray([0.2, 1.0, 3.0, 1.5], jnp.float32)
_tx_cw = optax.adam(3e-3)


def class_weighted_ce_step(state, batch):
  x, labels = batch

  def loss_fn(p):
    ce = optax.softmax_cross_entropy_with_integer_labels(_mlp_apply(p, x), labels)
    wt = _CLASS_W[labels]
    return jnp.sum(wt * ce) / jnp.sum(wt)           # torch CrossEntropyLoss(weight=...)

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  params, opt = _opt_step(_tx_cw, state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'loss': loss}


def class_weighted_ce_make():
  p = _mlp_params(760, [8, 16, 4])
  return {'params': p, 'opt': _tx_cw.init(p)}, _cls_batch(761)


# why: fixed class weights; the weighted mean is a ratio of two batch sums.
add('class_weighted_ce_torch_style_mean', class_weighted_ce_step, class_weighted_ce_make,
    expect_split=True)


_tx_gan = optax.adam(1e-4, b1=0.5, b2=0.9)


def wgan_gp_critic_step(state, real, z, eps):
  fake = jax.lax.stop_gradient(_mlp_apply(state['gen'], z, jax.nn.relu))
  x_hat = eps[:, None] * real + (1 - eps[:, None]) * fake

  def loss_fn(critic):
    d = lambda v: _mlp_apply(critic, v[None], jax.nn.leaky_relu)[0, 0]
    g = jax.vmap(jax.grad(d))(x_hat)
    gp = jnp.mean((jnp.sqrt(jnp.sum(g ** 2, -1) + 1e-12) - 1.0) ** 2)
    d_real = _mlp_apply(critic, real, jax.nn.leaky_relu)[:, 0]
    d_fake = _mlp_apply(critic, fake, jax.nn.leaky_relu)[:, 0]
    w_dist = d_real.mean() - d_fake.mean()
    return -w_dist + 10.0 * gp, (w_dist, gp)

  (loss, (w, gp)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['critic'])
  critic, opt = _opt_step(_tx_gan, state['critic'], state['opt'], grads)
  return dict(state, critic=critic, opt=opt), {'loss': loss, 'w_dist': w, 'gp': gp}


def wgan_gp_make():
  critic = _mlp_params(770, [6, 32, 32, 1])
  return ({'critic': critic, 'opt': _tx_gan.init(critic), 'gen': _mlp_params(771, [4, 32, 6])},
          _randn(772, 16, 6), _randn(773, 16, 4), _rand(774, 16))


# why: the gradient penalty is vmapped per interpolate (eps is an input), the critic has no
# batch norm; Wasserstein estimate and penalty are batch means.
add('wgan_gp_per_example_gradient_penalty', wgan_gp_critic_step, wgan_gp_make,
    expect_split=True)


_tx_g = optax.adam(2e-4, b1=0.5)
_tx_d = optax.adam(2e-4, b1=0.5)


def gan_two_vag_step(state, real, z):
  gen_fn = lambda g, z: jnp.tanh(_mlp_apply(g, z, jax.nn.relu))
  disc_fn = lambda d, x: _mlp_apply(d, x, jax.nn.leaky_relu)[:, 0]

  def g_loss(g):
    return -jnp.mean(jax.nn.log_sigmoid(disc_fn(state['d'], gen_fn(g, z))))   # non-saturating

  gl, g_grads = jax.value_and_grad(g_loss)(state['g'])
  g, g_opt = _opt_step(_tx_g, state['g'], state['g_opt'], g_grads)
  fake = jax.lax.stop_gradient(gen_fn(g, z))

  def d_loss(d):
    return (-jnp.mean(jax.nn.log_sigmoid(disc_fn(d, real)))
            - jnp.mean(jax.nn.log_sigmoid(-disc_fn(d, fake))))

  dl, d_grads = jax.value_and_grad(d_loss)(state['d'])
  d, d_opt = _opt_step(_tx_d, state['d'], state['d_opt'], d_grads)
  return {'g': g, 'd': d, 'g_opt': g_opt, 'd_opt': d_opt}, {'g_loss': gl, 'd_loss': dl}


def gan_two_vag_make():
  g, d = _mlp_params(780, [4, 32, 6]), _mlp_params(781, [6, 32, 1])
  return ({'g': g, 'd': d, 'g_opt': _tx_g.init(g), 'd_opt': _tx_d.init(d)},
          _randn(782, 16, 6), _randn(783, 16, 4))


# why: two value_and_grad calls in sequence (generator, then discriminator on the updated
# generator's samples); both losses are batch means with z given per example.
add('gan_generator_then_discriminator_two_vag', gan_two_vag_step, gan_two_vag_make,
    expect_split=True)


def fixmatch_step(state, batch):
  x_l, y_l = batch['labeled']
  thresh, lam = 0.6, 1.0

  def loss_fn(params):
    logits_l = state.apply_fn({'params': params}, x_l)
    sup = optax.softmax_cross_entropy_with_integer_labels(logits_l, y_l).mean()
    probs_w = jax.nn.softmax(jax.lax.stop_gradient(
        state.apply_fn({'params': params}, batch['weak'])))
    pseudo, conf = probs_w.argmax(-1), probs_w.max(-1)
    mask = (conf >= thresh).astype(jnp.float32)
    logits_s = state.apply_fn({'params': params}, batch['strong'])
    unsup = jnp.mean(mask * optax.softmax_cross_entropy_with_integer_labels(logits_s, pseudo))
    return sup + lam * unsup, {'sup': sup, 'unsup': unsup, 'mask_rate': mask.mean()}

  (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads), dict(aux, loss=loss)


class _SmallCls(nn.Module):
  classes: int = 4

  @nn.compact
  def __call__(self, x):
    x = nn.LayerNorm()(nn.gelu(nn.Dense(32)(x)))
    return nn.Dense(self.classes)(x)


def fixmatch_make():
  model = _SmallCls()
  xu = _randn(790, 16, 8)
  params = model.init(jax.random.PRNGKey(790), xu)['params']
  st = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                     tx=optax.sgd(0.03, momentum=0.9, nesterov=True))
  batch = {'labeled': (_randn(791, 8, 8), _randint(792, 4, 8)),
           'weak': xu + _randn(793, 16, 8, scale=0.05), 'strong': xu + _randn(794, 16, 8,
                                                                              scale=0.5)}
  return st, batch


# why: FixMatch consistency between a weak and a strong view given as inputs; pseudo-labels
# and confidence masks are per unlabeled example; labeled (8) and unlabeled (16) parts are
# each batch means.
add('fixmatch_weak_strong_views_two_batch_sizes', fixmatch_step, fixmatch_make,
    expect_split=True)


_tx_mix = optax.adamw(1e-3)


def mixup_perm_step(state, x, labels, perm, lam):
  y = jax.nn.one_hot(labels, 4)
  xm = lam[:, None] * x + (1 - lam[:, None]) * x[perm]
  ym = lam[:, None] * y + (1 - lam[:, None]) * y[perm]

  def loss_fn(p):
    return optax.softmax_cross_entropy(_mlp_apply(p, xm), ym).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  params, opt = _opt_step(_tx_mix, state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'loss': loss}


def mixup_perm_make():
  p = _mlp_params(800, [8, 32, 4])
  rs = np.random.RandomState(801)
  return ({'params': p, 'opt': _tx_mix.init(p)},) + _cls_batch(802) + (
      jnp.asarray(rs.permutation(16), jnp.int32), _f(rs.beta(0.4, 0.4, size=16)))


# why: the partner permutation and the mixing weights are inputs; the mixed batch is
# parameter-free preprocessing of the whole batch, after which each mixed row is one
# soft-label CE term.
add('mixup_permutation_and_lambda_given', mixup_perm_step, mixup_perm_make,
    expect_split=True)


class _TinyCNN(nn.Module):
  classes: int = 4

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(8, (3, 3))(x))
    x = nn.relu(nn.Conv(8, (3, 3), strides=(2, 2))(x))
    return nn.Dense(self.classes)(x.mean((1, 2)))


def cutmix_step(state, images, labels, box, perm):
  m = box[..., None]
  mixed = images * (1 - m) + images[perm] * m
  lam = 1.0 - box.mean((1, 2))
  y = jax.nn.one_hot(labels, 4)
  target = lam[:, None] * y + (1 - lam[:, None]) * y[perm]

  def loss_fn(params):
    return optax.softmax_cross_entropy(state.apply_fn({'params': params}, mixed),
                                       target).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


def cutmix_make():
  model = _TinyCNN()
  imgs = _randn(810, 8, 8, 8, 3)
  params = model.init(jax.random.PRNGKey(810), imgs)['params']
  st = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))
  rs = np.random.RandomState(811)
  box = np.zeros((8, 8, 8), np.float32)
  for i in range(8):
    r, c, h, w = rs.randint(0, 5), rs.randint(0, 5), rs.randint(2, 5), rs.randint(2, 5)
    box[i, r:r + h, c:c + w] = 1
  return st, imgs, _randint(812, 4, 8), _f(box), jnp.asarray(rs.permutation(8), jnp.int32)


# why: CutMix boxes and partner permutation are inputs, so the mixed images and soft labels
# are preprocessing of the whole batch; per-image CE averaged.
add('cutmix_boxes_and_permutation_given', cutmix_step, cutmix_make, expect_split=True)


_tx_noise = optax.adam(3e-3)


def label_noise_step(state, x, labels):
  key = jax.random.fold_in(state['key'], state['step'])
  k_flip, k_cls = jax.random.split(key)
  flip = jax.random.bernoulli(k_flip, 0.1, labels.shape)
  noisy = jnp.where(flip, jax.random.randint(k_cls, labels.shape, 0, 4), labels)

  def loss_fn(p):
    return optax.softmax_cross_entropy_with_integer_labels(_mlp_apply(p, x), noisy).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  params, opt = _opt_step(_tx_noise, state['params'], state['opt'], grads)
  return dict(state, params=params, opt=opt, step=state['step'] + 1), {
      'loss': loss, 'flip_rate': flip.mean()}


def label_noise_make():
  p = _mlp_params(820, [8, 16, 4])
  return ({'params': p, 'opt': _tx_noise.init(p), 'key': jax.random.PRNGKey(821),
           'step': jnp.zeros((), jnp.int32)},) + _cls_batch(822)


# why: symmetric label noise injected per example from a key in the state (a split draws
# other flips); mean CE on the noisy labels.
add('symmetric_label_noise_key_in_state', label_noise_step, label_noise_make,
    stochastic=True, expect_split=True)


class _MultiTask(nnx.Module):
  def __init__(self, rngs):
    self.trunk = nnx.Linear(10, 32, rngs=rngs)
    self.cls_head = nnx.Linear(32, 5, rngs=rngs)
    self.reg_head = nnx.Linear(32, 2, rngs=rngs)
    self.bin_head = nnx.Linear(32, 1, rngs=rngs)
    self.log_vars = nnx.Param(jnp.zeros(3))

  def __call__(self, x):
    h = nnx.gelu(self.trunk(x))
    return self.cls_head(h), self.reg_head(h), self.bin_head(h)[:, 0]


def multitask_step(state, batch):
  model, optimizer = state['model'], state['optimizer']

  def loss_fn(model):
    logits, reg, bin_logit = model(batch['x'])
    l_cls = optax.softmax_cross_entropy_with_integer_labels(logits, batch['cls']).mean()
    l_reg = jnp.mean((reg - batch['reg']) ** 2)
    l_bin = optax.sigmoid_binary_cross_entropy(bin_logit, batch['bin']).mean()
    s = model.log_vars[...]
    losses = jnp.stack([l_cls, l_reg, l_bin])
    return jnp.sum(jnp.exp(-s) * losses + s), losses

  (loss, losses), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
  optimizer.update(model, grads)
  return {'model': model, 'optimizer': optimizer}, {
      'loss': loss, 'cls': losses[0], 'reg': losses[1], 'bin': losses[2]}


def multitask_make():
  model = _MultiTask(nnx.Rngs(830))
  opt = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
  batch = {'x': _randn(831, 16, 10), 'cls': _randint(832, 5, 16), 'reg': _randn(833, 16, 2),
           'bin': _f(np.random.RandomState(834).rand(16) > 0.5)}
  return {'model': model, 'optimizer': opt}, batch


# why: Kendall-style uncertainty weighting: learned log-variances times three batch-mean
# task losses -- a function of three sums.
add('multitask_uncertainty_weighting_nnx', multitask_step, multitask_make, expect_split=True)


def pr_metrics_step(state, x, y):
  def loss_fn(params):
    logit = state.apply_fn({'params': params}, x)[:, 0]
    return optax.sigmoid_binary_cross_entropy(logit, y).mean(), logit

  (loss, logit), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  pred = (logit > 0).astype(jnp.float32)
  tp, fp, fn = jnp.sum(pred * y), jnp.sum(pred * (1 - y)), jnp.sum((1 - pred) * y)
  precision = tp / jnp.maximum(tp + fp, 1.0)
  recall = tp / jnp.maximum(tp + fn, 1.0)
  return state.apply_gradients(grads=grads), {
      'loss': loss, 'tp': tp, 'fp': fp, 'fn': fn, 'precision': precision, 'recall': recall,
      'f1': 2 * precision * recall / jnp.maximum(precision + recall, 1e-8),
      'auc_proxy': jnp.mean(jax.nn.sigmoid(logit) * y) - jnp.mean(jax.nn.sigmoid(logit))}


def pr_metrics_make():
  model = _SmallCls(classes=1)
  x = _randn(840, 16, 8)
  params = model.init(jax.random.PRNGKey(840), x)['params']
  st = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(3e-3))
  return st, x, _f(np.random.RandomState(841).rand(16) > 0.6)


# why: mean BCE over examples; precision/recall/F1 are reported metrics built from batch
# counts, not part of the loss.
add('has_aux_logits_precision_recall_metrics', pr_metrics_step, pr_metrics_make,
    expect_split=True)


_tx_lstm = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(3e-3))


def _lstm_init(seed, d_in, d):
  rs = np.random.RandomState(seed)
  return {'wx': _f(rs.randn(d_in, 4 * d) / np.sqrt(d_in)),
          'wh': _f(rs.randn(d, 4 * d) / np.sqrt(d)), 'b': _f(np.zeros(4 * d)),
          'out': _f(rs.randn(d, 3) / np.sqrt(d))}


def lstm_scan_step(state, x, lengths, labels):
  params, opt_state = state

  def loss_fn(p):
    b, t, _ = x.shape
    d = p['wh'].shape[0]

    def cell(carry, inp):
      h, c = carry
      x_t, alive = inp
      z = x_t @ p['wx'] + h @ p['wh'] + p['b']
      i, f, g, o = jnp.split(z, 4, -1)
      c_new = jax.nn.sigmoid(f + 1.0) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
      h_new = jax.nn.sigmoid(o) * jnp.tanh(c_new)
      keep = alive[:, None]
      return (keep * h_new + (1 - keep) * h, keep * c_new + (1 - keep) * c), None

    alive = (jnp.arange(t)[:, None] < lengths[None, :]).astype(jnp.float32)   # T, B
    (h, _), _ = jax.lax.scan(cell, (jnp.zeros((b, d)), jnp.zeros((b, d))),
                             (x.swapaxes(0, 1), alive))
    return optax.softmax_cross_entropy_with_integer_labels(h @ p['out'], labels).mean()

  loss, grads = jax.value_and_grad(loss_fn)(params)
  return _opt_step(_tx_lstm, params, opt_state, grads), {'loss': loss}


def lstm_scan_make():
  p = _lstm_init(850, 5, 16)
  return ((p, _tx_lstm.init(p)), _randn(851, 16, 12, 5),
          jnp.asarray(np.random.RandomState(852).randint(3, 13, size=16), jnp.int32),
          _randint(853, 3, 16))


# why: a hand-written LSTM scanned over time with the batch in the carry; each row freezes
# at its own length; classification from the last hidden state, mean CE.
add('lstm_manual_lax_scan_variable_lengths', lstm_scan_step, lstm_scan_make,
    expect_split=True)


_tx_refine = optax.adam(3e-3)


def fori_refine_step(state, x, y):
  def loss_fn(p):
    u = x @ p['u']

    def body(i, h):
      return h + 0.5 * jnp.tanh(h @ p['w'] + u + p['b'] * (i + 1))

    h = jax.lax.fori_loop(0, 4, body, jnp.zeros_like(u))
    return jnp.mean(jnp.abs(h @ p['out'] - y))

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  params, opt = _opt_step(_tx_refine, state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'mae': loss}


def fori_refine_make():
  rs = np.random.RandomState(860)
  p = {'u': _f(rs.randn(6, 16) / np.sqrt(6)), 'w': _f(rs.randn(16, 16) / 8),
       'b': _f(rs.randn(16) * 0.1), 'out': _f(rs.randn(16, 2) / 4)}
  return {'params': p, 'opt': _tx_refine.init(p)}, _randn(861, 16, 6), _randn(862, 16, 2)


# why: a fixed-trip-count fori_loop refining each row's state (differentiable, turned into a
# scan); mean absolute error over examples.
add('fori_loop_iterative_refinement_l1', fori_refine_step, fori_refine_make,
    expect_split=True)


_tx_deq = optax.adam(2e-3)


def _deq_f(p, z, x):
  return jnp.tanh(z @ p['w'] + x @ p['u'] + p['b'])


def deq_vmap_step(state, x, labels):
  p_sg = jax.lax.stop_gradient(state['params'])

  def solve_one(xi):
    def cond(c):
      z, res, it = c
      return (res > 1e-4) & (it < 40)

    def body(c):
      z, _, it = c
      z_new = _deq_f(p_sg, z, xi)
      return z_new, jnp.max(jnp.abs(z_new - z)), it + 1

    z, _, it = jax.lax.while_loop(cond, body, (jnp.zeros(16), jnp.inf, 0))
    return z, it

  z_star, iters = jax.vmap(solve_one)(x)

  def loss_fn(p):
    z = _deq_f(p, z_star, x)                                     # one-step phantom gradient
    return optax.softmax_cross_entropy_with_integer_labels(z @ p['out'], labels).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  params, opt = _opt_step(_tx_deq, state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'loss': loss, 'iters': iters.mean()}


def deq_make(seed):
  rs = np.random.RandomState(seed)
  p = {'w': _f(rs.randn(16, 16) * 0.3 / 4), 'u': _f(rs.randn(6, 16) / np.sqrt(6)),
       'b': _f(np.zeros(16)), 'out': _f(rs.randn(16, 3) / 4)}
  return {'params': p, 'opt': _tx_deq.init(p)}, _randn(seed + 1, 16, 6), _randint(seed + 2, 3,
                                                                                    16)


# why: a vmapped while_loop finds each example's own fixed point to its own tolerance (a
# batched predicate freezes finished rows); one-step gradient, mean CE.
add('deq_vmapped_while_loop_fixed_point', deq_vmap_step, lambda: deq_make(870),
    expect_split=True)


def deq_global_step(state, x, labels):
  p_sg = jax.lax.stop_gradient(state['params'])

  def cond(c):
    z, res, it = c
    return (res > 1e-3) & (it < 40)

  def body(c):
    z, _, it = c
    z_new = _deq_f(p_sg, z, x)
    return z_new, jnp.max(jnp.abs(z_new - z)), it + 1              # max over the batch

  z_star, _, iters = jax.lax.while_loop(cond, body, (jnp.zeros((x.shape[0], 16)), jnp.inf, 0))

  def loss_fn(p):
    z = _deq_f(p, z_star, x)
    return optax.softmax_cross_entropy_with_integer_labels(z @ p['out'], labels).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  params, opt = _opt_step(_tx_deq, state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'loss': loss, 'iters': iters}


# why: the solver stops when the worst row of the batch converges, so every row's iterate
# count depends on the others; a microbatch stops at another count (differences near the
# tolerance) -- exact only up to the solver tolerance, unsure.
add('deq_batch_while_loop_global_tolerance', deq_global_step, lambda: deq_make(880),
    expect_split=None)


_tx_pex = optax.sgd(0.1)


def per_example_grads_step(state, x, y):
  def single_loss(p, xi, yi):
    return jnp.mean((_mlp_apply(p, xi[None]) - yi[None]) ** 2)

  losses, per_ex = jax.vmap(jax.value_and_grad(single_loss), in_axes=(None, 0, 0))(
      state['params'], x, y)
  norms = jnp.sqrt(sum(jnp.sum(g.reshape(g.shape[0], -1) ** 2, -1)
                       for g in jax.tree_util.tree_leaves(per_ex)))
  grads = jax.tree_util.tree_map(lambda g: g.mean(0), per_ex)
  params, opt = _opt_step(_tx_pex, state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'loss': losses.mean(), 'grad_norm_p50':
                                          jnp.median(norms), 'grad_norm_max': norms.max()}


def per_example_grads_make():
  p = _mlp_params(890, [5, 16, 2])
  return {'params': p, 'opt': _tx_pex.init(p)}, _randn(891, 16, 5), _randn(892, 16, 2)


# why: vmap(grad) per example, then the plain mean of per-example gradients (no clipping);
# the median/max of per-example gradient norms are only logged.
add('vmap_per_example_grads_norm_logging', per_example_grads_step, per_example_grads_make,
    expect_split=True)


class _BNResBlock(nn.Module):
  ch: int

  @nn.compact
  def __call__(self, x, train):
    y = nn.Conv(self.ch, (3, 3), use_bias=False)(x)
    y = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(y))
    y = nn.Conv(self.ch, (3, 3), use_bias=False)(y)
    y = nn.BatchNorm(use_running_average=not train, momentum=0.9,
                     scale_init=nn.initializers.zeros)(y)
    return nn.relu(x + y)


class _TinyResNet(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Conv(8, (3, 3))(x)))
    x = _BNResBlock(8)(x, train)
    return nn.Dense(4)(x.mean((1, 2)))


def resnet_bn_step(state, batch):
  def loss_fn(params):
    logits, mut = state.apply_fn({'params': params, 'batch_stats': state.batch_stats},
                                 batch['image'], train=True, mutable=['batch_stats'])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch['label']).mean()
    l2 = sum(jnp.sum(w ** 2) for w in jax.tree_util.tree_leaves(params) if w.ndim == 4)
    return loss + 5e-4 * l2, (loss, mut['batch_stats'])

  (_, (loss, stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads, batch_stats=stats), {'loss': loss}


def resnet_bn_make():
  model = _TinyResNet()
  imgs = _randn(900, 8, 6, 6, 3)
  v = model.init(jax.random.PRNGKey(900), imgs, train=False)
  st = _StatsTrainState.create(apply_fn=model.apply, params=v['params'],
                               tx=optax.sgd(0.1, momentum=0.9), batch_stats=v['batch_stats'])
  return st, {'image': imgs, 'label': _randint(901, 4, 8)}


# why: train-mode BatchNorm couples the rows, but only through per-channel means and
# variances (sums over examples and pixels); forward statistics and the gradient's terms
# through them are further sums, so a fixed number of passes over microbatches (a few per
# BN layer) reproduces it exactly.
add('resnet_block_batchnorm_train_mode', resnet_bn_step, resnet_bn_make, expect_split=True)


_tx_proto = optax.adam(1e-3)


def protonet_step(state, support, query):
  """support (E, N, K, D), query (E, N, Q, D): E episodes of N-way K-shot per batch row."""
  e, n, q, _ = query.shape

  def loss_fn(p):
    protos = _mlp_apply(p, support).mean(2)                            # E, N, H
    zq = _mlp_apply(p, query)                                          # E, N, Q, H
    d2 = jnp.sum((zq[:, :, :, None] - protos[:, None, None]) ** 2, -1)  # E, N, Q, N
    labels = jnp.broadcast_to(jnp.arange(n)[None, :, None], (e, n, q))
    ce = optax.softmax_cross_entropy_with_integer_labels(-d2, labels)
    return ce.mean(), jnp.mean(jnp.argmin(d2, -1) == labels)

  (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  params, opt = _opt_step(_tx_proto, state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'loss': loss, 'acc': acc}


def protonet_make():
  p = _mlp_params(910, [6, 16, 8])
  return ({'params': p, 'opt': _tx_proto.init(p)}, _randn(911, 8, 3, 2, 6),
          _randn(912, 8, 3, 2, 6))


# why: prototypes are built from the support set of the same episode (one batch row);
# episodes never see each other; mean over episodes and queries.
add('protonet_episodes_as_batch_rows', protonet_step, protonet_make, expect_split=True)


_tx_center = optax.adam(3e-3)


def center_loss_step(state, x, labels):
  def loss_fn(p):
    feat = _mlp_apply(p['net'], x)
    logits = feat @ p['cls']
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    center = 0.5 * jnp.mean(jnp.sum((feat - p['centers'][labels]) ** 2, -1))
    return ce + 0.05 * center, center

  (loss, c), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  params, opt = _opt_step(_tx_center, state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'loss': loss, 'center': c}


def center_loss_make():
  p = {'net': _mlp_params(920, [8, 16, 6]), 'cls': _randn(921, 6, 4, scale=0.4),
       'centers': _randn(922, 4, 6, scale=0.1)}
  return ({'params': p, 'opt': _tx_center.init(p)},) + _cls_batch(923)


# why: the pull is towards learned class centres (parameters), not batch means; both terms
# are means over examples.
add('center_loss_learned_class_centres', center_loss_step, center_loss_make,
    expect_split=True)


class _NnxDropoutMLP(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(8, 32, rngs=rngs)
    self.drop1 = nnx.Dropout(0.2, rngs=rngs)
    self.l2 = nnx.Linear(32, 32, rngs=rngs)
    self.drop2 = nnx.Dropout(0.2, rngs=rngs)
    self.l3 = nnx.Linear(32, 4, rngs=rngs)

  def __call__(self, x):
    x = self.drop1(nnx.relu(self.l1(x)))
    return self.l3(self.drop2(nnx.relu(self.l2(x))))


def nnx_dropout_step(state, x, labels):
  model, optimizer = state
  model.train()

  def loss_fn(model):
    logits = model(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return (model, optimizer), {'loss': loss}


def nnx_dropout_make():
  model = _NnxDropoutMLP(nnx.Rngs(params=930, dropout=931))
  opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
  return ((model, opt),) + _cls_batch(932)


# why: nnx.Dropout draws from the model's own rng stream for the batch's shape (a split
# draws other masks); per-example CE averaged.
add('nnx_dropout_rngs_stream_in_model', nnx_dropout_step, nnx_dropout_make, stochastic=True,
    expect_split=True)


class _DropCls(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Dropout(0.3, deterministic=not train)(nn.gelu(nn.Dense(32)(x)))
    return nn.Dense(4)(x)


def rdrop_step(state, x, labels):
  k1, k2 = jax.random.split(jax.random.fold_in(state.rng, state.step))
  alpha = 1.0

  def loss_fn(params):
    l1 = state.apply_fn({'params': params}, x, train=True, rngs={'dropout': k1})
    l2 = state.apply_fn({'params': params}, x, train=True, rngs={'dropout': k2})
    ce = 0.5 * (optax.softmax_cross_entropy_with_integer_labels(l1, labels)
                + optax.softmax_cross_entropy_with_integer_labels(l2, labels))
    lp1, lp2 = jax.nn.log_softmax(l1), jax.nn.log_softmax(l2)
    kl = 0.5 * (optax.kl_divergence(lp1, jnp.exp(lp2)) + optax.kl_divergence(lp2, jnp.exp(lp1)))
    return jnp.mean(ce + alpha * kl), kl.mean()

  (loss, kl), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss, 'kl': kl}


def rdrop_make():
  model = _DropCls()
  x = _randn(940, 16, 8)
  params = model.init(jax.random.PRNGKey(940), x, train=False)['params']
  st = _RngTrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3),
                             rng=jax.random.PRNGKey(941))
  return st, x, _randint(942, 4, 16)


# why: R-Drop: two dropout passes of the same example and a symmetric KL between them, per
# example (the masks depend on the batch shape); mean over the batch.
add('r_drop_two_dropout_passes_symmetric_kl', rdrop_step, rdrop_make, stochastic=True,
    expect_split=True)


_tx_vq = optax.adam(1e-3)


def vqvae_ema_step(state, x):
  decay, beta, eps = 0.99, 0.25, 1e-5
  codebook = state['codebook']

  def loss_fn(p):
    z_e = _mlp_apply(p['enc'], x)
    d2 = (jnp.sum(z_e ** 2, -1, keepdims=True) - 2 * z_e @ codebook.T
          + jnp.sum(codebook ** 2, -1)[None])
    idx = jnp.argmin(d2, -1)
    e = codebook[idx]
    z_q = z_e + jax.lax.stop_gradient(e - z_e)                    # straight-through
    recon = jnp.mean(jnp.sum((_mlp_apply(p['dec'], z_q) - x) ** 2, -1))
    commit = jnp.mean(jnp.sum((z_e - jax.lax.stop_gradient(e)) ** 2, -1))
    return recon + beta * commit, (z_e, idx, recon)

  (loss, (z_e, idx, recon)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  params, opt = _opt_step(_tx_vq, state['params'], state['opt'], grads)
  onehot = jax.nn.one_hot(idx, codebook.shape[0])
  cluster = decay * state['cluster_size'] + (1 - decay) * onehot.sum(0)
  embed_sum = decay * state['embed_sum'] + (1 - decay) * onehot.T @ jax.lax.stop_gradient(z_e)
  n = cluster.sum()
  smoothed = (cluster + eps) / (n + codebook.shape[0] * eps) * n
  new_codebook = embed_sum / smoothed[:, None]
  avg = onehot.mean(0)
  return ({'params': params, 'opt': opt, 'codebook': new_codebook, 'cluster_size': cluster,
           'embed_sum': embed_sum}, {'loss': loss, 'recon': recon,
                                     'perplexity': jnp.exp(-jnp.sum(avg * jnp.log(avg + 1e-10)))})


def vqvae_ema_make():
  p = {'enc': _mlp_params(950, [10, 16, 4]), 'dec': _mlp_params(951, [4, 16, 10])}
  cb = _randn(952, 8, 4, scale=0.5)
  return ({'params': p, 'opt': _tx_vq.init(p), 'codebook': cb, 'cluster_size': jnp.ones(8),
           'embed_sum': cb}, _randn(953, 16, 10))


# why: nearest-code assignment is per example (codebook fixed during the step); the loss is
# a batch mean; the EMA codebook update uses per-code counts and sums over the batch.
add('vqvae_straight_through_ema_codebook', vqvae_ema_step, vqvae_ema_make, expect_split=True)


class _TokenTagger(nn.Module):
  tags: int = 5

  @nn.compact
  def __call__(self, toks, mask):
    h = nn.Embed(_VOC, 16)(toks)
    h = h + nn.SelfAttention(num_heads=2, qkv_features=16)(
        nn.LayerNorm()(h), mask=nn.make_attention_mask(mask > 0, mask > 0))
    h = h + nn.Dense(16)(nn.gelu(nn.Dense(32)(nn.LayerNorm()(h))))
    return nn.Dense(self.tags)(nn.LayerNorm()(h))


def token_tagging_step(state, input_ids, attention_mask, labels):
  valid = labels != -100
  safe = jnp.where(valid, labels, 0)

  def loss_fn(params):
    logits = state.apply_fn({'params': params}, input_ids, attention_mask)
    smoothed = optax.smooth_labels(jax.nn.one_hot(safe, 5), 0.05)
    ce = optax.softmax_cross_entropy(logits, smoothed)
    return jnp.sum(jnp.where(valid, ce, 0.0)) / jnp.maximum(valid.sum(), 1)

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss, 'n_labels': valid.sum()}


def token_tagging_make():
  model = _TokenTagger()
  ids = _randint(960, _VOC, 8, 12)
  am = _lengths_mask(961, 8, 12, 4)
  labels = np.array(_randint(962, 5, 8, 12))
  labels[np.asarray(am) == 0] = -100
  labels[:, 0] = -100                                           # [CLS]
  labels[np.random.RandomState(963).rand(8, 12) < 0.2] = -100   # sub-word continuations
  params = model.init(jax.random.PRNGKey(960), ids, am)['params']
  st = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(5e-4))
  return st, ids, am, jnp.asarray(labels, jnp.int32)


# why: token classification with the -100 ignore convention; padded self-attention within a
# sentence; CE summed over labelled tokens of the batch / their count.
add('token_tagging_ignore_index_minus_100', token_tagging_step, token_tagging_make,
    expect_split=True)


_tx_trip = optax.adam(1e-3)


def triplet_given_step(state, anchor, positive, negative):
  margin = 0.2

  def loss_fn(p):
    za, zp, zn = (_unit(_mlp_apply(p, v)) for v in (anchor, positive, negative))
    d_ap = jnp.sum((za - zp) ** 2, -1)
    d_an = jnp.sum((za - zn) ** 2, -1)
    return jnp.mean(jax.nn.relu(d_ap - d_an + margin)), jnp.mean(d_ap < d_an)

  (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  params, opt = _opt_step(_tx_trip, state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'loss': loss, 'triplet_acc': acc}


def triplet_given_make():
  p = _mlp_params(970, [8, 16, 8])
  return ({'params': p, 'opt': _tx_trip.init(p)}, _randn(971, 16, 8), _randn(972, 16, 8),
          _randn(973, 16, 8))


# why: each triplet is mined offline and arrives as one row of three arrays; margin loss per
# triplet, averaged.
add('triplet_margin_offline_mined_triplets', triplet_given_step, triplet_given_make,
    expect_split=True)


_tx_bnm = optax.adam(1e-3)


def bnm_step(state, x_src, y_src, x_tgt):
  def loss_fn(p):
    ce = optax.softmax_cross_entropy_with_integer_labels(_mlp_apply(p, x_src), y_src).mean()
    probs = jax.nn.softmax(_mlp_apply(p, x_tgt))
    nuc = jnp.sum(jnp.linalg.svd(probs, compute_uv=False)) / x_tgt.shape[0]
    return ce - 0.5 * nuc, nuc

  (loss, nuc), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  params, opt = _opt_step(_tx_bnm, state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'loss': loss, 'nuclear': nuc}


def bnm_make():
  p = _mlp_params(980, [8, 16, 4])
  return ({'params': p, 'opt': _tx_bnm.init(p)},) + _cls_batch(981) + (
      _randn(983, 16, 8, scale=1.3),)


# why: batch nuclear-norm maximisation: the singular values of the B x C target prediction
# matrix are the square roots of the eigenvalues of its C x C Gram matrix, a sum of
# per-example outer products; the norm and its gradient (rows times Gram^-1/2) come from
# that sum plus per-example terms.
add('bnm_batch_nuclear_norm_domain_adaptation', bnm_step, bnm_make, expect_split=True)


_tx_trim = optax.adam(3e-3)


def quantile_clip_step(state, x, y):
  def loss_fn(p):
    per = optax.huber_loss(_mlp_apply(p, x)[:, 0], y, delta=1.0)
    cap = jax.lax.stop_gradient(jnp.quantile(per, 0.9))
    return jnp.mean(jnp.minimum(per, cap)), cap

  (loss, cap), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  params, opt = _opt_step(_tx_trim, state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, {'loss': loss, 'cap': cap}


def quantile_clip_make():
  p = _mlp_params(990, [6, 16, 1])
  y = np.array(_randn(992, 16))
  y[:2] *= 8.0
  return {'params': p, 'opt': _tx_trim.init(p)}, _randn(991, 16, 6), _f(y)


# why: per-example losses are capped at the batch's 90th percentile (an order statistic,
# stop-gradient); it could be found from all per-example losses in an earlier pass, but it
# is not a function of sums -- unsure.
add('loss_capped_at_batch_quantile', quantile_clip_step, quantile_clip_make,
    expect_split=None)

# ========================================================================================
# 6. losses over pairs of examples: in-batch negatives, all-pairs, sorting -- and a few
#    pairwise-looking losses that reduce to sums
# ========================================================================================

_tx_pair = optax.adam(1e-3)


def _embed(p, x):
  return _unit(_mlp_apply(p, x))


def _pair_make(seed, d_in=8, d_out=8, b=16, **extra):
  p = _mlp_params(seed, [d_in, 16, d_out])
  state = {'params': p, 'opt': _tx_pair.init(p)}
  state.update(extra)
  return state


def _pair_apply(state, loss_fn):
  (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  params, opt = _opt_step(_tx_pair, state['params'], state['opt'], grads)
  return dict(state, params=params, opt=opt), dict(aux, loss=loss)


def retrieval_infonce_step(state, batch):
  def loss_fn(p):
    def encode(toks, mask):
      h = p['tok'][toks]
      h = jnp.sum(h * mask[..., None], 1) / mask.sum(1, keepdims=True)
      return _unit(_mlp_apply(p['tower'], h))

    q = encode(batch['query'], batch['query_mask'])
    d = encode(batch['passage'], batch['passage_mask'])
    scores = q @ d.T / 0.05
    labels = jnp.arange(q.shape[0])
    loss = optax.softmax_cross_entropy_with_integer_labels(scores, labels).mean()
    return loss, {'mrr_proxy': jnp.mean(jnp.argmax(scores, -1) == labels)}

  (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  params, opt = _opt_step(_tx_pair, state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, dict(aux, loss=loss)


def retrieval_infonce_make():
  p = {'tok': _randn(1000, _VOC, 8, scale=0.5), 'tower': _mlp_params(1001, [8, 16, 8])}
  batch = {'query': _randint(1002, _VOC, 16, 6), 'query_mask': _lengths_mask(1003, 16, 6),
           'passage': _randint(1004, _VOC, 16, 12),
           'passage_mask': _lengths_mask(1005, 16, 12, 4)}
  return {'params': p, 'opt': _tx_pair.init(p)}, batch


# why: every query's softmax runs over all passages of the batch (in-batch negatives), so a
# row's loss depends on every other row's embedding -- not a function of per-example sums.
add('dual_encoder_retrieval_in_batch_negatives', retrieval_infonce_step,
    retrieval_infonce_make, expect_split=False)


def siglip_step(state, images, texts):
  def loss_fn(p):
    zi = _embed(p['img'], images)
    zt = _embed(p['txt'], texts)
    logits = jnp.exp(p['log_t']) * zi @ zt.T + p['bias']
    n = zi.shape[0]
    labels = 2.0 * jnp.eye(n) - 1.0
    loss = -jnp.sum(jax.nn.log_sigmoid(labels * logits)) / n
    return loss, {'t': jnp.exp(p['log_t']), 'b': p['bias']}

  return _pair_apply(state, loss_fn)


def siglip_make():
  p = {'img': _mlp_params(1010, [12, 16, 8]), 'txt': _mlp_params(1011, [6, 16, 8]),
       'log_t': jnp.asarray(np.log(10.0), jnp.float32), 'bias': jnp.asarray(-10.0)}
  return {'params': p, 'opt': _tx_pair.init(p)}, _randn(1012, 16, 12), _randn(1013, 16, 6)


# why: SigLIP's sigmoid loss sums over all image-text pairs of the batch, B^2 terms that
# each join two different examples' embeddings -- a split loses the cross pairs.
add('siglip_sigmoid_all_pairs_learned_t_b', siglip_step, siglip_make, expect_split=False)


def batch_all_triplet_step(state, x, labels):
  margin = 0.3

  def loss_fn(p):
    z = _embed(p, x)
    d = jnp.sum((z[:, None] - z[None]) ** 2, -1)
    same = labels[:, None] == labels[None]
    eye = jnp.eye(x.shape[0], dtype=bool)
    valid = (same & ~eye)[:, :, None] & (~same)[:, None, :]           # a, p, n
    tl = jax.nn.relu(d[:, :, None] - d[:, None, :] + margin) * valid
    n_pos = jnp.sum(tl > 1e-16)
    return jnp.sum(tl) / jnp.maximum(n_pos, 1.0), {'frac_pos': n_pos / valid.sum()}

  return _pair_apply(state, loss_fn)


# why: online "batch-all" triplets are formed between every anchor, positive and negative
# in the batch, and normalised by the count of active triplets -- rows interact.
add('triplet_batch_all_online_mining', batch_all_triplet_step,
    lambda: (_pair_make(1020), _randn(1021, 16, 8), _randint(1022, 4, 16)),
    expect_split=False)


def auc_hinge_step(state, x, y):
  def loss_fn(p):
    s = _mlp_apply(p, x)[:, 0]
    pos, neg = y > 0.5, y <= 0.5
    pair = pos[:, None] & neg[None, :]
    h = jax.nn.relu(1.0 - (s[:, None] - s[None, :])) ** 2
    return jnp.sum(h * pair) / jnp.maximum(pair.sum(), 1), {}

  return _pair_apply(state, loss_fn)


def _auc_make(seed):
  st = _pair_make(seed, d_out=1)
  y = np.random.RandomState(seed + 2).rand(16) > 0.6
  y[:2] = [True, False]
  return st, _randn(seed + 1, 16, 8), _f(y)


# why: the squared hinge on every positive-negative score pair of the batch: the relu does
# not expand into per-example sums, so pairs across microbatches are lost.
add('auc_squared_hinge_all_pos_neg_pairs', auc_hinge_step, lambda: _auc_make(1030),
    expect_split=False)


def auc_square_step(state, x, y):
  def loss_fn(p):
    s = _mlp_apply(p, x)[:, 0]
    pos, neg = y > 0.5, y <= 0.5
    pair = pos[:, None] & neg[None, :]
    h = (1.0 - (s[:, None] - s[None, :])) ** 2
    return jnp.sum(h * pair) / jnp.maximum(pair.sum(), 1), {}

  return _pair_apply(state, loss_fn)


# why: without the hinge the pairwise square (1 - s_p + s_n)^2 expands: its mean over
# pos-neg pairs needs only the counts, sums and sums of squares of positive and negative
# scores -- a function of per-example sums, though written as a B x B matrix.
add('auc_square_loss_all_pairs_expands_to_sums', auc_square_step, lambda: _auc_make(1040),
    expect_split=True)


def wae_mmd_step(state, x, prior_z):
  def rbf_sum(a, b, scale):
    d2 = jnp.sum((a[:, None] - b[None]) ** 2, -1)
    return scale / (scale + d2)                                  # inverse multiquadric

  def loss_fn(p):
    z = _mlp_apply(p['enc'], x)
    rec = jnp.mean(jnp.sum((_mlp_apply(p['dec'], z) - x) ** 2, -1))
    n = z.shape[0]
    c = 2.0 * z.shape[-1]
    off = 1.0 - jnp.eye(n)
    mmd = (jnp.sum(rbf_sum(z, z, c) * off) / (n * (n - 1))
           + jnp.sum(rbf_sum(prior_z, prior_z, c) * off) / (n * (n - 1))
           - 2 * jnp.mean(rbf_sum(z, prior_z, c)))
    return rec + 10.0 * mmd, {'rec': rec, 'mmd': mmd}

  (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  params, opt = _opt_step(_tx_pair, state['params'], state['opt'], grads)
  return {'params': params, 'opt': opt}, dict(aux, loss=loss)


def wae_mmd_make():
  p = {'enc': _mlp_params(1050, [10, 16, 3]), 'dec': _mlp_params(1051, [3, 16, 10])}
  return {'params': p, 'opt': _tx_pair.init(p)}, _randn(1052, 16, 10), _randn(1053, 16, 3)


# why: the MMD U-statistic compares every pair of encoded codes in the batch through a
# kernel of their distance -- not reducible to per-example sums.
add('wae_mmd_imq_kernel_between_codes', wae_mmd_step, wae_mmd_make, expect_split=False)


def snn_step(state, x, labels):
  temp = 0.5

  def loss_fn(p):
    z = _mlp_apply(p, x)
    d2 = jnp.sum((z[:, None] - z[None]) ** 2, -1)
    eye = jnp.eye(x.shape[0], dtype=bool)
    logits = jnp.where(eye, -jnp.inf, -d2 / temp)
    same = (labels[:, None] == labels[None]) & ~eye
    num = jax.nn.logsumexp(jnp.where(same, logits, -jnp.inf), -1)
    den = jax.nn.logsumexp(logits, -1)
    has = same.any(-1)
    return -jnp.sum(jnp.where(has, num - den, 0.0)) / jnp.maximum(has.sum(), 1), {}

  return _pair_apply(state, loss_fn)


# why: the soft nearest-neighbour loss normalises each row over its distances to all other
# rows of the batch -- rows interact.
add('soft_nearest_neighbour_loss', snn_step,
    lambda: (_pair_make(1060), _randn(1061, 16, 8), _randint(1062, 3, 16)),
    expect_split=False)


def vsepp_step(state, images, captions):
  margin = 0.2

  def loss_fn(p):
    im = _embed(p['img'], images)
    cap = _embed(p['txt'], captions)
    s = im @ cap.T
    diag = jnp.diag(s)
    eye = jnp.eye(s.shape[0], dtype=bool)
    cost_c = jnp.where(eye, 0.0, jax.nn.relu(margin + s - diag[:, None]))
    cost_i = jnp.where(eye, 0.0, jax.nn.relu(margin + s - diag[None, :]))
    return jnp.mean(cost_c.max(1) + cost_i.max(0)), {}

  return _pair_apply(state, loss_fn)


def vsepp_make():
  p = {'img': _mlp_params(1070, [12, 16, 8]), 'txt': _mlp_params(1071, [6, 16, 8])}
  return {'params': p, 'opt': _tx_pair.init(p)}, _randn(1072, 16, 12), _randn(1073, 16, 6)


# why: VSE++ max-violation takes each image's hardest caption (and vice versa) among the
# batch -- a max over other examples.
add('vsepp_max_violation_hardest_in_batch', vsepp_step, vsepp_make, expect_split=False)


def listmle_step(state, x, relevance):
  def loss_fn(p):
    s = _mlp_apply(p, x)[:, 0]
    order = jnp.argsort(-relevance)                   # the whole batch is one list
    s_sorted = s[order]
    suffix_lse = jax.lax.cumlogsumexp(s_sorted[::-1])[::-1]
    return jnp.mean(suffix_lse - s_sorted), {}

  return _pair_apply(state, loss_fn)


# why: ListMLE over the batch as one ranked list: each position's term normalises over all
# lower-ranked examples of the batch (suffix log-sum-exp after a sort) -- rows interact.
add('listmle_whole_batch_one_list', listmle_step,
    lambda: (_pair_make(1080, d_out=1), _randn(1081, 16, 8), _rand(1082, 16)),
    expect_split=False)


def knn_consistency_step(state, x, labels):
  def loss_fn(p):
    h = _mlp_apply(p['net'], x)
    logits = h @ p['head']
    z = _unit(h)
    sim = z @ z.T / 0.1
    sim = jnp.where(jnp.eye(x.shape[0], dtype=bool), -jnp.inf, sim)
    w = jax.nn.softmax(sim, -1)                                    # through the embeddings
    neighbour_pred = w @ jax.lax.stop_gradient(jax.nn.softmax(logits))
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    cons = -jnp.mean(jnp.sum(neighbour_pred * jax.nn.log_softmax(logits), -1))
    return ce + 0.5 * cons, {'cons': cons}

  return _pair_apply(state, loss_fn)


def knn_consistency_make():
  p = {'net': _mlp_params(1090, [8, 16, 8]), 'head': _randn(1091, 8, 4, scale=0.4)}
  return ({'params': p, 'opt': _tx_pair.init(p)},) + _cls_batch(1092)


# why: each row's target is a similarity-weighted vote of the other rows' predictions,
# softmax over the batch of embedding similarities -- rows interact.
add('knn_neighbour_consistency_over_batch', knn_consistency_step, knn_consistency_make,
    expect_split=False)


def align_uniform_step(state, x1, x2):
  def loss_fn(p):
    z1, z2 = _embed(p, x1), _embed(p, x2)
    align = jnp.mean(jnp.sum((z1 - z2) ** 2, -1))

    def uniform(z):
      d2 = jnp.sum((z[:, None] - z[None]) ** 2, -1)
      off = ~jnp.eye(z.shape[0], dtype=bool)
      return jnp.log(jnp.sum(jnp.exp(-2.0 * d2) * off) / off.sum())

    unif = 0.5 * (uniform(z1) + uniform(z2))
    return align + unif, {'align': align, 'uniform': unif}

  return _pair_apply(state, loss_fn)


# why: Wang & Isola's uniformity term is a log-mean of a Gaussian potential over all pairs
# of the batch; exp(-2|zi - zj|^2) does not factor into per-example sums.
add('alignment_uniformity_gaussian_potential', align_uniform_step,
    lambda: (_pair_make(1100), _randn(1101, 16, 8), _randn(1102, 16, 8)),
    expect_split=False)


def gor_step(state, x, labels):
  def loss_fn(p):
    h = _mlp_apply(p['net'], x)
    ce = optax.softmax_cross_entropy_with_integer_labels(h @ p['head'], labels).mean()
    z = _unit(h)
    gram = z @ z.T
    n = z.shape[0]
    off = 1.0 - jnp.eye(n)
    m1 = jnp.sum(gram * off) / (n * (n - 1))
    m2 = jnp.sum(gram ** 2 * off) / (n * (n - 1))
    gor = m1 ** 2 + jax.nn.relu(m2 - 1.0 / z.shape[-1])
    return ce + 0.5 * gor, {'gor': gor}

  return _pair_apply(state, loss_fn)


def gor_make():
  p = {'net': _mlp_params(1110, [8, 16, 8]), 'head': _randn(1111, 8, 4, scale=0.4)}
  return ({'params': p, 'opt': _tx_pair.init(p)},) + _cls_batch(1112)


# why: the spread-out regulariser's pair moments are sums over pairs of dot products:
# sum_ij zi.zj = |sum_i zi|^2 and sum_ij (zi.zj)^2 = |Z^T Z|_F^2, with known diagonals
# (unit vectors), so both are functions of per-example sums.
add('global_orthogonal_regulariser_pair_moments', gor_step, gor_make, expect_split=True)


def mine_step(state, x, y):
  y_marg = jnp.roll(y, 1, axis=0)                     # shuffled partner for the marginal

  def loss_fn(p):
    t_joint = _mlp_apply(p, jnp.concatenate([x, y], -1))[:, 0]
    t_marg = _mlp_apply(p, jnp.concatenate([x, y_marg], -1))[:, 0]
    mi = t_joint.mean() - (jax.nn.logsumexp(t_marg) - jnp.log(t_marg.shape[0]))
    return -mi, {'mi_lower_bound': mi}

  return _pair_apply(state, loss_fn)


# why: the marginal partners come from a parameter-free roll of the whole batch (done
# first); the DV bound is a mean plus the log of a mean of exp -- functions of sums.
add('mine_dv_bound_rolled_marginal', mine_step,
    lambda: (_pair_make(1120, d_in=8, d_out=1), _randn(1121, 16, 5), _randn(1122, 16, 3)),
    expect_split=True)


def dcor_step(state, x, labels, sensitive):
  def loss_fn(p):
    h = _mlp_apply(p['net'], x)
    ce = optax.softmax_cross_entropy_with_integer_labels(h @ p['head'], labels).mean()

    def centred(v):
      d = jnp.sqrt(jnp.sum((v[:, None] - v[None]) ** 2, -1) + 1e-9)
      return d - d.mean(0, keepdims=True) - d.mean(1, keepdims=True) + d.mean()

    a, b = centred(h), centred(sensitive)
    dcov = jnp.mean(a * b)
    dcor = dcov / jnp.sqrt(jnp.mean(a * a) * jnp.mean(b * b) + 1e-9)
    return ce + 1.0 * dcor, {'dcor': dcor}

  return _pair_apply(state, loss_fn)


def dcor_make():
  p = {'net': _mlp_params(1130, [8, 16, 8]), 'head': _randn(1131, 8, 4, scale=0.4)}
  return ({'params': p, 'opt': _tx_pair.init(p)},) + _cls_batch(1132) + (
      _randn(1134, 16, 2),)


# why: distance correlation double-centres the B x B matrices of Euclidean distances
# between examples; the square roots do not factor into per-example sums.
add('distance_correlation_fairness_penalty', dcor_step, dcor_make, expect_split=False)

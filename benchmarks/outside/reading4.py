"""A fourth outside corpus of JAX/Flax train steps for hbm_guard's exactness harness.

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
# small shared helpers (plain numpy-seeded data, dict-of-arrays MLPs, a tiny causal LM)
# ----------------------------------------------------------------------------------------

def _f(a):
  return jnp.asarray(np.asarray(a, np.float32))


def _randn(seed, *shape, scale=1.0):
  return _f(np.random.RandomState(seed).randn(*shape) * scale)


def _randint(seed, hi, *shape):
  return jnp.asarray(np.random.RandomState(seed).randint(0, hi, size=shape), jnp.int32)


def _dense_init(rs, n_in, n_out):
  return {'w': _f(rs.randn(n_in, n_out) / np.sqrt(n_in)), 'b': _f(np.zeros(n_out))}


def _mlp_init(seed, sizes):
  rs = np.random.RandomState(seed)
  return [_dense_init(rs, a, b) for a, b in zip(sizes[:-1], sizes[1:])]


def _mlp(layers, x, act=jax.nn.relu):
  for layer in layers[:-1]:
    x = act(x @ layer['w'] + layer['b'])
  return x @ layers[-1]['w'] + layers[-1]['b']


def _ln(h, eps=1e-5):
  mu = h.mean(-1, keepdims=True)
  return (h - mu) * jax.lax.rsqrt(((h - mu) ** 2).mean(-1, keepdims=True) + eps)


def _l2n(z, eps=1e-8):
  return z / jnp.sqrt(jnp.sum(z * z, -1, keepdims=True) + eps)


def _ema(target, online, decay):
  return jax.tree_util.tree_map(lambda t, o: decay * t + (1.0 - decay) * o, target, online)


_V, _T, _D = 16, 8, 16   # vocab, tokens per row fed to the model, width


def _lm_init(seed, d=_D, vocab=_V):
  rs = np.random.RandomState(seed)
  n = lambda *s: _f(rs.randn(*s) / np.sqrt(s[0]))
  return {'emb': _f(rs.randn(vocab, d) * 0.5), 'pos': _f(rs.randn(16, d) * 0.1),
          'wq': n(d, d), 'wk': n(d, d), 'wv': n(d, d), 'wo': n(d, d),
          'w1': n(d, 2 * d), 'w2': n(2 * d, d), 'out': n(d, vocab)}


def _lm_logits(p, toks, attn_mask=None, positions=None):
  """One pre-LN causal attention block + MLP; toks (B, T) -> logits (B, T, V)."""
  t = toks.shape[1]
  pos = jnp.arange(t) if positions is None else positions
  h = p['emb'][toks] + p['pos'][pos]
  mask = jnp.tril(jnp.ones((t, t), bool))[None]
  if attn_mask is not None:
    mask = mask & attn_mask
  x = _ln(h)
  s = jnp.einsum('btd,bsd->bts', x @ p['wq'], x @ p['wk']) / np.sqrt(h.shape[-1])
  a = jax.nn.softmax(jnp.where(mask, s, -1e9), -1)
  h = h + jnp.einsum('bts,bsd->btd', a, x @ p['wv']) @ p['wo']
  h = h + jax.nn.gelu(_ln(h) @ p['w1']) @ p['w2']
  return _ln(h) @ p['out']


def _token_logp(p, toks):
  """log p(toks[:, 1:] | prefix), shape (B, T)."""
  lp = jax.nn.log_softmax(_lm_logits(p, toks[:, :-1]))
  return jnp.take_along_axis(lp, toks[:, 1:, None], -1)[..., 0]


def _resp_mask(seed, b, t=_T):
  """1 on response tokens (after a 2-token prompt, before a random end), else 0."""
  lens = np.random.RandomState(seed).randint(3, t + 1, size=b)
  ar = np.arange(t)[None]
  return _f((ar >= 2) & (ar < lens[:, None]))


def _pad_mask(seed, b, t=_T):
  lens = np.random.RandomState(seed).randint(2, t + 1, size=b)
  return _f(np.arange(t)[None] < lens[:, None])


class _KeyedState(train_state.TrainState):
  key: Any = None


class _BNState(train_state.TrainState):
  batch_stats: Any = None


# ========================================================================================
# 1. the user's own rematerialisation: jax.checkpoint policies, nn.remat, nn.scan, nnx.remat
# ========================================================================================

_tx_ckpt1 = optax.adam(1e-2)


def ckpt_nothing_saveable_step(state, x, y):
  params, opt_state = state

  @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
  def block(layer, h):
    return jax.nn.gelu(h @ layer['w'] + layer['b'])

  def loss_fn(p):
    h = x
    for layer in p[:-1]:
      h = block(layer, h)
    pred = h @ p[-1]['w'] + p[-1]['b']
    return jnp.mean((pred - y) ** 2)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  updates, opt_state = _tx_ckpt1.update(grads, opt_state, params)
  return (optax.apply_updates(params, updates), opt_state), {'loss': loss}


def ckpt_nothing_saveable_make():
  p = _mlp_init(10, [8, 16, 16, 1])
  return (p, _tx_ckpt1.init(p)), _randn(11, 32, 8), _randn(12, 32, 1)


# why: a mean of per-example squared errors; remat changes only what is stored for the
# backward pass, never the value, so per-microbatch sums reproduce it.
add('ckpt_nothing_saveable_mlp', ckpt_nothing_saveable_step, ckpt_nothing_saveable_make,
    expect_split=True)


_tx_ckpt2 = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1, momentum=0.9))


def ckpt_dots_step(state, x, labels):
  def loss_fn(params):
    logits = _mlp(params, x, jax.nn.silu)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, jnp.mean(jnp.argmax(logits, -1) == labels)

  loss_fn = jax.checkpoint(loss_fn,
                           policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
  (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  updates, opt = _tx_ckpt2.update(grads, state['opt'], state['params'])
  return ({'params': optax.apply_updates(state['params'], updates), 'opt': opt},
          {'loss': loss, 'accuracy': acc})


def ckpt_dots_make():
  p = _mlp_init(20, [12, 24, 24, 5])
  return {'params': p, 'opt': _tx_ckpt2.init(p)}, _randn(21, 24, 12), _randint(22, 5, 24)


# why: mean cross-entropy over examples; the global-norm clip acts on the full-batch
# gradient, which is still a sum of per-example gradients.
add('ckpt_dots_no_batch_dims_ce', ckpt_dots_step, ckpt_dots_make, expect_split=True)


_tx_ckpt3 = optax.adamw(3e-3, weight_decay=1e-2)


def _named_layer(layer, h):
  z = checkpoint_name(h @ layer['w'], 'proj')
  return jnp.tanh(z + layer['b'])


_named_layer_remat = jax.checkpoint(
    _named_layer, policy=jax.checkpoint_policies.save_only_these_names('proj'))


def ckpt_save_names_step(state, x, y):
  params, opt_state = state['params'], state['opt_state']

  def loss_fn(p):
    h = x
    for layer in p['body']:
      h = _named_layer_remat(layer, h)
    pred = (h @ p['head']['w'] + p['head']['b'])[:, 0]
    return jnp.mean(optax.huber_loss(pred, y, delta=0.5))

  loss, grads = jax.value_and_grad(loss_fn)(params)
  updates, opt_state = _tx_ckpt3.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  return {'params': params, 'opt_state': opt_state}, {'loss': loss,
                                                      'gnorm': optax.global_norm(grads)}


def ckpt_save_names_make():
  body = _mlp_init(30, [8, 16, 16, 16])
  p = {'body': body, 'head': _dense_init(np.random.RandomState(31), 16, 1)}
  return {'params': p, 'opt_state': _tx_ckpt3.init(p)}, _randn(32, 16, 8), _randn(33, 16)


# why: per-example Huber loss averaged over the batch; the named-residual policy is a
# memory choice only.
add('ckpt_save_only_these_names', ckpt_save_names_step, ckpt_save_names_make,
    expect_split=True)


_tx_ckpt4 = optax.sgd(5e-2)


def scan_ckpt_dots_step(state, x, y):
  def loss_fn(p):
    h = x @ p['inp']

    def body(h, layer):
      w, b = layer
      return h + jnp.tanh(h @ w + b), None

    body = jax.checkpoint(body, prevent_cse=False,
                          policy=jax.checkpoint_policies.checkpoint_dots)
    h, _ = jax.lax.scan(body, h, (p['w'], p['b']))
    return jnp.mean(optax.huber_loss(h @ p['head'], y))

  loss, grads = jax.value_and_grad(loss_fn)(state[0])
  updates, opt = _tx_ckpt4.update(grads, state[1])
  return (optax.apply_updates(state[0], updates), opt), {'loss': loss}


def scan_ckpt_dots_make():
  rs = np.random.RandomState(40)
  d, L = 16, 4
  p = {'inp': _f(rs.randn(8, d) / np.sqrt(8)), 'w': _f(rs.randn(L, d, d) / np.sqrt(d) * 0.5),
       'b': _f(np.zeros((L, d))), 'head': _f(rs.randn(d, 2) / np.sqrt(d))}
  return (p, _tx_ckpt4.init(p)), _randn(41, 32, 8), _randn(42, 32, 2)


# why: a residual tower scanned over stacked layers, remat inside the scan body; the loss
# is still a mean over independent examples.
add('scan_layers_checkpoint_dots', scan_ckpt_dots_step, scan_ckpt_dots_make,
    expect_split=True)


_tx_ckpt5 = optax.rmsprop(1e-3)


def _act_block(layer, h, act):
  h = h @ layer['w'] + layer['b']
  return {'gelu': jax.nn.gelu, 'relu': jax.nn.relu}[act](h)


_act_block_remat = jax.checkpoint(_act_block, static_argnums=(2,))


def ckpt_static_argnums_step(state, x, labels):
  def loss_fn(params):
    h = _act_block_remat(params[0], x, 'gelu')
    h = _act_block_remat(params[1], h, 'relu')
    logits = h @ params[2]['w'] + params[2]['b']
    return optax.softmax_cross_entropy(logits, jax.nn.one_hot(labels, 3)).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  updates, opt = _tx_ckpt5.update(grads, state['opt'])
  return {'params': optax.apply_updates(state['params'], updates), 'opt': opt}, {'loss': loss}


def ckpt_static_argnums_make():
  p = _mlp_init(50, [6, 16, 16, 3])
  return {'params': p, 'opt': _tx_ckpt5.init(p)}, _randn(51, 16, 6), _randint(52, 3, 16)


# why: plain mean cross-entropy; static_argnums only selects the activation at trace time.
add('ckpt_static_argnums', ckpt_static_argnums_step, ckpt_static_argnums_make,
    expect_split=True)


class _DenseBlock(nn.Module):
  width: int

  @nn.compact
  def __call__(self, x):
    return nn.gelu(nn.Dense(self.width)(nn.LayerNorm()(x)))


class _RematMLP(nn.Module):
  width: int = 16
  classes: int = 4

  @nn.compact
  def __call__(self, x):
    block = nn.remat(_DenseBlock)
    for _ in range(3):
      x = block(self.width)(x)
    return nn.Dense(self.classes)(x)


def linen_remat_step(state, x, labels):
  def loss_fn(params):
    logits = state.apply_fn({'params': params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


def linen_remat_make():
  model = _RematMLP()
  x = _randn(60, 32, 10)
  params = model.init(jax.random.PRNGKey(60), x)['params']
  st = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                     tx=optax.adamw(1e-3))
  return st, x, _randint(61, 4, 32)


# why: LayerNorm is per example and nn.remat is a memory transform; mean CE over the batch.
add('linen_remat_trainstate', linen_remat_step, linen_remat_make, expect_split=True)


class _NamedBlock(nn.Module):
  width: int

  @nn.compact
  def __call__(self, x):
    h = checkpoint_name(nn.Dense(2 * self.width)(x), 'mlp_in')
    return x + nn.Dense(self.width)(nn.relu(h))


class _NamedRematNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(16)(x)
    block = nn.remat(_NamedBlock,
                     policy=jax.checkpoint_policies.save_only_these_names('mlp_in'))
    x = block(16)(x)
    x = block(16)(x)
    return nn.Dense(1)(x)[:, 0]


def linen_remat_names_step(state, x, y):
  def loss_fn(params):
    pred = state.apply_fn({'params': params}, x)
    mse = jnp.mean((pred - y) ** 2)
    return mse, pred

  (loss, pred), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  state = state.apply_gradients(grads=grads)
  return state, {'mse': loss, 'pred_mean': pred.mean(), 'pred_max': pred.max()}


def linen_remat_names_make():
  model = _NamedRematNet()
  x = _randn(70, 24, 6)
  params = model.init(jax.random.PRNGKey(70), x)['params']
  st = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                     tx=optax.chain(optax.clip(1.0), optax.adam(1e-2)))
  return st, x, _randn(71, 24)


# why: mean squared error over independent examples; the max of the predictions is a
# reported metric (a max over microbatch maxima), not part of the loss.
add('linen_remat_save_names_policy', linen_remat_names_step, linen_remat_names_make,
    expect_split=True)


class _ScanBlock(nn.Module):
  width: int

  @nn.compact
  def __call__(self, h, _):
    return h + nn.tanh(nn.Dense(self.width)(nn.LayerNorm()(h))), None


class _ScanNet(nn.Module):
  width: int = 16
  layers: int = 3

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(self.width)(x)
    stack = nn.scan(nn.remat(_ScanBlock), variable_axes={'params': 0},
                    split_rngs={'params': True}, length=self.layers)
    h, _ = stack(self.width)(h, None)
    return nn.Dense(1)(h)[:, 0]


def linen_scan_remat_step(state, x, y):
  def loss_fn(params):
    logit = state.apply_fn({'params': params}, x)
    return optax.sigmoid_binary_cross_entropy(logit, y).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'bce': loss}


def linen_scan_remat_make():
  model = _ScanNet()
  x = _randn(80, 32, 8)
  params = model.init(jax.random.PRNGKey(80), x)['params']
  st = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(3e-3))
  return st, x, _f(np.random.RandomState(81).rand(32) > 0.5)


# why: nn.scan over depth (not over the batch) with remat; binary CE averaged over examples.
add('linen_scan_over_layers_remat', linen_scan_remat_step, linen_scan_remat_make,
    expect_split=True)


class _NnxRematNet(nnx.Module):
  def __init__(self, rngs):
    self.inp = nnx.Linear(8, 16, rngs=rngs)
    self.blocks = nnx.List([nnx.Linear(16, 16, rngs=rngs) for _ in range(3)])
    self.norm = nnx.LayerNorm(16, rngs=rngs)
    self.out = nnx.Linear(16, 3, rngs=rngs)

  def __call__(self, x):
    h = self.inp(x)
    for blk in self.blocks:
      h = h + nnx.remat(lambda m, v: nnx.gelu(m(v)))(blk, h)
    return self.out(self.norm(h))


def nnx_remat_step(state, x, labels):
  model, optimizer = state

  def loss_fn(model):
    logits = model(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), logits

  (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
  optimizer.update(model, grads)
  return (model, optimizer), {'loss': loss,
                              'acc': jnp.mean(jnp.argmax(logits, -1) == labels)}


def nnx_remat_make():
  model = _NnxRematNet(nnx.Rngs(90))
  opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  return (model, opt), _randn(91, 16, 8), _randint(92, 3, 16)


# why: nnx.remat around each residual block; the loss is the batch mean of per-example CE.
add('nnx_remat_optimizer', nnx_remat_step, nnx_remat_make, expect_split=True)


class _NnxMLP(nnx.Module):
  def __init__(self, rngs, d_in=8, width=16, d_out=1):
    self.l1 = nnx.Linear(d_in, width, rngs=rngs)
    self.l2 = nnx.Linear(width, width, rngs=rngs)
    self.l3 = nnx.Linear(width, d_out, rngs=rngs)

  def __call__(self, x):
    return self.l3(nnx.relu(self.l2(nnx.relu(self.l1(x)))))


_nnx_mlp_graphdef, _ = nnx.split(_NnxMLP(nnx.Rngs(0)))
_tx_nnx_ckpt = optax.adam(5e-3)


def nnx_merge_checkpoint_step(state, x, y):
  params, opt_state = state['params'], state['opt_state']

  @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
  def forward(params, x):
    return nnx.merge(_nnx_mlp_graphdef, params)(x)

  def loss_fn(params):
    return jnp.mean(jnp.abs(forward(params, x) - y))

  loss, grads = jax.value_and_grad(loss_fn)(params)
  updates, opt_state = _tx_nnx_ckpt.update(grads, opt_state, params)
  return ({'params': optax.apply_updates(params, updates), 'opt_state': opt_state},
          {'l1': loss})


def nnx_merge_checkpoint_make():
  _, params = nnx.split(_NnxMLP(nnx.Rngs(100)))
  return ({'params': params, 'opt_state': _tx_nnx_ckpt.init(params)},
          _randn(101, 32, 8), _randn(102, 32, 1))


# why: functional nnx (split/merge) under jax.checkpoint; mean absolute error per example.
add('nnx_merge_jax_checkpoint', nnx_merge_checkpoint_step, nnx_merge_checkpoint_make,
    expect_split=True)


# ========================================================================================
# 2. mixture of experts with Switch / GShard load-balancing losses
# ========================================================================================

_E = 4


def _moe_init(seed, d=8, h=16, e=_E):
  rs = np.random.RandomState(seed)
  return {'router': _f(rs.randn(d, e) * 0.7), 'w_in': _f(rs.randn(e, d, h) / np.sqrt(d)),
          'w_out': _f(rs.randn(e, h, d) / np.sqrt(h)), 'head': _f(rs.randn(d, 1) / np.sqrt(d))}


def _experts(p, x):
  """Every expert applied to every token (tiny sizes): (..., d) -> (..., E, d)."""
  h = jax.nn.gelu(jnp.einsum('...d,edh->...eh', x, p['w_in']))
  return jnp.einsum('...eh,ehd->...ed', h, p['w_out'])


def _top2_dispatch(probs, capacity, axis):
  """GShard top-2 with a per-group capacity; groups are all tokens along `axis`."""
  top_p, top_i = jax.lax.top_k(probs, 2)
  m1 = jax.nn.one_hot(top_i[..., 0], _E)
  m2 = jax.nn.one_hot(top_i[..., 1], _E)
  pos1 = jnp.cumsum(m1, axis=axis) * m1
  m1 = m1 * (pos1 <= capacity)
  count1 = jnp.sum(m1, axis=axis, keepdims=True)
  pos2 = (jnp.cumsum(m2, axis=axis) + count1) * m2
  m2 = m2 * (pos2 <= capacity)
  g = top_p / jnp.sum(top_p, -1, keepdims=True)
  combine = m1 * g[..., :1] + m2 * g[..., 1:]
  return combine, jax.nn.one_hot(top_i[..., 0], _E)


_tx_moe = optax.adam(3e-3)


def _moe_step_common(state, loss_fn):
  (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  updates, opt = _tx_moe.update(grads, state['opt'], state['params'])
  aux = dict(aux, loss=loss)
  return {'params': optax.apply_updates(state['params'], updates), 'opt': opt}, aux


def _moe_make(seed, b=16, t=4):
  p = _moe_init(seed)
  return ({'params': p, 'opt': _tx_moe.init(p)}, _randn(seed + 1, b, t, 8),
          _randn(seed + 2, b, 1))


def moe_switch_top1_step(state, x, y):
  def loss_fn(p):
    logits = x @ p['router']
    probs = jax.nn.softmax(logits, -1)
    dispatch = jax.nn.one_hot(jnp.argmax(probs, -1), _E)
    gate = jnp.sum(probs * dispatch, -1, keepdims=True)
    h = x + jnp.einsum('bted,bte->btd', _experts(p, x), dispatch) * gate
    pred = h.mean(1) @ p['head']
    task = jnp.mean((pred - y) ** 2)
    frac = dispatch.mean((0, 1))        # fraction of tokens sent to each expert
    prob = probs.mean((0, 1))           # mean router probability per expert
    aux = _E * jnp.sum(frac * prob)
    return task + 1e-2 * aux, {'task': task, 'lb_loss': aux}

  return _moe_step_common(state, loss_fn)


# why: no capacity, so each token's output is its own; the Switch aux loss is E * sum_e f_e
# P_e, a product of two batch means (f has no gradient) -- a function of sums.
add('moe_switch_top1_no_capacity', moe_switch_top1_step, lambda: _moe_make(200),
    expect_split=True)


def moe_gshard_top2_step(state, x, y):
  def loss_fn(p):
    probs = jax.nn.softmax(x @ p['router'], -1)
    top_p, top_i = jax.lax.top_k(probs, 2)
    g = top_p / top_p.sum(-1, keepdims=True)
    combine = jnp.sum(jax.nn.one_hot(top_i, _E) * g[..., None], -2)   # (B, T, E)
    h = x + jnp.einsum('bted,bte->btd', _experts(p, x), combine)
    pred = h.mean(1) @ p['head']
    task = jnp.mean(optax.huber_loss(pred, y))
    me = probs.reshape(-1, _E).mean(0)
    ce = jax.nn.one_hot(top_i[..., 0], _E).reshape(-1, _E).mean(0)
    aux = jnp.mean(me * ce) * _E * _E
    return task + 1e-2 * aux, {'task': task, 'aux': aux}

  return _moe_step_common(state, loss_fn)


# why: top-2 routing without capacity is per token; the GShard aux loss mean(me*ce)*E^2 is
# a function of two token-averages over the batch.
add('moe_gshard_top2_no_capacity', moe_gshard_top2_step, lambda: _moe_make(210),
    expect_split=True)


def moe_top1_capacity_step(state, x, y):
  def loss_fn(p):
    b, t, d = x.shape
    probs = jax.nn.softmax(x @ p['router'], -1)
    flat = jax.nn.one_hot(jnp.argmax(probs, -1), _E).reshape(b * t, _E)
    capacity = max(int(0.75 * b * t / _E), 1)
    pos = jnp.cumsum(flat, 0) * flat                 # arrival order across the whole batch
    kept = (flat * (pos <= capacity)).reshape(b, t, _E)
    gate = jnp.sum(probs * kept, -1, keepdims=True)
    h = x + jnp.einsum('bted,bte->btd', _experts(p, x), kept) * gate
    task = jnp.mean((h.mean(1) @ p['head'] - y) ** 2)
    aux = _E * jnp.sum(flat.mean(0) * probs.reshape(-1, _E).mean(0))
    dropped = 1.0 - kept.sum() / (b * t)
    return task + 1e-2 * aux, {'task': task, 'aux': aux, 'dropped': dropped}

  return _moe_step_common(state, loss_fn)


# why: the capacity is counted over all tokens of the batch in order, so whether a token of
# example i is dropped depends on the earlier examples; a microbatch resets the count.
add('moe_switch_top1_global_capacity', moe_top1_capacity_step, lambda: _moe_make(220),
    expect_split=False)


def moe_top2_seq_capacity_step(state, x, y):
  def loss_fn(p):
    t = x.shape[1]
    probs = jax.nn.softmax(x @ p['router'], -1)
    capacity = max(int(1.0 * 2 * t / _E), 1)
    combine, first = _top2_dispatch(probs, capacity, axis=1)   # groups are sequences
    h = x + jnp.einsum('bted,bte->btd', _experts(p, x), combine)
    task = jnp.mean((h.mean(1) @ p['head'] - y) ** 2)
    aux = _E * jnp.sum(first.mean((0, 1)) * probs.mean((0, 1)))
    return task + 1e-2 * aux, {'task': task, 'aux': aux}

  return _moe_step_common(state, loss_fn)


# why: capacity is per sequence (cumsum along the token axis of each example), so routing
# never crosses examples; the aux loss is again a function of batch means.
add('moe_gshard_top2_per_sequence_capacity', moe_top2_seq_capacity_step,
    lambda: _moe_make(230, t=8), expect_split=True)


def moe_top2_global_capacity_step(state, x, y):
  def loss_fn(p):
    b, t, d = x.shape
    probs = jax.nn.softmax(x @ p['router'], -1)
    capacity = max(int(1.0 * 2 * b * t / _E), 1) // 2
    combine, first = _top2_dispatch(probs.reshape(1, b * t, _E), capacity, axis=1)
    combine = combine.reshape(b, t, _E)
    h = x + jnp.einsum('bted,bte->btd', _experts(p, x), combine)
    task = jnp.mean((h.mean(1) @ p['head'] - y) ** 2)
    aux = _E * jnp.sum(first.mean((0, 1)) * probs.mean((0, 1)))
    return task + 1e-2 * aux, {'task': task, 'aux': aux}

  return _moe_step_common(state, loss_fn)


# why: one routing group for the whole batch with a capacity tied to the batch's token
# count: token drops depend on other examples and on the batch size.
add('moe_gshard_top2_global_capacity', moe_top2_global_capacity_step,
    lambda: _moe_make(240), expect_split=False)


def moe_expert_choice_step(state, x, y):
  def loss_fn(p):
    b, t, d = x.shape
    tokens = x.reshape(b * t, d)
    probs = jax.nn.softmax(tokens @ p['router'], -1)              # (N, E)
    k = (b * t * 2) // _E
    gate, idx = jax.lax.top_k(probs.T, k)                         # each expert picks tokens
    sel = jax.nn.one_hot(idx, b * t)                              # (E, k, N)
    weights = jnp.einsum('ek,ekn->ne', gate, sel)
    out = tokens + jnp.einsum('ned,ne->nd', _experts(p, tokens), weights)
    pred = out.reshape(b, t, d).mean(1) @ p['head']
    return jnp.mean((pred - y) ** 2), {'coverage': jnp.mean(weights.sum(-1) > 0)}

  return _moe_step_common(state, loss_fn)


# why: expert-choice routing ranks all tokens of the batch per expert (top-k over the
# batch); which tokens an expert serves depends on every other example.
add('moe_expert_choice_topk_over_batch', moe_expert_choice_step, lambda: _moe_make(250),
    expect_split=False)


class _LinenMoE(nn.Module):
  experts: int = _E
  hidden: int = 16

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    logits = nn.Dense(self.experts, use_bias=False, name='router')(x)
    probs = nn.softmax(logits)
    top_p, top_i = jax.lax.top_k(probs, 2)
    w_in = self.param('w_in', nn.initializers.lecun_normal(), (self.experts, d, self.hidden))
    w_out = self.param('w_out', nn.initializers.lecun_normal(), (self.experts, self.hidden, d))
    h = nn.gelu(jnp.einsum('btd,edh->bteh', x, w_in))
    expert_out = jnp.einsum('bteh,ehd->bted', h, w_out)
    g = top_p / top_p.sum(-1, keepdims=True)
    combine = jnp.sum(jax.nn.one_hot(top_i, self.experts) * g[..., None], -2)
    frac = jax.nn.one_hot(top_i[..., 0], self.experts).reshape(-1, self.experts).mean(0)
    self.sow('intermediates', 'lb_loss',
             self.experts * jnp.sum(frac * probs.reshape(-1, self.experts).mean(0)))
    self.sow('intermediates', 'z_loss', jnp.mean(jax.nn.logsumexp(logits, -1) ** 2))
    return x + jnp.einsum('bted,bte->btd', expert_out, combine)


class _MoEClassifier(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(8)(x)
    h = _LinenMoE(name='moe')(h)
    return nn.Dense(3)(nn.LayerNorm()(h).mean(1))


def linen_moe_sow_step(state, x, labels):
  def loss_fn(params):
    logits, inter = state.apply_fn({'params': params}, x, mutable=['intermediates'])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    lb = inter['intermediates']['moe']['lb_loss'][0]
    zl = inter['intermediates']['moe']['z_loss'][0]
    return ce + 1e-2 * lb + 1e-3 * zl, (ce, lb, zl)

  (loss, (ce, lb, zl)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss, 'ce': ce, 'lb': lb, 'z': zl}


def linen_moe_sow_make():
  model = _MoEClassifier()
  x = _randn(260, 16, 4, 6)
  params = model.init(jax.random.PRNGKey(260), x)['params']
  return (train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.adam(1e-3)), x, _randint(261, 3, 16))


# why: linen MoE with sown aux losses; no capacity, load-balance = product of batch token
# means, router z-loss = mean over tokens; all functions of sums.
add('linen_moe_sow_lb_and_z_loss', linen_moe_sow_step, linen_moe_sow_make,
    expect_split=True)


# ========================================================================================
# 3. preference optimisation: DPO / IPO / cDPO / SimPO / KTO / Bradley-Terry reward model
# ========================================================================================

_DPO_BETA = 0.1
_tx_dpo = optax.adamw(1e-3, weight_decay=0.0)


def _dpo_make(seed, b=16):
  ref = _lm_init(seed)                                   # the frozen SFT model
  rs = np.random.RandomState(seed + 9)
  p = jax.tree_util.tree_map(lambda a: a + _f(0.05 * rs.randn(*a.shape)), ref)
  state = {'params': p, 'ref': ref, 'opt': _tx_dpo.init(p)}
  return (state, _randint(seed + 1, _V, b, _T + 1), _randint(seed + 2, _V, b, _T + 1),
          _resp_mask(seed + 3, b), _resp_mask(seed + 4, b))


def _dpo_apply(state, loss_fn):
  (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  updates, opt = _tx_dpo.update(grads, state['opt'], state['params'])
  new = {'params': optax.apply_updates(state['params'], updates), 'ref': state['ref'],
         'opt': opt}
  return new, dict(metrics, loss=loss)


def dpo_concat_step(state, chosen, rejected, chosen_mask, rejected_mask):
  toks = jnp.concatenate([chosen, rejected], 0)
  mask = jnp.concatenate([chosen_mask, rejected_mask], 0)
  n = chosen.shape[0]
  ref_lp = jax.lax.stop_gradient((_token_logp(state['ref'], toks) * mask).sum(-1))

  def loss_fn(params):
    lp = (_token_logp(params, toks) * mask).sum(-1)
    logits = _DPO_BETA * ((lp[:n] - lp[n:]) - (ref_lp[:n] - ref_lp[n:]))
    loss = -jax.nn.log_sigmoid(logits).mean()
    r_c = _DPO_BETA * (lp[:n] - ref_lp[:n])
    r_r = _DPO_BETA * (lp[n:] - ref_lp[n:])
    return loss, {'reward_acc': jnp.mean(r_c > r_r), 'margin': jnp.mean(r_c - r_r)}

  return _dpo_apply(state, loss_fn)


# why: chosen/rejected come as separate batch arrays concatenated inside the step; each
# pair's term uses only row i of both, and the frozen reference is a constant.
add('dpo_concat_chosen_rejected_frozen_ref', dpo_concat_step, lambda: _dpo_make(300),
    expect_split=True)


def ipo_step(state, chosen, rejected, chosen_mask, rejected_mask):
  toks = jnp.concatenate([chosen, rejected], 0)
  mask = jnp.concatenate([chosen_mask, rejected_mask], 0)
  n = chosen.shape[0]
  ref_lp = jax.lax.stop_gradient(
      (_token_logp(state['ref'], toks) * mask).sum(-1) / mask.sum(-1))

  def loss_fn(params):
    lp = (_token_logp(params, toks) * mask).sum(-1) / mask.sum(-1)   # mean token log-prob
    h = (lp[:n] - lp[n:]) - (ref_lp[:n] - ref_lp[n:])
    return jnp.mean((h - 1.0 / (2 * _DPO_BETA)) ** 2), {'h': h.mean()}

  return _dpo_apply(state, loss_fn)


# why: IPO's squared loss per pair, length-normalised within each sequence; batch mean.
add('ipo_concat_length_normalised', ipo_step, lambda: _dpo_make(310), expect_split=True)


def dpo_preconcat_step(state, pairs, pair_mask):
  n = pairs.shape[0] // 2          # rows [0, n) chosen, rows [n, 2n) rejected
  ref_lp = jax.lax.stop_gradient((_token_logp(state['ref'], pairs) * pair_mask).sum(-1))

  def loss_fn(params):
    lp = (_token_logp(params, pairs) * pair_mask).sum(-1)
    logits = _DPO_BETA * ((lp[:n] - lp[n:]) - (ref_lp[:n] - ref_lp[n:]))
    return -jax.nn.log_sigmoid(logits).mean(), {'acc': jnp.mean(logits > 0)}

  return _dpo_apply(state, loss_fn)


def dpo_preconcat_make():
  state, c, r, mc, mr = _dpo_make(320)
  return state, jnp.concatenate([c, r], 0), jnp.concatenate([mc, mr], 0)


# why: the batch arrives already stacked [chosen; rejected] and row i is paired with row
# i + n; a contiguous split pairs the wrong rows, a strided one would be exact -- unsure.
add('dpo_pre_concatenated_halves', dpo_preconcat_step, dpo_preconcat_make,
    expect_split=None)


def cdpo_label_smoothing_step(state, chosen, rejected, chosen_mask, rejected_mask):
  eps = 0.1
  ref_c = jax.lax.stop_gradient((_token_logp(state['ref'], chosen) * chosen_mask).sum(-1))
  ref_r = jax.lax.stop_gradient((_token_logp(state['ref'], rejected) * rejected_mask).sum(-1))

  def loss_fn(params):
    pc = (_token_logp(params, chosen) * chosen_mask).sum(-1)
    pr = (_token_logp(params, rejected) * rejected_mask).sum(-1)
    z = _DPO_BETA * ((pc - ref_c) - (pr - ref_r))
    losses = -(1 - eps) * jax.nn.log_sigmoid(z) - eps * jax.nn.log_sigmoid(-z)
    return losses.mean(), {'chosen_logps': pc.mean(), 'rejected_logps': pr.mean(),
                           'acc': jnp.mean(z > 0)}

  return _dpo_apply(state, loss_fn)


# why: conservative DPO with two separate forwards; still one term per pair, averaged.
add('cdpo_label_smoothing_two_forwards', cdpo_label_smoothing_step, lambda: _dpo_make(330),
    expect_split=True)


def simpo_step(state, chosen, rejected, chosen_mask, rejected_mask):
  beta, gamma = 2.0, 0.5

  def loss_fn(params):
    toks = jnp.concatenate([chosen, rejected], 0)
    mask = jnp.concatenate([chosen_mask, rejected_mask], 0)
    avg = (_token_logp(params, toks) * mask).sum(-1) / mask.sum(-1)
    c, r = jnp.split(avg, 2)
    return -jax.nn.log_sigmoid(beta * (c - r) - gamma).mean(), {'gap': (c - r).mean()}

  return _dpo_apply(state, loss_fn)


# why: SimPO is reference-free, per pair, length-normalised within each sequence.
add('simpo_reference_free', simpo_step, lambda: _dpo_make(340), expect_split=True)


def kto_step(state, toks, mask, desirable):
  ref = jax.lax.stop_gradient((_token_logp(state['ref'], toks) * mask).sum(-1))

  def loss_fn(params):
    lp = (_token_logp(params, toks) * mask).sum(-1)
    r = lp - ref
    z = jax.lax.stop_gradient(jnp.maximum(r.mean(), 0.0))   # batch KL reference point
    l_d = 1.0 - jax.nn.sigmoid(_DPO_BETA * (r - z))
    l_u = 1.0 - jax.nn.sigmoid(_DPO_BETA * (z - r))
    loss = jnp.mean(desirable * 1.0 * l_d + (1.0 - desirable) * 1.33 * l_u)
    return loss, {'kl': z}

  return _dpo_apply(state, loss_fn)


def kto_make():
  state, toks, _, m, _ = _dpo_make(350)
  return state, toks, m, _f(np.random.RandomState(351).rand(16) > 0.4)


# why: KTO's reference point z is a stop-gradient batch mean of per-example log-ratios --
# a batch statistic computable in an earlier pass; the rest is per example.
add('kto_batch_kl_reference_point', kto_step, kto_make, expect_split=True)


class _RewardModel(nn.Module):
  @nn.compact
  def __call__(self, toks, mask):
    h = nn.Embed(_V, 16)(toks)
    h = nn.tanh(nn.Dense(16)(h))
    pooled = (h * mask[..., None]).sum(1) / jnp.maximum(mask.sum(1, keepdims=True), 1.0)
    return nn.Dense(1)(pooled)[:, 0]


def bt_reward_model_step(state, chosen, rejected, chosen_mask, rejected_mask):
  def loss_fn(params):
    rc = state.apply_fn({'params': params}, chosen, chosen_mask)
    rr = state.apply_fn({'params': params}, rejected, rejected_mask)
    loss = -jax.nn.log_sigmoid(rc - rr).mean() + 1e-3 * jnp.mean(rc ** 2 + rr ** 2)
    return loss, (rc, rr)

  (loss, (rc, rr)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss, 'acc': jnp.mean(rc > rr),
                                              'rewards_chosen': rc}


def bt_reward_model_make():
  model = _RewardModel()
  c = _randint(360, _V, 16, _T)
  params = model.init(jax.random.PRNGKey(360), c, _pad_mask(361, 16))['params']
  st = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))
  return st, c, _randint(362, _V, 16, _T), _pad_mask(363, 16), _pad_mask(364, 16)


# why: Bradley-Terry per pair plus a per-example reward-centering penalty; the per-example
# chosen rewards are also returned as an output (one row per example).
add('bt_reward_model_linen', bt_reward_model_step, bt_reward_model_make, expect_split=True)


# ========================================================================================
# 4. contrastive and self-supervised objectives
# ========================================================================================

_tx_ssl = optax.adam(1e-3)


def _two_views(seed, b=16, d=8):
  x = np.random.RandomState(seed).randn(b, d)
  v1 = x + 0.1 * np.sin(3 * x)
  v2 = 0.9 * x[:, ::-1] + 0.05
  return _f(v1), _f(v2)


def clip_step(state, images, texts):
  def loss_fn(p):
    a = _l2n(_mlp(p['img'], images))
    b = _l2n(_mlp(p['txt'], texts))
    logits = jnp.exp(p['logit_scale']) * a @ b.T
    labels = jnp.arange(a.shape[0])
    l_i = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    l_t = optax.softmax_cross_entropy_with_integer_labels(logits.T, labels).mean()
    return (l_i + l_t) / 2, jnp.mean(jnp.argmax(logits, -1) == labels)

  (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  updates, opt = _tx_ssl.update(grads, state['opt'], state['params'])
  return {'params': optax.apply_updates(state['params'], updates), 'opt': opt}, {
      'loss': loss, 'i2t_acc': acc}


def clip_make():
  p = {'img': _mlp_init(400, [10, 16, 8]), 'txt': _mlp_init(401, [6, 16, 8]),
       'logit_scale': _f(np.log(1 / 0.07))}
  return {'params': p, 'opt': _tx_ssl.init(p)}, _randn(402, 16, 10), _randn(403, 16, 6)


# why: InfoNCE with in-batch negatives: every example's softmax denominator runs over all
# other examples' embeddings, so the loss is not a function of per-example sums.
add('clip_infonce_in_batch_negatives', clip_step, clip_make, expect_split=False)


def simclr_step(state, x):
  temperature = 0.5

  def loss_fn(params):
    v1 = x + 0.1 * jnp.sin(3.0 * x)
    v2 = 0.9 * x[:, ::-1]
    z = _l2n(_mlp(params, jnp.concatenate([v1, v2], 0)))
    n = x.shape[0]
    sim = z @ z.T / temperature
    sim = jnp.where(jnp.eye(2 * n, dtype=bool), -1e9, sim)
    positives = jnp.concatenate([jnp.arange(n, 2 * n), jnp.arange(0, n)])
    return optax.softmax_cross_entropy_with_integer_labels(sim, positives).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  updates, opt = _tx_ssl.update(grads, state['opt'], state['params'])
  return {'params': optax.apply_updates(state['params'], updates), 'opt': opt}, {'loss': loss}


def simclr_make():
  p = _mlp_init(410, [8, 16, 8])
  return {'params': p, 'opt': _tx_ssl.init(p)}, _randn(411, 16, 8)


# why: NT-Xent over 2N views: each view's negatives are all the other 2N-2 views of the
# batch -- pairwise interaction between every pair of examples.
add('simclr_nt_xent_two_views', simclr_step, simclr_make, expect_split=False)


def supcon_step(state, x, labels):
  def loss_fn(params):
    z = _l2n(_mlp(params, x))
    n = z.shape[0]
    eye = jnp.eye(n, dtype=bool)
    sim = jnp.where(eye, -1e9, z @ z.T / 0.1)
    log_prob = sim - jax.nn.logsumexp(sim, axis=1, keepdims=True)
    pos = (labels[:, None] == labels[None, :]) & ~eye
    per = -jnp.sum(jnp.where(pos, log_prob, 0.0), 1) / jnp.maximum(pos.sum(1), 1)
    return per.mean()

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  updates, opt = _tx_ssl.update(grads, state['opt'], state['params'])
  return {'params': optax.apply_updates(state['params'], updates), 'opt': opt}, {'loss': loss}


def supcon_make():
  p = _mlp_init(420, [8, 16, 8])
  return {'params': p, 'opt': _tx_ssl.init(p)}, _randn(421, 24, 8), _randint(422, 4, 24)


# why: supervised contrastive: positives and negatives are other examples of the batch.
add('supcon_in_batch_positives', supcon_step, supcon_make, expect_split=False)


def byol_step(state, v1, v2):
  target = state['target']

  def online_pred(o, v):
    return _mlp(o['pred'], _mlp(o['proj'], _mlp(o['enc'], v)))

  def target_proj(v):
    return jax.lax.stop_gradient(_mlp(target['proj'], _mlp(target['enc'], v)))

  def loss_fn(online):
    def reg(p, z):
      return 2.0 - 2.0 * jnp.sum(_l2n(p) * _l2n(z), -1)
    l = reg(online_pred(online, v1), target_proj(v2)) + reg(online_pred(online, v2),
                                                             target_proj(v1))
    return l.mean()

  loss, grads = jax.value_and_grad(loss_fn)(state['online'])
  updates, opt = _tx_ssl.update(grads, state['opt'], state['online'])
  online = optax.apply_updates(state['online'], updates)
  target = _ema(target, {'enc': online['enc'], 'proj': online['proj']}, 0.99)
  return {'online': online, 'target': target, 'opt': opt}, {'loss': loss}


def byol_make():
  online = {'enc': _mlp_init(430, [8, 16, 16]), 'proj': _mlp_init(431, [16, 16, 8]),
            'pred': _mlp_init(432, [8, 16, 8])}
  target = {'enc': _mlp_init(433, [8, 16, 16]), 'proj': _mlp_init(434, [16, 16, 8])}
  v1, v2 = _two_views(435)
  return {'online': online, 'target': target, 'opt': _tx_ssl.init(online)}, v1, v2


# why: BYOL without BatchNorm: each example's regression targets come from its own other
# view through a stop-gradient EMA network; per-example loss, batch mean.
add('byol_ema_target_stop_gradient', byol_step, byol_make, expect_split=True)


class _SimSiam(nn.Module):
  @nn.compact
  def __call__(self, x):
    z = nn.Dense(16)(nn.relu(nn.Dense(16)(x)))
    p = nn.Dense(16)(nn.relu(nn.Dense(8)(z)))
    return z, p


def simsiam_step(state, v1, v2):
  def loss_fn(params):
    z1, p1 = state.apply_fn({'params': params}, v1)
    z2, p2 = state.apply_fn({'params': params}, v2)

    def d(p, z):
      return -jnp.mean(jnp.sum(_l2n(p) * _l2n(jax.lax.stop_gradient(z)), -1))
    return 0.5 * d(p1, z2) + 0.5 * d(p2, z1)

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


def simsiam_make():
  model = _SimSiam()
  v1, v2 = _two_views(440, b=24)
  params = model.init(jax.random.PRNGKey(440), v1)['params']
  return (train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.sgd(0.05, momentum=0.9)), v1, v2)


# why: SimSiam's symmetric negative cosine is per example (no BN here); stop_gradient
# does not couple examples.
add('simsiam_linen_stop_gradient', simsiam_step, simsiam_make, expect_split=True)


def barlow_twins_step(state, v1, v2):
  lam = 5e-3

  def loss_fn(params):
    z1, z2 = _mlp(params, v1), _mlp(params, v2)
    n = z1.shape[0]
    z1n = (z1 - z1.mean(0)) / jnp.sqrt(z1.var(0) + 1e-5)
    z2n = (z2 - z2.mean(0)) / jnp.sqrt(z2.var(0) + 1e-5)
    c = z1n.T @ z2n / n
    on_diag = jnp.sum((1.0 - jnp.diag(c)) ** 2)
    off_diag = jnp.sum((c * (1.0 - jnp.eye(c.shape[0]))) ** 2)
    return on_diag + lam * off_diag, (on_diag, off_diag)

  (loss, (on, off)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  updates, opt = _tx_ssl.update(grads, state['opt'], state['params'])
  return {'params': optax.apply_updates(state['params'], updates), 'opt': opt}, {
      'loss': loss, 'on_diag': on, 'off_diag': off}


def barlow_twins_make():
  p = _mlp_init(450, [8, 16, 8])
  v1, v2 = _two_views(451, b=32)
  return {'params': p, 'opt': _tx_ssl.init(p)}, v1, v2


# why: the cross-correlation matrix of batch-standardised embeddings is a function of the
# batch sums of z1, z2, z1^2, z2^2 and z1 z2^T; the loss is a function of those sums.
add('barlow_twins_cross_correlation', barlow_twins_step, barlow_twins_make,
    expect_split=True)


def vicreg_step(state, v1, v2):
  def var_cov(z):
    z = z - z.mean(0)
    std = jnp.sqrt(z.var(0) + 1e-4)
    var_term = jnp.mean(jax.nn.relu(1.0 - std))
    cov = z.T @ z / (z.shape[0] - 1)
    cov_term = jnp.sum((cov * (1.0 - jnp.eye(z.shape[1]))) ** 2) / z.shape[1]
    return var_term, cov_term

  def loss_fn(params):
    z1, z2 = _mlp(params['enc'], v1), _mlp(params['enc'], v2)
    inv = jnp.mean((z1 - z2) ** 2)
    va, ca = var_cov(z1)
    vb, cb = var_cov(z2)
    return 25.0 * inv + 25.0 * (va + vb) + (ca + cb), {'inv': inv, 'var': va + vb,
                                                      'cov': ca + cb}

  (loss, m), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  updates, opt = _tx_ssl.update(grads, state['opt'], state['params'])
  return {'params': optax.apply_updates(state['params'], updates), 'opt': opt}, dict(
      m, loss=loss)


def vicreg_make():
  p = {'enc': _mlp_init(460, [8, 16, 8])}
  v1, v2 = _two_views(461, b=32)
  return {'params': p, 'opt': _tx_ssl.init(p)}, v1, v2


# why: invariance is per example; variance and covariance terms are functions of the
# batch sums of z and z z^T (with the N-1 normaliser known from the batch size).
add('vicreg_variance_covariance', vicreg_step, vicreg_make, expect_split=True)


_tx_reg = optax.adam(1e-2)


def pearson_step(state, x, y):
  def loss_fn(p):
    pred = _mlp(p, x)[:, 0]
    pc, yc = pred - pred.mean(), y - y.mean()
    r = jnp.sum(pc * yc) / jnp.sqrt(jnp.sum(pc ** 2) * jnp.sum(yc ** 2) + 1e-8)
    return 1.0 - r + 0.1 * jnp.mean((pred - y) ** 2), r

  (loss, r), grads = jax.value_and_grad(loss_fn, has_aux=True)(state[0])
  updates, opt = _tx_reg.update(grads, state[1])
  return (optax.apply_updates(state[0], updates), opt), {'loss': loss, 'pearson': r}


def pearson_make():
  p = _mlp_init(470, [6, 16, 1])
  x = _randn(471, 32, 6)
  y = x[:, 0] * 0.7 + _randn(472, 32) * 0.3
  return (p, _tx_reg.init(p)), x, y


# why: Pearson r over the batch is a function of sum p, sum y, sum p^2, sum y^2, sum p*y.
add('pearson_correlation_loss', pearson_step, pearson_make, expect_split=True)


def ccc_step(state, x, y):
  def loss_fn(p):
    pred = _mlp(p, x, jnp.tanh)[:, 0]
    mp, my = pred.mean(), y.mean()
    cov = jnp.mean((pred - mp) * (y - my))
    ccc = 2.0 * cov / (pred.var() + y.var() + (mp - my) ** 2)
    return 1.0 - ccc

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  updates, opt = _tx_reg.update(grads, state['opt'])
  return {'params': optax.apply_updates(state['params'], updates), 'opt': opt}, {
      'ccc_loss': loss}


def ccc_make():
  p = _mlp_init(480, [5, 12, 1])
  x = _randn(481, 24, 5)
  return {'params': p, 'opt': _tx_reg.init(p)}, x, jnp.sin(x[:, 1]) + 0.5


# why: concordance correlation uses only batch means, variances and the covariance --
# all functions of per-example sums.
add('concordance_correlation_ccc', ccc_step, ccc_make, expect_split=True)


def moco_queue_step(state, v1, v2):
  keys = jax.lax.stop_gradient(_l2n(_mlp(state['key_enc'], v2)))

  def loss_fn(params):
    q = _l2n(_mlp(params, v1))
    l_pos = jnp.sum(q * keys, -1, keepdims=True)
    l_neg = q @ state['queue'].T
    logits = jnp.concatenate([l_pos, l_neg], 1) / 0.2
    labels = jnp.zeros(q.shape[0], jnp.int32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  updates, opt = _tx_ssl.update(grads, state['opt'], state['params'])
  params = optax.apply_updates(state['params'], updates)
  k = state['queue'].shape[0]
  queue = jnp.concatenate([keys, state['queue']], 0)[:k]        # enqueue / dequeue
  return {'params': params, 'key_enc': _ema(state['key_enc'], params, 0.99),
          'queue': queue, 'opt': opt}, {'loss': loss}


def moco_queue_make():
  p = _mlp_init(490, [8, 16, 8])
  v1, v2 = _two_views(491)
  queue = _l2n(_randn(492, 48, 8))
  return {'params': p, 'key_enc': _mlp_init(490, [8, 16, 8]), 'queue': queue,
          'opt': _tx_ssl.init(p)}, v1, v2


# why: negatives come from a queue in the state, so the loss is per example; but the new
# queue stores this batch's keys row by row -- a per-example output, not a sum. Unsure.
add('moco_queue_negatives', moco_queue_step, moco_queue_make, expect_split=None)


def dino_step(state, v1, v2):
  center = state['center']
  t1 = jax.lax.stop_gradient(_mlp(state['teacher'], v1, jax.nn.gelu))
  t2 = jax.lax.stop_gradient(_mlp(state['teacher'], v2, jax.nn.gelu))

  def h(t, s):
    tp = jax.nn.softmax((t - center) / 0.04, -1)
    return -jnp.sum(tp * jax.nn.log_softmax(s / 0.1, -1), -1)

  def loss_fn(student):
    s1 = _mlp(student, v1, jax.nn.gelu)
    s2 = _mlp(student, v2, jax.nn.gelu)
    return jnp.mean(h(t1, s2) + h(t2, s1)) / 2

  loss, grads = jax.value_and_grad(loss_fn)(state['student'])
  updates, opt = _tx_ssl.update(grads, state['opt'], state['student'])
  student = optax.apply_updates(state['student'], updates)
  batch_center = jnp.concatenate([t1, t2], 0).mean(0)
  return {'student': student, 'teacher': _ema(state['teacher'], student, 0.996),
          'center': 0.9 * center + 0.1 * batch_center, 'opt': opt}, {'loss': loss}


def dino_make():
  student = _mlp_init(500, [8, 16, 12])
  v1, v2 = _two_views(501, b=24)
  return {'student': student, 'teacher': _mlp_init(500, [8, 16, 12]),
          'center': _f(np.zeros(12)), 'opt': _tx_ssl.init(student)}, v1, v2


# why: teacher targets use the centre from the state (not the batch); the new centre is an
# EMA of a batch mean of teacher outputs -- a sum over examples.
add('dino_centering_ema', dino_step, dino_make, expect_split=True)


def _sinkhorn(scores, iters=3, eps=0.05):
  q = jnp.exp((scores - scores.max()) / eps).T      # (K, B)
  q = q / q.sum()
  k, b = q.shape
  for _ in range(iters):
    q = q / q.sum(1, keepdims=True) / k
    q = q / q.sum(0, keepdims=True) / b
  return (q * b).T


def swav_step(state, v1, v2):
  def loss_fn(params):
    protos = _l2n(params['protos'])
    z1 = _l2n(_mlp(params['enc'], v1))
    z2 = _l2n(_mlp(params['enc'], v2))
    s1, s2 = z1 @ protos.T, z2 @ protos.T
    q1 = jax.lax.stop_gradient(_sinkhorn(s1))
    q2 = jax.lax.stop_gradient(_sinkhorn(s2))
    l = -jnp.sum(q1 * jax.nn.log_softmax(s2 / 0.1, -1), -1) - jnp.sum(
        q2 * jax.nn.log_softmax(s1 / 0.1, -1), -1)
    return l.mean() / 2

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  updates, opt = _tx_ssl.update(grads, state['opt'], state['params'])
  return {'params': optax.apply_updates(state['params'], updates), 'opt': opt}, {'loss': loss}


def swav_make():
  p = {'enc': _mlp_init(510, [8, 16, 8]), 'protos': _randn(511, 6, 8)}
  v1, v2 = _two_views(512, b=32)
  return {'params': p, 'opt': _tx_ssl.init(p)}, v1, v2


# why: Sinkhorn codes alternate row and column normalisations across the batch; each round
# is a batch sum, but the codes are an iterated, global-max-shifted map of all scores. Unsure.
add('swav_sinkhorn_codes', swav_step, swav_make, expect_split=None)


# ========================================================================================
# 5. losses with batch statistics
# ========================================================================================

_tx_bs = optax.adam(5e-3)


def _bs_apply(state, loss_fn, has_aux=False):
  out, grads = jax.value_and_grad(loss_fn, has_aux=has_aux)(state['params'])
  loss, aux = out if has_aux else (out, {})
  updates, opt = _tx_bs.update(grads, state['opt'], state['params'])
  return ({'params': optax.apply_updates(state['params'], updates), 'opt': opt},
          dict(aux, loss=loss))


def _bs_make_cls(seed, b=32, d=8, c=4, hidden=16):
  p = _mlp_init(seed, [d, hidden, c])
  return {'params': p, 'opt': _tx_bs.init(p)}, _randn(seed + 1, b, d), _randint(seed + 2, c, b)


def standardised_pred_step(state, x, y):
  def loss_fn(p):
    pred = _mlp(p, x)[:, 0]
    z = (pred - pred.mean()) / (pred.std() + 1e-6)
    yz = (y - y.mean()) / (y.std() + 1e-6)
    return jnp.mean(optax.huber_loss(z, yz, delta=0.5))

  return _bs_apply(state, loss_fn)


def standardised_pred_make():
  p = _mlp_init(600, [8, 16, 1])
  x = _randn(601, 32, 8)
  return {'params': p, 'opt': _tx_bs.init(p)}, x, 3.0 * x[:, 2] - x[:, 3] + 1.0


# why: predictions standardised by the batch mean/std: two batch statistics (sums of p
# and p^2) computed in an earlier pass, then a per-example Huber term -- exact in passes.
add('standardised_predictions_huber', standardised_pred_step, standardised_pred_make,
    expect_split=True)


def tilted_erm_step(state, x, labels):
  t = 2.0

  def loss_fn(p):
    ce = optax.softmax_cross_entropy_with_integer_labels(_mlp(p, x), labels)
    tilted = (jax.nn.logsumexp(t * ce) - jnp.log(ce.shape[0])) / t
    return tilted, {'mean_ce': ce.mean(), 'max_ce': ce.max()}

  return _bs_apply(state, loss_fn, has_aux=True)


# why: tilted ERM (1/t) log mean exp(t l_i) is a smooth function of the single batch sum
# sum_i exp(t l_i).
add('tilted_erm_logsumexp_over_batch', tilted_erm_step, lambda: _bs_make_cls(610),
    expect_split=True)


def batch_softmax_sg_step(state, x, labels):
  def loss_fn(p):
    ce = optax.softmax_cross_entropy_with_integer_labels(_mlp(p, x), labels)
    w = jax.lax.stop_gradient(jax.nn.softmax(ce / 0.5))
    return jnp.sum(w * ce), {'w_max': w.max()}

  return _bs_apply(state, loss_fn, has_aux=True)


# why: weights softmax(l/T) over the batch, stop-gradient: sum_i e^{l_i/T} l_i divided by
# sum_j e^{l_j/T} -- a ratio of batch sums (denominator constant for the gradient).
add('dro_batch_softmax_weights_stop_gradient', batch_softmax_sg_step,
    lambda: _bs_make_cls(620), expect_split=True)


def batch_softmax_full_step(state, x, labels):
  def loss_fn(p):
    ce = optax.softmax_cross_entropy_with_integer_labels(_mlp(p, x, jnp.tanh), labels)
    return jnp.sum(jax.nn.softmax(ce / 1.0) * ce)

  return _bs_apply(state, loss_fn)


# why: without stop-gradient it is still sum_i e^{l_i} l_i / sum_j e^{l_j}, a smooth
# function of two batch sums.
add('dro_batch_softmax_weights_through', batch_softmax_full_step, lambda: _bs_make_cls(630),
    expect_split=True)


def focal_step(state, x, labels):
  gamma = 2.0
  alpha = jnp.array([0.25, 0.25, 0.25, 0.25])

  def loss_fn(p):
    logp = jax.nn.log_softmax(_mlp(p, x), -1)
    lp_t = jnp.take_along_axis(logp, labels[:, None], -1)[:, 0]
    pt = jnp.exp(lp_t)
    return jnp.mean(-alpha[labels] * (1.0 - pt) ** gamma * lp_t)

  return _bs_apply(state, loss_fn)


# why: focal loss with fixed alpha is a per-example term averaged over the batch.
add('focal_loss_fixed_alpha', focal_step, lambda: _bs_make_cls(640), expect_split=True)


def class_balanced_step(state, x, labels):
  c, beta = 4, 0.99
  counts = jnp.sum(jax.nn.one_hot(labels, c), 0)                 # counted from this batch
  eff = (1.0 - beta ** jnp.maximum(counts, 1.0)) / (1.0 - beta)
  w = 1.0 / eff
  w = w / w.sum() * c
  wi = w[labels]

  def loss_fn(p):
    ce = optax.softmax_cross_entropy_with_integer_labels(_mlp(p, x), labels)
    return jnp.sum(wi * ce) / jnp.sum(wi)

  return _bs_apply(state, loss_fn)


def class_balanced_make():
  st, x, _ = _bs_make_cls(650)
  labels = jnp.asarray(np.random.RandomState(653).choice(4, size=32, p=[.6, .25, .1, .05]),
                       jnp.int32)
  return st, x, labels


# why: class-balanced weights come from label counts of the whole batch (parameter-free
# preprocessing); the loss is a weighted sum over the batch divided by a constant.
add('class_balanced_effective_number', class_balanced_step, class_balanced_make,
    expect_split=True)


def inverse_freq_focal_step(state, x, labels):
  def loss_fn(p):
    logits = _mlp(p, x)
    counts = jnp.bincount(labels, length=4)
    w = 1.0 / counts[labels]
    logp = jax.nn.log_softmax(logits)
    lp_t = jnp.take_along_axis(logp, labels[:, None], -1)[:, 0]
    fl = -(1.0 - jnp.exp(lp_t)) ** 2 * lp_t
    return jnp.sum(w * fl) / jnp.sum(w)

  return _bs_apply(state, loss_fn)


# why: inverse-frequency weights counted from the batch labels (no parameters involved);
# weighted focal sum over examples over a parameter-free normaliser.
add('focal_inverse_frequency_from_batch', inverse_freq_focal_step, class_balanced_make,
    expect_split=True)


def retina_focal_step(state, feats, targets):
  def loss_fn(p):
    logits = _mlp(p, feats)                                    # (B, A, C)
    ce = optax.sigmoid_binary_cross_entropy(logits, targets)
    prob = jax.nn.sigmoid(logits)
    pt = prob * targets + (1 - prob) * (1 - targets)
    a = 0.25 * targets + 0.75 * (1 - targets)
    num_pos = jnp.maximum(targets.sum(), 1.0)
    return jnp.sum(a * (1 - pt) ** 2 * ce) / num_pos, {'num_pos': num_pos}

  return _bs_apply(state, loss_fn, has_aux=True)


def retina_focal_make():
  p = _mlp_init(660, [8, 16, 3])
  t = _f(np.random.RandomState(662).rand(16, 6, 3) < 0.15)
  return {'params': p, 'opt': _tx_bs.init(p)}, _randn(661, 16, 6, 8), t


# why: RetinaNet normalises the summed focal loss by the number of positive anchors in the
# batch, a count of the targets -- parameter-free.
add('sigmoid_focal_normalised_by_num_pos', retina_focal_step, retina_focal_make,
    expect_split=True)


def marginal_entropy_step(state, x, labels):
  def loss_fn(p):
    logits = _mlp(p, x)
    probs = jax.nn.softmax(logits)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    marg = probs.mean(0)
    ent = -jnp.sum(marg * jnp.log(marg + 1e-8))
    return ce - 0.1 * ent, {'marginal_entropy': ent}

  return _bs_apply(state, loss_fn, has_aux=True)


# why: entropy of the batch-mean prediction: a function of the batch sum of softmax rows.
add('marginal_entropy_of_mean_prediction', marginal_entropy_step, lambda: _bs_make_cls(670),
    expect_split=True)


def batch_context_step(state, x, y):
  def loss_fn(p):
    h = jax.nn.relu(x @ p['w1'] + p['b1'])
    ctx = h.mean(0, keepdims=True)                  # batch context vector
    out = jnp.concatenate([h, jnp.broadcast_to(ctx, h.shape)], -1) @ p['w2']
    return jnp.mean((out[:, 0] - y) ** 2)

  return _bs_apply(state, loss_fn)


def batch_context_make():
  rs = np.random.RandomState(680)
  p = {'w1': _f(rs.randn(6, 12) / 3), 'b1': _f(np.zeros(12)), 'w2': _f(rs.randn(24, 1) / 5)}
  return {'params': p, 'opt': _tx_bs.init(p)}, _randn(681, 24, 6), _randn(682, 24)


# why: every prediction sees the batch mean of hidden features; like BatchNorm, that mean
# is a batch sum, so value and gradient follow from per-example pieces in two passes.
add('batch_mean_context_feature', batch_context_step, batch_context_make, expect_split=True)


def rmse_step(state, x, y):
  def loss_fn(p):
    return jnp.sqrt(jnp.mean((_mlp(p, x)[:, 0] - y) ** 2) + 1e-12)

  return _bs_apply(state, loss_fn)


def rmse_make():
  p = _mlp_init(690, [4, 8, 1])
  x = _randn(691, 16, 4)
  return {'params': p, 'opt': _tx_bs.init(p)}, x, x.sum(1)


# why: sqrt of the mean squared error -- a function of one batch sum.
add('rmse_sqrt_of_batch_mean', rmse_step, rmse_make, expect_split=True)


def listnet_step(state, x, relevance):
  def loss_fn(p):
    s = _mlp(p, x)[:, 0]
    target = jax.nn.softmax(relevance)              # over the batch, parameter-free
    return -jnp.sum(target * jax.nn.log_softmax(s))

  return _bs_apply(state, loss_fn)


def listnet_make():
  p = _mlp_init(700, [6, 16, 1])
  return {'params': p, 'opt': _tx_bs.init(p)}, _randn(701, 24, 6), _randn(702, 24)


# why: ListNet over the batch = -sum_i q_i s_i + logsumexp_i s_i with q from the labels only:
# a batch sum plus a function of the batch sum of exp(s_i).
add('listnet_softmax_over_batch', listnet_step, listnet_make, expect_split=True)


# ========================================================================================
# 6. language models: padding, packing, token weights, label smoothing, z-loss
# ========================================================================================

_tx_lm = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 3e-3, 2, 20),
                                 weight_decay=0.01))


def _lm_apply(state, loss_fn):
  (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  updates, opt = _tx_lm.update(grads, state['opt'], state['params'])
  return ({'params': optax.apply_updates(state['params'], updates), 'opt': opt},
          dict(aux, loss=loss))


def _lm_make(seed, b=16):
  p = _lm_init(seed)
  return {'params': p, 'opt': _tx_lm.init(p)}, _randint(seed + 1, _V, b, _T + 1)


def lm_padding_mask_step(state, tokens, mask):
  def loss_fn(p):
    logits = _lm_logits(p, tokens[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    n_tok = jnp.sum(mask)
    return jnp.sum(ce * mask) / n_tok, {'tokens': n_tok}

  return _lm_apply(state, loss_fn)


def lm_padding_mask_make():
  st, toks = _lm_make(800)
  return st, toks, _pad_mask(801, 16)


# why: token cross-entropy summed over valid tokens and divided by the batch's valid-token
# count -- a parameter-free count; causal attention stays within each row.
add('lm_padding_mask_token_mean', lm_padding_mask_step, lm_padding_mask_make,
    expect_split=True)


def lm_packed_step(state, tokens, segment_ids, positions):
  def loss_fn(p):
    inp, tgt = tokens[:, :-1], tokens[:, 1:]
    seg_in, seg_tgt = segment_ids[:, :-1], segment_ids[:, 1:]
    attn = seg_in[:, :, None] == seg_in[:, None, :]
    logits = _lm_logits(p, inp, attn_mask=attn, positions=positions[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tgt)
    w = ((seg_in == seg_tgt) & (seg_tgt > 0)).astype(ce.dtype)
    return jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1.0), {'n': jnp.sum(w)}

  return _lm_apply(state, loss_fn)


def lm_packed_make():
  st, toks = _lm_make(810)
  rs = np.random.RandomState(811)
  seg = np.zeros((16, _T + 1), np.int32)
  pos = np.zeros((16, _T + 1), np.int32)
  for i in range(16):
    cut1, cut2 = rs.randint(2, 5), rs.randint(6, _T + 2)
    seg[i, :cut1], seg[i, cut1:cut2] = 1, 2
    pos[i, :cut1] = np.arange(cut1)
    pos[i, cut1:cut2] = np.arange(cut2 - cut1)
  return st, toks, jnp.asarray(seg), jnp.asarray(pos)


# why: packing puts several documents in one row; segment ids block attention across
# documents but every row is still processed on its own; loss / batch token count.
add('lm_packed_segment_ids', lm_packed_step, lm_packed_make, expect_split=True)


def lm_token_weights_step(state, tokens, weights):
  def loss_fn(p):
    logits = _lm_logits(p, tokens[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    per_example = jnp.sum(ce * weights, -1)
    return jnp.sum(per_example) / jnp.sum(weights), {'per_example_loss': per_example}

  return _lm_apply(state, loss_fn)


def lm_token_weights_make():
  st, toks = _lm_make(820)
  w = np.random.RandomState(821).rand(16, _T) * (np.random.RandomState(822).rand(16, _T) > .2)
  return st, toks, _f(w)


# why: per-token weights normalised by the batch's total weight (parameter-free); the
# per-example losses are also returned, one row per example.
add('lm_token_weights_batch_normalised', lm_token_weights_step, lm_token_weights_make,
    expect_split=True)


def lm_smoothing_zloss_step(state, tokens, mask):
  def loss_fn(p):
    logits = _lm_logits(p, tokens[:, :-1])
    labels = optax.smooth_labels(jax.nn.one_hot(tokens[:, 1:], _V), 0.1)
    ce = optax.softmax_cross_entropy(logits, labels)
    z = jax.nn.logsumexp(logits, -1) ** 2
    denom = jnp.sum(mask)
    return jnp.sum((ce + 1e-4 * z) * mask) / denom, {'z_loss': jnp.sum(z * mask) / denom}

  return _lm_apply(state, loss_fn)


def lm_smoothing_zloss_make():
  st, toks = _lm_make(830)
  return st, toks, _pad_mask(831, 16)


# why: label smoothing and the PaLM z-loss are per token; normalised by a token count.
add('lm_label_smoothing_z_loss', lm_smoothing_zloss_step, lm_smoothing_zloss_make,
    expect_split=True)


def lm_per_sequence_mean_step(state, tokens, mask):
  def loss_fn(p):
    logits = _lm_logits(p, tokens[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    per_seq = jnp.sum(ce * mask, -1) / jnp.maximum(jnp.sum(mask, -1), 1.0)
    return per_seq.mean(), {'worst_seq': per_seq.max()}

  return _lm_apply(state, loss_fn)


def lm_per_sequence_mean_make():
  st, toks = _lm_make(840, b=24)
  return st, toks, _pad_mask(841, 24)


# why: mean over sequences of each sequence's own token mean: a plain mean over examples.
add('lm_per_sequence_then_batch_mean', lm_per_sequence_mean_step, lm_per_sequence_mean_make,
    expect_split=True)


class _TinyLM(nn.Module):
  vocab: int = _V
  d: int = 16

  @nn.compact
  def __call__(self, toks, train: bool):
    t = toks.shape[1]
    h = nn.Embed(self.vocab, self.d)(toks)
    h = h + self.param('pos', nn.initializers.normal(0.02), (16, self.d))[:t]
    x = nn.LayerNorm()(h)
    a = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=self.d)(
        x, x, mask=nn.make_causal_mask(toks))
    h = h + nn.Dropout(0.1, deterministic=not train)(a)
    x = nn.LayerNorm()(h)
    m = nn.Dense(self.d)(nn.gelu(nn.Dense(2 * self.d)(x)))
    h = h + nn.Dropout(0.1, deterministic=not train)(m)
    return nn.Dense(self.vocab)(nn.LayerNorm()(h))


def linen_lm_dropout_step(state, tokens, mask):
  dropout_key = jax.random.fold_in(state.key, state.step)

  def loss_fn(params):
    logits = state.apply_fn({'params': params}, tokens[:, :-1], train=True,
                            rngs={'dropout': dropout_key})
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return jnp.sum(ce * mask) / jnp.sum(mask)

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss, 'ppl': jnp.exp(loss)}


def linen_lm_dropout_make():
  model = _TinyLM()
  toks = _randint(850, _V, 16, _T + 1)
  params = model.init(jax.random.PRNGKey(850), toks[:, :-1], train=False)['params']
  st = _KeyedState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3),
                          key=jax.random.PRNGKey(851))
  return st, toks, _pad_mask(852, 16)


# why: a linen causal transformer with dropout (random per token, independent of other
# examples in distribution); masked token mean over the batch.
add('linen_transformer_dropout_trainstate', linen_lm_dropout_step, linen_lm_dropout_make,
    stochastic=True, expect_split=True)


class _NnxLM(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(_V, 16, rngs=rngs)
    self.ln1 = nnx.LayerNorm(16, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=16, qkv_features=16,
                                       decode=False, rngs=rngs)
    self.ln2 = nnx.LayerNorm(16, rngs=rngs)
    self.mlp_in = nnx.Linear(16, 32, rngs=rngs)
    self.mlp_out = nnx.Linear(32, 16, rngs=rngs)
    self.head = nnx.Linear(16, _V, rngs=rngs)

  def __call__(self, toks):
    h = self.embed(toks)
    h = h + self.attn(self.ln1(h), mask=nnx.make_causal_mask(toks))
    h = h + self.mlp_out(nnx.gelu(self.mlp_in(self.ln2(h))))
    return self.head(h)


def nnx_lm_step(state, tokens, mask):
  model, optimizer = state['model'], state['optimizer']

  def loss_fn(model):
    logits = model(tokens[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return jnp.sum(ce * mask) / jnp.sum(mask)

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return {'model': model, 'optimizer': optimizer}, {'loss': loss}


def nnx_lm_make():
  model = _NnxLM(nnx.Rngs(860))
  opt = nnx.Optimizer(model, optax.adamw(2e-3), wrt=nnx.Param)
  return {'model': model, 'optimizer': opt}, _randint(861, _V, 16, _T + 1), _pad_mask(862, 16)


# why: nnx causal LM, nnx.value_and_grad + nnx.Optimizer; masked token mean over the batch.
add('nnx_lm_value_and_grad_optimizer', nnx_lm_step, nnx_lm_make, expect_split=True)


class _ScanAttnBlock(nn.Module):
  d: int = 16

  @nn.compact
  def __call__(self, h, mask):
    x = nn.LayerNorm()(h)
    h = h + nn.SelfAttention(num_heads=2, qkv_features=self.d)(x, mask=mask)
    h = h + nn.Dense(self.d)(nn.relu(nn.Dense(2 * self.d)(nn.LayerNorm()(h))))
    return h, None


class _ScanLM(nn.Module):
  @nn.compact
  def __call__(self, toks):
    h = nn.Embed(_V, 16)(toks)
    stack = nn.scan(nn.remat(_ScanAttnBlock), variable_axes={'params': 0},
                    split_rngs={'params': True}, in_axes=nn.broadcast, length=2)
    h, _ = stack()(h, nn.make_causal_mask(toks))
    return nn.Dense(_V)(nn.LayerNorm()(h))


def linen_scan_lm_step(state, tokens, weights):
  def loss_fn(params):
    logits = state.apply_fn({'params': params}, tokens[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return jnp.sum(ce * weights) / jnp.sum(weights)

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


def linen_scan_lm_make():
  model = _ScanLM()
  toks = _randint(870, _V, 16, _T + 1)
  params = model.init(jax.random.PRNGKey(870), toks[:, :-1])['params']
  st = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                     tx=optax.lion(3e-4))
  return st, toks, _pad_mask(871, 16)


# why: layers scanned with nn.scan + nn.remat, causal mask broadcast; token mean over batch.
add('linen_scan_remat_transformer_lm', linen_scan_lm_step, linen_scan_lm_make,
    expect_split=True)


# ========================================================================================
# 7. reinforcement learning: PPO, GAE, DQN, REINFORCE
# ========================================================================================

_A = 4
_tx_rl = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(3e-4, eps=1e-5))


def _pv(p, obs):
  return _mlp(p['pi'], obs, jnp.tanh), _mlp(p['v'], obs, jnp.tanh)[..., 0]


def _rl_params(seed, d=6):
  return {'pi': _mlp_init(seed, [d, 16, _A]), 'v': _mlp_init(seed + 1, [d, 16, 1])}


def _rl_apply(state, loss_fn):
  (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  updates, opt = _tx_rl.update(grads, state['opt'], state['params'])
  return ({'params': optax.apply_updates(state['params'], updates), 'opt': opt},
          dict(aux, loss=loss))


def _ppo_loss(p, obs, actions, old_logp, adv, returns):
  logits, v = _pv(p, obs)
  logp_all = jax.nn.log_softmax(logits)
  logp = jnp.take_along_axis(logp_all, actions[..., None], -1)[..., 0]
  ratio = jnp.exp(logp - old_logp)
  pg = -jnp.mean(jnp.minimum(ratio * adv, jnp.clip(ratio, 0.8, 1.2) * adv))
  vf = 0.5 * jnp.mean((v - returns) ** 2)
  ent = -jnp.mean(jnp.sum(jnp.exp(logp_all) * logp_all, -1))
  return pg + 0.5 * vf - 0.01 * ent, {'pg': pg, 'vf': vf, 'entropy': ent,
                                      'clipfrac': jnp.mean(jnp.abs(ratio - 1) > 0.2)}


def ppo_step(state, obs, actions, old_logp, advantages, returns):
  adv = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
  return _rl_apply(state, lambda p: _ppo_loss(p, obs, actions, old_logp, adv, returns))


def _old_logp(p, obs, actions, seed):
  lp = jax.nn.log_softmax(_pv(p, obs)[0])
  lp = jnp.take_along_axis(lp, actions[..., None], -1)[..., 0]
  return lp + _randn(seed, *actions.shape, scale=0.1)


def ppo_make():
  p = _rl_params(900)
  obs, actions = _randn(901, 32, 6), _randint(902, _A, 32)
  return ({'params': p, 'opt': _tx_rl.init(p)}, obs, actions, _old_logp(p, obs, actions, 903),
          _randn(904, 32), _randn(905, 32))


# why: advantages are inputs, so normalising them by the batch mean/std is parameter-free
# preprocessing; the clipped surrogate, value and entropy terms are per-example means.
add('ppo_advantage_normalisation', ppo_step, ppo_make, expect_split=True)


def ppo_gae_env_major_step(state, obs, actions, old_logp, rewards, dones, last_obs):
  gamma, lam = 0.99, 0.95
  values = jax.lax.stop_gradient(_pv(state['params'], obs)[1])          # (B, T)
  last_v = jax.lax.stop_gradient(_pv(state['params'], last_obs)[1])     # (B,)

  def gae_body(carry, inp):
    gae, next_v = carry
    r, v, d = inp
    delta = r + gamma * next_v * (1.0 - d) - v
    gae = delta + gamma * lam * (1.0 - d) * gae
    return (gae, v), gae

  _, adv = jax.lax.scan(gae_body, (jnp.zeros_like(last_v), last_v),
                        (rewards.T, values.T, dones.T), reverse=True)
  adv = adv.T
  returns = adv + values
  adv = (adv - adv.mean()) / (adv.std() + 1e-8)
  return _rl_apply(state, lambda p: _ppo_loss(p, obs, actions, old_logp, adv, returns))


def ppo_gae_env_major_make():
  p = _rl_params(910)
  b, t = 16, 8
  obs, actions = _randn(911, b, t, 6), _randint(912, _A, b, t)
  dones = _f(np.random.RandomState(915).rand(b, t) < 0.1)
  return ({'params': p, 'opt': _tx_rl.init(p)}, obs, actions, _old_logp(p, obs, actions, 913),
          _randn(914, b, t), dones, _randn(916, b, 6))


# why: the batch axis is environments and GAE runs along time inside each environment; the
# critic values are stop-gradient per-example forwards; advantage norm is a batch statistic.
add('ppo_gae_inside_step_env_major', ppo_gae_env_major_step, ppo_gae_env_major_make,
    expect_split=True)


def ppo_gae_time_major_step(state, obs, actions, old_logp, rewards, dones):
  gamma, lam = 0.99, 0.95
  values = jax.lax.stop_gradient(_pv(state['params'], obs)[1])          # (T,)

  def gae_body(carry, inp):
    gae, next_v = carry
    r, v, d = inp
    delta = r + gamma * next_v * (1.0 - d) - v
    gae = delta + gamma * lam * (1.0 - d) * gae
    return (gae, v), gae

  zero = jnp.zeros_like(values[0])
  _, adv = jax.lax.scan(gae_body, (zero, zero), (rewards, values, dones), reverse=True)
  returns = adv + values
  adv = (adv - adv.mean()) / (adv.std() + 1e-8)
  return _rl_apply(state, lambda p: _ppo_loss(p, obs, actions, old_logp, adv, returns))


def ppo_gae_time_major_make():
  p = _rl_params(920)
  obs, actions = _randn(921, 32, 6), _randint(922, _A, 32)
  dones = _f(np.random.RandomState(925).rand(32) < 0.1)
  return ({'params': p, 'opt': _tx_rl.init(p)}, obs, actions, _old_logp(p, obs, actions, 923),
          _randn(924, 32), dones)


# why: here the leading axis is time: GAE scans backwards across the "examples", using
# critic values of other rows; exact only if the whole rollout is pre-processed first.
add('ppo_gae_inside_step_time_major', ppo_gae_time_major_step, ppo_gae_time_major_make,
    expect_split=None)


_tx_dqn = optax.adam(1e-3)


def dqn_step(state, obs, actions, rewards, next_obs, dones):
  q_next = _mlp(state['target'], next_obs).max(-1)
  target = rewards + 0.99 * (1.0 - dones) * q_next

  def loss_fn(params):
    q = jnp.take_along_axis(_mlp(params, obs), actions[:, None], -1)[:, 0]
    return jnp.mean(optax.huber_loss(q, jax.lax.stop_gradient(target))), q.mean()

  (loss, q_mean), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  updates, opt = _tx_dqn.update(grads, state['opt'])
  return {'params': optax.apply_updates(state['params'], updates), 'target': state['target'],
          'opt': opt}, {'td_loss': loss, 'q': q_mean}


def _dqn_batch(seed, b=32):
  return (_randn(seed, b, 6), _randint(seed + 1, _A, b), _randn(seed + 2, b),
          _randn(seed + 3, b, 6), _f(np.random.RandomState(seed + 4).rand(b) < 0.1))


def dqn_make():
  p = _mlp_init(930, [6, 16, _A])
  return ({'params': p, 'target': _mlp_init(931, [6, 16, _A]), 'opt': _tx_dqn.init(p)},
          *_dqn_batch(932))


# why: TD targets from a frozen target network, one Huber term per transition.
add('dqn_target_network_huber', dqn_step, dqn_make, expect_split=True)


def double_dqn_step(state, obs, actions, rewards, next_obs, dones):
  params = state['params']
  a_star = jnp.argmax(_mlp(params, next_obs), -1)
  q_next = jnp.take_along_axis(_mlp(state['target'], next_obs), a_star[:, None], -1)[:, 0]
  target = jax.lax.stop_gradient(rewards + 0.99 * (1.0 - dones) * q_next)

  def loss_fn(p):
    q = jnp.take_along_axis(_mlp(p, obs), actions[:, None], -1)[:, 0]
    return jnp.mean((q - target) ** 2)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  updates, opt = _tx_dqn.update(grads, state['opt'])
  params = optax.apply_updates(params, updates)
  steps = state['steps'] + 1
  target_params = optax.periodic_update(params, state['target'], steps, 2)
  return {'params': params, 'target': target_params, 'opt': opt, 'steps': steps}, {
      'loss': loss}


def double_dqn_make():
  p = _mlp_init(940, [6, 16, _A])
  return ({'params': p, 'target': p, 'opt': _tx_dqn.init(p),
           'steps': jnp.zeros((), jnp.int32)}, *_dqn_batch(941))


# why: double-DQN action selection uses the online net on each transition's own next state;
# periodic target copy is a parameter update, per-transition squared TD error.
add('double_dqn_periodic_target', double_dqn_step, double_dqn_make, expect_split=True)


def reinforce_step(state, obs, actions, returns):
  baseline = returns.mean()

  def loss_fn(p):
    logp = jax.nn.log_softmax(_mlp(p, obs))
    logp_a = jnp.take_along_axis(logp, actions[:, None], -1)[:, 0]
    return -jnp.mean((returns - baseline) * logp_a)

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  updates, opt = _tx_dqn.update(grads, state['opt'])
  return {'params': optax.apply_updates(state['params'], updates), 'opt': opt}, {
      'loss': loss, 'baseline': baseline}


def reinforce_make():
  p = _mlp_init(950, [6, 16, _A])
  return ({'params': p, 'opt': _tx_dqn.init(p)}, _randn(951, 32, 6), _randint(952, _A, 32),
          _randn(953, 32))


# why: the baseline is the batch mean of the observed returns -- parameter-free preprocessing.
add('reinforce_batch_mean_baseline', reinforce_step, reinforce_make, expect_split=True)


def reinforce_learned_baseline_step(state, obs, actions, returns):
  def loss_fn(p):
    logits, v = _pv(p, obs)
    logp = jax.nn.log_softmax(logits)
    logp_a = jnp.take_along_axis(logp, actions[:, None], -1)[:, 0]
    adv = returns - jax.lax.stop_gradient(v)
    pg = -jnp.mean(adv * logp_a)
    vf = jnp.mean((v - returns) ** 2)
    ent = -jnp.mean(jnp.sum(jnp.exp(logp) * logp, -1))
    return pg + 0.5 * vf - 0.01 * ent, {'pg': pg, 'vf': vf}

  return _rl_apply(state, loss_fn)


def reinforce_learned_baseline_make():
  p = _rl_params(960)
  return ({'params': p, 'opt': _tx_rl.init(p)}, _randn(961, 24, 6), _randint(962, _A, 24),
          _randn(963, 24))


# why: a learned state-value baseline is per example; all three terms are batch means.
add('reinforce_learned_value_baseline', reinforce_learned_baseline_step,
    reinforce_learned_baseline_make, expect_split=True)


def a2c_mc_returns_step(state, obs, actions, rewards, dones):
  def disc(carry, inp):
    r, d = inp
    g = r + 0.99 * carry * (1.0 - d)
    return g, g

  _, returns = jax.lax.scan(disc, jnp.zeros_like(rewards[0]), (rewards, dones), reverse=True)

  def loss_fn(p):
    logits, v = _pv(p, obs)
    logp_a = jnp.take_along_axis(jax.nn.log_softmax(logits), actions[:, None], -1)[:, 0]
    adv = returns - jax.lax.stop_gradient(v)
    return -jnp.mean(adv * logp_a) + 0.5 * jnp.mean((v - returns) ** 2), {
        'ret': returns.mean()}

  return _rl_apply(state, loss_fn)


def a2c_mc_returns_make():
  p = _rl_params(970)
  return ({'params': p, 'opt': _tx_rl.init(p)}, _randn(971, 32, 6), _randint(972, _A, 32),
          _randn(973, 32), _f(np.random.RandomState(974).rand(32) < 0.15))


# why: discounted returns scan backwards across the time-major batch, but only over rewards
# and dones (no parameters): whole-batch preprocessing, then per-example terms.
add('a2c_monte_carlo_returns_time_major', a2c_mc_returns_step, a2c_mc_returns_make,
    expect_split=True)


# ========================================================================================
# 8. views built by tile / repeat / concatenate, per-example keys, dropout, mixup, DP-SGD
# ========================================================================================

_tx_v = optax.sgd(0.05, momentum=0.9, nesterov=True)


def _v_apply(state, loss_fn, **extra):
  (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  updates, opt = _tx_v.update(grads, state['opt'])
  new = dict(state, params=optax.apply_updates(state['params'], updates), opt=opt, **extra)
  return new, dict(aux, loss=loss)


def _v_make(seed, sizes=(8, 16, 4), b=32, **extra):
  p = _mlp_init(seed, list(sizes))
  return dict({'params': p, 'opt': _tx_v.init(p)}, **extra), _randn(seed + 1, b, sizes[0]), \
      _randint(seed + 2, sizes[-1], b)


def tile_views_step(state, x, labels):
  def loss_fn(p):
    n = x.shape[0]
    x2 = jnp.tile(x, (2, 1)) * jnp.repeat(jnp.array([1.0, 0.8]), n)[:, None]
    logits = _mlp(p, x2)
    l1, l2 = logits[:n], logits[n:]
    ce = optax.softmax_cross_entropy_with_integer_labels(l1, labels).mean()
    cons = jnp.mean((jax.nn.softmax(l1) - jax.nn.softmax(l2)) ** 2)
    return ce + 0.5 * cons, {'ce': ce, 'consistency': cons}

  return _v_apply(state, loss_fn)


# why: jnp.tile stacks two scaled copies of the batch; slicing [:n] and [n:] gives back
# each example's two views, and the consistency term pairs an example only with itself.
add('tile_two_views_consistency', tile_views_step, lambda: _v_make(1000), expect_split=True)


def repeat_iwae_step(state, x):
  k = 4
  key = jax.random.fold_in(state['key'], state['step'])

  def loss_fn(p):
    xr = jnp.repeat(x, k, axis=0)
    mu, logvar = jnp.split(_mlp(p['enc'], xr), 2, -1)
    eps = jax.random.normal(key, mu.shape)
    z = mu + jnp.exp(0.5 * logvar) * eps
    xhat = _mlp(p['dec'], z)
    log_px = -0.5 * jnp.sum((xr - xhat) ** 2, -1)
    log_pz = -0.5 * jnp.sum(z ** 2, -1)
    log_qz = -0.5 * jnp.sum(eps ** 2 + logvar, -1)
    lw = (log_px + log_pz - log_qz).reshape(-1, k)
    return -jnp.mean(jax.nn.logsumexp(lw, 1) - jnp.log(k)), {}

  return _v_apply(state, loss_fn, step=state['step'] + 1)


def repeat_iwae_make():
  p = {'enc': _mlp_init(1010, [8, 16, 8]), 'dec': _mlp_init(1011, [4, 16, 8])}
  return ({'params': p, 'opt': _tx_v.init(p), 'key': jax.random.PRNGKey(1012),
           'step': jnp.zeros((), jnp.int32)}, _randn(1013, 16, 8))


# why: jnp.repeat makes k samples per example that reshape back to (B, k); the IWAE bound
# is a per-example logmeanexp. The noise is drawn for the whole (B*k) block.
add('repeat_k_samples_iwae', repeat_iwae_step, repeat_iwae_make, stochastic=True,
    expect_split=True)


def concat_flip_tta_step(state, x, labels):
  def loss_fn(p):
    n = x.shape[0]
    both = jnp.concatenate([x, x[:, ::-1]], axis=0)
    logits = _mlp(p, both)
    avg = 0.5 * (logits[:n] + logits[n:])
    return optax.softmax_cross_entropy_with_integer_labels(avg, labels).mean(), {}

  return _v_apply(state, loss_fn)


# why: the flipped copy is concatenated along the batch and averaged back pairwise (i, i+n):
# the prediction of example i uses only its own two views.
add('concat_flip_views_average', concat_flip_tta_step, lambda: _v_make(1020),
    expect_split=True)


def per_example_keys_arg_step(state, x, labels, keys):
  def loss_fn(p):
    noise = jax.vmap(lambda k: jax.random.normal(k, x.shape[1:]))(keys)
    logits = _mlp(p, x + 0.1 * noise)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), {}

  return _v_apply(state, loss_fn)


def per_example_keys_arg_make():
  st, x, y = _v_make(1030)
  return st, x, y, jax.random.split(jax.random.PRNGKey(1031), 32)


# why: each example carries its own PRNG key in the batch, so its noise is fixed by its
# own row: deterministic and per example.
add('per_example_keys_as_batch_input', per_example_keys_arg_step, per_example_keys_arg_make,
    expect_split=True)


def per_example_keys_split_step(state, x, labels):
  keys = jax.random.split(jax.random.fold_in(state['key'], state['step']), x.shape[0])

  def loss_fn(p):
    noise = jax.vmap(lambda k: jax.random.normal(k, x.shape[1:]))(keys)
    logits = _mlp(p, x + 0.1 * noise)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), {}

  return _v_apply(state, loss_fn, step=state['step'] + 1)


# why: keys are split inside the step by the batch size, so a microbatch draws other noise
# (same distribution); the loss itself is per example.
add('per_example_keys_split_in_step', per_example_keys_split_step,
    lambda: _v_make(1040, key=jax.random.PRNGKey(1041), step=jnp.zeros((), jnp.int32)),
    stochastic=True, expect_split=True)


class _DropoutMLP(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.relu(nn.Dense(32)(x))
    x = nn.Dropout(0.2, deterministic=not train)(x)
    x = nn.relu(nn.Dense(16)(x))
    x = nn.Dropout(0.2, deterministic=not train)(x)
    return nn.Dense(4)(x)


def linen_dropout_step(state, x, labels):
  key = jax.random.fold_in(state.key, state.step)

  def loss_fn(params):
    logits = state.apply_fn({'params': params}, x, train=True, rngs={'dropout': key})
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, logits

  (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads), {
      'loss': loss, 'acc': jnp.mean(jnp.argmax(logits, -1) == labels)}


def linen_dropout_make():
  model = _DropoutMLP()
  x = _randn(1050, 32, 8)
  params = model.init(jax.random.PRNGKey(1050), x, train=False)['params']
  st = _KeyedState.create(apply_fn=model.apply, params=params,
                          tx=optax.sgd(0.1), key=jax.random.PRNGKey(1051))
  return st, x, _randint(1052, 4, 32)


# why: dropout masks are independent per unit and example; mean CE over the batch.
add('linen_dropout_keyed_trainstate', linen_dropout_step, linen_dropout_make,
    stochastic=True, expect_split=True)


def mixup_flip_step(state, x, labels):
  lam = 0.7
  y = jax.nn.one_hot(labels, 4)
  xm = lam * x + (1 - lam) * x[::-1]
  ym = lam * y + (1 - lam) * y[::-1]

  def loss_fn(p):
    return optax.softmax_cross_entropy(_mlp(p, xm), ym).mean(), {}

  return _v_apply(state, loss_fn)


# why: mixing each input with its mirror in the batch uses only inputs and labels:
# parameter-free preprocessing on the whole batch, then a per-(mixed)-example loss.
add('mixup_with_reversed_batch', mixup_flip_step, lambda: _v_make(1060), expect_split=True)


def mixup_random_step(state, x, labels):
  k1, k2 = jax.random.split(jax.random.fold_in(state['key'], state['step']))
  lam = jax.random.beta(k1, 0.4, 0.4)
  perm = jax.random.permutation(k2, x.shape[0])
  y = jax.nn.one_hot(labels, 4)
  xm = lam * x + (1 - lam) * x[perm]
  ym = lam * y + (1 - lam) * y[perm]

  def loss_fn(p):
    return optax.softmax_cross_entropy(_mlp(p, xm), ym).mean(), {'lam': lam}

  return _v_apply(state, loss_fn, step=state['step'] + 1)


# why: random-permutation mixup is still input/label preprocessing without parameters;
# the permutation and lambda are random draws.
add('mixup_random_permutation_beta', mixup_random_step,
    lambda: _v_make(1070, key=jax.random.PRNGKey(1071), step=jnp.zeros((), jnp.int32)),
    stochastic=True, expect_split=True)


def manifold_mixup_step(state, x, labels):
  lam = 0.6
  y = jax.nn.one_hot(labels, 4)

  def loss_fn(p):
    h = jax.nn.relu(x @ p[0]['w'] + p[0]['b'])
    hm = lam * h + (1 - lam) * h[::-1]                 # mixes hidden states of two rows
    logits = _mlp(p[1:], jax.nn.relu(hm))
    ym = lam * y + (1 - lam) * y[::-1]
    return optax.softmax_cross_entropy(logits, ym).mean(), {}

  return _v_apply(state, loss_fn)


# why: hidden states (parameter-dependent) of example i and n-1-i are mixed; only a split
# that keeps mirrored rows together reproduces it. Unsure.
add('manifold_mixup_hidden_reversed', manifold_mixup_step,
    lambda: _v_make(1080, sizes=(8, 16, 16, 4)), expect_split=None)


def dp_sgd_step(state, x, labels):
  clip, sigma = 1.0, 0.5
  params = state['params']
  key = jax.random.fold_in(state['key'], state['step'])

  def example_loss(p, xi, yi):
    return optax.softmax_cross_entropy_with_integer_labels(_mlp(p, xi[None]), yi[None])[0]

  losses = jax.vmap(example_loss, in_axes=(None, 0, 0))(params, x, labels)
  grads = jax.vmap(jax.grad(example_loss), in_axes=(None, 0, 0))(params, x, labels)
  sq = sum(jnp.sum(g.reshape(g.shape[0], -1) ** 2, 1) for g in jax.tree_util.tree_leaves(grads))
  scale = jnp.minimum(1.0, clip / (jnp.sqrt(sq) + 1e-6))
  summed = jax.tree_util.tree_map(lambda g: jnp.einsum('b...,b->...', g, scale), grads)
  leaves, treedef = jax.tree_util.tree_flatten(summed)
  keys = jax.random.split(key, len(leaves))
  noisy = [(g + sigma * clip * jax.random.normal(k, g.shape)) / x.shape[0]
           for g, k in zip(leaves, keys)]
  g = jax.tree_util.tree_unflatten(treedef, noisy)
  updates, opt = _tx_v.update(g, state['opt'])
  return dict(state, params=optax.apply_updates(params, updates), opt=opt,
              step=state['step'] + 1), {'loss': losses.mean(), 'clip_frac': jnp.mean(scale < 1)}


# why: per-example clipped gradients are summed over the batch (a sum of per-example
# pieces); Gaussian noise is one random draw added to the sum.
add('dp_sgd_per_example_clipping', dp_sgd_step,
    lambda: _v_make(1090, key=jax.random.PRNGKey(1091), step=jnp.zeros((), jnp.int32)),
    stochastic=True, expect_split=True)


# ========================================================================================
# 9. normalisation layers: BatchNorm (linen / nnx), GroupNorm, LayerNorm, ghost BN
# ========================================================================================

class _BNNet(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Dense(16)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
    x = nn.relu(x)
    x = nn.Dense(16)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
    return nn.Dense(4)(nn.relu(x))


def linen_batchnorm_step(state, x, labels):
  def loss_fn(params):
    logits, updates = state.apply_fn({'params': params, 'batch_stats': state.batch_stats},
                                     x, train=True, mutable=['batch_stats'])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, updates['batch_stats']

  (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  state = state.apply_gradients(grads=grads).replace(batch_stats=batch_stats)
  return state, {'loss': loss}


def linen_batchnorm_make():
  model = _BNNet()
  x = _randn(1100, 32, 8)
  v = model.init(jax.random.PRNGKey(1100), x, train=False)
  st = _BNState.create(apply_fn=model.apply, params=v['params'], tx=optax.adam(1e-3),
                       batch_stats=v['batch_stats'])
  return st, x, _randint(1101, 4, 32)


# why: BatchNorm normalises with the batch mean and variance (functions of batch sums, the
# gradient flows through them); the running stats are EMAs of those sums -- exact in passes.
add('linen_batchnorm_mutable_batch_stats', linen_batchnorm_step, linen_batchnorm_make,
    expect_split=True)


class _NnxBNNet(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(8, 16, rngs=rngs)
    self.bn = nnx.BatchNorm(16, momentum=0.9, rngs=rngs)
    self.l2 = nnx.Linear(16, 1, rngs=rngs)

  def __call__(self, x):
    return self.l2(nnx.relu(self.bn(self.l1(x))))[:, 0]


_nnx_bn_graphdef, _, _ = nnx.split(_NnxBNNet(nnx.Rngs(0)), nnx.Param, nnx.BatchStat)
_tx_nnx_bn = optax.adam(3e-3)


def nnx_batchnorm_functional_step(state, x, y):
  params, stats, opt_state = state

  def loss_fn(params, stats):
    model = nnx.merge(_nnx_bn_graphdef, params, stats, copy=True)
    pred = model(x)
    _, _, new_stats = nnx.split(model, nnx.Param, nnx.BatchStat)
    return jnp.mean((pred - y) ** 2), new_stats

  (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, stats)
  updates, opt_state = _tx_nnx_bn.update(grads, opt_state, params)
  return (optax.apply_updates(params, updates), stats, opt_state), {'mse': loss}


def nnx_batchnorm_functional_make():
  _, params, stats = nnx.split(_NnxBNNet(nnx.Rngs(1110)), nnx.Param, nnx.BatchStat)
  return (params, stats, _tx_nnx_bn.init(params)), _randn(1111, 24, 8), _randn(1112, 24)


# why: nnx.BatchNorm in training mode through split/merge: batch mean/var are batch sums;
# same judgement as linen BatchNorm.
add('nnx_batchnorm_split_merge', nnx_batchnorm_functional_step,
    nnx_batchnorm_functional_make, expect_split=True)


def nnx_batchnorm_pytree_step(state, x, labels):
  def loss_fn(model):
    logits = model(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  loss, grads = nnx.value_and_grad(loss_fn)(state['model'])
  state['optimizer'].update(state['model'], grads)
  return state, {'loss': loss}


class _NnxBNClassifier(nnx.Module):
  def __init__(self, rngs):
    self.conv = nnx.Conv(3, 8, kernel_size=(3, 3), rngs=rngs)
    self.bn = nnx.BatchNorm(8, rngs=rngs)
    self.head = nnx.Linear(8, 4, rngs=rngs)

  def __call__(self, x):
    h = nnx.relu(self.bn(self.conv(x)))
    return self.head(h.mean((1, 2)))


def nnx_batchnorm_pytree_make():
  model = _NnxBNClassifier(nnx.Rngs(1120))
  opt = nnx.Optimizer(model, optax.sgd(0.05, momentum=0.9), wrt=nnx.Param)
  return {'model': model, 'optimizer': opt}, _randn(1121, 16, 6, 6, 3), _randint(1122, 4, 16)


# why: conv + BatchNorm over (batch, H, W): the statistics are sums over examples and pixels.
add('nnx_batchnorm_conv_optimizer', nnx_batchnorm_pytree_step, nnx_batchnorm_pytree_make,
    expect_split=True)


class _GNConv(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.GroupNorm(num_groups=4)(nn.Conv(8, (3, 3))(x)))
    x = nn.relu(nn.GroupNorm(num_groups=2)(nn.Conv(8, (3, 3), strides=2)(x)))
    return nn.Dense(4)(x.mean((1, 2)))


def groupnorm_step(state, images, labels):
  def loss_fn(params):
    logits = state.apply_fn({'params': params}, images)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


def groupnorm_make():
  model = _GNConv()
  x = _randn(1130, 16, 8, 8, 3)
  params = model.init(jax.random.PRNGKey(1130), x)['params']
  return (train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.adam(1e-3)), x, _randint(1131, 4, 16))


# why: GroupNorm statistics are per example (over its own pixels and channel groups).
add('linen_groupnorm_conv', groupnorm_step, groupnorm_make, expect_split=True)


class _NnxLNMLP(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(8, 16, rngs=rngs)
    self.ln = nnx.LayerNorm(16, rngs=rngs)
    self.l2 = nnx.Linear(16, 3, rngs=rngs)

  def __call__(self, x):
    return self.l2(nnx.gelu(self.ln(self.l1(x))))


_nnx_ln_graphdef, _ = nnx.split(_NnxLNMLP(nnx.Rngs(0)))
_tx_ln = optax.adamw(1e-3)


def nnx_layernorm_step(state, x, labels):
  def loss_fn(params):
    logits = nnx.merge(_nnx_ln_graphdef, params)(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  updates, opt = _tx_ln.update(grads, state['opt'], state['params'])
  return {'params': optax.apply_updates(state['params'], updates), 'opt': opt}, {'loss': loss}


def nnx_layernorm_make():
  _, params = nnx.split(_NnxLNMLP(nnx.Rngs(1140)))
  return {'params': params, 'opt': _tx_ln.init(params)}, _randn(1141, 24, 8), \
      _randint(1142, 3, 24)


# why: LayerNorm normalises each example over its own features.
add('nnx_layernorm_mlp', nnx_layernorm_step, nnx_layernorm_make, expect_split=True)


def ghost_bn_step(state, x, y):
  ghost = 8

  def loss_fn(p):
    h = x @ p['w1']
    g = h.reshape(-1, ghost, h.shape[-1])
    mu, var = g.mean(1, keepdims=True), g.var(1, keepdims=True)
    h = ((g - mu) / jnp.sqrt(var + 1e-5)).reshape(h.shape) * p['gamma'] + p['beta']
    pred = jax.nn.relu(h) @ p['w2']
    return jnp.mean((pred[:, 0] - y) ** 2), (mu.mean((0, 1)), var.mean((0, 1)))

  (loss, (mu, var)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  updates, opt = _tx_bs.update(grads, state['opt'], state['params'])
  return {'params': optax.apply_updates(state['params'], updates), 'opt': opt,
          'mean': 0.9 * state['mean'] + 0.1 * mu, 'var': 0.9 * state['var'] + 0.1 * var}, {
              'loss': loss}


def ghost_bn_make():
  rs = np.random.RandomState(1150)
  p = {'w1': _f(rs.randn(8, 16) / 3), 'gamma': _f(np.ones(16)), 'beta': _f(np.zeros(16)),
       'w2': _f(rs.randn(16, 1) / 4)}
  return ({'params': p, 'opt': _tx_bs.init(p), 'mean': _f(np.zeros(16)),
           'var': _f(np.ones(16))}, _randn(1151, 32, 8), _randn(1152, 32))


# why: ghost BatchNorm over fixed groups of 8 consecutive rows: each group's statistics are
# sums over its rows, so per-group (or per-microbatch multiple-of-8) pieces are exact.
add('ghost_batchnorm_virtual_batch_8', ghost_bn_step, ghost_bn_make, expect_split=True)


class _BNDropConv(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Conv(8, (3, 3))(x)
    x = nn.BatchNorm(use_running_average=not train)(x)
    x = nn.Dropout(0.1, deterministic=not train)(nn.relu(x))
    return nn.Dense(4)(x.mean((1, 2)))


class _BNKeyState(train_state.TrainState):
  batch_stats: Any = None
  key: Any = None


def bn_dropout_conv_step(state, images, labels):
  key = jax.random.fold_in(state.key, state.step)

  def loss_fn(params):
    logits, upd = state.apply_fn({'params': params, 'batch_stats': state.batch_stats}, images,
                                 train=True, mutable=['batch_stats'], rngs={'dropout': key})
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), upd

  (loss, upd), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  state = state.apply_gradients(grads=grads)
  return state.replace(batch_stats=upd['batch_stats']), {'loss': loss}


def bn_dropout_conv_make():
  model = _BNDropConv()
  x = _randn(1160, 16, 6, 6, 3)
  v = model.init(jax.random.PRNGKey(1160), x, train=False)
  st = _BNKeyState.create(apply_fn=model.apply, params=v['params'], tx=optax.adam(1e-3),
                          batch_stats=v['batch_stats'], key=jax.random.PRNGKey(1161))
  return st, x, _randint(1162, 4, 16)


# why: BatchNorm (batch sums) followed by per-unit dropout; exact in passes, random masks.
add('linen_batchnorm_dropout_conv', bn_dropout_conv_step, bn_dropout_conv_make,
    stochastic=True, expect_split=True)


# ========================================================================================
# 10. steps where examples really interact
# ========================================================================================

def ranknet_step(state, x, relevance):
  def loss_fn(p):
    s = _mlp(p, x)[:, 0]
    pair = (relevance[:, None] > relevance[None, :]).astype(s.dtype)
    diff = s[:, None] - s[None, :]
    return jnp.sum(pair * jax.nn.softplus(-diff)) / jnp.maximum(pair.sum(), 1.0)

  return _bs_apply(state, loss_fn)


def ranknet_make():
  p = _mlp_init(1200, [6, 16, 1])
  return {'params': p, 'opt': _tx_bs.init(p)}, _randn(1201, 24, 6), \
      _f(np.random.RandomState(1202).randint(0, 4, 24))


# why: RankNet over all ordered pairs of the batch: each term couples two examples' scores.
add('ranknet_all_pairs_in_batch', ranknet_step, ranknet_make, expect_split=False)


def triplet_batch_hard_step(state, x, labels):
  def loss_fn(p):
    e = _l2n(_mlp(p, x))
    d = jnp.sqrt(jnp.sum((e[:, None] - e[None]) ** 2, -1) + 1e-12)
    same = labels[:, None] == labels[None, :]
    eye = jnp.eye(x.shape[0], dtype=bool)
    hardest_pos = jnp.max(jnp.where(same & ~eye, d, 0.0), 1)
    hardest_neg = jnp.min(jnp.where(same, 1e9, d), 1)
    return jnp.mean(jax.nn.relu(0.3 + hardest_pos - hardest_neg))

  return _bs_apply(state, loss_fn)


def triplet_make():
  p = _mlp_init(1210, [8, 16, 8])
  return {'params': p, 'opt': _tx_bs.init(p)}, _randn(1211, 32, 8), _randint(1212, 4, 32)


# why: batch-hard mining picks each anchor's farthest positive and nearest negative among
# the other examples of the batch.
add('triplet_batch_hard_mining', triplet_batch_hard_step, triplet_make, expect_split=False)


def sorted_wasserstein_step(state, x, y):
  def loss_fn(p):
    pred = _mlp(p, x)[:, 0]
    return jnp.mean((jnp.sort(pred) - jnp.sort(y)) ** 2)

  return _bs_apply(state, loss_fn)


def sorted_wasserstein_make():
  p = _mlp_init(1220, [4, 16, 1])
  return {'params': p, 'opt': _tx_bs.init(p)}, _randn(1221, 32, 4), _randn(1222, 32) * 2 + 1


# why: sorting predictions and targets matches the k-th smallest prediction to the k-th
# smallest target across the whole batch (1-D Wasserstein).
add('sorted_predictions_wasserstein', sorted_wasserstein_step, sorted_wasserstein_make,
    expect_split=False)


def cumsum_cdf_step(state, x, y):
  def loss_fn(p):
    pred = jax.nn.sigmoid(_mlp(p, x)[:, 0])
    return jnp.mean((jnp.cumsum(pred) - jnp.cumsum(y)) ** 2) / x.shape[0]

  return _bs_apply(state, loss_fn)


def cumsum_cdf_make():
  p = _mlp_init(1230, [5, 12, 1])
  return {'params': p, 'opt': _tx_bs.init(p)}, _randn(1231, 24, 5), \
      _f(np.random.RandomState(1232).rand(24) > 0.5)


# why: the squared error of running sums over the batch order: row k's term involves the
# predictions of all rows before it, squared.
add('cumulative_sum_across_batch', cumsum_cdf_step, cumsum_cdf_make, expect_split=False)


def cox_ph_step(state, x, times, events):
  def loss_fn(p):
    order = jnp.argsort(-times)
    eta = _mlp(p, x)[:, 0][order]
    ev = events[order]
    log_risk = jax.lax.cumlogsumexp(eta)                 # risk set: all with t_j >= t_i
    return -jnp.sum(ev * (eta - log_risk)) / jnp.maximum(ev.sum(), 1.0)

  return _bs_apply(state, loss_fn)


def cox_ph_make():
  p = _mlp_init(1240, [6, 12, 1])
  rs = np.random.RandomState(1241)
  return ({'params': p, 'opt': _tx_bs.init(p)}, _randn(1242, 32, 6), _f(rs.exponential(1, 32)),
          _f(rs.rand(32) < 0.7))


# why: Cox partial likelihood: each event's denominator sums exp(risk) over the batch's
# risk set (everyone still at risk), a sort plus cumulative logsumexp across examples.
add('cox_partial_likelihood_risk_sets', cox_ph_step, cox_ph_make, expect_split=False)


def ohem_topk_step(state, x, labels):
  def loss_fn(p):
    ce = optax.softmax_cross_entropy_with_integer_labels(_mlp(p, x), labels)
    k = max(ce.shape[0] // 4, 1)
    hard, _ = jax.lax.top_k(ce, k)
    return hard.mean(), {'mean_ce': ce.mean()}

  return _bs_apply(state, loss_fn, has_aux=True)


# why: online hard example mining keeps the k=B/4 largest losses of the batch; a threshold
# found in an earlier pass might reproduce it, but k depends on the batch size. Unsure.
add('ohem_top_quarter_losses', ohem_topk_step, lambda: _bs_make_cls(1250), expect_split=None)


def batch_attention_step(state, x, labels):
  def loss_fn(p):
    h = x @ p['w_in']
    s = h @ h.T / np.sqrt(h.shape[-1])                   # attention across the batch axis
    h = h + jax.nn.softmax(s, -1) @ (h @ p['wv'])
    logits = jax.nn.relu(h) @ p['out']
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  return _bs_apply(state, loss_fn)


def batch_attention_make():
  rs = np.random.RandomState(1260)
  p = {'w_in': _f(rs.randn(8, 16) / 3), 'wv': _f(rs.randn(16, 16) / 4),
       'out': _f(rs.randn(16, 4) / 4)}
  return {'params': p, 'opt': _tx_bs.init(p)}, _randn(1261, 24, 8), _randint(1262, 4, 24)


# why: self-attention over the batch axis treats the batch as a set: each example's
# representation is a softmax-weighted mix of all the others'.
add('self_attention_across_batch', batch_attention_step, batch_attention_make,
    expect_split=False)


def worst_case_max_step(state, x, labels):
  def loss_fn(p):
    ce = optax.softmax_cross_entropy_with_integer_labels(_mlp(p, x), labels)
    return jnp.max(ce) + 0.1 * ce.mean(), {'max_ce': ce.max()}

  return _bs_apply(state, loss_fn, has_aux=True)


# why: the max over the batch equals the max of microbatch maxima and its gradient is the
# argmax example's, so it may be exact, but it is not a sum. Unsure.
add('worst_example_max_loss', worst_case_max_step, lambda: _bs_make_cls(1270),
    expect_split=None)

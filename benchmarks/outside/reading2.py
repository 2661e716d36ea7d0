"""A second, independent corpus of realistic JAX/Flax train steps.

Every entry of CASES is a `Case(name, step, make, stochastic, expect_split)`.
`expect_split` is this author's own mathematical judgement:
  True  - whole-batch loss/gradient/state update is computable exactly from
          per-microbatch pieces (functions of sums over examples, however
          nonlinear; parameter-free preprocessing of the whole batch allowed),
  False - examples genuinely interact through the parameters,
  None  - unsure.
A `# why:` comment precedes each registration.
"""
import functools
import math

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
import optax
import flax.linen as nn
from flax import nnx
from flax.training import train_state
from jax.sharding import Mesh, PartitionSpec as P

from tests.exactness.harness import Case

CASES: list = []


def register(name, make, *, stochastic=False, expect_split=None):
  def deco(step):
    CASES.append(Case(name=name, step=step, make=make, stochastic=stochastic,
                      expect_split=expect_split))
    return step
  return deco


# ----------------------------------------------------------------------------
# small shared helpers (data is deterministic numpy, converted to float32)
# ----------------------------------------------------------------------------
def _rs(seed):
  return np.random.RandomState(seed)


def f32(a):
  return jnp.asarray(a, jnp.float32)


def i32(a):
  return jnp.asarray(a, jnp.int32)


def init_params(module, *init_inputs, seed=0, **init_kw):
  """Variables of `module` with the shapes flax would create, filled from numpy.

  (Compiling flax's random initialisers costs seconds per model on a CPU, so
  only the shapes are traced; values follow the usual fan-in scaling.)
  """
  shapes = jax.eval_shape(functools.partial(module.init, **init_kw),
                          jax.random.PRNGKey(seed), *init_inputs)
  rs = np.random.RandomState(seed + 1234)

  def fill(path, sds):
    name = str(getattr(path[-1], 'key', path[-1]))
    shp = sds.shape
    if name in ('bias', 'mean'):
      return jnp.zeros(shp, sds.dtype)
    if name in ('scale', 'var'):
      return jnp.ones(shp, sds.dtype)
    if name == 'embedding':
      return jnp.asarray(rs.randn(*shp) / math.sqrt(shp[-1]), sds.dtype)
    if name == 'kernel' and len(shp) >= 2:
      parent = str(getattr(path[-2], 'key', '')) if len(path) > 1 else ''
      fan_in = shp[0] if parent in ('query', 'key', 'value') else int(np.prod(shp[:-1]))
      return jnp.asarray(rs.randn(*shp) / math.sqrt(fan_in), sds.dtype)
    return jnp.asarray(rs.randn(*shp) * 0.02, sds.dtype)
  return jax.tree_util.tree_map_with_path(fill, shapes)


def make_ts(module, *init_inputs, tx=None, seed=0, **init_kw):
  variables = init_params(module, *init_inputs, seed=seed, **init_kw)
  return train_state.TrainState.create(
      apply_fn=module.apply, params=variables['params'],
      tx=tx if tx is not None else optax.adam(1e-3))


class MLP(nn.Module):
  features: tuple
  act: str = 'relu'

  @nn.compact
  def __call__(self, x):
    act = getattr(nn, self.act)
    for f in self.features[:-1]:
      x = act(nn.Dense(f)(x))
    return nn.Dense(self.features[-1])(x)


class Block(nn.Module):
  """Pre-LN transformer block."""
  dim: int = 32
  heads: int = 2

  @nn.compact
  def __call__(self, x, mask=None):
    h = nn.LayerNorm()(x)
    h = nn.MultiHeadDotProductAttention(num_heads=self.heads,
                                        qkv_features=self.dim)(h, h, mask=mask)
    x = x + h
    h = nn.LayerNorm()(x)
    h = nn.Dense(2 * self.dim)(h)
    h = nn.gelu(h)
    return x + nn.Dense(self.dim)(h)


def timestep_embedding(t, dim, max_period=10000.0):
  half = dim // 2
  freqs = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / half)
  args = t.astype(jnp.float32)[:, None] * freqs[None]
  return jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)


def tree_ema(target, online, tau):
  return jax.tree.map(lambda t, o: tau * t + (1.0 - tau) * o, target, online)


def images(seed, b=16, h=16, c=3):
  return f32(_rs(seed).randn(b, h, h, c))


def labels(seed, b=16, n=10):
  return i32(_rs(seed).randint(0, n, size=(b,)))


def ce_int(logits, y):
  return optax.softmax_cross_entropy_with_integer_labels(logits, y)


# ============================================================================
# VISION
# ============================================================================
class PatchViT(nn.Module):
  patch: int = 4
  dim: int = 32
  depth: int = 1
  num_classes: int = 10

  @nn.compact
  def __call__(self, x):
    b = x.shape[0]
    x = nn.Conv(self.dim, (self.patch, self.patch), strides=(self.patch, self.patch),
                padding='VALID', name='patch_embed')(x)
    x = x.reshape(b, -1, self.dim)
    cls = self.param('cls', nn.initializers.zeros, (1, 1, self.dim))
    x = jnp.concatenate([jnp.broadcast_to(cls, (b, 1, self.dim)), x], axis=1)
    x = x + self.param('pos_embed', nn.initializers.normal(0.02), (1, x.shape[1], self.dim))
    for _ in range(self.depth):
      x = Block(self.dim)(x)
    x = nn.LayerNorm()(x[:, 0])
    return nn.Dense(self.num_classes)(x)


def make_vit():
  x = images(1)
  return make_ts(PatchViT(), x[:1]), x, labels(2)


# why: plain per-image cross entropy averaged over the batch; attention mixes
# patches of the same image only.
@register('vision/vit_cls_token', make_vit, expect_split=True)
def step_vit(state, imgs, y):
  def loss_fn(params):
    logits = state.apply_fn({'params': params}, imgs)
    return ce_int(logits, y).mean(), logits
  (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  state = state.apply_gradients(grads=grads)
  return state, {'loss': loss, 'acc': jnp.mean(jnp.argmax(logits, -1) == y)}


class TinyUNet(nn.Module):
  c: int = 8

  @nn.compact
  def __call__(self, x, temb):
    h1 = nn.silu(nn.Conv(self.c, (3, 3))(x))
    h1 = h1 + nn.Dense(self.c)(nn.silu(nn.Dense(16)(temb)))[:, None, None, :]
    h2 = nn.silu(nn.Conv(2 * self.c, (3, 3), strides=(2, 2))(h1))
    h3 = nn.silu(nn.Conv(2 * self.c, (3, 3))(h2))
    u = nn.ConvTranspose(self.c, (2, 2), strides=(2, 2))(h3)
    u = nn.silu(nn.Conv(self.c, (3, 3))(jnp.concatenate([u, h1], -1)))
    return nn.Conv(x.shape[-1], (1, 1))(u)


def make_unet_edm():
  x = images(3, c=1)
  sigma = f32(np.exp(_rs(4).randn(16) * 1.2 - 1.2))
  ts = make_ts(TinyUNet(), x[:1], jnp.zeros((1, 16)), tx=optax.adam(2e-4))
  return {'train': ts, 'rng': jax.random.PRNGKey(42)}, x, sigma


# why: EDM preconditioned denoising loss, per-example sigma from the batch,
# noise drawn from a key in the state; loss is a mean of per-image terms.
@register('vision/unet_edm_denoise', make_unet_edm, stochastic=True, expect_split=True)
def step_unet_edm(state, x, sigma):
  rng, nkey = jax.random.split(state['rng'])
  sd = 0.5
  noise = jax.random.normal(nkey, x.shape)
  s = sigma[:, None, None, None]
  c_skip = sd ** 2 / (s ** 2 + sd ** 2)
  c_out = s * sd / jnp.sqrt(s ** 2 + sd ** 2)
  c_in = 1.0 / jnp.sqrt(s ** 2 + sd ** 2)
  temb = timestep_embedding(jnp.log(sigma) / 4.0 * 1000.0, 16)
  weight = (s ** 2 + sd ** 2) / (s * sd) ** 2
  ts = state['train']

  def loss_fn(params):
    xn = x + s * noise
    f = ts.apply_fn({'params': params}, c_in * xn, temb)
    denoised = c_skip * xn + c_out * f
    return jnp.mean(weight * (denoised - x) ** 2)
  loss, grads = jax.value_and_grad(loss_fn)(ts.params)
  return {'train': ts.apply_gradients(grads=grads), 'rng': rng}, {'loss': loss}


def make_diffusion_t():
  x = images(5, c=1)
  t = i32(_rs(6).randint(0, 1000, size=(16,)))
  noise = f32(_rs(7).randn(*x.shape))
  return make_ts(TinyUNet(), x[:1], jnp.zeros((1, 16))), x, t, noise


def cosine_alpha_bar(t, s=0.008):
  f = jnp.cos(((t / 1000.0) + s) / (1 + s) * jnp.pi / 2) ** 2
  return f / (math.cos(s / (1 + s) * math.pi / 2) ** 2)


# why: v-prediction with per-example integer timesteps and given noise arrays;
# every term is per image.
@register('vision/diffusion_vpred_t_array', make_diffusion_t, expect_split=True)
def step_diffusion_t(state, x0, t, noise):
  ab = cosine_alpha_bar(t.astype(jnp.float32))[:, None, None, None]
  xt = jnp.sqrt(ab) * x0 + jnp.sqrt(1 - ab) * noise
  v = jnp.sqrt(ab) * noise - jnp.sqrt(1 - ab) * x0
  temb = timestep_embedding(t, 16)

  def loss_fn(p):
    pred = state.apply_fn({'params': p}, xt, temb)
    per_ex = jnp.mean((pred - v) ** 2, axis=(1, 2, 3))
    return per_ex.mean(), per_ex
  (loss, per_ex), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss, 'worst': per_ex.max()}


def make_ddpm():
  x = images(8, c=1)
  betas = np.linspace(1e-4, 0.02, 1000)
  ab = np.cumprod(1.0 - betas)
  sched = {'sqrt_ab': f32(np.sqrt(ab)), 'sqrt_1m_ab': f32(np.sqrt(1 - ab))}
  ts = make_ts(TinyUNet(), x[:1], jnp.zeros((1, 16)))
  return {'train': ts, 'sched': sched}, x, jax.random.PRNGKey(3)


# why: DDPM eps-loss; the schedule table (state) is gathered per example with
# random timesteps from a key argument; mean over images.
@register('vision/ddpm_schedule_table', make_ddpm, stochastic=True, expect_split=True)
def step_ddpm(state, x0, key):
  kt, kn = jax.random.split(key)
  b = x0.shape[0]
  t = jax.random.randint(kt, (b,), 0, 1000)
  eps = jax.random.normal(kn, x0.shape)
  sched = state['sched']
  xt = (sched['sqrt_ab'][t][:, None, None, None] * x0
        + sched['sqrt_1m_ab'][t][:, None, None, None] * eps)
  temb = timestep_embedding(t, 16)
  ts = state['train']
  loss, grads = jax.value_and_grad(
      lambda p: jnp.mean((ts.apply_fn({'params': p}, xt, temb) - eps) ** 2))(ts.params)
  return {'train': ts.apply_gradients(grads=grads), 'sched': sched}, {'loss': loss}


def patchify(imgs, p):
  b, h, w, c = imgs.shape
  x = imgs.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(b, (h // p) * (w // p), p * p * c)


class MIMNet(nn.Module):
  dim: int = 32
  patch: int = 4

  @nn.compact
  def __call__(self, imgs, mask):
    tok = nn.Dense(self.dim)(patchify(imgs, self.patch))
    mtok = self.param('mask_token', nn.initializers.normal(0.02), (1, 1, self.dim))
    tok = jnp.where(mask[..., None], mtok, tok)
    tok = tok + self.param('pos', nn.initializers.normal(0.02), (1, tok.shape[1], self.dim))
    tok = Block(self.dim)(tok)
    return nn.Dense(self.patch * self.patch * imgs.shape[-1])(nn.LayerNorm()(tok))


def make_mim():
  x = images(9)
  mask = jnp.asarray(_rs(10).rand(16, 16) < 0.6)
  return make_ts(MIMNet(), x[:1], mask[:1]), x, mask


# why: SimMIM/MAE-style; target patches normalised per patch (parameter-free),
# loss summed over masked patches and divided by the total number of masked
# patches in the batch (ratio of sums).
@register('vision/masked_image_modelling', make_mim, expect_split=True)
def step_mim(state, imgs, mask):
  target = patchify(imgs, 4)
  mu = target.mean(-1, keepdims=True)
  var = target.var(-1, keepdims=True)
  target = (target - mu) / jnp.sqrt(var + 1e-6)
  m = mask.astype(jnp.float32)

  def loss_fn(p):
    pred = state.apply_fn({'params': p}, imgs, mask)
    per_patch = jnp.mean((pred - target) ** 2, axis=-1)
    return jnp.sum(per_patch * m) / jnp.maximum(m.sum(), 1.0)
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss, 'mask_ratio': m.mean()}


class SmallCNN(nn.Module):
  num_classes: int = 10
  width: int = 8

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(self.width, (3, 3))(x))
    x = nn.max_pool(x, (2, 2), (2, 2))
    x = nn.relu(nn.Conv(2 * self.width, (3, 3))(x))
    x = x.mean(axis=(1, 2))
    return nn.Dense(self.num_classes)(x)


def make_distill():
  x = images(11)
  teacher = MLP((64, 64, 10))
  tparams = init_params(teacher, x[:1].reshape(1, -1), seed=99)['params']
  return make_ts(SmallCNN(), x[:1]), tparams, x, labels(12)


_TEACHER = MLP((64, 64, 10))


# why: Hinton KD with a frozen teacher passed as an argument; per-example KL
# and CE averaged.
@register('vision/distill_frozen_teacher', make_distill, expect_split=True)
def step_distill(state, teacher_params, imgs, y):
  T = 4.0
  t_logits = _TEACHER.apply({'params': teacher_params}, imgs.reshape(imgs.shape[0], -1))
  t_prob = jax.nn.softmax(t_logits / T)

  def loss_fn(p):
    s_logits = state.apply_fn({'params': p}, imgs)
    kd = optax.kl_divergence(jax.nn.log_softmax(s_logits / T), t_prob).mean() * T * T
    hard = ce_int(s_logits, y).mean()
    return 0.7 * kd + 0.3 * hard, (kd, hard)
  (loss, (kd, hard)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss, 'kd': kd, 'ce': hard}


class BYOLNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Conv(8, (3, 3), strides=(2, 2))(x))
    h = nn.relu(nn.Conv(16, (3, 3), strides=(2, 2))(h)).mean(axis=(1, 2))
    proj = nn.Dense(16)(nn.relu(nn.LayerNorm()(nn.Dense(32)(h))))
    pred = nn.Dense(16)(nn.relu(nn.LayerNorm()(nn.Dense(32, name='pred_hidden')(proj))))
    return proj, pred


def make_byol():
  v1, v2 = images(13), images(14)
  ts = make_ts(BYOLNet(), v1[:1], tx=optax.adamw(1e-3))
  return {'online': ts, 'target': ts.params}, v1, v2


def _cos(a, b):
  a = a / jnp.linalg.norm(a, axis=-1, keepdims=True)
  b = b / jnp.linalg.norm(b, axis=-1, keepdims=True)
  return jnp.sum(a * b, -1)


# why: BYOL without batch norm: per-example cosine regression to an EMA target
# (target params are state, not a batch statistic).
@register('vision/byol_ema_target', make_byol, expect_split=True)
def step_byol(state, v1, v2):
  online = state['online']
  tproj1, _ = online.apply_fn({'params': state['target']}, v1)
  tproj2, _ = online.apply_fn({'params': state['target']}, v2)
  tproj1, tproj2 = lax.stop_gradient(tproj1), lax.stop_gradient(tproj2)

  def loss_fn(p):
    _, p1 = online.apply_fn({'params': p}, v1)
    _, p2 = online.apply_fn({'params': p}, v2)
    return jnp.mean(2 - 2 * _cos(p1, tproj2)) + jnp.mean(2 - 2 * _cos(p2, tproj1))
  loss, grads = jax.value_and_grad(loss_fn)(online.params)
  online = online.apply_gradients(grads=grads)
  target = tree_ema(state['target'], online.params, 0.99)
  return {'online': online, 'target': target}, {'loss': loss}


def make_dino():
  rs = _rs(15)
  g1, g2 = f32(rs.randn(16, 24)), f32(rs.randn(16, 24))
  ts = make_ts(MLP((48, 48, 32), act='gelu'), g1[:1])
  return {'student': ts, 'teacher': ts.params, 'center': jnp.zeros((32,))}, g1, g2


def _dino_loss(s_out, t_out, center, tau_s=0.1, tau_t=0.04):
  total = 0.0
  for i in range(2):
    for j in range(2):
      if i == j:
        continue
      tp = jax.nn.softmax((t_out[j] - center) / tau_t, axis=-1)
      total += jnp.mean(jnp.sum(-tp * jax.nn.log_softmax(s_out[i] / tau_s, -1), -1))
  return total / 2


# why: DINO as in the paper: the loss uses the centre from the state (previous
# batches); the new centre is an EMA of the batch mean of teacher outputs,
# which is a sum over examples. Teacher is an EMA of the student.
@register('vision/dino_state_center', make_dino, expect_split=True)
def step_dino(state, g1, g2):
  ts = state['student']
  t_out = [lax.stop_gradient(ts.apply_fn({'params': state['teacher']}, g)) for g in (g1, g2)]

  def loss_fn(p):
    s_out = [ts.apply_fn({'params': p}, g) for g in (g1, g2)]
    return _dino_loss(s_out, t_out, state['center'])
  loss, grads = jax.value_and_grad(loss_fn)(ts.params)
  ts = ts.apply_gradients(grads=grads)
  batch_center = jnp.mean(jnp.concatenate(t_out, 0), axis=0)
  center = 0.9 * state['center'] + 0.1 * batch_center
  return {'student': ts, 'teacher': tree_ema(state['teacher'], ts.params, 0.996),
          'center': center}, {'loss': loss}


# why: a "simplified" DINO that centres the teacher outputs by the CURRENT
# batch mean before the sharpened softmax: each example's target depends
# nonlinearly on all other examples' teacher activations.
@register('vision/dino_current_batch_center', make_dino, expect_split=False)
def step_dino_batch(state, g1, g2):
  ts = state['student']
  t_out = [lax.stop_gradient(ts.apply_fn({'params': state['teacher']}, g)) for g in (g1, g2)]
  center = jnp.mean(jnp.concatenate(t_out, 0), axis=0)

  def loss_fn(p):
    s_out = [ts.apply_fn({'params': p}, g) for g in (g1, g2)]
    return _dino_loss(s_out, t_out, center)
  loss, grads = jax.value_and_grad(loss_fn)(ts.params)
  ts = ts.apply_gradients(grads=grads)
  return {'student': ts, 'teacher': tree_ema(state['teacher'], ts.params, 0.996),
          'center': center}, {'loss': loss}


def make_fixmatch():
  rs = _rs(16)
  xl = f32(rs.randn(16, 20) * 3)
  yl = i32(rs.randint(0, 4, 16))
  uw = f32(rs.randn(32, 20) * 3)
  us = uw + f32(rs.randn(32, 20))
  return make_ts(MLP((32, 4)), xl[:1]), xl, yl, uw, us


# why: FixMatch: confidence-thresholded pseudo labels from each example's own
# weak view; unlabeled loss divided by the fixed number of unlabeled examples.
@register('vision/fixmatch_threshold', make_fixmatch, expect_split=True)
def step_fixmatch(state, xl, yl, uw, us):
  def loss_fn(p):
    sup = ce_int(state.apply_fn({'params': p}, xl), yl).mean()
    pw = jax.nn.softmax(lax.stop_gradient(state.apply_fn({'params': p}, uw)))
    conf, pseudo = pw.max(-1), pw.argmax(-1)
    mask = (conf >= 0.5).astype(jnp.float32)
    unsup = jnp.mean(mask * ce_int(state.apply_fn({'params': p}, us), pseudo))
    return sup + 1.0 * unsup, (sup, unsup, mask.mean())
  (loss, (sup, unsup, frac)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss, 'sup': sup, 'unsup': unsup,
                                              'mask_rate': frac}


# why: ReMixMatch-style distribution alignment using the CURRENT batch's mean
# prediction: every pseudo-label depends on the model outputs of all other
# unlabeled examples (then thresholded/argmaxed nonlinearly).
@register('vision/fixmatch_distribution_alignment', make_fixmatch, expect_split=False)
def step_fixmatch_da(state, xl, yl, uw, us):
  prior = jnp.full((4,), 0.25)

  def loss_fn(p):
    sup = ce_int(state.apply_fn({'params': p}, xl), yl).mean()
    pw = jax.nn.softmax(lax.stop_gradient(state.apply_fn({'params': p}, uw)))
    pw = pw * prior / pw.mean(axis=0)
    pw = pw / pw.sum(-1, keepdims=True)
    mask = (pw.max(-1) >= 0.4).astype(jnp.float32)
    unsup = jnp.mean(mask * ce_int(state.apply_fn({'params': p}, us), pw.argmax(-1)))
    return sup + unsup
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


def make_mixmatch():
  rs = _rs(17)
  xl = f32(rs.randn(16, 20))
  yl = i32(rs.randint(0, 4, 16))
  u1 = f32(rs.randn(16, 20))
  u2 = u1 + 0.3 * f32(rs.randn(16, 20))
  return make_ts(MLP((32, 4)), xl[:1]), xl, yl, u1, u2


# why: MixMatch: guessed labels (model outputs) are mixed with a partner
# example from the flipped concatenated batch, so example i's target contains
# the model's guess on a different example j.
@register('vision/mixmatch_guess_and_mix', make_mixmatch, expect_split=False)
def step_mixmatch(state, xl, yl, u1, u2):
  lam = 0.75

  def loss_fn(p):
    q = 0.5 * (jax.nn.softmax(state.apply_fn({'params': p}, u1))
               + jax.nn.softmax(state.apply_fn({'params': p}, u2)))
    q = q ** 2
    q = lax.stop_gradient(q / q.sum(-1, keepdims=True))
    xs = jnp.concatenate([xl, u1, u2], 0)
    ys = jnp.concatenate([jax.nn.one_hot(yl, 4), q, q], 0)
    xm = lam * xs + (1 - lam) * jnp.flip(xs, 0)
    ym = lam * ys + (1 - lam) * jnp.flip(ys, 0)
    logits = state.apply_fn({'params': p}, xm)
    nl = xl.shape[0]
    lx = optax.softmax_cross_entropy(logits[:nl], ym[:nl]).mean()
    lu = jnp.mean((jax.nn.softmax(logits[nl:]) - ym[nl:]) ** 2)
    return lx + 75.0 * lu
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


def make_mixup():
  return make_ts(SmallCNN(), images(18)[:1]), images(18), labels(19), jax.random.PRNGKey(5)


# why: mixup with the reversed batch and a Beta lambda from a key argument:
# preprocessing of inputs and (data) labels is parameter-free; the loss is a
# mean of per-(mixed)-example terms.
@register('vision/mixup_flip', make_mixup, stochastic=True, expect_split=True)
def step_mixup(state, imgs, y, key):
  lam = jax.random.beta(key, 0.4, 0.4)
  x = lam * imgs + (1 - lam) * imgs[::-1]
  yy = jax.nn.one_hot(y, 10)
  t = lam * yy + (1 - lam) * yy[::-1]
  loss, grads = jax.value_and_grad(
      lambda p: optax.softmax_cross_entropy(state.apply_fn({'params': p}, x), t).mean())(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss, 'lam': lam}


# why: CutMix with a random permutation of the whole batch drawn from a key
# argument: pasting and label mixing are parameter-free preprocessing of the
# whole batch (like mixup_flip); the loss is then a per-example mean.
@register('vision/cutmix_random_perm', make_mixup, stochastic=True, expect_split=True)
def step_cutmix(state, imgs, y, key):
  kp, kl, kx, ky = jax.random.split(key, 4)
  b, h, w, _ = imgs.shape
  perm = jax.random.permutation(kp, b)
  lam = jax.random.beta(kl, 1.0, 1.0)
  cut = jnp.sqrt(1.0 - lam)
  cw, ch = cut * w, cut * h
  cx = jax.random.uniform(kx) * w
  cy = jax.random.uniform(ky) * h
  xs, ys = jnp.arange(w)[None, :], jnp.arange(h)[:, None]
  box = ((xs >= cx - cw / 2) & (xs < cx + cw / 2) & (ys >= cy - ch / 2) & (ys < cy + ch / 2))
  box = box[None, :, :, None]
  x = jnp.where(box, imgs[perm], imgs)
  lam_adj = 1.0 - box.mean()
  t = lam_adj * jax.nn.one_hot(y, 10) + (1 - lam_adj) * jax.nn.one_hot(y[perm], 10)
  loss, grads = jax.value_and_grad(
      lambda p: optax.softmax_cross_entropy(state.apply_fn({'params': p}, x), t).mean())(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


class GNNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.GroupNorm(num_groups=4)(nn.Conv(16, (3, 3))(x)))
    x = nn.relu(nn.GroupNorm(num_groups=4)(nn.Conv(16, (3, 3), strides=(2, 2))(x)))
    return nn.Dense(10)(x.mean(axis=(1, 2)))


def make_gn():
  x = images(20)
  return make_ts(GNNet(), x[:1], tx=optax.sgd(0.05, momentum=0.9, nesterov=True)), x, labels(21)


# why: GroupNorm normalises within each example only.
@register('vision/groupnorm_cnn_nesterov', make_gn, expect_split=True)
def step_gn(state, x, y):
  loss, grads = jax.value_and_grad(
      lambda p: ce_int(state.apply_fn({'params': p}, x), y).mean())(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


class BNResNet(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9)
    x = nn.relu(norm()(nn.Conv(16, (3, 3), use_bias=False)(x)))
    r = nn.relu(norm()(nn.Conv(16, (3, 3), use_bias=False)(x)))
    r = norm(scale_init=nn.initializers.zeros)(nn.Conv(16, (3, 3), use_bias=False)(r))
    x = nn.relu(x + r)
    return nn.Dense(10)(x.mean(axis=(1, 2)))


class BNTrainState(train_state.TrainState):
  batch_stats: dict = None


def make_bn():
  x = images(22)
  m = BNResNet()
  v = init_params(m, x[:2], train=False)
  # pretend the running stats were already trained
  stats = jax.tree.map(lambda a: a + 0.1, v['batch_stats'])
  ts = BNTrainState.create(apply_fn=m.apply, params=v['params'], tx=optax.adam(1e-3),
                           batch_stats=stats)
  return ts, x, labels(23)


# why: BatchNorm in inference mode (running statistics from the state), e.g.
# fine-tuning with frozen BN: no statistics of the batch are used.
@register('vision/resnet_frozen_batchnorm', make_bn, expect_split=True)
def step_bn_eval(state, x, y):
  def loss_fn(p):
    logits = state.apply_fn({'params': p, 'batch_stats': state.batch_stats}, x, train=False)
    return ce_int(logits, y).mean()
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


# why: BatchNorm in training mode normalises activations by batch statistics,
# followed by nonlinear layers: examples interact through the parameters.
@register('vision/resnet_batchnorm_train', make_bn, expect_split=False)
def step_bn_train(state, x, y):
  def loss_fn(p):
    logits, updates = state.apply_fn({'params': p, 'batch_stats': state.batch_stats}, x,
                                     train=True, mutable=['batch_stats'])
    return ce_int(logits, y).mean(), updates
  (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  state = state.apply_gradients(grads=grads).replace(batch_stats=updates['batch_stats'])
  return state, {'loss': loss}


class MinibatchStdDisc(nn.Module):
  group: int = 4

  @nn.compact
  def __call__(self, x):
    h = nn.leaky_relu(nn.Conv(8, (3, 3), strides=(2, 2))(x), 0.2)
    b, hh, ww, c = h.shape
    g = min(self.group, b)
    y = h.reshape(g, -1, hh, ww, c)
    y = y - y.mean(axis=0)
    y = jnp.sqrt(jnp.mean(y ** 2, axis=0) + 1e-8).mean(axis=(1, 2, 3))
    y = jnp.tile(y, (g,))[:, None, None, None] * jnp.ones((b, hh, ww, 1))
    h = jnp.concatenate([h, y], axis=-1)
    h = nn.leaky_relu(nn.Conv(16, (3, 3))(h), 0.2)
    return nn.Dense(1)(h.reshape(b, -1))[:, 0]


class Generator(nn.Module):
  @nn.compact
  def __call__(self, z):
    h = nn.relu(nn.Dense(64)(z))
    return jnp.tanh(nn.Dense(64)(h)).reshape(z.shape[0], 8, 8, 1)


def make_gan_mbstd():
  rs = _rs(24)
  real = f32(np.tanh(rs.randn(16, 8, 8, 1)))
  z = f32(rs.randn(16, 8))
  g = make_ts(Generator(), z[:1], tx=optax.adam(2e-4, b1=0.0, b2=0.99))
  d = make_ts(MinibatchStdDisc(), real, tx=optax.adam(2e-4, b1=0.0, b2=0.99), seed=1)
  return {'g': g, 'd': d}, real, z


# why: StyleGAN minibatch-stddev layer: the discriminator's features include
# the std of activations across a group of examples of the batch.
@register('vision/gan_minibatch_stddev', make_gan_mbstd, expect_split=False)
def step_gan_mbstd(state, real, z):
  g, d = state['g'], state['d']
  fake = g.apply_fn({'params': g.params}, z)

  def d_loss(dp):
    return (jnp.mean(jax.nn.softplus(-d.apply_fn({'params': dp}, real)))
            + jnp.mean(jax.nn.softplus(d.apply_fn({'params': dp}, lax.stop_gradient(fake)))))
  dl, dg = jax.value_and_grad(d_loss)(d.params)
  d = d.apply_gradients(grads=dg)

  def g_loss(gp):
    return jnp.mean(jax.nn.softplus(-d.apply_fn({'params': d.params}, g.apply_fn({'params': gp}, z))))
  gl, gg = jax.value_and_grad(g_loss)(g.params)
  g = g.apply_gradients(grads=gg)
  return {'g': g, 'd': d}, {'d_loss': dl, 'g_loss': gl}


class Critic(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.leaky_relu(nn.Conv(8, (3, 3), strides=(2, 2))(x), 0.2)
    h = nn.leaky_relu(nn.Conv(16, (3, 3), strides=(2, 2))(h), 0.2)
    return nn.Dense(1)(h.reshape(x.shape[0], -1))[:, 0]


def make_wgan():
  rs = _rs(25)
  real = f32(np.tanh(rs.randn(16, 8, 8, 1)))
  z = f32(rs.randn(16, 8))
  eps = f32(rs.rand(16))
  g = make_ts(Generator(), z[:1], tx=optax.adam(1e-4, b1=0.5, b2=0.9))
  d = make_ts(Critic(), real[:1], tx=optax.adam(1e-4, b1=0.5, b2=0.9), seed=1)
  return {'g': g, 'd': d, 'step': jnp.zeros((), jnp.int32)}, real, z, eps


# why: WGAN-GP: the gradient penalty uses d critic(x_hat_i)/d x_hat_i, which is
# per example (grad of the batch sum of an example-wise critic); generator
# updated every 2nd step via jnp.where on a counter.
@register('vision/wgan_gradient_penalty', make_wgan, expect_split=True)
def step_wgan(state, real, z, eps):
  g, d = state['g'], state['d']
  fake = lax.stop_gradient(g.apply_fn({'params': g.params}, z))
  e = eps[:, None, None, None]
  x_hat = e * real + (1 - e) * fake

  def d_loss(dp):
    critic = lambda x: d.apply_fn({'params': dp}, x)
    gx = jax.grad(lambda x: critic(x).sum())(x_hat)
    gnorm = jnp.sqrt(jnp.sum(gx ** 2, axis=(1, 2, 3)) + 1e-12)
    gp = jnp.mean((gnorm - 1.0) ** 2)
    return jnp.mean(critic(fake)) - jnp.mean(critic(real)) + 10.0 * gp, gp
  (dl, gp), dg = jax.value_and_grad(d_loss, has_aux=True)(d.params)
  d = d.apply_gradients(grads=dg)

  def g_loss(gp_):
    return -jnp.mean(d.apply_fn({'params': d.params}, g.apply_fn({'params': gp_}, z)))
  gl, gg = jax.value_and_grad(g_loss)(g.params)
  new_g = g.apply_gradients(grads=gg)
  do_g = state['step'] % 2 == 1
  g = jax.tree.map(lambda a, b: jnp.where(do_g, a, b), new_g, g)
  return {'g': g, 'd': d, 'step': state['step'] + 1}, {'d_loss': dl, 'gp': gp, 'g_loss': gl}


class SubPixelSR(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Conv(16, (3, 3))(x))
    h = nn.Conv(3 * 4, (3, 3))(h)
    b, hh, ww, _ = h.shape
    h = h.reshape(b, hh, ww, 2, 2, 3).transpose(0, 1, 3, 2, 4, 5).reshape(b, 2 * hh, 2 * ww, 3)
    return h + jax.image.resize(x, (b, 2 * hh, 2 * ww, 3), 'bilinear')


def ssim_per_image(a, b, c1=0.01 ** 2, c2=0.03 ** 2):
  pool = lambda t: nn.avg_pool(t, (3, 3), strides=(1, 1), padding='VALID')
  mu_a, mu_b = pool(a), pool(b)
  va = pool(a * a) - mu_a ** 2
  vb = pool(b * b) - mu_b ** 2
  cov = pool(a * b) - mu_a * mu_b
  s = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a ** 2 + mu_b ** 2 + c1) * (va + vb + c2))
  return s.mean(axis=(1, 2, 3))


def make_sr():
  rs = _rs(26)
  hi = f32(rs.rand(16, 16, 16, 3))
  lo = f32(hi.reshape(16, 8, 2, 8, 2, 3).mean(axis=(2, 4)))
  return make_ts(SubPixelSR(), lo[:1]), lo, hi


# why: super-resolution with pixel shuffle; L1 + (1-SSIM) computed per image
# (SSIM windows never cross images).
@register('vision/superres_ssim_l1', make_sr, expect_split=True)
def step_sr(state, lo, hi):
  def loss_fn(p):
    sr = state.apply_fn({'params': p}, lo)
    ssim = ssim_per_image(sr, hi)
    l1 = jnp.mean(jnp.abs(sr - hi), axis=(1, 2, 3))
    return jnp.mean(0.84 * (1 - ssim) + 0.16 * l1), ssim.mean()
  (loss, ssim), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss, 'ssim': ssim}


class SegNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Conv(8, (3, 3))(x))
    h = nn.relu(nn.Conv(8, (3, 3), kernel_dilation=(2, 2))(h))
    return nn.Conv(1, (1, 1))(h)[..., 0]


def make_seg():
  rs = _rs(27)
  x = f32(rs.randn(16, 16, 16, 3))
  yy, xx = np.mgrid[:16, :16]
  cx, cy, r = rs.randint(4, 12, 16), rs.randint(4, 12, 16), rs.randint(2, 6, 16)
  masks = ((xx[None] - cx[:, None, None]) ** 2 + (yy[None] - cy[:, None, None]) ** 2
           < r[:, None, None] ** 2)
  return make_ts(SegNet(), x[:1]), x, f32(masks)


# why: soft Dice computed per image then averaged, plus pixel BCE.
@register('vision/seg_dice_per_image', make_seg, expect_split=True)
def step_dice_img(state, x, m):
  def loss_fn(p):
    logits = state.apply_fn({'params': p}, x)
    prob = jax.nn.sigmoid(logits)
    inter = jnp.sum(prob * m, axis=(1, 2))
    dice = (2 * inter + 1.0) / (prob.sum(axis=(1, 2)) + m.sum(axis=(1, 2)) + 1.0)
    bce = optax.sigmoid_binary_cross_entropy(logits, m).mean()
    return jnp.mean(1 - dice) + bce
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


# why: "global" Dice over the whole batch: 1 - 2*sum(p*m)/(sum p + sum m), a
# nonlinear function of batch sums (each sum splits over microbatches).
@register('vision/seg_dice_global_batch', make_seg, expect_split=True)
def step_dice_global(state, x, m):
  def loss_fn(p):
    prob = jax.nn.sigmoid(state.apply_fn({'params': p}, x))
    return 1.0 - (2 * jnp.sum(prob * m) + 1.0) / (jnp.sum(prob) + jnp.sum(m) + 1.0)
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'dice_loss': loss}


# ============================================================================
# LANGUAGE
# ============================================================================
V = 64  # vocabulary


def tokens(seed, b=16, l=16, v=V, low=1):
  return i32(_rs(seed).randint(low, v, size=(b, l)))


class TinyBERT(nn.Module):
  dim: int = 32

  @nn.compact
  def __call__(self, ids, attn_mask):
    emb = nn.Embed(V, self.dim)
    x = emb(ids) + self.param('pos', nn.initializers.normal(0.02), (1, ids.shape[1], self.dim))
    x = Block(self.dim)(x, mask=nn.make_attention_mask(attn_mask, attn_mask))
    x = nn.LayerNorm()(nn.gelu(nn.Dense(self.dim)(x)))
    return emb.attend(x) + self.param('out_bias', nn.initializers.zeros, (V,))


def make_mlm():
  rs = _rs(30)
  ids = tokens(30)
  lengths = rs.randint(8, 17, 16)
  attn = jnp.asarray(np.arange(16)[None] < lengths[:, None])
  ids = jnp.where(attn, ids, 0)
  mlm_mask = jnp.asarray(rs.rand(16, 16) < 0.15) & attn
  rnd = i32(rs.randint(1, V, (16, 16)))
  u = f32(rs.rand(16, 16))
  inputs = jnp.where(mlm_mask & (u < 0.8), 3, jnp.where(mlm_mask & (u < 0.9), rnd, ids))
  return make_ts(TinyBERT(), inputs[:1], attn[:1]), inputs, ids, mlm_mask, attn


# why: BERT MLM on flattened tokens: jnp.where(mask, ce, 0) summed and divided
# by the number of masked tokens in the whole batch (ratio of sums).
@register('lang/bert_mlm_flat', make_mlm, expect_split=True)
def step_mlm(state, input_ids, labels_, mlm_mask, attn):
  def loss_fn(p):
    logits = state.apply_fn({'params': p}, input_ids, attn)
    logits = logits.reshape(-1, logits.shape[-1])
    lab = labels_.reshape(-1)
    m = mlm_mask.reshape(-1)
    ce = ce_int(logits, lab)
    n = jnp.maximum(m.sum(), 1)
    loss = jnp.sum(jnp.where(m, ce, 0.0)) / n
    acc = jnp.sum(jnp.where(m, logits.argmax(-1) == lab, False)) / n
    return loss, acc
  (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads), {'mlm_loss': loss, 'mlm_acc': acc}


class DecBlock(nn.Module):
  dim: int = 32

  @nn.compact
  def __call__(self, y, enc, self_mask, cross_mask):
    h = nn.RMSNorm()(y)
    y = y + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=self.dim)(h, h, mask=self_mask)
    h = nn.RMSNorm()(y)
    y = y + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=self.dim)(h, enc, mask=cross_mask)
    h = nn.RMSNorm()(y)
    return y + nn.Dense(self.dim)(nn.relu(nn.Dense(2 * self.dim)(h)))


class TinyT5(nn.Module):
  dim: int = 32

  @nn.compact
  def __call__(self, enc_ids, dec_in):
    emb = nn.Embed(V, self.dim)
    enc_valid = enc_ids > 0
    dec_valid = dec_in >= 0
    x = Block(self.dim)(emb(enc_ids), mask=nn.make_attention_mask(enc_valid, enc_valid))
    x = nn.RMSNorm()(x)
    self_mask = nn.combine_masks(nn.make_causal_mask(dec_in), nn.make_attention_mask(dec_valid, dec_valid))
    y = DecBlock(self.dim)(emb(dec_in), x, self_mask, nn.make_attention_mask(dec_valid, enc_valid))
    return nn.Dense(V, use_bias=False)(nn.RMSNorm()(y))


def make_t5():
  rs = _rs(31)
  # span corruption already applied in the input pipeline: sentinels 60..63
  enc = np.array(tokens(31, l=16))
  tgt = np.array(tokens(32, l=8))
  for b in range(16):
    s = rs.randint(1, 12)
    enc[b, s:s + 3] = 0  # a corrupted span removed -> padding at the end after shift
    enc[b, s] = 63
    enc[b] = np.concatenate([enc[b][enc[b] > 0], np.zeros((enc[b] == 0).sum(), int)])
    tgt[b, 0] = 63
    n = rs.randint(3, 9)
    tgt[b, n:] = 0
  enc, tgt = i32(enc), i32(tgt)
  return make_ts(TinyT5(), enc[:1], tgt[:1]), enc, tgt


# why: T5 span corruption with teacher forcing (shift right); decoder loss over
# non-pad target tokens divided by the total number of target tokens.
@register('lang/t5_span_corruption', make_t5, expect_split=True)
def step_t5(state, enc_ids, targets):
  dec_in = jnp.concatenate([jnp.zeros_like(targets[:, :1]), targets[:, :-1]], axis=1)
  w = (targets > 0).astype(jnp.float32)

  def loss_fn(p):
    logits = state.apply_fn({'params': p}, enc_ids, dec_in)
    ce = ce_int(logits, targets)
    return jnp.sum(ce * w) / jnp.sum(w)
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss, 'tokens': w.sum()}


class CausalLM(nn.Module):
  dim: int = 32
  max_len: int = 32

  @nn.compact
  def __call__(self, ids, positions, mask):
    emb = nn.Embed(V, self.dim)
    pos = nn.Embed(self.max_len, self.dim)
    x = emb(ids) + pos(positions)
    x = Block(self.dim)(x, mask=mask)
    return emb.attend(nn.LayerNorm()(x))


def make_packed():
  rs = _rs(33)
  ids = np.array(tokens(33, l=32))
  seg = np.zeros((16, 32), int)
  for b in range(16):
    pos, s = 0, 1
    while pos < 32:
      n = rs.randint(4, 14)
      seg[b, pos:pos + n] = s
      pos += n
      s += 1
    tail = rs.randint(0, 6)
    if tail:
      seg[b, 32 - tail:] = 0
  ids = np.where(seg > 0, ids, 0)
  m = CausalLM()
  ids, seg = i32(ids), i32(seg)
  init_mask = nn.make_causal_mask(ids[:1])
  return make_ts(m, ids[:1], jnp.zeros_like(ids[:1]), init_mask), ids, seg


# why: sequence packing: positions from jnp.cumsum restarted at each segment,
# block-diagonal causal mask inside each row; loss normalised by the total
# number of predicted tokens in the batch (ratio of sums).
@register('lang/causal_lm_packed_segments', make_packed, expect_split=True)
def step_packed(state, ids, seg):
  valid = seg > 0
  starts = jnp.concatenate([jnp.ones_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], axis=1)
  count = jnp.cumsum(valid.astype(jnp.int32), axis=1)
  base = lax.cummax(jnp.where(starts, count - 1, 0), axis=1)
  positions = jnp.where(valid, count - 1 - base, 0)
  mask = nn.combine_masks(nn.make_causal_mask(ids),
                          nn.make_attention_mask(seg, seg, jnp.equal),
                          nn.make_attention_mask(valid, valid))
  targets = ids[:, 1:]
  tw = (valid[:, 1:] & (seg[:, 1:] == seg[:, :-1])).astype(jnp.float32)

  def loss_fn(p):
    logits = state.apply_fn({'params': p}, ids, positions, mask)[:, :-1]
    return jnp.sum(ce_int(logits, targets) * tw) / jnp.sum(tw)
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss, 'ppl': jnp.exp(loss)}


def make_ls():
  rs = _rs(34)
  ids = np.array(tokens(34, l=16))
  lengths = rs.randint(6, 17, 16)
  ids[np.arange(16)[None] >= lengths[:, None]] = 0
  ids = i32(ids)
  return (make_ts(CausalLM(max_len=16), ids[:1], jnp.zeros_like(ids[:1]), nn.make_causal_mask(ids[:1]),
                  tx=optax.adafactor(1e-2)), ids)


# why: label-smoothed causal LM; loss = mean over sequences of the per-sequence
# mean token loss (each sequence is its own unit). Adafactor optimizer.
@register('lang/label_smoothing_per_sequence', make_ls, expect_split=True)
def step_ls(state, ids):
  valid = ids > 0
  mask = nn.combine_masks(nn.make_causal_mask(ids), nn.make_attention_mask(valid, valid))
  positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
  tw = valid[:, 1:].astype(jnp.float32)

  def loss_fn(p):
    logits = state.apply_fn({'params': p}, ids, positions, mask)[:, :-1]
    tgt = optax.smooth_labels(jax.nn.one_hot(ids[:, 1:], V), 0.1)
    ce = optax.softmax_cross_entropy(logits, tgt)
    per_seq = jnp.sum(ce * tw, 1) / jnp.maximum(tw.sum(1), 1.0)
    return per_seq.mean()
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


def make_prefix():
  ids = tokens(35)
  plen = i32(_rs(35).randint(2, 10, 16))
  return (make_ts(CausalLM(max_len=16), ids[:1], jnp.zeros_like(ids[:1]), nn.make_causal_mask(ids[:1])),
          ids, plen)


# why: prefix-LM: bidirectional attention inside each example's prefix (mask
# from jnp.arange and per-example prefix lengths), loss on the suffix only,
# normalised by total suffix tokens.
@register('lang/prefix_lm_arange_mask', make_prefix, expect_split=True)
def step_prefix(state, ids, prefix_len):
  L = ids.shape[1]
  i = jnp.arange(L)[:, None]
  j = jnp.arange(L)[None, :]
  allowed = (j <= i)[None] | (j[None] < prefix_len[:, None, None])
  mask = allowed[:, None].astype(jnp.float32)
  positions = jnp.broadcast_to(jnp.arange(L), ids.shape)
  tw = (jnp.arange(1, L)[None] >= prefix_len[:, None]).astype(jnp.float32)

  def loss_fn(p):
    logits = state.apply_fn({'params': p}, ids, positions, mask)[:, :-1]
    return jnp.sum(ce_int(logits, ids[:, 1:]) * tw) / tw.sum()
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


class TiedGRULM(nn.Module):
  dim: int = 32

  @nn.compact
  def __call__(self, ids, lengths):
    emb = nn.Embed(V, self.dim, name='shared')
    h = nn.RNN(nn.GRUCell(self.dim))(emb(ids), seq_lengths=lengths)
    return emb.attend(h)


def make_gru():
  rs = _rs(36)
  ids = np.array(tokens(36))
  lengths = rs.randint(5, 17, 16)
  ids[np.arange(16)[None] >= lengths[:, None]] = 0
  return (make_ts(TiedGRULM(), i32(ids[:1]), i32(lengths[:1])), i32(ids), i32(lengths))


# why: GRU LM with tied input/output embeddings and per-example lengths; token
# mean over the batch (ratio of sums).
@register('lang/tied_embedding_gru_lm', make_gru, expect_split=True)
def step_gru(state, ids, lengths):
  tw = (jnp.arange(1, ids.shape[1])[None] < lengths[:, None]).astype(jnp.float32)

  def loss_fn(p):
    logits = state.apply_fn({'params': p}, ids, lengths)[:, :-1]
    return jnp.sum(ce_int(logits, ids[:, 1:]) * tw) / tw.sum()
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


class LSTMLM(nn.Module):
  @nn.compact
  def __call__(self, ids, lengths):
    x = nn.Embed(V, 24)(ids)
    h = nn.RNN(nn.OptimizedLSTMCell(32))(x, seq_lengths=lengths)
    return nn.Dense(V)(nn.Dropout(0.0, deterministic=True)(h))


def make_lstm():
  rs = _rs(37)
  ids = np.array(tokens(37))
  lengths = rs.randint(5, 17, 16)
  ids[np.arange(16)[None] >= lengths[:, None]] = 0
  tx = optax.chain(optax.clip(0.25), optax.sgd(1.0))
  return (make_ts(LSTMLM(), i32(ids[:1]), i32(lengths[:1]), tx=tx), i32(ids), i32(lengths))


# why: classic AWD-style LSTM LM with per-token clip and SGD; loss averaged per
# sequence over its own length, then summed and divided by the batch size.
@register('lang/lstm_lm_elementwise_clip', make_lstm, expect_split=True)
def step_lstm(state, ids, lengths):
  def loss_fn(p):
    logits = state.apply_fn({'params': p}, ids, lengths)[:, :-1]
    tw = (jnp.arange(1, ids.shape[1])[None] < lengths[:, None]).astype(jnp.float32)
    per_seq = jnp.sum(ce_int(logits, ids[:, 1:]) * tw, -1) / (lengths - 1)
    return jnp.sum(per_seq) / ids.shape[0]
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


class BagUserTower(nn.Module):
  n_items: int = 200
  dim: int = 16

  def setup(self):
    self.items = nn.Embed(self.n_items, self.dim)
    self.mlp = MLP((32, self.dim))

  def user(self, hist, hist_mask):
    e = self.items(hist) * hist_mask[..., None]
    return self.mlp(e.sum(1) / jnp.maximum(hist_mask.sum(1, keepdims=True), 1.0))

  def item(self, ids):
    return self.items(ids)

  def __call__(self, hist, hist_mask, ids):
    return self.user(hist, hist_mask), self.item(ids)


def make_sampled_softmax():
  rs = _rs(38)
  hist = i32(rs.randint(0, 200, (16, 6)))
  hmask = f32(rs.rand(16, 6) < 0.8)
  pos = i32(rs.randint(0, 200, 16))
  negs = i32(rs.randint(0, 200, (16, 10)))
  freq = 1.0 / np.arange(1, 201)
  q = freq / freq.sum()
  pos_logq = f32(np.log(q[np.array(pos)] * 10))
  neg_logq = f32(np.log(q[np.array(negs)] * 10))
  ts = make_ts(BagUserTower(), hist[:1], hmask[:1], pos[:1], tx=optax.adagrad(0.1))
  return ts, hist, hmask, pos, negs, pos_logq, neg_logq


# why: sampled softmax where each example carries its own sampled negatives and
# log-Q correction; accidental hits masked per example.
@register('lang/sampled_softmax_per_example_negs', make_sampled_softmax, expect_split=True)
def step_sampled_softmax(state, hist, hmask, pos, negs, pos_logq, neg_logq):
  def loss_fn(p):
    u, e_pos = state.apply_fn({'params': p}, hist, hmask, pos)
    e_neg = state.apply_fn({'params': p}, negs, method=BagUserTower.item)
    lp = jnp.sum(u * e_pos, -1) - pos_logq
    ln = jnp.einsum('bd,bkd->bk', u, e_neg) - neg_logq
    ln = jnp.where(negs == pos[:, None], -1e9, ln)
    logits = jnp.concatenate([lp[:, None], ln], 1)
    return ce_int(logits, jnp.zeros_like(pos)).mean()
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


_MESH = Mesh(np.array(jax.devices()), ('vocab',))
VP = 64 * len(jax.devices())


def _vocab_parallel_xent(h, w_out, labels_):
  """Megatron-style cross entropy with the output projection sharded on vocab."""
  def local(h, w, y):
    shard = lax.axis_index('vocab')
    vl = w.shape[1]
    logits = h @ w
    m = lax.pmax(lax.stop_gradient(logits.max(-1)), 'vocab')
    sum_exp = lax.psum(jnp.exp(logits - m[:, None]).sum(-1), 'vocab')
    local_y = y - shard * vl
    in_range = (local_y >= 0) & (local_y < vl)
    picked = jnp.take_along_axis(logits, jnp.clip(local_y, 0, vl - 1)[:, None], -1)[:, 0]
    target = lax.psum(jnp.where(in_range, picked, 0.0), 'vocab')
    return jnp.log(sum_exp) + m - target
  return jax.shard_map(local, mesh=_MESH, in_specs=(P(), P(None, 'vocab'), P()), out_specs=P())(
      h, w_out, labels_)


def make_vocab_parallel():
  rs = _rs(39)
  ids = i32(rs.randint(1, VP, (16, 12)))
  params = {'emb': f32(rs.randn(VP, 32) * 0.1), 'w1': f32(rs.randn(32, 32) / 6),
            'w_out': f32(rs.randn(32, VP) / 6)}
  tx = optax.adam(1e-3)
  return {'params': params, 'opt': tx.init(params)}, ids


_VP_TX = optax.adam(1e-3)


# why: vocab-parallel softmax cross entropy with lax.psum/pmax inside
# jax.shard_map over the local devices; reductions are over the vocab shards,
# never over examples; token mean over the batch.
@register('lang/vocab_parallel_shard_map', make_vocab_parallel, expect_split=True)
def step_vocab_parallel(state, ids):
  def loss_fn(p):
    x = p['emb'][ids[:, :-1]]
    x = x + jnp.tanh(x @ p['w1'])
    # a causal running mean as a (very) cheap "mixer" within each sequence
    x = jnp.cumsum(x, 1) / jnp.arange(1, x.shape[1] + 1)[None, :, None]
    h = x.reshape(-1, x.shape[-1])
    return _vocab_parallel_xent(h, p['w_out'], ids[:, 1:].reshape(-1)).mean()
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  upd, opt = _VP_TX.update(grads, state['opt'], state['params'])
  return {'params': optax.apply_updates(state['params'], upd), 'opt': opt}, {'loss': loss}


class CTCModel(nn.Module):
  @nn.compact
  def __call__(self, feats):
    x = nn.relu(nn.Conv(16, (3,))(feats))
    x = nn.Bidirectional(nn.RNN(nn.GRUCell(16)), nn.RNN(nn.GRUCell(16)))(x)
    return nn.Dense(12)(x)


def make_ctc():
  rs = _rs(40)
  feats = f32(rs.randn(16, 24, 8))
  flen = rs.randint(14, 25, 16)
  fpad = f32(np.arange(24)[None] >= flen[:, None])
  lab = i32(rs.randint(1, 12, (16, 6)))
  llen = rs.randint(2, 7, 16)
  lpad = f32(np.arange(6)[None] >= llen[:, None])
  return make_ts(CTCModel(), feats[:1]), feats, fpad, lab, lpad


# why: CTC with per-example feature/label paddings; per-utterance loss divided
# by its own label length, averaged.
@register('lang/ctc_per_example_lengths', make_ctc, expect_split=True)
def step_ctc(state, feats, fpad, lab, lpad):
  def loss_fn(p):
    logits = state.apply_fn({'params': p}, feats)
    per = optax.ctc_loss(logits, fpad, lab, lpad, blank_id=0)
    return jnp.mean(per / jnp.maximum((1 - lpad).sum(-1), 1.0))
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


class Transducer(nn.Module):
  vocab: int = 8

  @nn.compact
  def __call__(self, feats, labels_in):
    enc = nn.Dense(16)(nn.tanh(nn.Dense(16)(feats)))                     # [B,T,D]
    pred = nn.RNN(nn.GRUCell(16))(nn.Embed(self.vocab, 16)(labels_in))   # [B,U+1,D]
    joint = nn.tanh(enc[:, :, None, :] + pred[:, None, :, :])
    return jax.nn.log_softmax(nn.Dense(self.vocab)(joint), -1)          # [B,T,U+1,V]


def rnnt_loss(logp, labels_, t_len, u_len):
  """RNN-T forward algorithm; blank id 0. logp: [B,T,U+1,V], labels_: [B,U]."""
  b, t_max, u1, _ = logp.shape
  blank = logp[..., 0]
  lab = jnp.take_along_axis(logp[:, :, :-1, :], labels_[:, None, :, None], -1)[..., 0]  # [B,T,U]

  def row(alpha_prev_plus_blank, x):
    lab_t = x  # [B,U]

    def inner(prev, xs):
      a_in, l_in = xs
      cur = jnp.logaddexp(a_in, prev + l_in)
      return cur, cur
    first = alpha_prev_plus_blank[:, 0]
    _, rest = lax.scan(inner, first, (alpha_prev_plus_blank[:, 1:].T, lab_t.T))
    return jnp.concatenate([first[:, None], rest.T], 1)

  neg_inf = -1e30
  init = jnp.concatenate([jnp.zeros((b, 1)), jnp.full((b, u1 - 1), neg_inf)], 1)
  alpha0 = row(init, lab[:, 0])

  def step_t(alpha, t):
    new = row(alpha + blank[:, t - 1], lab[:, t])
    return new, new
  _, alphas = lax.scan(step_t, alpha0, jnp.arange(1, t_max))
  alphas = jnp.concatenate([alpha0[None], alphas], 0)  # [T,B,U+1]
  bi = jnp.arange(b)
  final = alphas[t_len - 1, bi, u_len] + blank[bi, t_len - 1, u_len]
  return -final


def make_rnnt():
  rs = _rs(41)
  feats = f32(rs.randn(16, 8, 6))
  t_len = i32(rs.randint(5, 9, 16))
  labs = i32(rs.randint(1, 8, (16, 4)))
  u_len = i32(rs.randint(1, 5, 16))
  lin = jnp.concatenate([jnp.zeros((16, 1), jnp.int32), labs], 1)
  return make_ts(Transducer(), feats[:1], lin[:1]), feats, labs, t_len, u_len


# why: RNN-T lattice loss computed by scans over time and label axes for each
# utterance independently; mean over utterances.
@register('lang/rnnt_lattice_scan', make_rnnt, expect_split=True)
def step_rnnt(state, feats, labs, t_len, u_len):
  lin = jnp.concatenate([jnp.zeros_like(labs[:, :1]), labs], 1)

  def loss_fn(p):
    logp = state.apply_fn({'params': p}, feats, lin)
    return rnnt_loss(logp, labs, t_len, u_len).mean()
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


class MoELayer(nn.Module):
  experts: int = 4
  dim: int = 16
  capacity_factor: float = 0.0  # 0 -> no capacity limit

  @nn.compact
  def __call__(self, x):
    b, l, d = x.shape
    tok = x.reshape(-1, d)
    router_logits = nn.Dense(self.experts, use_bias=False, name='router')(tok)
    probs = jax.nn.softmax(router_logits)
    choice = probs.argmax(-1)
    onehot = jax.nn.one_hot(choice, self.experts)
    w1 = self.param('w1', nn.initializers.lecun_normal(), (self.experts, d, 2 * d))
    w2 = self.param('w2', nn.initializers.lecun_normal(), (self.experts, 2 * d, d))
    h = jnp.einsum('td,edh->teh', tok, w1)
    out_all = jnp.einsum('teh,ehd->ted', nn.gelu(h), w2)
    keep = onehot
    if self.capacity_factor > 0:
      cap = int(math.ceil(self.capacity_factor * tok.shape[0] / self.experts))
      position = jnp.cumsum(onehot, axis=0) * onehot  # over ALL tokens of the batch
      keep = onehot * (position <= cap)
    gate = jnp.sum(probs * keep, -1, keepdims=True)
    out = jnp.einsum('te,ted->td', keep, out_all) * gate
    frac = onehot.mean(0)
    aux = self.experts * jnp.sum(frac * probs.mean(0))
    return (tok + out).reshape(b, l, d), aux, keep.sum() / tok.shape[0]


class MoELM(nn.Module):
  capacity_factor: float = 0.0

  @nn.compact
  def __call__(self, ids):
    x = nn.Embed(V, 16)(ids)
    x, aux, kept = MoELayer(capacity_factor=self.capacity_factor)(x)
    return nn.Dense(V)(nn.LayerNorm()(x)), aux, kept


def make_moe(cf):
  def make():
    ids = tokens(42, l=8)
    return make_ts(MoELM(capacity_factor=cf), ids[:1]), ids
  return make


def _moe_step(state, ids):
  def loss_fn(p):
    logits, aux, kept = state.apply_fn({'params': p}, ids[:, :-1])
    ce = ce_int(logits, ids[:, 1:]).mean()
    return ce + 0.01 * aux, (ce, aux, kept)
  (loss, (ce, aux, kept)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss, 'ce': ce, 'aux': aux, 'kept': kept}


# why: Switch top-1 MoE without capacity: per-token routing; the load-balance
# loss E*sum_e f_e*P_e is a product of two batch means (function of sums).
register('lang/moe_load_balance_no_capacity', make_moe(0.0), expect_split=True)(
    lambda state, ids: _moe_step(state, ids))

# why: expert capacity computed from the whole batch's token count, position in
# expert via cumsum over all tokens: whether a token is dropped depends on the
# routing (parameters) of tokens of other examples.
register('lang/moe_expert_capacity_drop', make_moe(1.0), expect_split=False)(
    lambda state, ids: _moe_step(state, ids))


# ============================================================================
# RECOMMENDATION / RETRIEVAL / RANKING
# ============================================================================
class TwoTower(nn.Module):
  n_items: int = 300

  def setup(self):
    self.user_mlp = MLP((32, 16), act='gelu')
    self.item_emb = nn.Embed(self.n_items, 16)
    self.item_mlp = MLP((16,), act='gelu')

  def encode_user(self, feats):
    u = self.user_mlp(feats)
    return u / jnp.linalg.norm(u, axis=-1, keepdims=True)

  def encode_item(self, ids):
    v = self.item_emb(ids)
    v = v + self.item_mlp(v)
    return v / jnp.linalg.norm(v, axis=-1, keepdims=True)

  def __call__(self, feats, ids):
    return self.encode_user(feats), self.encode_item(ids)


def make_two_tower_cands():
  rs = _rs(50)
  feats = f32(rs.randn(16, 12))
  cands = i32(rs.randint(0, 300, (16, 8)))
  target = i32(rs.randint(0, 8, 16))
  return make_ts(TwoTower(), feats[:1], cands[:1]), feats, cands, target


# why: each example is scored only against its own candidate list (softmax over
# the example's candidates), with a learned-free fixed temperature.
@register('rec/two_tower_own_candidates', make_two_tower_cands, expect_split=True)
def step_two_tower(state, feats, cands, target):
  def loss_fn(p):
    u, v = state.apply_fn({'params': p}, feats, cands)
    logits = jnp.einsum('bd,bcd->bc', u, v) / 0.1
    return ce_int(logits, target).mean(), (logits.argmax(-1) == target).mean()
  (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss, 'hit@1': acc}


class CLIPLike(nn.Module):
  @nn.compact
  def __call__(self, img_feats, txt_ids):
    zi = MLP((32, 16), name='img')(img_feats)
    t = nn.Embed(V, 16)(txt_ids).mean(1)
    zt = MLP((32, 16), name='txt')(t)
    zi = zi / jnp.linalg.norm(zi, axis=-1, keepdims=True)
    zt = zt / jnp.linalg.norm(zt, axis=-1, keepdims=True)
    log_scale = self.param('logit_scale', nn.initializers.constant(math.log(1 / 0.07)), ())
    return zi, zt, jnp.exp(jnp.minimum(log_scale, math.log(100.0)))


def make_clip():
  rs = _rs(51)
  img = f32(rs.randn(16, 24))
  txt = tokens(51, l=8)
  return make_ts(CLIPLike(), img[:1], txt[:1]), img, txt


# why: CLIP symmetric InfoNCE with in-batch negatives: every example's logits
# involve the embeddings of all other examples.
@register('rec/clip_in_batch_negatives', make_clip, expect_split=False)
def step_clip(state, img, txt):
  def loss_fn(p):
    zi, zt, scale = state.apply_fn({'params': p}, img, txt)
    logits = scale * zi @ zt.T
    lab = jnp.arange(logits.shape[0])
    return 0.5 * (ce_int(logits, lab).mean() + ce_int(logits.T, lab).mean())
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


DLRM_TABLES = (40, 30, 50)


def make_dlrm():
  rs = _rs(52)
  b, L = 32, 4
  dense = f32(np.log1p(rs.exponential(2.0, (b, 4))))
  ids = i32(np.stack([rs.randint(0, n, (b, L)) for n in DLRM_TABLES], 1))  # [B,3,L]
  valid = f32(rs.rand(b, 3, L) < 0.7)
  y = f32(rs.rand(b) < 0.3)
  params = {
      'tables': [f32(rs.randn(n, 8) * 0.05) for n in DLRM_TABLES],
      'bottom': [f32(rs.randn(4, 16) * 0.5), f32(np.zeros(16)), f32(rs.randn(16, 8) * 0.25), f32(np.zeros(8))],
      'top': [f32(rs.randn(8 + 6, 16) * 0.3), f32(np.zeros(16)), f32(rs.randn(16, 1) * 0.25), f32(np.zeros(1))],
  }
  tx = optax.adagrad(0.05)
  return {'params': params, 'opt': tx.init(params)}, dense, ids, valid, y


_DLRM_TX = optax.adagrad(0.05)


def dlrm_forward(p, dense, ids, valid):
  b, nf, L = ids.shape
  w1, b1, w2, b2 = p['bottom']
  x = nn.relu(nn.relu(dense @ w1 + b1) @ w2 + b2)           # [B,8]
  seg = jnp.repeat(jnp.arange(b), L)                        # example index per id
  pooled = []
  for f, table in enumerate(p['tables']):
    flat = ids[:, f].reshape(-1)
    e = jnp.take(table, flat, axis=0) * valid[:, f].reshape(-1, 1)
    pooled.append(jax.ops.segment_sum(e, seg, num_segments=b))   # pool within example
  z = jnp.stack([x] + pooled, 1)                            # [B,4,8]
  inter = jnp.einsum('bid,bjd->bij', z, z)
  iu, ju = jnp.triu_indices(4, k=1)
  feats = jnp.concatenate([x, inter[:, iu, ju]], -1)
  w1, b1, w2, b2 = p['top']
  return (nn.relu(feats @ w1 + b1) @ w2 + b2)[:, 0]


# why: DLRM: jnp.take lookups, segment_sum pooling whose segments are example
# indices (pooling never crosses examples), pairwise dot interactions between
# an example's own feature vectors; mean BCE.
@register('rec/dlrm_take_segment_sum', make_dlrm, expect_split=True)
def step_dlrm(state, dense, ids, valid, y):
  def loss_fn(p):
    logit = dlrm_forward(p, dense, ids, valid)
    return optax.sigmoid_binary_cross_entropy(logit, y).mean()
  loss, grads = jax.value_and_grad(loss_fn)(state['params'])
  upd, opt = _DLRM_TX.update(grads, state['opt'], state['params'])
  return {'params': optax.apply_updates(state['params'], upd), 'opt': opt}, {'logloss': loss}


def make_bpr():
  rs = _rs(53)
  params = {'user': f32(rs.randn(100, 8) * 0.1), 'item': f32(rs.randn(150, 8) * 0.1),
            'item_bias': f32(np.zeros(150))}
  users = i32(rs.randint(0, 100, 32))
  pos = i32(rs.randint(0, 150, 32))
  neg = i32(rs.randint(0, 150, (32, 4)))
  tx = optax.sgd(0.05)
  return {'params': params, 'opt': tx.init(params)}, users, pos, neg


_BPR_TX = optax.sgd(0.05)


# why: BPR with per-example sampled negatives and L2 on the gathered rows;
# everything is a mean of per-example terms.
@register('rec/bpr_per_example_negatives', make_bpr, expect_split=True)
def step_bpr(state, users, pos, neg):
  def loss_fn(p):
    u = p['user'][users]
    ip, ineg = p['item'][pos], p['item'][neg]
    sp = jnp.sum(u * ip, -1) + p['item_bias'][pos]
    sn = jnp.einsum('bd,bkd->bk', u, ineg) + p['item_bias'][neg]
    bpr = -jnp.mean(jax.nn.log_sigmoid(sp[:, None] - sn))
    reg = 1e-3 * jnp.mean(jnp.sum(u ** 2, -1) + jnp.sum(ip ** 2, -1) + jnp.sum(ineg ** 2, (-1, -2)))
    return bpr + reg, bpr
  (loss, bpr), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  upd, opt = _BPR_TX.update(grads, state['opt'], state['params'])
  return {'params': optax.apply_updates(state['params'], upd), 'opt': opt}, {'loss': loss, 'bpr': bpr}


def make_listwise():
  rs = _rs(54)
  docs = f32(rs.randn(16, 8, 6))
  rel = f32(rs.randint(0, 4, (16, 8)))
  lmask = jnp.asarray(np.arange(8)[None] < rs.randint(3, 9, 16)[:, None])
  return make_ts(MLP((16, 1)), docs[:1]), docs, rel, lmask


# why: ListNet softmax + pairwise hinge computed within each query's own list
# (padding masked); queries averaged.
@register('rec/listwise_within_query', make_listwise, expect_split=True)
def step_listwise(state, docs, rel, lmask):
  def loss_fn(p):
    s = state.apply_fn({'params': p}, docs)[..., 0]
    s = jnp.where(lmask, s, -1e9)
    t = jax.nn.softmax(jnp.where(lmask, rel, -1e9), -1)
    listnet = -jnp.sum(t * jax.nn.log_softmax(s, -1), -1)
    diff = s[:, :, None] - s[:, None, :]
    better = (rel[:, :, None] > rel[:, None, :]) & lmask[:, :, None] & lmask[:, None, :]
    hinge = jnp.sum(jnp.where(better, nn.relu(1.0 - diff), 0.0), (1, 2)) / jnp.maximum(better.sum((1, 2)), 1)
    return jnp.mean(listnet + 0.5 * hinge)
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


def make_batch_rank():
  rs = _rs(55)
  x = f32(rs.randn(32, 10))
  rel = f32(rs.randint(0, 5, 32))
  return make_ts(MLP((16, 1)), x[:1]), x, rel


# why: RankNet over all pairs of examples in the batch (the batch is the
# list): pairwise logistic terms between examples' scores.
@register('rec/ranknet_all_pairs_in_batch', make_batch_rank, expect_split=False)
def step_ranknet_batch(state, x, rel):
  def loss_fn(p):
    s = state.apply_fn({'params': p}, x)[:, 0]
    diff = s[:, None] - s[None, :]
    pair = (rel[:, None] > rel[None, :]).astype(jnp.float32)
    return jnp.sum(pair * jax.nn.softplus(-diff)) / jnp.sum(pair)
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


# why: ListNet where the whole batch is one list: -sum t_i s_i + logsumexp_j s_j
# is formally a function of sums over examples, but it is a softmax across the
# batch; unsure which way to call it.
@register('rec/listnet_softmax_over_batch', make_batch_rank, expect_split=None)
def step_listnet_batch(state, x, rel):
  t = jax.nn.softmax(rel)

  def loss_fn(p):
    s = state.apply_fn({'params': p}, x)[:, 0]
    return -jnp.sum(t * jax.nn.log_softmax(s))
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


class DCN(nn.Module):
  layers: int = 2

  @nn.compact
  def __call__(self, x):
    x0, xl = x, x
    for i in range(self.layers):
      xl = x0 * nn.Dense(x.shape[-1], name=f'cross_{i}')(xl) + xl
    deep = MLP((32, 16))(x)
    return nn.Dense(1)(jnp.concatenate([xl, deep], -1))[:, 0]


def make_dcn():
  rs = _rs(56)
  x = f32(rs.randn(32, 12))
  y = f32(rs.rand(32) < 0.25)
  w = f32(rs.uniform(0.2, 3.0, 32))  # e.g. importance weights from the logging policy
  return make_ts(DCN(), x[:1], tx=optax.adamw(1e-3, weight_decay=1e-4)), x, y, w


# why: DCN-v2 CTR model; loss = sum(w_i * bce_i) / sum(w_i), with the weights
# read from the batch (ratio of sums).
@register('rec/dcn_importance_weighted', make_dcn, expect_split=True)
def step_dcn(state, x, y, w):
  def loss_fn(p):
    logit = state.apply_fn({'params': p}, x)
    return jnp.sum(w * optax.sigmoid_binary_cross_entropy(logit, y)) / jnp.sum(w)
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


class WideDeep(nn.Module):
  @nn.compact
  def __call__(self, cross_ids, cat_ids, dense):
    wide = nn.Embed(500, 1, name='wide')(cross_ids).sum((1, 2))
    e = nn.Embed(60, 8)(cat_ids).reshape(cat_ids.shape[0], -1)
    deep = MLP((32, 1))(jnp.concatenate([e, dense], -1))[:, 0]
    return wide + deep


def make_widedeep():
  rs = _rs(57)
  cross = i32(rs.randint(0, 500, (32, 3)))
  cats = i32(rs.randint(0, 60, (32, 4)))
  dense = f32(rs.randn(32, 5))
  y = i32(rs.rand(32) < 0.2)
  return make_ts(WideDeep(), cross[:1, :, None], cats[:1], dense[:1],
                 tx=optax.chain(optax.clip_by_global_norm(5.0), optax.adam(2e-3))), cross, cats, dense, y


# why: class-balanced BCE with weights n / (2 * count(class)) counted over the
# batch's labels (parameter-free preprocessing of the whole batch).
@register('rec/wide_deep_batch_class_balance', make_widedeep, expect_split=True)
def step_widedeep(state, cross, cats, dense, y):
  n = y.shape[0]
  n_pos = jnp.maximum(jnp.sum(y), 1)
  n_neg = jnp.maximum(n - jnp.sum(y), 1)
  w = jnp.where(y == 1, n / (2.0 * n_pos), n / (2.0 * n_neg))

  def loss_fn(p):
    logit = state.apply_fn({'params': p}, cross[:, :, None], cats, dense)
    return jnp.mean(w * optax.sigmoid_binary_cross_entropy(logit, y.astype(jnp.float32)))
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


class SASRec(nn.Module):
  n_items: int = 120
  dim: int = 16

  @nn.compact
  def __call__(self, seq, pos, neg):
    emb = nn.Embed(self.n_items, self.dim)
    valid = seq > 0
    x = emb(seq) * math.sqrt(self.dim) + self.param('pos', nn.initializers.normal(0.02),
                                                     (1, seq.shape[1], self.dim))
    x = x * valid[..., None]
    mask = nn.combine_masks(nn.make_causal_mask(seq), nn.make_attention_mask(valid, valid))
    x = Block(self.dim)(x, mask=mask)
    x = nn.LayerNorm()(x)
    return jnp.sum(x * emb(pos), -1), jnp.sum(x * emb(neg), -1)


def make_sasrec():
  rs = _rs(58)
  seq = np.array(rs.randint(1, 120, (16, 10)))
  for b in range(16):
    seq[b, :rs.randint(0, 6)] = 0  # left padding
  seq = i32(seq)
  pos = jnp.where(seq > 0, i32(rs.randint(1, 120, (16, 10))), 0)
  neg = i32(rs.randint(1, 120, (16, 10)))
  return make_ts(SASRec(), seq[:1], pos[:1], neg[:1]), seq, pos, neg


# why: SASRec next-item BCE with one negative per position, masked on padding,
# normalised by the number of valid positions in the batch.
@register('rec/sasrec_causal_bce', make_sasrec, expect_split=True)
def step_sasrec(state, seq, pos, neg):
  m = (pos > 0).astype(jnp.float32)

  def loss_fn(p):
    lp, ln = state.apply_fn({'params': p}, seq, pos, neg)
    l = -(jax.nn.log_sigmoid(lp) + jax.nn.log_sigmoid(-ln))
    return jnp.sum(l * m) / jnp.sum(m)
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


# ============================================================================
# REINFORCEMENT LEARNING
# ============================================================================
class PolicyValue(nn.Module):
  actions: int = 4

  @nn.compact
  def __call__(self, obs):
    h = nn.tanh(nn.Dense(32)(obs))
    h = nn.tanh(nn.Dense(32)(h))
    return nn.Dense(self.actions)(h), nn.Dense(1)(h)[..., 0]


def make_vtrace():
  rs = _rs(60)
  T, B = 8, 16
  obs = f32(rs.randn(T, B, 6))
  actions = i32(rs.randint(0, 4, (T, B)))
  rewards = f32(rs.randn(T, B))
  discounts = f32(0.99 * (rs.rand(T, B) > 0.05))
  behaviour_logits = f32(rs.randn(T, B, 4))
  bootstrap_obs = f32(rs.randn(B, 6))
  ts = make_ts(PolicyValue(), obs[0], tx=optax.rmsprop(6e-4, decay=0.99, eps=0.01))
  return ts, obs, actions, rewards, discounts, behaviour_logits, bootstrap_obs


# why: IMPALA with time-major [T, B] rollouts; V-trace is a reverse scan over
# T separately for every column b; losses are sums over (t, b).
@register('rl/impala_vtrace_time_major', make_vtrace, expect_split=True)
def step_vtrace(state, obs, actions, rewards, discounts, behaviour_logits, bootstrap_obs):
  def loss_fn(p):
    logits, values = state.apply_fn({'params': p}, obs)          # [T,B,A], [T,B]
    _, bootstrap = state.apply_fn({'params': p}, bootstrap_obs)  # [B]
    logp = jax.nn.log_softmax(logits)
    blogp = jax.nn.log_softmax(behaviour_logits)
    a = actions[..., None]
    log_rhos = (jnp.take_along_axis(logp, a, -1) - jnp.take_along_axis(blogp, a, -1))[..., 0]
    rhos = jnp.exp(lax.stop_gradient(log_rhos))
    cr = jnp.minimum(1.0, rhos)
    cs = jnp.minimum(1.0, rhos)
    v = lax.stop_gradient(values)
    bv = lax.stop_gradient(bootstrap)
    v_tp1 = jnp.concatenate([v[1:], bv[None]], 0)
    deltas = cr * (rewards + discounts * v_tp1 - v)

    def body(acc, xs):
      d, disc, c = xs
      acc = d + disc * c * acc
      return acc, acc
    _, vs_minus_v = lax.scan(body, jnp.zeros_like(bv), (deltas, discounts, cs), reverse=True)
    vs = vs_minus_v + v
    vs_tp1 = jnp.concatenate([vs[1:], bv[None]], 0)
    pg_adv = cr * (rewards + discounts * vs_tp1 - v)
    pg = -jnp.sum(jnp.take_along_axis(logp, a, -1)[..., 0] * pg_adv)
    baseline = 0.5 * jnp.sum((vs - values) ** 2)
    entropy = -jnp.sum(jax.nn.softmax(logits) * logp)
    return pg + 0.5 * baseline - 0.01 * entropy, (pg, baseline, entropy)
  (loss, (pg, bl, ent)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  grads = optax.clip_by_global_norm(40.0).update(grads, optax.EmptyState())[0]
  return state.apply_gradients(grads=grads), {'loss': loss, 'pg': pg, 'baseline': bl, 'entropy': ent}


class Actor(nn.Module):
  act_dim: int = 2

  @nn.compact
  def __call__(self, obs):
    return jnp.tanh(MLP((32, 32, self.act_dim))(obs))


class TwinQ(nn.Module):
  @nn.compact
  def __call__(self, obs, act):
    x = jnp.concatenate([obs, act], -1)
    return MLP((32, 32, 1), name='q1')(x)[:, 0], MLP((32, 32, 1), name='q2')(x)[:, 0]


_TD3_ACTOR_TX = optax.adam(3e-4)
_TD3_CRITIC_TX = optax.adam(3e-4)


def make_td3():
  rs = _rs(61)
  B = 32
  obs, nxt = f32(rs.randn(B, 6)), f32(rs.randn(B, 6))
  act = f32(np.tanh(rs.randn(B, 2)))
  rew = f32(rs.randn(B))
  done = f32(rs.rand(B) < 0.1)
  ap = init_params(Actor(), obs[:1])['params']
  cp = init_params(TwinQ(), obs[:1], act[:1], seed=1)['params']
  state = {'actor': ap, 'critic': cp, 'actor_t': ap, 'critic_t': cp,
           'actor_opt': _TD3_ACTOR_TX.init(ap), 'critic_opt': _TD3_CRITIC_TX.init(cp),
           'step': jnp.zeros((), jnp.int32)}
  return state, obs, act, rew, nxt, done, jax.random.PRNGKey(7)


# why: TD3: target policy smoothing noise from a key argument (per example),
# clipped double-Q target, MSE critic loss, then a delayed actor step through
# the updated critic (two gradients); all per-transition means.
@register('rl/td3_target_smoothing', make_td3, stochastic=True, expect_split=True)
def step_td3(state, obs, act, rew, next_obs, done, key):
  actor, critic = Actor(), TwinQ()
  noise = jnp.clip(0.2 * jax.random.normal(key, act.shape), -0.5, 0.5)
  next_a = jnp.clip(actor.apply({'params': state['actor_t']}, next_obs) + noise, -1.0, 1.0)
  tq1, tq2 = critic.apply({'params': state['critic_t']}, next_obs, next_a)
  y = rew + 0.99 * (1 - done) * jnp.minimum(tq1, tq2)

  def critic_loss(cp):
    q1, q2 = critic.apply({'params': cp}, obs, act)
    return jnp.mean((q1 - y) ** 2) + jnp.mean((q2 - y) ** 2)
  cl, cg = jax.value_and_grad(critic_loss)(state['critic'])
  upd, critic_opt = _TD3_CRITIC_TX.update(cg, state['critic_opt'])
  critic_p = optax.apply_updates(state['critic'], upd)

  def actor_loss(ap):
    q1, _ = critic.apply({'params': critic_p}, obs, actor.apply({'params': ap}, obs))
    return -jnp.mean(q1)

  def do_actor(_):
    al, ag = jax.value_and_grad(actor_loss)(state['actor'])
    upd, aopt = _TD3_ACTOR_TX.update(ag, state['actor_opt'])
    ap = optax.apply_updates(state['actor'], upd)
    return (al, ap, aopt, tree_ema(state['actor_t'], ap, 0.995),
            tree_ema(state['critic_t'], critic_p, 0.995))

  def skip(_):
    return (jnp.zeros(()), state['actor'], state['actor_opt'], state['actor_t'], state['critic_t'])
  al, ap, aopt, at, ct = lax.cond(state['step'] % 2 == 0, do_actor, skip, None)
  new = {'actor': ap, 'critic': critic_p, 'actor_t': at, 'critic_t': ct, 'actor_opt': aopt,
         'critic_opt': critic_opt, 'step': state['step'] + 1}
  return new, {'critic_loss': cl, 'actor_loss': al}


class QNet(nn.Module):
  actions: int = 3
  atoms: int = 1

  @nn.compact
  def __call__(self, obs):
    out = MLP((32, 32, self.actions * self.atoms))(obs)
    return out.reshape(obs.shape[:-1] + ((self.actions, self.atoms) if self.atoms > 1 else (self.actions,)))


def make_nstep():
  rs = _rs(62)
  B, T = 16, 5
  obs = f32(rs.randn(B, T, 4))
  actions = i32(rs.randint(0, 3, (B, T)))
  rewards = f32(rs.randn(B, T))
  dones = f32(rs.rand(B, T) < 0.1)
  boot = f32(rs.randn(B, 4))
  ts = make_ts(QNet(), obs[:1, 0])
  return {'q': ts, 'target': ts.params}, obs, actions, rewards, dones, boot


# why: n-step returns by a reverse lax.scan over the time axis (axis 1) of each
# example, bootstrapped from a target network in the state; Huber mean.
@register('rl/nstep_returns_reverse_scan', make_nstep, expect_split=True)
def step_nstep(state, obs, actions, rewards, dones, boot):
  ts = state['q']
  gamma = 0.97
  boot_v = ts.apply_fn({'params': state['target']}, boot).max(-1)

  def body(g, xs):
    r, d = xs
    g = r + gamma * (1.0 - d) * g
    return g, g
  _, rets = lax.scan(body, boot_v, (rewards.T, dones.T), reverse=True)
  rets = lax.stop_gradient(rets.T)  # [B,T]

  def loss_fn(p):
    q = ts.apply_fn({'params': p}, obs)
    qa = jnp.take_along_axis(q, actions[..., None], -1)[..., 0]
    return optax.huber_loss(qa, rets).mean()
  loss, grads = jax.value_and_grad(loss_fn)(ts.params)
  return {'q': ts.apply_gradients(grads=grads), 'target': state['target']}, {'loss': loss}


N_ATOMS, V_MIN, V_MAX = 11, -5.0, 5.0


def make_c51():
  rs = _rs(63)
  B = 32
  obs, nxt = f32(rs.randn(B, 4)), f32(rs.randn(B, 4))
  a = i32(rs.randint(0, 3, B))
  r = f32(rs.randn(B))
  d = f32(rs.rand(B) < 0.1)
  ts = make_ts(QNet(atoms=N_ATOMS), obs[:1], tx=optax.adam(6.25e-5, eps=1.5e-4))
  return {'q': ts, 'target': ts.params, 'step': jnp.zeros((), jnp.int32)}, obs, a, r, nxt, d


# why: C51 categorical projection of the target distribution, computed per
# transition (one-hot scatter over atoms), cross entropy mean; hard target
# update every 2 steps via jnp.where on a counter.
@register('rl/c51_distributional_projection', make_c51, expect_split=True)
def step_c51(state, obs, a, r, next_obs, d):
  ts = state['q']
  z = jnp.linspace(V_MIN, V_MAX, N_ATOMS)
  dz = (V_MAX - V_MIN) / (N_ATOMS - 1)
  next_p = jax.nn.softmax(ts.apply_fn({'params': state['target']}, next_obs), -1)   # [B,A,N]
  next_a = jnp.argmax(jnp.sum(next_p * z, -1), -1)
  p_next = jnp.take_along_axis(next_p, next_a[:, None, None], 1)[:, 0]             # [B,N]
  tz = jnp.clip(r[:, None] + 0.99 * (1 - d[:, None]) * z[None], V_MIN, V_MAX)
  bpos = (tz - V_MIN) / dz
  lo, hi = jnp.floor(bpos), jnp.ceil(bpos)
  lo_oh = jax.nn.one_hot(lo.astype(jnp.int32), N_ATOMS)
  hi_oh = jax.nn.one_hot(hi.astype(jnp.int32), N_ATOMS)
  w_lo = (hi - bpos) + (lo == hi)
  w_hi = bpos - lo
  m = jnp.einsum('bj,bjk->bk', p_next * w_lo, lo_oh) + jnp.einsum('bj,bjk->bk', p_next * w_hi, hi_oh)
  m = lax.stop_gradient(m)

  def loss_fn(p):
    logits = ts.apply_fn({'params': p}, obs)
    la = jnp.take_along_axis(logits, a[:, None, None], 1)[:, 0]
    return jnp.mean(-jnp.sum(m * jax.nn.log_softmax(la), -1))
  loss, grads = jax.value_and_grad(loss_fn)(ts.params)
  ts = ts.apply_gradients(grads=grads)
  upd = (state['step'] + 1) % 2 == 0
  target = jax.tree.map(lambda o, t: jnp.where(upd, o, t), ts.params, state['target'])
  return {'q': ts, 'target': target, 'step': state['step'] + 1}, {'loss': loss}


def make_ppo_given_adv():
  rs = _rs(64)
  B = 32
  obs = f32(rs.randn(B, 6))
  act = i32(rs.randint(0, 4, B))
  old_logp = f32(np.log(np.full(B, 0.25)) + 0.1 * rs.randn(B))
  adv = f32(rs.randn(B) * 3 + 1)
  ret = f32(rs.randn(B))
  ts = make_ts(PolicyValue(), obs[:1], tx=optax.chain(optax.clip_by_global_norm(0.5), optax.adam(3e-4, eps=1e-5)))
  return ts, obs, act, old_logp, adv, ret


# why: PPO minibatch where advantages arrive in the batch (computed by the
# rollout worker) and are normalised by the batch mean/std: parameter-free
# preprocessing; the clipped surrogate is then per example.
@register('rl/ppo_adv_norm_from_inputs', make_ppo_given_adv, expect_split=True)
def step_ppo_given(state, obs, act, old_logp, adv, ret):
  adv = (adv - adv.mean()) / (adv.std() + 1e-8)

  def loss_fn(p):
    logits, v = state.apply_fn({'params': p}, obs)
    logp_all = jax.nn.log_softmax(logits)
    logp = jnp.take_along_axis(logp_all, act[:, None], -1)[:, 0]
    ratio = jnp.exp(logp - old_logp)
    pg = -jnp.mean(jnp.minimum(ratio * adv, jnp.clip(ratio, 0.8, 1.2) * adv))
    vf = 0.5 * jnp.mean((v - ret) ** 2)
    ent = -jnp.mean(jnp.sum(jnp.exp(logp_all) * logp_all, -1))
    clipfrac = jnp.mean(jnp.abs(ratio - 1) > 0.2)
    return pg + 0.5 * vf - 0.01 * ent, {'pg': pg, 'vf': vf, 'entropy': ent, 'clipfrac': clipfrac,
                                         'approx_kl': jnp.mean(old_logp - logp)}
  (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss, **aux}


def make_ppo_gae():
  rs = _rs(65)
  B, T = 16, 6
  obs = f32(rs.randn(B, T, 6))
  act = i32(rs.randint(0, 4, (B, T)))
  rew = f32(rs.randn(B, T))
  done = f32(rs.rand(B, T) < 0.1)
  old_logp = f32(np.log(np.full((B, T), 0.25)))
  last_obs = f32(rs.randn(B, 6))
  return make_ts(PolicyValue(), obs[:1, 0]), obs, act, rew, done, old_logp, last_obs


# why: GAE computed inside the step with the CURRENT critic, then advantages
# normalised by the mean/std over the whole batch before the clipped (nonlinear)
# surrogate: each example's objective depends on other examples' values under
# the current parameters.
@register('rl/ppo_gae_from_current_critic_norm', make_ppo_gae, expect_split=False)
def step_ppo_gae(state, obs, act, rew, done, old_logp, last_obs):
  gamma, lam = 0.99, 0.95
  _, values = state.apply_fn({'params': state.params}, obs)
  _, last_v = state.apply_fn({'params': state.params}, last_obs)
  next_v = jnp.concatenate([values[:, 1:], last_v[:, None]], 1)
  deltas = rew + gamma * (1 - done) * next_v - values

  def body(acc, xs):
    dlt, dn = xs
    acc = dlt + gamma * lam * (1 - dn) * acc
    return acc, acc
  _, adv = lax.scan(body, jnp.zeros(obs.shape[0]), (deltas.T, done.T), reverse=True)
  adv = lax.stop_gradient(adv.T)
  ret = adv + lax.stop_gradient(values)
  adv = (adv - adv.mean()) / (adv.std() + 1e-8)

  def loss_fn(p):
    logits, v = state.apply_fn({'params': p}, obs)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits), act[..., None], -1)[..., 0]
    ratio = jnp.exp(logp - old_logp)
    pg = -jnp.mean(jnp.minimum(ratio * adv, jnp.clip(ratio, 0.8, 1.2) * adv))
    return pg + 0.5 * jnp.mean((v - ret) ** 2)
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


class PopArtNet(nn.Module):
  @nn.compact
  def __call__(self, obs):
    h = MLP((32, 16))(obs)
    h = nn.relu(h)
    w = self.param('w', nn.initializers.lecun_normal(), (16, 1))
    b = self.param('b', nn.initializers.zeros, (1,))
    return (h @ w + b)[:, 0]


def make_popart():
  rs = _rs(66)
  obs = f32(rs.randn(32, 5))
  ret = f32(rs.randn(32) * 20 + 50)
  ts = make_ts(PopArtNet(), obs[:1], tx=optax.sgd(1e-3))
  return {'ts': ts, 'mu': jnp.zeros(()), 'nu': jnp.ones(())}, obs, ret


# why: PopArt: normalisation statistics (state) updated with batch moments of
# the *targets* (data, parameter-free), the last layer rescaled to preserve
# outputs, then per-example normalised regression.
@register('rl/popart_state_statistics', make_popart, expect_split=True)
def step_popart(state, obs, ret):
  beta = 0.1
  mu, nu = state['mu'], state['nu']
  sigma = jnp.sqrt(jnp.maximum(nu - mu ** 2, 1e-4))
  new_mu = (1 - beta) * mu + beta * jnp.mean(ret)
  new_nu = (1 - beta) * nu + beta * jnp.mean(ret ** 2)
  new_sigma = jnp.sqrt(jnp.maximum(new_nu - new_mu ** 2, 1e-4))
  ts = state['ts']
  p = dict(ts.params)
  p['w'] = p['w'] * sigma / new_sigma
  p['b'] = (sigma * p['b'] + mu - new_mu) / new_sigma
  ts = ts.replace(params=p)
  target = (ret - new_mu) / new_sigma

  def loss_fn(pp):
    return 0.5 * jnp.mean((ts.apply_fn({'params': pp}, obs) - target) ** 2)
  loss, grads = jax.value_and_grad(loss_fn)(ts.params)
  return {'ts': ts.apply_gradients(grads=grads), 'mu': new_mu, 'nu': new_nu}, {
      'loss': loss, 'sigma': new_sigma}


class DiscreteSAC(nn.Module):
  actions: int = 4

  @nn.compact
  def __call__(self, obs):
    return (MLP((32, self.actions), name='pi')(obs), MLP((32, self.actions), name='q1')(obs),
            MLP((32, self.actions), name='q2')(obs))


def make_sac():
  rs = _rs(67)
  B = 32
  obs, nxt = f32(rs.randn(B, 5)), f32(rs.randn(B, 5))
  a = i32(rs.randint(0, 4, B))
  r = f32(rs.randn(B))
  d = f32(rs.rand(B) < 0.05)
  p = init_params(DiscreteSAC(), obs[:1])['params']
  tx = optax.adam(3e-4)
  state = {'params': p, 'target': p, 'log_alpha': jnp.zeros(()), 'opt': tx.init(p),
           'alpha_opt': tx.init(jnp.zeros(()))}
  return state, obs, a, r, nxt, d


_SAC_TX = optax.adam(3e-4)


# why: discrete SAC with three losses (critic, actor, temperature) and two
# separate gradient computations; all per-transition means, the temperature
# loss is linear in the batch mean entropy.
@register('rl/sac_discrete_learned_temperature', make_sac, expect_split=True)
def step_sac(state, obs, a, r, next_obs, d):
  net = DiscreteSAC()
  alpha = jnp.exp(state['log_alpha'])
  target_entropy = 0.98 * math.log(4)
  pi_n, tq1, tq2 = net.apply({'params': state['target']}, next_obs)
  pn = jax.nn.softmax(pi_n)
  v_next = jnp.sum(pn * (jnp.minimum(tq1, tq2) - alpha * jax.nn.log_softmax(pi_n)), -1)
  y = r + 0.99 * (1 - d) * v_next

  def loss_fn(p):
    logits, q1, q2 = net.apply({'params': p}, obs)
    q1a = jnp.take_along_axis(q1, a[:, None], -1)[:, 0]
    q2a = jnp.take_along_axis(q2, a[:, None], -1)[:, 0]
    critic = jnp.mean((q1a - y) ** 2) + jnp.mean((q2a - y) ** 2)
    probs = jax.nn.softmax(logits)
    logp = jax.nn.log_softmax(logits)
    qmin = lax.stop_gradient(jnp.minimum(q1, q2))
    actor = jnp.mean(jnp.sum(probs * (alpha * logp - qmin), -1))
    entropy = -jnp.sum(probs * logp, -1)
    return critic + actor, entropy
  (loss, entropy), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  upd, opt = _SAC_TX.update(grads, state['opt'])
  params = optax.apply_updates(state['params'], upd)
  ent = lax.stop_gradient(entropy)
  a_loss, a_grad = jax.value_and_grad(
      lambda la: jnp.mean(la * (ent - target_entropy)))(state['log_alpha'])
  aupd, aopt = _SAC_TX.update(a_grad, state['alpha_opt'])
  return {'params': params, 'target': tree_ema(state['target'], params, 0.995),
          'log_alpha': state['log_alpha'] + aupd, 'opt': opt, 'alpha_opt': aopt}, {
              'loss': loss, 'alpha_loss': a_loss, 'entropy': ent.mean()}


def make_dqn():
  rs = _rs(68)
  B = 32
  obs, nxt = f32(rs.randn(B, 4)), f32(rs.randn(B, 4))
  a = i32(rs.randint(0, 3, B))
  r = f32(np.sign(rs.randn(B)))
  d = f32(rs.rand(B) < 0.1)
  isw = f32(rs.uniform(0.3, 1.0, B))  # prioritized-replay importance weights
  ts = make_ts(QNet(), obs[:1], tx=optax.adam(1e-4))
  return {'q': ts, 'target': ts.params}, obs, a, r, nxt, d, isw


# why: double DQN with prioritized-replay importance weights; the new priorities
# (|td|) are returned per example as a metric. All per-transition.
@register('rl/double_dqn_per_weights', make_dqn, expect_split=True)
def step_dqn(state, obs, a, r, next_obs, d, isw):
  ts = state['q']
  next_a = jnp.argmax(ts.apply_fn({'params': ts.params}, next_obs), -1)
  q_next = jnp.take_along_axis(ts.apply_fn({'params': state['target']}, next_obs), next_a[:, None], -1)[:, 0]
  y = r + 0.99 * (1 - d) * q_next

  def loss_fn(p):
    qa = jnp.take_along_axis(ts.apply_fn({'params': p}, obs), a[:, None], -1)[:, 0]
    td = qa - y
    return jnp.mean(isw * optax.huber_loss(td)), td
  (loss, td), grads = jax.value_and_grad(loss_fn, has_aux=True)(ts.params)
  return {'q': ts.apply_gradients(grads=grads), 'target': state['target']}, {
      'loss': loss, 'priorities': jnp.abs(td) + 1e-6}


def make_cql():
  rs = _rs(69)
  B = 32
  obs, nxt = f32(rs.randn(B, 4)), f32(rs.randn(B, 4))
  a = i32(rs.randint(0, 3, B))
  r = f32(rs.randn(B))
  d = f32(rs.rand(B) < 0.1)
  ts = make_ts(QNet(), obs[:1])
  return {'q': ts, 'target': ts.params}, obs, a, r, nxt, d


# why: discrete CQL: per-example logsumexp over actions minus the data action's
# Q, plus the TD loss; means over transitions.
@register('rl/cql_logsumexp_penalty', make_cql, expect_split=True)
def step_cql(state, obs, a, r, next_obs, d):
  ts = state['q']
  y = r + 0.99 * (1 - d) * ts.apply_fn({'params': state['target']}, next_obs).max(-1)

  def loss_fn(p):
    q = ts.apply_fn({'params': p}, obs)
    qa = jnp.take_along_axis(q, a[:, None], -1)[:, 0]
    cql = jnp.mean(jax.nn.logsumexp(q, -1) - qa)
    return jnp.mean((qa - y) ** 2) + 1.0 * cql, cql
  (loss, cql), grads = jax.value_and_grad(loss_fn, has_aux=True)(ts.params)
  return {'q': ts.apply_gradients(grads=grads), 'target': tree_ema(state['target'], ts.params, 0.99)}, {
      'loss': loss, 'cql': cql}


class ActorCriticSep(nn.Module):
  @nn.compact
  def __call__(self, obs):
    return MLP((32, 4))(obs)


def make_a2c():
  rs = _rs(70)
  B = 32
  obs = f32(rs.randn(B, 6))
  act = i32(rs.randint(0, 4, B))
  ret = f32(rs.randn(B) * 2)
  actor = make_ts(ActorCriticSep(), obs[:1], tx=optax.rmsprop(7e-4))
  critic = make_ts(MLP((32, 1)), obs[:1], tx=optax.adam(1e-3), seed=3)
  return {'actor': actor, 'critic': critic}, obs, act, ret


# why: A2C with separate actor and critic TrainStates and two gradient calls;
# advantages use the critic before its update; everything per sample.
@register('rl/a2c_two_gradients', make_a2c, expect_split=True)
def step_a2c(state, obs, act, ret):
  actor, critic = state['actor'], state['critic']

  def critic_loss(p):
    v = critic.apply_fn({'params': p}, obs)[:, 0]
    return jnp.mean((ret - v) ** 2), v
  (cl, v), cg = jax.value_and_grad(critic_loss, has_aux=True)(critic.params)
  adv = lax.stop_gradient(ret - v)

  def actor_loss(p):
    logp = jax.nn.log_softmax(actor.apply_fn({'params': p}, obs))
    lp = jnp.take_along_axis(logp, act[:, None], -1)[:, 0]
    ent = -jnp.sum(jnp.exp(logp) * logp, -1)
    return -jnp.mean(lp * adv + 0.01 * ent)
  al, ag = jax.value_and_grad(actor_loss)(actor.params)
  return {'actor': actor.apply_gradients(grads=ag), 'critic': critic.apply_gradients(grads=cg)}, {
      'actor_loss': al, 'critic_loss': cl}


# ============================================================================
# STRUCTURED: graphs, sets, flows, VAEs, GPs, ODEs, point clouds
# ============================================================================
class GCN(nn.Module):
  @nn.compact
  def __call__(self, nodes, adj, node_mask):
    a = adj + jnp.eye(adj.shape[-1])[None] * node_mask[:, :, None]
    deg = a.sum(-1)
    dinv = jnp.where(deg > 0, 1.0 / jnp.sqrt(jnp.maximum(deg, 1e-9)), 0.0)
    a_hat = dinv[:, :, None] * a * dinv[:, None, :]
    h = nodes
    for f in (32, 32):
      h = nn.relu(jnp.einsum('bij,bjf->bif', a_hat, nn.Dense(f)(h)))
    m = node_mask[..., None]
    readout = jnp.concatenate([(h * m).sum(1) / m.sum(1), jnp.where(m > 0, h, -1e9).max(1)], -1)
    return nn.Dense(3)(readout)


def make_gcn():
  rs = _rs(80)
  B, N = 16, 8
  n_nodes = rs.randint(3, N + 1, B)
  mask = (np.arange(N)[None] < n_nodes[:, None]).astype(np.float32)
  adj = (rs.rand(B, N, N) < 0.3).astype(np.float32)
  adj = np.triu(adj, 1)
  adj = (adj + adj.transpose(0, 2, 1)) * mask[:, :, None] * mask[:, None, :]
  nodes = rs.randn(B, N, 5) * mask[..., None]
  y = rs.randint(0, 3, B)
  nodes, adj, mask = f32(nodes), f32(adj), f32(mask)
  return make_ts(GCN(), nodes[:1], adj[:1], mask[:1]), nodes, adj, mask, i32(y)


# why: batch of padded graphs [B, N, ...], each with its own adjacency; message
# passing and readout never cross graphs.
@register('struct/gcn_padded_graph_batch', make_gcn, expect_split=True)
def step_gcn(state, nodes, adj, mask, y):
  loss, grads = jax.value_and_grad(
      lambda p: ce_int(state.apply_fn({'params': p}, nodes, adj, mask), y).mean())(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


class DeepSets(nn.Module):
  @nn.compact
  def __call__(self, elems, mask):
    h = MLP((32, 32), name='phi')(elems)
    pooled = jnp.sum(h * mask[..., None], 1)
    return MLP((32, 1), name='rho')(pooled)[:, 0]


def make_deepsets():
  rs = _rs(81)
  B, M = 32, 10
  sizes = rs.randint(2, M + 1, B)
  mask = (np.arange(M)[None] < sizes[:, None]).astype(np.float32)
  elems = rs.randn(B, M, 3) * mask[..., None]
  target = (elems[..., 0] * mask).sum(1) + (elems[..., 1] ** 2 * mask).max(1)
  return make_ts(DeepSets(), f32(elems[:1]), f32(mask[:1])), f32(elems), f32(mask), f32(target)


# why: DeepSets: sum pooling within each set (masked), MSE per set.
@register('struct/deepsets_masked_sum', make_deepsets, expect_split=True)
def step_deepsets(state, elems, mask, target):
  loss, grads = jax.value_and_grad(
      lambda p: jnp.mean((state.apply_fn({'params': p}, elems, mask) - target) ** 2))(state.params)
  return state.apply_gradients(grads=grads), {'mse': loss}


class PMA(nn.Module):
  @nn.compact
  def __call__(self, elems, mask):
    h = nn.Dense(16)(elems)
    seed = self.param('seed', nn.initializers.normal(0.1), (1, 1, 16))
    q = jnp.broadcast_to(seed, (elems.shape[0], 1, 16))
    att_mask = nn.make_attention_mask(jnp.ones(q.shape[:2], bool), mask > 0)
    pooled = nn.MultiHeadDotProductAttention(num_heads=2)(q, h, mask=att_mask)[:, 0]
    return nn.Dense(2)(nn.relu(nn.Dense(16)(pooled)))


def make_pma():
  rs = _rs(82)
  B, M = 16, 12
  sizes = rs.randint(3, M + 1, B)
  mask = (np.arange(M)[None] < sizes[:, None]).astype(np.float32)
  elems = f32(rs.randn(B, M, 4))
  y = i32((np.array(elems)[..., 0] * mask).sum(1) > 0)
  return make_ts(PMA(), elems[:1], f32(mask[:1])), elems, f32(mask), y


# why: Set-Transformer PMA: a learned seed attends over the elements of its own
# set (key padding mask); CE per set.
@register('struct/set_attention_pooling', make_pma, expect_split=True)
def step_pma(state, elems, mask, y):
  loss, grads = jax.value_and_grad(
      lambda p: ce_int(state.apply_fn({'params': p}, elems, mask), y).mean())(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


class Coupling(nn.Module):
  mask: tuple

  @nn.compact
  def __call__(self, x):
    m = jnp.asarray(self.mask, jnp.float32)
    h = MLP((32, 2 * x.shape[-1]), act='tanh')(x * m)
    s, t = jnp.split(h, 2, -1)
    s = jnp.tanh(s) * (1 - m)
    t = t * (1 - m)
    y = x * m + (1 - m) * (x * jnp.exp(s) + t)
    return y, s.sum(-1)


class RealNVP(nn.Module):
  @nn.compact
  def __call__(self, x):
    logdet = jnp.zeros(x.shape[0])
    d = x.shape[-1]
    for i in range(4):
      mask = tuple(float((j + i) % 2) for j in range(d))
      x, ld = Coupling(mask)(x)
      logdet = logdet + ld
    return x, logdet


def make_flow():
  rs = _rs(83)
  t = rs.rand(32) * 2 * np.pi
  x = np.stack([np.cos(t), np.sin(t), 0.3 * np.cos(2 * t), rs.randn(32) * 0.1], -1) + 0.05 * rs.randn(32, 4)
  return make_ts(RealNVP(), f32(x[:1])), f32(x)


# why: RealNVP maximum likelihood: per-example log N(z) + log|det J|.
@register('struct/realnvp_logdet', make_flow, expect_split=True)
def step_flow(state, x):
  def loss_fn(p):
    z, logdet = state.apply_fn({'params': p}, x)
    logpz = -0.5 * jnp.sum(z ** 2, -1) - 0.5 * z.shape[-1] * math.log(2 * math.pi)
    return -jnp.mean(logpz + logdet)
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'nll': loss, 'bits_per_dim': loss / (4 * math.log(2))}


class VAE(nn.Module):
  latent: int = 4

  @nn.compact
  def __call__(self, x, eps):
    h = nn.relu(nn.Dense(32)(x))
    mu, logvar = nn.Dense(self.latent)(h), nn.Dense(self.latent)(h)
    z = mu + jnp.exp(0.5 * logvar) * eps
    rec = nn.Dense(x.shape[-1])(nn.relu(nn.Dense(32)(z)))
    return rec, mu, logvar


def make_vae():
  rs = _rs(84)
  x = f32((rs.rand(32, 20) < 0.3).astype(np.float32))
  ts = make_ts(VAE(), x[:1], jnp.zeros((1, 4)))
  return {'ts': ts, 'step': jnp.zeros((), jnp.int32), 'rng': jax.random.PRNGKey(11)}, x


# why: Bernoulli VAE with reparameterisation noise from the state key and KL
# annealing by the step counter (lax.cond); ELBO is a per-example mean.
@register('struct/vae_kl_annealing_cond', make_vae, stochastic=True, expect_split=True)
def step_vae(state, x):
  rng, k = jax.random.split(state['rng'])
  eps = jax.random.normal(k, (x.shape[0], 4))
  step = state['step']
  warmup = 1  # tiny so that both branches are exercised in two steps
  beta = lax.cond(step < warmup, lambda s: s.astype(jnp.float32) / warmup,
                  lambda s: jnp.float32(1.0), step)
  ts = state['ts']

  def loss_fn(p):
    logits, mu, logvar = ts.apply_fn({'params': p}, x, eps)
    rec = jnp.sum(optax.sigmoid_binary_cross_entropy(logits, x), -1)
    kl = -0.5 * jnp.sum(1 + logvar - mu ** 2 - jnp.exp(logvar), -1)
    return jnp.mean(rec + beta * kl), (rec.mean(), kl.mean())
  (loss, (rec, kl)), grads = jax.value_and_grad(loss_fn, has_aux=True)(ts.params)
  return {'ts': ts.apply_gradients(grads=grads), 'step': step + 1, 'rng': rng}, {
      'loss': loss, 'rec': rec, 'kl': kl, 'beta': beta}


class DeepKernelGP(nn.Module):
  @nn.compact
  def __call__(self, x, y):
    feat = nn.tanh(nn.Dense(8)(nn.tanh(nn.Dense(16)(x))))   # [B,N,8]
    log_ls = self.param('log_ls', nn.initializers.zeros, ())
    log_sf = self.param('log_sf', nn.initializers.zeros, ())
    log_sn = self.param('log_sn', nn.initializers.constant(-1.0), ())
    mean_c = self.param('mean', nn.initializers.zeros, ())

    def nll(f, yy):
      d2 = jnp.sum((f[:, None] - f[None]) ** 2, -1)
      k = jnp.exp(2 * log_sf) * jnp.exp(-0.5 * d2 / jnp.exp(2 * log_ls))
      k = k + (jnp.exp(2 * log_sn) + 1e-3) * jnp.eye(f.shape[0])
      chol = jnp.linalg.cholesky(k)
      r = yy - mean_c
      alpha = jax.scipy.linalg.cho_solve((chol, True), r)
      return 0.5 * r @ alpha + jnp.sum(jnp.log(jnp.diag(chol))) + 0.5 * f.shape[0] * math.log(2 * math.pi)
    return jax.vmap(nll)(feat, y)


def make_gp():
  rs = _rs(85)
  B, N = 16, 8
  x = rs.uniform(-2, 2, (B, N, 2))
  amp = rs.uniform(0.5, 2, (B, 1))
  y = amp * np.sin(2 * x[..., 0]) + 0.5 * x[..., 1] + 0.1 * rs.randn(B, N)
  return make_ts(DeepKernelGP(), f32(x[:1]), f32(y[:1]), tx=optax.adam(1e-2)), f32(x), f32(y)


# why: each example is its own small GP regression task (deep kernel); the
# marginal likelihood uses a Cholesky per example; NLL averaged over tasks.
@register('struct/deep_kernel_gp_per_task', make_gp, expect_split=True)
def step_gp(state, x, y):
  loss, grads = jax.value_and_grad(lambda p: state.apply_fn({'params': p}, x, y).mean())(state.params)
  return state.apply_gradients(grads=grads), {'nll': loss}


class EdgeConvNet(nn.Module):
  k: int = 4

  @nn.compact
  def __call__(self, pts):
    d2 = jnp.sum((pts[:, :, None] - pts[:, None]) ** 2, -1)          # [B,P,P] within cloud
    _, idx = lax.top_k(-d2, self.k + 1)
    idx = idx[..., 1:]
    nbr = jax.vmap(lambda p, i: p[i])(pts, idx)                       # [B,P,k,3]
    center = jnp.broadcast_to(pts[:, :, None], nbr.shape)
    e = MLP((16, 16))(jnp.concatenate([center, nbr - center], -1)).max(2)
    g = nn.Dense(32)(e).max(1)
    return nn.Dense(4)(nn.relu(g))


def make_pointcloud():
  rs = _rs(86)
  B, Pn = 16, 16
  y = rs.randint(0, 4, B)
  pts = rs.randn(B, Pn, 3) * (0.5 + 0.3 * y[:, None, None])
  pts[y == 1, :, 2] *= 0.1
  return make_ts(EdgeConvNet(), f32(pts[:1])), f32(pts), i32(y)


# why: DGCNN EdgeConv: kNN graph built from pairwise distances WITHIN each
# cloud, max pooling within the cloud; examples never meet.
@register('struct/pointcloud_knn_edgeconv', make_pointcloud, expect_split=True)
def step_pointcloud(state, pts, y):
  loss, grads = jax.value_and_grad(
      lambda p: ce_int(state.apply_fn({'params': p}, pts), y).mean())(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


class ODEFunc(nn.Module):
  @nn.compact
  def __call__(self, t, x):
    tt = jnp.full(x.shape[:-1] + (1,), t)
    return MLP((32, x.shape[-1]), act='softplus')(jnp.concatenate([x, tt], -1))


def make_node():
  rs = _rs(87)
  x0 = rs.randn(32, 4)
  theta = 0.8
  rot = np.array([[np.cos(theta), -np.sin(theta)], [np.sin(theta), np.cos(theta)]])
  x1 = np.concatenate([x0[:, :2] @ rot.T, x0[:, 2:] * np.exp(-0.5)], -1)
  return make_ts(ODEFunc(), jnp.zeros(()), f32(x0[:1])), f32(x0), f32(x1)


# why: neural ODE integrated with fixed-step RK4 inside lax.scan; each
# trajectory evolves independently; MSE at t=1.
@register('struct/neural_ode_rk4_scan', make_node, expect_split=True)
def step_node(state, x0, x1):
  n_steps = 8
  dt = 1.0 / n_steps

  def loss_fn(p):
    f = lambda t, x: state.apply_fn({'params': p}, t, x)

    def rk4(x, t):
      k1 = f(t, x)
      k2 = f(t + dt / 2, x + dt / 2 * k1)
      k3 = f(t + dt / 2, x + dt / 2 * k2)
      k4 = f(t + dt, x + dt * k3)
      return x + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4), None
    xT, _ = lax.scan(rk4, x0, jnp.arange(n_steps) * dt)
    return jnp.mean((xT - x1) ** 2)
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'mse': loss}


class MDN(nn.Module):
  k: int = 3

  @nn.compact
  def __call__(self, x):
    h = nn.tanh(nn.Dense(24)(x))
    return nn.Dense(self.k)(h), nn.Dense(self.k)(h), nn.Dense(self.k)(h)


def make_mdn():
  rs = _rs(88)
  y = rs.uniform(-1, 1, (32, 1))
  x = y + 0.3 * np.sin(2 * np.pi * y) + 0.05 * rs.randn(32, 1)
  return make_ts(MDN(), f32(x[:1])), f32(x), f32(y[:, 0])


# why: mixture density network: per-example logsumexp over mixture components.
@register('struct/mixture_density_network', make_mdn, expect_split=True)
def step_mdn(state, x, y):
  def loss_fn(p):
    logit_pi, mu, log_sigma = state.apply_fn({'params': p}, x)
    log_sigma = jnp.clip(log_sigma, -5, 3)
    comp = -0.5 * ((y[:, None] - mu) / jnp.exp(log_sigma)) ** 2 - log_sigma - 0.5 * math.log(2 * math.pi)
    return -jnp.mean(jax.nn.logsumexp(jax.nn.log_softmax(logit_pi) + comp, -1))
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'nll': loss}


class BatchAttention(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(16)(x))
    # "non-parametric transformer": examples attend to each other
    ctx = nn.MultiHeadDotProductAttention(num_heads=2)(h[None], h[None])[0]
    return nn.Dense(3)(h + ctx)


def make_batch_attn():
  rs = _rs(89)
  x = f32(rs.randn(16, 8))
  return make_ts(BatchAttention(), x), x, i32(rs.randint(0, 3, 16))


# why: attention ACROSS the examples of the batch (the batch is the sequence):
# each prediction depends on every other example through the parameters.
@register('struct/attention_across_batch', make_batch_attn, expect_split=False)
def step_batch_attn(state, x, y):
  loss, grads = jax.value_and_grad(
      lambda p: ce_int(state.apply_fn({'params': p}, x), y).mean())(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


def make_proto_episodes():
  rs = _rs(90)
  B, W, K, Q = 16, 3, 2, 4
  centers = rs.randn(B, W, 6) * 2
  support = centers[:, :, None] + 0.5 * rs.randn(B, W, K, 6)
  qy = rs.randint(0, W, (B, Q))
  query = centers[np.arange(B)[:, None], qy] + 0.5 * rs.randn(B, Q, 6)
  return make_ts(MLP((32, 16)), f32(query[:1, 0])), f32(support), f32(query), i32(qy)


# why: prototypical networks where EACH EXAMPLE is a whole episode (its own
# support and query sets): prototypes are per-episode means.
@register('struct/protonet_episode_per_example', make_proto_episodes, expect_split=True)
def step_proto_episodes(state, support, query, qy):
  def loss_fn(p):
    es = state.apply_fn({'params': p}, support)            # [B,W,K,D]
    eq = state.apply_fn({'params': p}, query)              # [B,Q,D]
    protos = es.mean(2)                                    # [B,W,D]
    logits = -jnp.sum((eq[:, :, None] - protos[:, None]) ** 2, -1)
    return ce_int(logits, qy).mean(), (logits.argmax(-1) == qy).mean()
  (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss, 'acc': acc}


def make_batch_protos():
  rs = _rs(91)
  y = np.repeat(np.arange(4), 8)
  x = rs.randn(32, 6) + 1.5 * np.eye(6)[y]
  return make_ts(MLP((32, 16)), f32(x[:1])), f32(x), i32(y)


# why: prototypes are class means of the CURRENT batch's embeddings and every
# example is classified by softmax over distances to them.
@register('struct/prototypes_from_batch_embeddings', make_batch_protos, expect_split=False)
def step_batch_protos(state, x, y):
  def loss_fn(p):
    e = state.apply_fn({'params': p}, x)
    sums = jax.ops.segment_sum(e, y, num_segments=4)
    counts = jax.ops.segment_sum(jnp.ones_like(y, jnp.float32), y, num_segments=4)
    protos = sums / jnp.maximum(counts, 1.0)[:, None]
    logits = -jnp.sum((e[:, None] - protos[None]) ** 2, -1)
    return ce_int(logits, y).mean()
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


# ============================================================================
# SELF-SUPERVISED / METRIC LEARNING / DOMAIN ADAPTATION
# ============================================================================
class Embedder(nn.Module):
  out: int = 16
  normalize: bool = True

  @nn.compact
  def __call__(self, x):
    z = MLP((32, self.out), act='gelu')(x)
    if self.normalize:
      z = z / jnp.linalg.norm(z, axis=-1, keepdims=True)
    return z


def make_ssl_vectors(seed=100, b=16, d=12):
  def make():
    x = f32(_rs(seed).randn(b, d))
    return {'ts': make_ts(Embedder(), x[:1]), 'rng': jax.random.PRNGKey(seed)}, x
  return make


# why: SimCLR NT-Xent over 2B augmented views: every view's softmax runs over
# all other views in the batch.
@register('ssl/simclr_ntxent', make_ssl_vectors(), stochastic=True, expect_split=False)
def step_simclr(state, x):
  rng, k1, k2, k3, k4 = jax.random.split(state['rng'], 5)
  aug = lambda k, kk: (x + 0.1 * jax.random.normal(k, x.shape)) * jax.random.bernoulli(kk, 0.8, x.shape)
  v1, v2 = aug(k1, k2), aug(k3, k4)
  ts = state['ts']

  def loss_fn(p):
    z = ts.apply_fn({'params': p}, jnp.concatenate([v1, v2], 0))
    n = x.shape[0]
    sim = z @ z.T / 0.5
    sim = jnp.where(jnp.eye(2 * n, dtype=bool), -1e9, sim)
    pos = jnp.concatenate([jnp.arange(n, 2 * n), jnp.arange(n)])
    return ce_int(sim, pos).mean()
  loss, grads = jax.value_and_grad(loss_fn)(ts.params)
  return {'ts': ts.apply_gradients(grads=grads), 'rng': rng}, {'loss': loss}


def make_triplet_hard():
  rs = _rs(101)
  y = np.repeat(np.arange(4), 4)
  x = rs.randn(16, 12) + 2 * np.eye(12)[y]
  return make_ts(Embedder(), f32(x[:1])), f32(x), i32(y)


# why: batch-hard triplet mining: for each anchor the hardest positive and
# negative are chosen among the other examples of the batch by distance.
@register('ssl/triplet_batch_hard', make_triplet_hard, expect_split=False)
def step_triplet_hard(state, x, y):
  def loss_fn(p):
    e = state.apply_fn({'params': p}, x)
    d = jnp.sqrt(jnp.maximum(jnp.sum((e[:, None] - e[None]) ** 2, -1), 1e-12))
    same = y[:, None] == y[None]
    eye = jnp.eye(y.shape[0], dtype=bool)
    hardest_pos = jnp.max(jnp.where(same & ~eye, d, 0.0), 1)
    hardest_neg = jnp.min(jnp.where(same, 1e9, d), 1)
    return jnp.mean(nn.relu(hardest_pos - hardest_neg + 0.2))
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


def make_triplet_given():
  rs = _rs(102)
  a = rs.randn(32, 12)
  pos = a + 0.3 * rs.randn(32, 12)
  neg = rs.randn(32, 12)
  return make_ts(Embedder(), f32(a[:1])), f32(a), f32(pos), f32(neg)


# why: triplets are pre-formed by the data pipeline (anchor, positive, negative
# per example): no mining across the batch.
@register('ssl/triplet_preformed', make_triplet_given, expect_split=True)
def step_triplet_given(state, a, pos, neg):
  def loss_fn(p):
    ea, ep, en = (state.apply_fn({'params': p}, t) for t in (a, pos, neg))
    dp = jnp.sum((ea - ep) ** 2, -1)
    dn = jnp.sum((ea - en) ** 2, -1)
    return jnp.mean(nn.relu(dp - dn + 0.5)), jnp.mean(dp < dn)
  (loss, frac), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss, 'ordered': frac}


class FeatClassifier(nn.Module):
  @nn.compact
  def __call__(self, x):
    f = nn.relu(nn.Dense(16)(nn.relu(nn.Dense(32)(x))))
    return f, nn.Dense(3)(f)


def make_mmd():
  rs = _rs(103)
  xs = f32(rs.randn(16, 10))
  ys = i32(rs.randint(0, 3, 16))
  xt = f32(rs.randn(16, 10) * 1.3 + 0.5)
  return make_ts(FeatClassifier(), xs[:1]), xs, ys, xt


def rbf_mmd2(a, b, bandwidths=(0.5, 1.0, 2.0, 4.0)):
  def k(u, v):
    d2 = jnp.sum((u[:, None] - v[None]) ** 2, -1)
    return sum(jnp.exp(-d2 / (2 * bw ** 2)) for bw in bandwidths)
  return k(a, a).mean() + k(b, b).mean() - 2 * k(a, b).mean()


# why: DAN-style domain adaptation with a multi-kernel RBF MMD between source and
# target features: kernel terms between every pair of examples.
@register('ssl/mmd_rbf_domain_adaptation', make_mmd, expect_split=False)
def step_mmd(state, xs, ys, xt):
  def loss_fn(p):
    fs, logits = state.apply_fn({'params': p}, xs)
    ft, _ = state.apply_fn({'params': p}, xt)
    ce = ce_int(logits, ys).mean()
    mmd = rbf_mmd2(fs, ft)
    return ce + 0.5 * mmd, (ce, mmd)
  (loss, (ce, mmd)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss, 'ce': ce, 'mmd': mmd}


@jax.custom_vjp
def grad_reverse(x, lam):
  return x


def _gr_fwd(x, lam):
  return x, lam


def _gr_bwd(lam, g):
  return (-lam * g, jnp.zeros_like(lam))


grad_reverse.defvjp(_gr_fwd, _gr_bwd)


class DANN(nn.Module):
  @nn.compact
  def __call__(self, x, lam):
    f = nn.relu(nn.Dense(16)(nn.relu(nn.Dense(32)(x))))
    cls = nn.Dense(3, name='label_head')(f)
    dom = MLP((16, 1), name='domain_head')(grad_reverse(f, lam))[:, 0]
    return cls, dom


def make_dann():
  rs = _rs(104)
  xs = f32(rs.randn(16, 10))
  ys = i32(rs.randint(0, 3, 16))
  xt = f32(rs.randn(16, 10) * 1.3 + 0.5)
  return {'ts': make_ts(DANN(), xs[:1], jnp.float32(1.0)), 'step': jnp.zeros((), jnp.int32)}, xs, ys, xt


# why: DANN with a custom_vjp gradient-reversal layer and a domain classifier
# scored per example; lambda ramps with a step counter in the state.
@register('ssl/dann_gradient_reversal', make_dann, expect_split=True)
def step_dann(state, xs, ys, xt):
  ts = state['ts']
  prog = jnp.minimum(state['step'].astype(jnp.float32) / 10.0, 1.0)
  lam = 2.0 / (1.0 + jnp.exp(-10.0 * prog)) - 1.0

  def loss_fn(p):
    cls_s, dom_s = ts.apply_fn({'params': p}, xs, lam)
    _, dom_t = ts.apply_fn({'params': p}, xt, lam)
    ce = ce_int(cls_s, ys).mean()
    dom = 0.5 * (optax.sigmoid_binary_cross_entropy(dom_s, jnp.zeros_like(dom_s)).mean()
                 + optax.sigmoid_binary_cross_entropy(dom_t, jnp.ones_like(dom_t)).mean())
    return ce + dom, (ce, dom)
  (loss, (ce, dom)), grads = jax.value_and_grad(loss_fn, has_aux=True)(ts.params)
  return {'ts': ts.apply_gradients(grads=grads), 'step': state['step'] + 1}, {
      'loss': loss, 'ce': ce, 'domain': dom, 'lambda': lam}


def sinkhorn(scores, eps=0.05, iters=3):
  q = jnp.exp(scores / eps).T                 # [K,B]
  q = q / q.sum()
  k, b = q.shape
  for _ in range(iters):
    q = q / q.sum(1, keepdims=True) / k
    q = q / q.sum(0, keepdims=True) / b
  return (q * b).T


class SwAVNet(nn.Module):
  k: int = 8

  @nn.compact
  def __call__(self, x):
    z = Embedder()(x)
    protos = self.param('prototypes', nn.initializers.normal(1.0), (16, self.k))
    protos = protos / jnp.linalg.norm(protos, axis=0, keepdims=True)
    return z @ protos


def make_swav():
  rs = _rs(105)
  x = rs.randn(32, 12)
  v1 = x + 0.2 * rs.randn(32, 12)
  v2 = x + 0.2 * rs.randn(32, 12)
  return make_ts(SwAVNet(), f32(v1[:1])), f32(v1), f32(v2)


# why: SwAV: codes from Sinkhorn-Knopp normalisation over the batch dimension
# (equipartition across examples), computed from the current prototypes.
@register('ssl/swav_sinkhorn_codes', make_swav, expect_split=False)
def step_swav(state, v1, v2):
  def loss_fn(p):
    s1 = state.apply_fn({'params': p}, v1)
    s2 = state.apply_fn({'params': p}, v2)
    q1 = lax.stop_gradient(sinkhorn(s1))
    q2 = lax.stop_gradient(sinkhorn(s2))
    l1 = -jnp.mean(jnp.sum(q1 * jax.nn.log_softmax(s2 / 0.1), -1))
    l2 = -jnp.mean(jnp.sum(q2 * jax.nn.log_softmax(s1 / 0.1), -1))
    return 0.5 * (l1 + l2)
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


def make_ohem():
  rs = _rs(106)
  x = f32(rs.randn(32, 10))
  y = i32(rs.randint(0, 5, 32))
  return make_ts(MLP((32, 5)), x[:1]), x, y


# why: online hard example mining: only the top-25% highest-loss examples of
# the batch contribute, a selection that depends on all examples' losses.
@register('ssl/ohem_topk_hardest', make_ohem, expect_split=False)
def step_ohem(state, x, y):
  def loss_fn(p):
    per = ce_int(state.apply_fn({'params': p}, x), y)
    k = per.shape[0] // 4
    top, _ = lax.top_k(per, k)
    return top.mean(), per.mean()
  (loss, full), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss, 'mean_loss': full}


class CenteredNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(32)(x)
    h = h - h.mean(axis=0, keepdims=True)   # "mean-only batch norm" (no running stats)
    h = nn.relu(h)
    return nn.Dense(5)(h)


# why: activations centred by their batch mean, then ReLU and further layers:
# every example's output depends on the other examples' activations.
def make_centered():
  rs = _rs(110)
  x = f32(rs.randn(32, 10))
  y = i32(rs.randint(0, 5, 32))
  return make_ts(CenteredNet(), x[:2]), x, y


@register('ssl/mean_only_batch_centering', make_centered, expect_split=False)
def step_centered(state, x, y):
  loss, grads = jax.value_and_grad(
      lambda p: ce_int(state.apply_fn({'params': p}, x), y).mean())(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


def make_barlow():
  rs = _rs(107)
  x = rs.randn(32, 12)
  return (make_ts(Embedder(out=8, normalize=False), f32(x[:1])),
          f32(x + 0.2 * rs.randn(32, 12)), f32(x + 0.2 * rs.randn(32, 12)))


# why: Barlow Twins: embeddings standardised by batch mean/std, then the
# cross-correlation matrix. Algebraically a function of batch sums (sum z,
# sum z^2, sum z z'^T), but it is batch-normalisation of activations: unsure.
@register('ssl/barlow_twins', make_barlow, expect_split=None)
def step_barlow(state, v1, v2):
  def loss_fn(p):
    z1 = state.apply_fn({'params': p}, v1)
    z2 = state.apply_fn({'params': p}, v2)
    n = z1.shape[0]
    z1 = (z1 - z1.mean(0)) / (z1.std(0) + 1e-5)
    z2 = (z2 - z2.mean(0)) / (z2.std(0) + 1e-5)
    c = z1.T @ z2 / n
    on = jnp.sum((1 - jnp.diag(c)) ** 2)
    off = jnp.sum(c ** 2) - jnp.sum(jnp.diag(c) ** 2)
    return on + 5e-3 * off
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


def make_moco():
  rs = _rs(108)
  x = rs.randn(16, 12)
  ts = make_ts(Embedder(), f32(x[:1]))
  queue = rs.randn(64, 16)
  queue /= np.linalg.norm(queue, axis=-1, keepdims=True)
  return ({'ts': ts, 'key_params': ts.params, 'queue': f32(queue)},
          f32(x + 0.2 * rs.randn(16, 12)), f32(x + 0.2 * rs.randn(16, 12)))


# why: MoCo v2: negatives come from a queue in the state (not the batch), so
# the loss is per example; but the queue update stores the batch's keys in
# order (a concatenation, not a sum); unsure.
@register('ssl/moco_queue', make_moco, expect_split=None)
def step_moco(state, q_view, k_view):
  ts = state['ts']
  keys = lax.stop_gradient(ts.apply_fn({'params': state['key_params']}, k_view))

  def loss_fn(p):
    q = ts.apply_fn({'params': p}, q_view)
    l_pos = jnp.sum(q * keys, -1, keepdims=True)
    l_neg = q @ state['queue'].T
    logits = jnp.concatenate([l_pos, l_neg], 1) / 0.2
    return ce_int(logits, jnp.zeros(q.shape[0], jnp.int32)).mean()
  loss, grads = jax.value_and_grad(loss_fn)(ts.params)
  ts = ts.apply_gradients(grads=grads)
  queue = jnp.concatenate([keys, state['queue'][:-keys.shape[0]]], 0)
  return {'ts': ts, 'key_params': tree_ema(state['key_params'], ts.params, 0.999), 'queue': queue}, {
      'loss': loss}


class VQVAE(nn.Module):
  @nn.compact
  def __call__(self, x, codebook):
    z = nn.Conv(8, (3, 3), strides=(2, 2))(x)
    z = nn.Conv(4, (1, 1))(nn.relu(z))                      # [B,4,4,4]
    flat = z.reshape(-1, z.shape[-1])
    d = (jnp.sum(flat ** 2, -1, keepdims=True) - 2 * flat @ codebook.T
         + jnp.sum(codebook ** 2, -1)[None])
    idx = jnp.argmin(d, -1)
    zq = codebook[idx].reshape(z.shape)
    zq_st = z + lax.stop_gradient(zq - z)
    h = nn.relu(nn.ConvTranspose(8, (2, 2), strides=(2, 2))(zq_st))
    return nn.Conv(x.shape[-1], (3, 3))(h), z, zq, idx


def make_vqvae():
  rs = _rs(109)
  x = f32(rs.rand(16, 8, 8, 1))
  cb = f32(rs.randn(16, 4) * 0.5)
  ts = make_ts(VQVAE(), x[:1], cb)
  return {'ts': ts, 'codebook': cb, 'ema_count': jnp.ones((16,)), 'ema_sum': cb}, x


# why: VQ-VAE with straight-through estimator and EMA codebook updates: the
# codebook update uses sums over the batch of one-hot counts and assigned
# encoder outputs (sums over examples); recon and commitment losses are means.
@register('ssl/vqvae_ema_codebook', make_vqvae, expect_split=True)
def step_vqvae(state, x):
  ts = state['ts']
  cb = state['codebook']

  def loss_fn(p):
    rec, z, zq, idx = ts.apply_fn({'params': p}, x, cb)
    recon = jnp.mean((rec - x) ** 2)
    commit = jnp.mean((z - lax.stop_gradient(zq)) ** 2)
    return recon + 0.25 * commit, (z, idx, recon)
  (loss, (z, idx, recon)), grads = jax.value_and_grad(loss_fn, has_aux=True)(ts.params)
  flat = lax.stop_gradient(z.reshape(-1, z.shape[-1]))
  onehot = jax.nn.one_hot(idx, cb.shape[0])
  decay = 0.9
  count = decay * state['ema_count'] + (1 - decay) * onehot.sum(0)
  summ = decay * state['ema_sum'] + (1 - decay) * onehot.T @ flat
  n = count.sum()
  count_s = (count + 1e-5) / (n + cb.shape[0] * 1e-5) * n
  new_cb = summ / count_s[:, None]
  usage = jnp.mean(onehot, 0)
  perplexity = jnp.exp(-jnp.sum(usage * jnp.log(usage + 1e-10)))
  return {'ts': ts.apply_gradients(grads=grads), 'codebook': new_cb, 'ema_count': count,
          'ema_sum': summ}, {'loss': loss, 'recon': recon, 'perplexity': perplexity}


# ============================================================================
# TRAINING MECHANICS
# ============================================================================
def make_cls_vectors(seed, tx, module=None, b=32, d=16, n=5):
  def make():
    rs = _rs(seed)
    x = f32(rs.randn(b, d))
    y = i32(rs.randint(0, n, b))
    return make_ts(module if module is not None else MLP((32, n)), x[:1], tx=tx), x, y
  return make


def _plain_cls_step(state, x, y):
  def loss_fn(p):
    logits = state.apply_fn({'params': p}, x)
    return ce_int(logits, y).mean(), logits
  (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss, 'acc': jnp.mean(logits.argmax(-1) == y),
                                              'grad_norm': optax.global_norm(grads)}


# why: optax.MultiSteps accumulates over k=2 calls in its own state; the
# gradient of each call is an ordinary batch mean.
register('mech/optax_multisteps', make_cls_vectors(120, optax.MultiSteps(optax.adam(1e-3), every_k_schedule=2)),
         expect_split=True)(lambda state, x, y: _plain_cls_step(state, x, y))

# why: global-norm clipping applied to the full-batch mean gradient, then AdamW
# (clipping is a function of the summed gradient).
register('mech/clip_global_norm_adamw',
         make_cls_vectors(121, optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(1e-3, weight_decay=0.05))),
         expect_split=True)(lambda state, x, y: _plain_cls_step(state, x, y))


class BF16MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(64, dtype=jnp.bfloat16, param_dtype=jnp.float32)(x)
    h = nn.gelu(h)
    h = nn.Dense(64, dtype=jnp.bfloat16, param_dtype=jnp.float32)(h)
    h = nn.gelu(h)
    return nn.Dense(5, dtype=jnp.float32, param_dtype=jnp.float32)(h)


_MP_TX = optax.adam(1e-3)


def make_mp():
  rs = _rs(122)
  x = f32(rs.randn(32, 16))
  y = i32(rs.randint(0, 5, 32))
  params = init_params(BF16MLP(), x[:1])['params']
  return {'params': params, 'opt': _MP_TX.init(params), 'loss_scale': jnp.float32(2.0 ** 15),
          'good_steps': jnp.zeros((), jnp.int32)}, x, y


# why: dynamic loss scaling with bf16 activations: loss*scale, grads/scale,
# skip the update on non-finite grads, grow the scale after N good steps; the
# loss is a batch mean.
@register('mech/dynamic_loss_scale_bf16', make_mp, expect_split=True)
def step_mp(state, x, y):
  scale = state['loss_scale']

  def loss_fn(p):
    logits = BF16MLP().apply({'params': p}, x.astype(jnp.bfloat16))
    loss = ce_int(logits.astype(jnp.float32), y).mean()
    return loss * scale, loss
  (_, loss), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  grads = jax.tree.map(lambda g: g / scale, grads)
  finite = jnp.all(jnp.array([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
  upd, opt = _MP_TX.update(grads, state['opt'], state['params'])
  new_params = optax.apply_updates(state['params'], upd)
  params = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_params, state['params'])
  opt = jax.tree.map(lambda n, o: jnp.where(finite, n, o), opt, state['opt'])
  good = jnp.where(finite, state['good_steps'] + 1, 0)
  grow = good >= 2
  new_scale = jnp.where(finite, jnp.where(grow, scale * 2.0, scale), scale / 2.0)
  good = jnp.where(grow, 0, good)
  return {'params': params, 'opt': opt, 'loss_scale': new_scale, 'good_steps': good}, {
      'loss': loss, 'finite': finite.astype(jnp.float32), 'scale': new_scale}


class ResMLPBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(x)
    return x + nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(2 * x.shape[-1])(h)))


class RematNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(24)(x)
    block = nn.remat(ResMLPBlock, prevent_cse=True)
    for _ in range(3):
      x = block()(x)
    return nn.Dense(5)(x)


# why: nn.remat only changes what is stored for the backward pass.
register('mech/linen_nn_remat', make_cls_vectors(123, optax.adam(1e-3), RematNet()),
         expect_split=True)(lambda state, x, y: _plain_cls_step(state, x, y))


class ScanBlock(nn.Module):
  @nn.compact
  def __call__(self, carry, _):
    return ResMLPBlock()(carry), None


class ScanRematNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(24)(x)
    stack = nn.scan(nn.remat(ScanBlock), variable_axes={'params': 0}, split_rngs={'params': True},
                    length=4)
    x, _ = stack()(x, None)
    return nn.Dense(5)(x)


# why: layers stacked with nn.scan over a remat'd block; per-example CE.
register('mech/linen_nn_scan_remat', make_cls_vectors(124, optax.adam(1e-3), ScanRematNet()),
         expect_split=True)(lambda state, x, y: _plain_cls_step(state, x, y))


class NNXBlock(nnx.Module):
  def __init__(self, d, rngs):
    self.ln = nnx.LayerNorm(d, rngs=rngs)
    self.up = nnx.Linear(d, 2 * d, rngs=rngs)
    self.down = nnx.Linear(2 * d, d, rngs=rngs)

  def __call__(self, x):
    return x + self.down(jax.nn.gelu(self.up(self.ln(x))))


class NNXRematNet(nnx.Module):
  def __init__(self, rngs):
    self.inp = nnx.Linear(16, 24, rngs=rngs)
    self.blocks = nnx.List([NNXBlock(24, rngs) for _ in range(2)])
    self.out = nnx.Linear(24, 5, rngs=rngs)

  def __call__(self, x):
    x = self.inp(x)
    for blk in self.blocks:
      x = nnx.remat(lambda b, h: b(h))(blk, x)
    return self.out(x)


class NNXScanNet(nnx.Module):
  def __init__(self, rngs):
    self.inp = nnx.Linear(16, 24, rngs=rngs)

    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make_blocks(r):
      return NNXBlock(24, r)
    self.blocks = make_blocks(rngs)
    self.out = nnx.Linear(24, 5, rngs=rngs)

  def __call__(self, x):
    x = self.inp(x)

    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def run(blk, h):
      return blk(h)
    return self.out(run(self.blocks, x))


class NNXBNDropNet(nnx.Module):
  def __init__(self, rngs, use_bn=False, drop=0.0):
    self.l1 = nnx.Linear(16, 32, rngs=rngs)
    self.bn = nnx.BatchNorm(32, momentum=0.9, rngs=rngs) if use_bn else None
    self.drop = nnx.Dropout(drop, rngs=rngs)
    self.l2 = nnx.Linear(32, 5, rngs=rngs)

  def __call__(self, x):
    h = self.l1(x)
    if self.bn is not None:
      h = self.bn(h)
    return self.l2(self.drop(jax.nn.relu(h)))


def nnx_case(ctor, tx_fn, seed):
  """make() and a step for an NNX model + nnx.Optimizer carried as nnx.State."""
  model = ctor()
  graphdef, _ = nnx.split((model, nnx.Optimizer(model, tx_fn(), wrt=nnx.Param)))

  def make():
    rs = _rs(seed)
    m = ctor()
    m.train()
    opt = nnx.Optimizer(m, tx_fn(), wrt=nnx.Param)
    _, st = nnx.split((m, opt))
    return st, f32(rs.randn(32, 16)), i32(rs.randint(0, 5, 32))

  def step(state, x, y):
    model, opt = nnx.merge(graphdef, state)

    def loss_fn(m):
      logits = m(x)
      return ce_int(logits, y).mean(), logits
    (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    opt.update(model, grads)
    return nnx.state((model, opt)), {'loss': loss, 'acc': jnp.mean(logits.argmax(-1) == y)}
  return make, step


# why: nnx.remat around NNX blocks; plain per-example CE.
_mk, _st = nnx_case(lambda: NNXRematNet(nnx.Rngs(0)), lambda: optax.adam(1e-3), 125)
register('mech/nnx_remat_blocks', _mk, expect_split=True)(_st)

# why: nnx.scan over nnx.vmap-created stacked blocks; plain per-example CE.
_mk, _st = nnx_case(lambda: NNXScanNet(nnx.Rngs(1)), lambda: optax.adamw(1e-3), 126)
register('mech/nnx_scan_stacked_blocks', _mk, expect_split=True)(_st)

# why: nnx.BatchNorm in train mode (batch statistics of activations, then ReLU
# and another layer): examples interact.
_mk, _st = nnx_case(lambda: NNXBNDropNet(nnx.Rngs(2), use_bn=True), lambda: optax.sgd(0.05, 0.9), 127)
register('mech/nnx_batchnorm_train', _mk, expect_split=False)(_st)

# why: nnx.Dropout with its RNG stream living in the model state; per-example
# masks, per-example CE.
_mk, _st = nnx_case(lambda: NNXBNDropNet(nnx.Rngs(3, dropout=4), drop=0.3), lambda: optax.adam(1e-3), 128)
register('mech/nnx_dropout_rng_in_state', _mk, stochastic=True, expect_split=True)(_st)


_STACK_TX = optax.sgd(0.05, momentum=0.9)


def make_stacked():
  rs = _rs(129)
  L, d = 4, 16
  params = {'w_in': f32(rs.randn(8, d) / math.sqrt(8)),
            'layers': {'w': f32(rs.randn(L, d, d) / math.sqrt(d)), 'b': f32(np.zeros((L, d))),
                       'gain': f32(np.ones((L, d)))},
            'w_out': f32(rs.randn(d, 1) / math.sqrt(d))}
  x = f32(rs.randn(32, 8))
  y = f32(np.sin(np.array(x).sum(-1)))
  return {'params': params, 'opt': _STACK_TX.init(params)}, x, y


# why: hand-written stacked layers run with lax.scan (jax.checkpoint per layer)
# over the layer axis, not the batch; regression MSE.
@register('mech/lax_scan_stacked_params', make_stacked, expect_split=True)
def step_stacked(state, x, y):
  def forward(p, x):
    h = x @ p['w_in']

    def layer(h, lp):
      z = h @ lp['w'] + lp['b']
      z = z * lax.rsqrt(jnp.mean(z ** 2, -1, keepdims=True) + 1e-6) * lp['gain']
      return h + jnp.tanh(z), None
    h, _ = lax.scan(jax.checkpoint(layer), h, p['layers'])
    return (h @ p['w_out'])[:, 0]
  loss, grads = jax.value_and_grad(lambda p: jnp.mean((forward(p, x) - y) ** 2))(state['params'])
  upd, opt = _STACK_TX.update(grads, state['opt'], state['params'])
  return {'params': optax.apply_updates(state['params'], upd), 'opt': opt}, {'mse': loss}


_ENS = MLP((32, 5))
_ENS_TX = optax.adam(1e-3)


def make_ensemble():
  rs = _rs(130)
  x = f32(rs.randn(32, 16))
  y = i32(rs.randint(0, 5, 32))
  members = [init_params(_ENS, x[:1], seed=s)['params'] for s in range(4)]
  params = jax.tree.map(lambda *a: jnp.stack(a), *members)
  return {'params': params, 'opt': _ENS_TX.init(params)}, x, y


# why: deep ensemble of 4 members vmapped over a leading params axis, all
# seeing the same batch; sum of member mean-CE losses.
@register('mech/vmap_ensemble_shared_batch', make_ensemble, expect_split=True)
def step_ensemble(state, x, y):
  def member_loss(p):
    return ce_int(_ENS.apply({'params': p}, x), y).mean()

  def loss_fn(ps):
    losses = jax.vmap(member_loss)(ps)
    return losses.sum(), losses
  (loss, losses), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  upd, opt = _ENS_TX.update(grads, state['opt'], state['params'])
  probs = jax.vmap(lambda p: jax.nn.softmax(_ENS.apply({'params': p}, x)))(state['params']).mean(0)
  ens_acc = jnp.mean(probs.argmax(-1) == y)
  return {'params': optax.apply_updates(state['params'], upd), 'opt': opt}, {
      'loss': loss, 'member_loss_max': losses.max(), 'ensemble_acc': ens_acc}


def make_weighted():
  rs = _rs(131)
  x = f32(rs.randn(32, 16))
  y = i32(rs.randint(0, 5, 32))
  w = f32(rs.uniform(0, 2, 32))
  return make_ts(MLP((32, 5)), x[:1]), x, y, w


# why: per-example loss weights from the batch, loss = mean(w * ce) with the
# plain batch size as denominator.
@register('mech/per_example_weights_mean', make_weighted, expect_split=True)
def step_weighted(state, x, y, w):
  loss, grads = jax.value_and_grad(
      lambda p: jnp.mean(w * ce_int(state.apply_fn({'params': p}, x), y)))(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


def make_imbalanced():
  rs = _rs(132)
  y = i32(rs.choice(5, 32, p=[0.5, 0.2, 0.15, 0.1, 0.05]))
  x = f32(rs.randn(32, 16))
  return make_ts(MLP((32, 5)), x[:1]), x, y


# why: inverse class frequency weights computed from the batch labels
# (bincount over the whole batch, parameter-free), normalised to sum to one.
@register('mech/inverse_class_frequency_from_batch', make_imbalanced, expect_split=True)
def step_invfreq(state, x, y):
  counts = jnp.bincount(y, length=5).astype(jnp.float32)
  cw = jnp.where(counts > 0, 1.0 / jnp.maximum(counts, 1.0), 0.0)
  w = cw[y]
  w = w / w.sum()
  loss, grads = jax.value_and_grad(
      lambda p: jnp.sum(w * ce_int(state.apply_fn({'params': p}, x), y)))(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


# why: focal loss with gamma=2 and per-class alpha: per-example terms.
@register('mech/focal_loss_alpha', make_imbalanced, expect_split=True)
def step_focal(state, x, y):
  alpha = jnp.array([0.1, 0.2, 0.2, 0.25, 0.25])

  def loss_fn(p):
    logp = jax.nn.log_softmax(state.apply_fn({'params': p}, x))
    lp = jnp.take_along_axis(logp, y[:, None], -1)[:, 0]
    pt = jnp.exp(lp)
    return jnp.mean(-alpha[y] * (1 - pt) ** 2 * lp)
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'focal': loss}


class MultiTask(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = MLP((32, 32))(x)
    h = nn.relu(h)
    log_vars = self.param('log_vars', nn.initializers.zeros, (3,))
    return nn.Dense(4)(h), nn.Dense(1)(h)[:, 0], nn.Dense(2)(h), log_vars


def make_multitask():
  rs = _rs(133)
  x = f32(rs.randn(32, 10))
  yc = i32(rs.randint(0, 4, 32))
  yr = f32(rs.randn(32) * 5)
  yb = f32(rs.rand(32, 2) < 0.5)
  return make_ts(MultiTask(), x[:1]), x, yc, yr, yb


# why: Kendall et al. uncertainty weighting with learned log-variances:
# sum_t exp(-s_t) * mean_loss_t + s_t is linear in the per-task batch means.
@register('mech/uncertainty_weighted_multitask', make_multitask, expect_split=True)
def step_multitask(state, x, yc, yr, yb):
  def loss_fn(p):
    lc, r, lb, s = state.apply_fn({'params': p}, x)
    losses = jnp.stack([ce_int(lc, yc).mean(), 0.5 * jnp.mean((r - yr) ** 2),
                        optax.sigmoid_binary_cross_entropy(lb, yb).mean()])
    return jnp.sum(jnp.exp(-s) * losses + s), (losses, s)
  (loss, (losses, s)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss, 'cls': losses[0], 'reg': losses[1],
                                              'bin': losses[2], 'sigma_reg': jnp.exp(0.5 * s[1])}


# why: has_aux returns per-example losses, per-example predictions and batch
# max/min; metrics are concatenations / max of per-example values.
@register('mech/has_aux_per_example_and_max', make_weighted, expect_split=True)
def step_aux(state, x, y, w):
  def loss_fn(p):
    logits = state.apply_fn({'params': p}, x)
    per = ce_int(logits, y)
    return per.mean(), {'per_example': per, 'pred': logits.argmax(-1), 'max_loss': per.max(),
                        'min_margin': jnp.min(jnp.max(logits, -1) - jnp.take_along_axis(logits, y[:, None], -1)[:, 0]),
                        'max_logit': jnp.max(jnp.abs(logits))}
  (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss, **aux}


def tree_vdot(a, b):
  return sum(jnp.vdot(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def make_hvp():
  mk = make_cls_vectors(134, optax.adam(1e-3))
  ts, x, y = mk()
  rs = _rs(135)
  v = jax.tree.map(lambda p: f32(rs.randn(*p.shape)), ts.params)
  norm = jnp.sqrt(tree_vdot(v, v))
  v = jax.tree.map(lambda a: a / norm, v)
  return {'ts': ts, 'probe': v}, x, y


# why: curvature penalty v^T H v along a fixed probe direction (state), via
# jax.jvp of jax.grad inside the loss; H of a batch mean is a batch mean, so
# the penalty is linear in per-example terms.
@register('mech/hvp_curvature_penalty', make_hvp, expect_split=True)
def step_hvp(state, x, y):
  ts, v = state['ts'], state['probe']

  def base(p):
    return ce_int(ts.apply_fn({'params': p}, x), y).mean()

  def loss_fn(p):
    l, hv = jax.jvp(jax.grad(base), (p,), (v,))
    curv = tree_vdot(v, hv)
    return base(p) + 0.1 * curv, curv
  (loss, curv), grads = jax.value_and_grad(loss_fn, has_aux=True)(ts.params)
  return {'ts': ts.apply_gradients(grads=grads), 'probe': v}, {'loss': loss, 'vHv': curv}


# why: gradient-norm regularisation ||grad L_batch||^2: a function of the summed
# gradient (so of sums over examples), but quadratic in it, so example pairs
# interact through the double-backward; unsure.
@register('mech/gradient_norm_penalty', make_cls_vectors(136, optax.adam(1e-3)), expect_split=None)
def step_gnp(state, x, y):
  def base(p):
    return ce_int(state.apply_fn({'params': p}, x), y).mean()

  def loss_fn(p):
    g = jax.grad(base)(p)
    gn2 = tree_vdot(g, g)
    return base(p) + 0.05 * gn2, gn2
  (loss, gn2), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss, 'grad_norm_sq': gn2}


# why: SAM: ascent to w + rho*g/||g|| with the FULL-batch gradient g, then the
# gradient there. Exactly computable with two passes over sums, but a per-
# microbatch SAM would differ; unsure.
@register('mech/sharpness_aware_minimization', make_cls_vectors(137, optax.sgd(0.05, momentum=0.9)),
          expect_split=None)
def step_sam(state, x, y):
  def loss_fn(p):
    return ce_int(state.apply_fn({'params': p}, x), y).mean()
  loss, g = jax.value_and_grad(loss_fn)(state.params)
  gnorm = optax.global_norm(g)
  eps = jax.tree.map(lambda a: 0.05 * a / (gnorm + 1e-12), g)
  sam_loss, sam_g = jax.value_and_grad(loss_fn)(jax.tree.map(jnp.add, state.params, eps))
  return state.apply_gradients(grads=sam_g), {'loss': loss, 'sam_loss': sam_loss}


class DropMLP(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    h = nn.relu(nn.Dense(64)(x))
    h = nn.Dropout(0.3, deterministic=not train)(h)
    h = nn.relu(nn.Dense(64)(h))
    h = nn.Dropout(0.3, deterministic=not train)(h)
    return nn.Dense(5)(h)


class RngTrainState(train_state.TrainState):
  rng: jax.Array = None


def make_dropout():
  rs = _rs(138)
  x = f32(rs.randn(32, 16))
  y = i32(rs.randint(0, 5, 32))
  m = DropMLP()
  p = init_params(m, x[:1], train=False)['params']
  return RngTrainState.create(apply_fn=m.apply, params=p, tx=optax.adam(1e-3),
                              rng=jax.random.key(0)), x, y


# why: linen Dropout with a typed key carried in a TrainState subclass
# (fold_in the step); masks are per element, loss per example.
@register('mech/linen_dropout_rng_in_trainstate', make_dropout, stochastic=True, expect_split=True)
def step_dropout(state, x, y):
  drop_key = jax.random.fold_in(state.rng, state.step)

  def loss_fn(p):
    logits = state.apply_fn({'params': p}, x, train=True, rngs={'dropout': drop_key})
    return ce_int(logits, y).mean()
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {'loss': loss}


class LNNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(nn.Dense(32)(x))
    return nn.Dense(5)(nn.gelu(h))


def _decay_mask(params):
  return jax.tree_util.tree_map_with_path(
      lambda path, _: getattr(path[-1], 'key', '') == 'kernel', params)


# why: AdamW with a warmup-cosine schedule driven by the optimizer's count and
# a weight-decay mask excluding biases/LayerNorm; gradient is a batch mean.
register('mech/warmup_cosine_adamw_decay_mask',
         make_cls_vectors(139, optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-3, 1, 100),
                                           weight_decay=0.1, mask=_decay_mask), LNNet()),
         expect_split=True)(lambda state, x, y: _plain_cls_step(state, x, y))


class EMATrainState(train_state.TrainState):
  ema_params: dict = None


def make_polyak():
  rs = _rs(140)
  x = f32(rs.randn(32, 16))
  y = i32(rs.randint(0, 5, 32))
  m = MLP((32, 5))
  p = init_params(m, x[:1])['params']
  return EMATrainState.create(apply_fn=m.apply, params=p, tx=optax.nadam(1e-3), ema_params=p), x, y


# why: Polyak/EMA copy of the weights with a bias-corrected decay by step; the
# EMA is a function of the updated params only.
@register('mech/polyak_ema_weights', make_polyak, expect_split=True)
def step_polyak(state, x, y):
  loss, grads = jax.value_and_grad(
      lambda p: ce_int(state.apply_fn({'params': p}, x), y).mean())(state.params)
  state = state.apply_gradients(grads=grads)
  decay = jnp.minimum(0.999, (1.0 + state.step) / (10.0 + state.step))
  ema = tree_ema(state.ema_params, state.params, decay)
  ema_loss = ce_int(state.apply_fn({'params': ema}, x), y).mean()
  return state.replace(ema_params=ema), {'loss': loss, 'ema_loss': ema_loss}


# why: the user already accumulates gradients over 4 micro-chunks with
# lax.scan (reshape of the batch axis); the result is the batch mean gradient.
@register('mech/user_grad_accumulation_scan', make_cls_vectors(141, optax.adam(1e-3)), expect_split=True)
def step_user_accum(state, x, y):
  n_micro = 4
  xs = x.reshape(n_micro, -1, x.shape[-1])
  ys = y.reshape(n_micro, -1)
  grad_fn = jax.value_and_grad(lambda p, xb, yb: ce_int(state.apply_fn({'params': p}, xb), yb).mean())

  def body(carry, batch):
    loss_acc, g_acc = carry
    l, g = grad_fn(state.params, *batch)
    return (loss_acc + l, jax.tree.map(jnp.add, g_acc, g)), None
  zeros = jax.tree.map(jnp.zeros_like, state.params)
  (loss, grads), _ = lax.scan(body, (0.0, zeros), (xs, ys))
  grads = jax.tree.map(lambda g: g / n_micro, grads)
  return state.apply_gradients(grads=grads), {'loss': loss / n_micro}


def make_dpsgd():
  mk = make_cls_vectors(142, optax.sgd(0.1))
  ts, x, y = mk()
  return {'ts': ts, 'rng': jax.random.PRNGKey(142)}, x, y


# why: DP-SGD: per-example gradients (vmap), each clipped to norm C, summed,
# Gaussian noise added once to the sum (key in state), divided by B. The sum
# of clipped per-example gradients splits.
@register('mech/dp_sgd_per_example_clip', make_dpsgd, stochastic=True, expect_split=True)
def step_dpsgd(state, x, y):
  ts = state['ts']
  rng, nk = jax.random.split(state['rng'])
  clip, sigma = 1.0, 0.5

  def ex_loss(p, xi, yi):
    return ce_int(ts.apply_fn({'params': p}, xi[None]), yi[None])[0]
  losses, per_g = jax.vmap(jax.value_and_grad(ex_loss), in_axes=(None, 0, 0))(ts.params, x, y)
  norms = jnp.sqrt(sum(jnp.sum(g.reshape(g.shape[0], -1) ** 2, -1) for g in jax.tree.leaves(per_g)))
  factor = jnp.minimum(1.0, clip / (norms + 1e-6))
  summed = jax.tree.map(lambda g: jnp.tensordot(factor, g, axes=1), per_g)
  leaves, treedef = jax.tree.flatten(summed)
  keys = jax.random.split(nk, len(leaves))
  noisy = [g + sigma * clip * jax.random.normal(k, g.shape) for g, k in zip(leaves, keys)]
  grads = jax.tree.map(lambda g: g / x.shape[0], jax.tree.unflatten(treedef, noisy))
  return {'ts': ts.apply_gradients(grads=grads), 'rng': rng}, {
      'loss': losses.mean(), 'clipped_frac': jnp.mean(norms > clip)}

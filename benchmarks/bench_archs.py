"""Fit cost across architectures at real size (issue #57): each step unmodified, abstract
arguments, `guarded_jit(..., target=..., max_class="numerics").fit`, as a new user would.

    .venv/bin/python -m benchmarks.bench_archs                    # all: about an hour here
    .venv/bin/python -m benchmarks.bench_archs --model vit --model moe
    .venv/bin/python -m benchmarks.bench_archs --small            # the same code, tiny sizes

Prints per model: its parameters, the plan kept, compiles, compiles beside (failed), probes,
the fit's seconds, one compile of the plan kept (the same process, after the fit), their
ratio, each attempt's need; then the median and worst ratio. Run it alone: compile seconds
on a shared machine say little. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

import hbm_guard
from benchmarks import bench_scale


@dataclasses.dataclass(frozen=True)
class Dims:
  layers: int
  emb: int
  mlp: int
  heads: int
  seq: int
  vocab: int
  batch: int


def _attention(dims: Dims, x, kv=None, mask=None, dtype=jnp.float32):
  y = nn.LayerNorm(dtype=dtype)(x)
  kv = y if kv is None else kv
  return x + nn.MultiHeadDotProductAttention(dims.heads, dtype=dtype)(y, kv, mask=mask)


def _mlp(dims: Dims, x, dtype=jnp.float32):
  y = nn.Dense(dims.mlp, dtype=dtype)(nn.LayerNorm(dtype=dtype)(x))
  return x + nn.Dense(dims.emb, dtype=dtype)(nn.gelu(y))


class DecoderBlock(nn.Module):
  dims: Dims

  @nn.compact
  def __call__(self, x, _=None):
    x = _attention(self.dims, x, mask=nn.make_causal_mask(jnp.ones(x.shape[:2])))
    return _mlp(self.dims, x), None


class DecoderLM(nn.Module):
  """A decoder LM whose embedding is tied to its large output vocabulary."""
  dims: Dims

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(self.dims.vocab, self.dims.emb)
    x = embed(tokens)
    for _ in range(self.dims.layers):
      x, _ = DecoderBlock(self.dims)(x)
    return embed.attend(nn.LayerNorm()(x))


class ScannedLM(nn.Module):
  """MaxText's way: the layers stacked under `nn.scan`, each under `nn.remat`."""
  dims: Dims

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(self.dims.vocab, self.dims.emb)
    block = nn.remat(DecoderBlock, prevent_cse=False,
                     policy=jax.checkpoint_policies.nothing_saveable)
    x, _ = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                   length=self.dims.layers)(self.dims)(embed(tokens), None)
    return nn.Dense(self.dims.vocab)(nn.LayerNorm()(x))


class EncoderDecoder(nn.Module):
  """T5's shape: an encoder, a decoder attending to it, shared embeddings."""
  dims: Dims

  @nn.compact
  def __call__(self, src, tgt):
    d = self.dims
    embed = nn.Embed(d.vocab, d.emb)
    x = embed(src)
    pad = nn.make_attention_mask(src > 0, src > 0)
    for _ in range(d.layers):
      x = _mlp(d, _attention(d, x, mask=pad))
    causal = nn.combine_masks(nn.make_attention_mask(tgt > 0, tgt > 0),
                              nn.make_causal_mask(tgt))
    cross = nn.make_attention_mask(tgt > 0, src > 0)
    y = embed(tgt)
    for _ in range(d.layers):
      y = _attention(d, y, mask=causal)
      y = _mlp(d, _attention(d, y, kv=nn.LayerNorm()(x), mask=cross))
    return embed.attend(nn.LayerNorm()(y))


class ViT(nn.Module):
  """ViT-L/16's shape in bfloat16: patches, blocks, a pooled head."""
  dims: Dims
  classes: int = 1000

  @nn.compact
  def __call__(self, images):
    d = self.dims
    x = nn.Conv(d.emb, (16, 16), strides=(16, 16))(images)
    x = x.reshape(x.shape[0], -1, d.emb)
    for _ in range(d.layers):
      x = _mlp(d, _attention(d, x, dtype=jnp.bfloat16), dtype=jnp.bfloat16)
    return nn.Dense(self.classes)(nn.LayerNorm()(x.mean(1)))


class MoeMlp(nn.Module):
  """Switch routing (top-1, capacity 1.25 per sequence) by einsum dispatch, GShard's way;
  the load-balancing loss per sequence, sown for the step."""
  dims: Dims
  experts: int = 8

  @nn.compact
  def __call__(self, x):
    d, n = self.dims, self.experts
    b, t, _ = x.shape
    cap = max(1, int(1.25 * t / n))
    probs = jax.nn.softmax(nn.Dense(n, use_bias=False)(x).astype(jnp.float32))
    expert = jnp.argmax(probs, -1)
    mask = jax.nn.one_hot(expert, n)  # [b, t, n]
    slot = (jnp.cumsum(mask, axis=1) * mask).astype(jnp.int32) - 1
    dispatch = mask[..., None] * jax.nn.one_hot(slot, cap)  # [b, t, n, cap]; -1: dropped
    gate = jnp.sum(probs * mask, -1)
    w1 = self.param("w1", nn.initializers.lecun_normal(), (n, d.emb, d.mlp))
    w2 = self.param("w2", nn.initializers.lecun_normal(), (n, d.mlp, d.emb))
    h = jnp.einsum("btnc,bte->bnce", dispatch, x)
    h = jnp.einsum("bncm,nme->bnce", nn.gelu(jnp.einsum("bnce,nem->bncm", h, w1)), w2)
    y = jnp.einsum("btnc,bnce->bte", dispatch * gate[..., None, None], h)
    balance = n * jnp.sum(mask.mean(1) * probs.mean(1), -1)  # [b]: one per sequence
    self.sow("intermediates", "balance", balance)
    return y


class MoeLM(nn.Module):
  dims: Dims

  @nn.compact
  def __call__(self, tokens):
    d = self.dims
    embed = nn.Embed(d.vocab, d.emb)
    x = embed(tokens)
    causal = nn.make_causal_mask(tokens)
    for _ in range(d.layers):
      x = _attention(d, x, mask=causal)
      x = x + MoeMlp(d)(nn.LayerNorm()(x))
    return embed.attend(nn.LayerNorm()(x))


def lm_step(state, batch):
  """Flax lm1b's step: cross-entropy over the tokens, `jax.value_and_grad`."""
  def loss_fn(params):
    logits = state.apply_fn({"params": params}, batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), loss


def moe_step(state, batch):
  """Cross-entropy plus 0.01 x the routers' load-balancing loss, each sequence's own."""
  def loss_fn(params):
    logits, sown = state.apply_fn({"params": params}, batch["inputs"],
                                  mutable=["intermediates"])
    balance = sum(jnp.mean(v[0]) for v in jax.tree.leaves(
        sown["intermediates"], is_leaf=lambda v: isinstance(v, tuple)))
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
    return ce + 0.01 * balance
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), loss


def seq2seq_step(state, batch):
  """Flax WMT's step: label-smoothed cross-entropy weighted by the target's padding."""
  def loss_fn(params):
    logits = state.apply_fn({"params": params}, batch["src"], batch["tgt_in"])
    vocab = logits.shape[-1]
    labels = optax.smooth_labels(jax.nn.one_hot(batch["tgt_out"], vocab), 0.1)
    w = (batch["tgt_out"] > 0).astype(jnp.float32)
    return (optax.softmax_cross_entropy(logits, labels) * w).sum() / w.sum()
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), loss


def vit_step(state, batch):
  def loss_fn(params):
    logits = state.apply_fn({"params": params}, batch["images"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), loss


def _state(model: nn.Module, *example) -> train_state.TrainState:
  def create():
    params = model.init(jax.random.key(0), *example)["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                         tx=optax.adamw(1e-4))
  return jax.eval_shape(create)


def _tokens(b: int, t: int):
  return jax.ShapeDtypeStruct((b, t), jnp.int32)


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  target: str
  build: Callable[[bool], tuple]  # small -> (step, abstract state, abstract batch)


def _language(model, step, small_dims: Dims, dims: Dims):
  """A case whose model reads tokens and predicts the next ones."""
  def build(small: bool):
    d = small_dims if small else dims
    tokens = _tokens(d.batch, d.seq)
    return step, _state(model(d), jnp.zeros((1, 8), jnp.int32)), {"inputs": tokens,
                                                                   "targets": tokens}
  return build


def _encdec(small: bool):
  d = (Dims(2, 128, 512, 4, 64, 2048, 16) if small
       else Dims(12, 1024, 4096, 16, 256, 32000, 128))
  src = _tokens(d.batch, d.seq)
  return seq2seq_step, _state(EncoderDecoder(d), *[jnp.ones((1, 8), jnp.int32)] * 2), {
      "src": src, "tgt_in": src, "tgt_out": src}


def _vit(small: bool):
  d = Dims(2, 128, 512, 4, 0, 0, 16) if small else Dims(24, 1024, 4096, 16, 0, 0, 256)
  side = 64 if small else 224
  return vit_step, _state(ViT(d), jnp.zeros((1, side, side, 3))), {
      "images": jax.ShapeDtypeStruct((d.batch, side, side, 3), jnp.float32),
      "labels": jax.ShapeDtypeStruct((d.batch,), jnp.int32)}


_SMALL = Dims(2, 128, 512, 4, 128, 4096, 8)
CASES = (
    Case("decoder_lm_262k_vocab", "v5e:1x1", _language(
        DecoderLM, lm_step, _SMALL, Dims(12, 1024, 4096, 16, 1024, 262144, 8))),
    Case("encoder_decoder", "v5e:1x1", _encdec),
    Case("vit_l16", "v5e:1x1", _vit),
    Case("scan_remat_lm", "v5e:1x1", _language(
        ScannedLM, lm_step, _SMALL, Dims(24, 1024, 4096, 16, 2048, 32000, 32))),
    Case("moe_lm", "v5e:1x1", _language(
        MoeLM, moe_step, _SMALL, Dims(12, 768, 3072, 12, 1024, 32000, 32))),
    Case("decoder_lm_4_chips", "v5e:2x2", _language(
        DecoderLM, lm_step, dataclasses.replace(_SMALL, batch=16),
        Dims(24, 2048, 8192, 16, 1024, 32000, 32))),
)


def run(case: Case, small: bool) -> dict:
  step, state, batch = case.build(small)
  n = sum(x.size for x in jax.tree.leaves(state.params))
  return {"name": case.name, "target": case.target, "params": n,
          **bench_scale.measure(step, state, batch, case.target,
                                capacity="16MiB" if small else None)}


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--model", action="append", choices=[c.name for c in CASES])
  p.add_argument("--small", action="store_true", help="tiny sizes at 16 MiB: a smoke run")
  a = p.parse_args()
  hbm_guard.quiet_libtpu_on_cpu_host()
  print(f"jax {jax.__version__}; each step unmodified, abstract arguments, "
        f"max_class='numerics'", flush=True)
  print("| model | target | params | plan | compiles | beside (failed) | probes | fit s | "
        "one compile s | ratio |")
  print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
  ratios = []
  for case in CASES:
    if a.model and case.name not in a.model:
      continue
    r = run(case, a.small)
    ratio = r.get("ratio")
    if ratio is not None:
      ratios.append(ratio)
    print(f"| {r['name']} | {r['target']} | {r['params'] / 1e6:.0f}M | "
          f"{r['plan'] or r['error']} | {r['compiles']} | {r['beside_failed']} | "
          f"{r['probes']} | {r['fit_seconds']:.0f} | "
          f"{r.get('one_compile_seconds', float('nan')):.0f} | "
          f"{'' if ratio is None else f'{ratio:.2f}'} |", flush=True)
    for plan, outcome, seconds, need in r["attempts"]:
      print(f"    {plan}: {outcome}, {seconds:.0f} s, "
            f"{hbm_guard.format_bytes(need) if need else '?'}", flush=True)
  if ratios:
    print(f"median ratio {statistics.median(ratios):.2f}, worst {max(ratios):.2f} "
          f"({len(ratios)} fitted)", flush=True)


if __name__ == "__main__":
  main()

"""The main job: a small transformer that does not fit one v5e chip's 96 MiB budget.

A tiny model needs a tiny budget to overflow; the guard compiles for the chip with libtpu
here, climbs until a plan fits, then trains on this machine's CPU with that plan.
"""

import ml_collections


def get_config():
  config = ml_collections.ConfigDict()
  config.width = 256
  config.depth = 4
  config.seq = 128
  config.batch = 64
  config.steps = 5
  config.learning_rate = 1e-3
  config.seed = 0
  config.guard = ml_collections.ConfigDict()
  config.guard.auto_fallback = True
  config.guard.target = "v5e:1x1"
  config.guard.capacity = "96MiB"
  config.guard.max_class = "numerics"  # microbatching allowed; bf16 (behaviour) is not
  return config

"""An nnx MLP trained with nnx.Optimizer, compiled for one v5e chip given a small budget.

At this budget the step needs microbatching and host offload of the optimizer state.
"""

import ml_collections


def get_config():
  config = ml_collections.ConfigDict()
  config.width = 256
  config.hidden = 1024
  config.depth = 4
  config.batch = 8192
  config.steps = 5
  config.learning_rate = 0.05
  config.seed = 0
  config.guard = ml_collections.ConfigDict()
  config.guard.auto_fallback = True
  config.guard.target = "v5e:1x1"
  # The plain step needs 179 MiB, mostly activations; microbatching alone stops at 40
  # (arguments: 32 MiB, 8 of them SGD's momentum); offload alone at 188. Both: 35 or less.
  config.guard.capacity = "36MiB"
  config.guard.max_class = "numerics"
  return config

"""An nnx MLP trained with nnx.Optimizer, compiled for one v5e chip given a small budget."""

import ml_collections


def get_config():
  config = ml_collections.ConfigDict()
  config.width = 512
  config.depth = 4
  config.batch = 1024
  config.steps = 5
  config.learning_rate = 0.05
  config.seed = 0
  config.guard = ml_collections.ConfigDict()
  config.guard.auto_fallback = True
  config.guard.target = "v5e:1x1"
  config.guard.capacity = "16MiB"  # the plain step needs 21.5 MiB here
  config.guard.max_class = "numerics"
  return config

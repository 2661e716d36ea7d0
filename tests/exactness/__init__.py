"""The drop-in's differential harness: steps people write, run under the guard and jax.jit."""

"""Framework integrations (flax, optax, orbax), each imported lazily."""

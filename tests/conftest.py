"""Shared fixtures: TPU topology devices from libtpu, for real-compiler tests."""

import os

# A failure inside the drop-in's analysis or rewrite is a bug: the tests fail on it rather
# than see it as a refusal (users see it as a refusal that says so). Set before hbm_guard
# is imported.
os.environ["HBM_GUARD_RAISE_INTERNAL"] = "1"

import jax  # noqa: E402  pylint: disable=wrong-import-position
import pytest

from hbm_guard._src.backends import targets

# Tests count compiles: a plan remembered from another test (or run) would hide a climb.
# Tests of the cache pass plan_cache= explicitly.
os.environ["HBM_GUARD_PLAN_CACHE"] = "off"

# CI sets HBM_GUARD_REQUIRE_TPU=1 so a missing libtpu fails the run instead of skipping.
_REQUIRE = os.environ.get("HBM_GUARD_REQUIRE_TPU") == "1"


def _devices(name):
  try:
    return targets.Target.parse(name).devices()
  except Exception as e:  # pylint: disable=broad-except
    if _REQUIRE:
      raise
    pytest.skip(f"libtpu cannot compile for {name} here: {e}")


@pytest.fixture(scope="session")
def v5e_devices():
  return _devices("v5e:2x2")


@pytest.fixture(scope="session")
def v5e_mesh1(v5e_devices):
  return jax.sharding.Mesh(v5e_devices[:1], ("x",))

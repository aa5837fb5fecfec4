"""The one mesh and its partition specs (8 fake CPU devices; fails, never skips, without them)."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from moelab.parallel.mesh import (
    batch_spec,
    expert_weight_spec,
    make_mesh,
    shard_batch,
    shard_expert_weights,
)


def require_devices():
    if len(jax.devices()) < 8:
        pytest.fail("needs 8 devices: set XLA_FLAGS=--xla_force_host_platform_device_count=8 "
                    "before importing jax (tests/conftest.py does this)")


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_make_mesh_shapes(ep):
    require_devices()
    mesh = make_mesh(expert=ep)
    assert mesh.axis_names == ("data", "expert")
    assert dict(mesh.shape) == {"data": 8 // ep, "expert": ep}
    # expert is the inner axis: an EP group is a run of neighbouring devices
    assert [d.id for d in mesh.devices[0]] == [d.id for d in jax.devices()[:ep]]


def test_make_mesh_errors():
    require_devices()
    with pytest.raises(ValueError, match="expert=3"):
        make_mesh(expert=3)
    with pytest.raises(ValueError, match="data=2"):
        make_mesh(data=2, expert=2)


def test_specs_and_sharding():
    require_devices()
    mesh = make_mesh(expert=4)
    assert batch_spec(2) == P(("data", "expert"), None)
    assert expert_weight_spec(3) == P("expert", None, None)
    x = shard_batch(jnp.zeros((64, 4)), mesh)
    assert x.sharding.shard_shape(x.shape) == (8, 4)
    w = shard_expert_weights({"w_gate": jnp.zeros((8, 4, 2))}, mesh)
    assert w["w_gate"].sharding.shard_shape((8, 4, 2)) == (2, 4, 2)

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


def _devices(processes: int, per_process: int) -> list:
    """Stand-ins for jax.devices() of a multi-controller run: ids in process order."""
    from types import SimpleNamespace

    return [SimpleNamespace(id=i, process_index=i // per_process)
            for i in range(processes * per_process)]


@pytest.mark.parametrize("devices", [1, 4])
def test_a_device_count_that_leaves_out_a_process_is_refused(devices):
    """With several processes, parallel.devices=1 (the default) trained one copy of the model
    per process and failed at the first checkpoint; a mesh on process 0's devices alone, too."""
    from moelab.config import ConfigError, config_from_dict
    from moelab.parallel.mesh import check_device_count

    cfg = config_from_dict({"parallel": {"devices": devices}})
    with pytest.raises(ConfigError, match=rf"parallel.devices={devices}: takes the first "
                       rf"{devices} of the 8 devices, those of process\(es\) \[0\]; a run of 2 "
                       r"processes .* use parallel.devices=0"):
        check_device_count(cfg, _devices(2, 4))
    for ok in (0, 8, 6):  # every process has devices in the mesh (6: 4 of one, 2 of the other)
        check_device_count(config_from_dict({"data": {"batch_size": 48},
                                             "parallel": {"devices": ok}}), _devices(2, 4))
    check_device_count(cfg, _devices(1, 8))  # one process: any count it has

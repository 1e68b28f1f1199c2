import pytest

from m2flow.runtime.placement import Placement, PlacementError, parse_devices


def indices(devices):
    return [d.index for d in devices]


def test_range_grammar(cluster):
    assert indices(parse_devices("0-3", cluster)) == [0, 1, 2, 3]
    assert indices(parse_devices("0,2", cluster)) == [0, 2]
    assert indices(parse_devices("0-1, 3", cluster)) == [0, 1, 3]
    assert indices(parse_devices(2, cluster)) == [2]
    assert indices(parse_devices("all:1-2", cluster)) == [1, 2]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("0-4", "reaches device 4"),
        ("3-1", "empty device range"),
        ("0,0", "names a device twice"),
        ("a-b", "cannot parse"),
        ("gpus:0", "unknown device group 'gpus'"),
    ],
)
def test_bad_ranges_name_component_and_range(cluster, spec, message):
    with pytest.raises(PlacementError, match=message) as err:
        Placement.from_config({"rollout": spec}, cluster)
    assert "'rollout'" in str(err.value)


def test_device_sharing(cluster):
    assert Placement.from_config({"env": "0-1", "actor": "0-1"}, cluster).sharing == "shared"
    assert Placement.from_config({"env": "0", "rollout": "1", "actor": "2-3"}, cluster).sharing == "disjoint"
    assert Placement.from_config({"env": "0", "rollout": "1", "actor": "0-1"}, cluster).sharing == "overlapping"


def test_processes_per_device_and_devices_per_process(cluster):
    p = Placement.from_config(
        {"env": {"devices": "0-1", "procs_per_device": 2}, "actor": {"devices": "0-3", "devices_per_proc": 2}}, cluster
    )
    env, actor = p["env"], p["actor"]
    assert env.world_size == 4
    assert [indices(r.devices) for r in env.ranks()] == [[0], [0], [1], [1]]
    assert actor.world_size == 2
    assert [indices(r.devices) for r in actor.ranks()] == [[0, 1], [2, 3]]
    text = p.describe()
    assert "devices overlapping" in text and "4 rank(s)" in text


def test_invalid_placements_fail_with_component_name(cluster):
    with pytest.raises(PlacementError, match="'actor'.*cannot be split"):
        Placement.from_config({"actor": {"devices": "0-2", "devices_per_proc": 2}}, cluster)
    with pytest.raises(PlacementError, match="'actor'.*not both"):
        Placement.from_config({"actor": {"devices": "0-1", "devices_per_proc": 2, "procs_per_device": 2}}, cluster)
    with pytest.raises(PlacementError, match="'env'.*unknown placement keys"):
        Placement.from_config({"env": {"devices": "0", "gpus": 1}}, cluster)
    with pytest.raises(PlacementError, match="'env' is exclusive but shares device"):
        Placement.from_config({"env": {"devices": "0-1", "exclusive": True}, "actor": "1-2"}, cluster)
    with pytest.raises(KeyError, match="no placement for component 'critic'"):
        Placement.from_config({"actor": "0"}, cluster)["critic"]


def test_cluster_reports_cpu_slots(cluster):
    assert cluster.device_kind == "cpu"
    assert len(cluster.devices) == 4
    assert [d.cores for d in cluster.devices] == [(0,), (1,), (2,), (3,)]
    assert "4 device(s)" in cluster.describe()

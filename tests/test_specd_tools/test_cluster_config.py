"""cluster.yaml is a valid Ray cluster launcher config (checked with Ray's own schema)."""

from pathlib import Path

import yaml
from ray.autoscaler._private.util import validate_config

ROOT = Path(__file__).resolve().parents[2]


def test_cluster_yaml_validates_against_rays_schema():
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    validate_config(config)
    assert config["head_node_type"] in config["available_node_types"]
    assert any("pip install -e ~/specd" in c for c in config["setup_commands"])


def test_the_schema_check_rejects_a_broken_config():
    import jsonschema
    import pytest

    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    config["available_node_types"]["head"]["not_a_field"] = 1
    with pytest.raises(jsonschema.ValidationError):
        validate_config(config)


def test_a_gpu_node_type_fits_a_smollm2_tp3_replica_on_one_node():
    # A TP replica is a STRICT_PACK placement group: all its GPUs on one node.
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    gpus = [t.get("resources", {}).get("GPU", 0) for t in config["available_node_types"].values()]
    assert max(gpus) >= 3


def test_the_placement_resources_named_in_the_readme_are_offered():
    # `specd serve --target-resource specd_target --drafter-resource specd_drafter` (docs,
    # cluster page): every GPU
    # node type offers one specd_target per GPU, the head the drafters' resource.
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    types = config["available_node_types"]
    assert types[config["head_node_type"]]["resources"].get("specd_drafter", 0) >= 1
    for name, node in types.items():
        resources = node.get("resources", {})
        if name != config["head_node_type"]:
            assert resources.get("specd_target", 0) == resources.get("GPU", 1), name
    assert "--target-resource specd_target" in (ROOT / "docs" / "cluster.md").read_text()

"""Placement, channel-TLS, prompt-cap and port settings are checked before anything starts."""

from __future__ import annotations

import pytest

from coordinator.cluster.config import ServiceConfig
from coordinator.cluster.service import Service
from specd_tools.cli import build_parser

MODEL = "tiny-random:vocab=64,seed=0,layers=2"


@pytest.mark.parametrize("field,value", [("target_resource", ""), ("drafter_resource", " "),
                                         ("target_resource", 3), ("channel_tls", "maybe")])
def test_bad_placement_or_tls_settings_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        Service(ServiceConfig(model=MODEL, **{field: value}))


@pytest.mark.parametrize("fields, field", [
    ({"max_prompt_bytes": 0}, "max_prompt_bytes"),
    ({"max_prompt_bytes": True}, "max_prompt_bytes"),
    ({"http_port": 50051}, "http_port"),
    ({"port": 7000, "metrics_port": 7000}, "metrics_port"),
    ({"http_port": 7001, "metrics_port": 7001}, "metrics_port"),
])
def test_a_bad_prompt_cap_or_a_shared_port_is_refused(fields, field):
    with pytest.raises(ValueError, match=f"^{field} must"):
        ServiceConfig(model=MODEL, **fields)


def test_ports_0_and_off_never_clash():
    ServiceConfig(port=0, http_port=0, metrics_port=0)
    ServiceConfig(http_port=None, metrics_port=None, max_prompt_bytes=1)


def test_the_start_says_a_first_load_converts_before_ray_starts(monkeypatch):
    import ray

    from coordinator.cluster import service
    from target_worker import loader

    class RayStarting(Exception):
        pass

    def init_embedded_ray(*_args, **_kwargs):
        raise RayStarting

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(service, "init_embedded_ray", init_embedded_ray)
    monkeypatch.setattr(loader, "needs_conversion", lambda source: source == MODEL)
    said = []
    with pytest.raises(RayStarting):
        Service(ServiceConfig(model=MODEL, port=0)).start(
            progress=lambda message, done, total: said.append(message))
    # The conversion is said before Ray starts (and Ray's start is said as it starts).
    assert said[0].startswith("first load of this model: it is converted")
    assert said[1:] == ["starting Ray (embedded, on loopback)..."]


def test_channel_tls_is_on_for_a_cluster_and_off_embedded_by_default():
    assert not ServiceConfig().tls_channels
    assert ServiceConfig(address="auto").tls_channels
    assert not ServiceConfig(address="auto", channel_tls="off").tls_channels
    assert ServiceConfig(channel_tls="on").tls_channels


def test_serve_takes_the_placement_flags():
    args = build_parser().parse_args(["serve", "--address", "auto", "--target-resource",
                                      "specd_target", "--drafter-resource", "specd_drafter",
                                      "--channel-tls", "off"])
    assert (args.target_resource, args.drafter_resource, args.channel_tls) == (
        "specd_target", "specd_drafter", "off")


def test_a_missing_tls_file_is_refused_before_anything_starts(tmp_path):
    cert = tmp_path / "cert.pem"
    cert.write_text("not checked here: only that the file exists")
    with pytest.raises(ValueError, match="^--tls-key: .*key.pem is not a file"):
        ServiceConfig(model=MODEL, tls_cert=str(cert), tls_key=str(tmp_path / "key.pem"))
    with pytest.raises(ValueError, match="^--tls-cert: "):
        ServiceConfig(model=MODEL, tls_cert=str(tmp_path), tls_key=str(cert))  # a directory

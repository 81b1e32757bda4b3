"""The cluster: target replicas, drafter workers, their supervision, Ray and configuration.

- `router`: target replicas (data parallel) behind one front end, scaling while serving;
- `replica`: one replica as the router holds it (metered target, its scheduler);
- `supervisor`: what follows a failure; `failures`: how one is recognised;
- `drafter_pool`: several drafter workers behind one client;
- `service` and `actor`: the Ray service and its coordinator actor (the router and the front
  doors' servers in one process);
- `config`: what ``specd serve`` configures; `metrics`: the Prometheus export.

The top room: imports `coordinator.front` and `coordinator.step`.
"""

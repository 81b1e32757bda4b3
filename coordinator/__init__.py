"""The service layer, in three rooms, each importing only those below it:

- `coordinator.cluster`: target replicas, drafter workers, supervision, the Ray service and
  its coordinator actor, configuration, metrics;
- `coordinator.front`: the front doors (the gateway, the gRPC and OpenAI HTTP APIs);
- `coordinator.step`: one replica's step loop (the scheduler and what a step decides), and the
  request errors and latency histograms the rooms above share.

Each name is imported from its own module: the rule and sampling from `specd_core`, the
in-process decode loop from `coordinator.step.speculative`.
"""

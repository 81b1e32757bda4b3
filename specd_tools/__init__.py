"""The top layer: the tools a user runs (the `specd` CLI, `specd bench` and its workloads,
the batch job, the gRPC client helpers, EAGLE head training). They use the layers below and
hold no policy the service needs."""

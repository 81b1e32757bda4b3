"""The top layer: the tools a user runs (the `specd` CLI, `specd bench` and its workloads,
the batch job, the gRPC client helpers, EAGLE head training). They use the layers below and
hold no policy the service needs.

Where things are: `cli` (the ``specd`` command), `generate` (what a ``specd generate`` request
is), `flags` (flag pieces the commands share), `client` (the Generation API client),
`batch` (the ``ray job submit`` batch job), `bench` (``specd bench`` and its modes),
`workloads` (the bench's prompts), `train_eagle` (``specd train-drafter``) and `data` (its
prompts, and MT-Bench for ``specd bench serve``).
"""

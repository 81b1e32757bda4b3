"""Drafter worker: the drafters (prompt lookup, suffix, EAGLE), their per-request sessions
and the gRPC service that serves them. The `Drafter` interface itself is `specd_core.draft`.

Where things are:

- the drafters: `prompt_lookup`, `suffix`, `eagle`; `registry` names them (`build_drafter`,
  `check_drafter`, their defaults);
- per-request state over one drafter: `sessions`;
- what the scheduler drafts through (``propose(jobs)``, ``release``, ``info``): `client`
  (`DrafterClient`, a worker over gRPC) or `local` (`LocalDrafter`, in this process);
- the worker: `server` (the gRPC service), `wire` (its messages), `actor` (on Ray),
  ``python -m drafter_worker`` (`__main__`).
"""

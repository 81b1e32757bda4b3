"""Drafter worker: the drafters (prompt lookup, suffix, EAGLE), their per-request sessions
and the gRPC service that serves them. The `Drafter` interface itself is `specd_core.draft`."""

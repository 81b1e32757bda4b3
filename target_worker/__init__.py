"""Target worker: the large model that verifies speculative drafts (pure torch)."""

"""Suite-wide settings."""

import torch

# Tiny test models are dominated by per-op overhead, where a second intra-op thread only
# adds synchronisation; real-model tests raise this again themselves.
torch.set_num_threads(1)

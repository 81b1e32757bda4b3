"""Suite-wide settings."""

import pytest
import torch

# Tiny test models are dominated by per-op overhead, where a second intra-op thread only
# adds synchronisation; real-model tests raise this again themselves.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """Gives each test back the thread count it started with: `specd generate --in-process`
    sets the process's threads (every core by default), which would otherwise carry into
    every later test of this process."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def smollm2():
    """``(decoder, tokenizer)`` of the real default model, with two torch threads while the
    module's tests run (the suite's single thread is for tiny models)."""
    from target_worker.loader import load_model

    torch.set_num_threads(2)
    yield load_model(dtype="float32")  # the tests that want bfloat16 cast a copy
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def smollm2_float32():
    """`smollm2` (float32 too), named for tests against transformers' float32 load or with
    float32 bounds: ``auto`` is bfloat16 on an AMX CPU (`cpu_prefers_bf16`)."""
    from target_worker.loader import load_model

    torch.set_num_threads(2)
    yield load_model(dtype="float32")
    torch.set_num_threads(1)

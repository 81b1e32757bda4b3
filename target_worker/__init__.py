"""Target worker: the large model that verifies speculative drafts (pure torch).

Where things are:

- the model: `config` (`ModelConfig`), `model` (`Decoder`, `KvCache`);
- loading it: `loader` (`load_model`, `load_decoder`, `model_config`: dispatch by source), the
  sources `gguf` (GGUF files), `hf` (Hugging Face directories) and `testing` (the tiny random
  model), `fetch` (the default model), `disk_cache` (the cache root and float32 weights cache);
- serving it: `engine` (`TargetEngine`: slots, KV caches, packed verification), `actor` (the
  Ray actor body), `channel` and `step_codec` (the per-step socket and its data format),
  `tls`;
- tensor parallel: `sharded` (one rank's shard), `tp` (TP replicas on Ray).
"""

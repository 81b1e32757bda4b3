"""``specd bench``: specd measured, one module per kind of run.

- `cli`: the ``specd bench`` command (its flags and `cmd_bench`);
- `core`: ``specd bench`` in process: specd plain / fixed / adaptive against transformers on
  the shipped workloads (`specd_tools.workloads`); its systems are `systems`, transformers'
  model `hf`, and the forward and thread timing beside them `forward`;
- `service`: ``specd bench --service HOST:PORT``, a running service under concurrent streams;
- `default_path`: ``specd bench --default-path``, the embedded service ``specd generate``
  starts against transformers;
- `report`: the JSON, Markdown and PNG report of those runs, and their targets;
- `serve`: ``specd bench serve``, a load generator for any OpenAI-compatible server: its
  command `serve_cli`, prompts `serve_data`, tables and plots `serve_report`, and
  ``--compare`` against a peer server `serve_compare`;
- `long_prompts`: ``specd bench long-prompts``: time to first token, the stall a long prompt
  causes, and prefix reuse.
"""

"""``specd bench``: specd measured, one module per kind of run.

- `core`: ``specd bench``, in process: specd plain / fixed / adaptive against transformers
  on the shipped workloads (`specd_tools.workloads`), plus forward timing;
- `service`: ``specd bench --service HOST:PORT`` (a running service under concurrent
  streams) and ``specd bench --default-path`` (the embedded service ``specd generate`` starts);
- `report`: the JSON, Markdown and PNG report of those runs, and their targets;
- `serve`: ``specd bench serve``, a load generator for any OpenAI-compatible server, with its
  prompts (`serve_data`) and ``--compare`` against a peer server (`serve_compare`);
- `long_prompts`: ``specd bench long-prompts``: time to first token, the stall a long prompt
  causes, and prefix reuse.
"""

"""The step loop: one replica's continuous-batching scheduler and what each step decides.

- `scheduler`: the loop (admit, draft, one target call, the rule per request, stream);
- `plan`: what one step computes (chunked prefill under a token budget);
- `drafting`: the drafting policy (who drafts how much, pipelined run-aheads);
- `adaptive`: adaptive draft length from the target's measured forward cost;
- `schedule`: the pipelined, serial or undrafted step, chosen by measurement;
- `requests`: a request as the loop holds it, and the loop's counters;
- `targets`: the target the loop drives, and its in-process adapters;
- `speculative`: the in-process entry points over the scheduler;
- shared with the rooms above: `errors` (a request's failure and how it reaches its
  client), `latency` (latency histograms).

The lowest room: imports no other room (`coordinator.front`, `coordinator.cluster`).
"""

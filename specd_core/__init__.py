"""The bottom layer: pure shared code, no Ray, no gRPC, no files.

Sampling parameters and transforms and the per-request generator (`sampling`), the
accept/reject rule and its row types (`rule`), draft blocks and the `Drafter` protocol
(`draft`), the target step's input/output types (`step`), raw log probabilities of target rows
(`logprobs`), per-request decode state (`request`), tokenizer helpers (`text`) and choosing
among equivalent options by their measured cost (`choice`).
`target_worker`, `drafter_worker`, `coordinator` and `specd_tools` import it; it imports none
of them (checked by import-linter in CI).
"""

"""Times 'specd generate' with 1 and 2 torch threads, with no load of ours and beside one
CPU-burning process, interleaved (README, "Threads on a busy machine").

    python scripts/threads_under_load.py [--repeats 2] [--max-new-tokens 64] [--no-service]

The burner (``python -c 'while True: pass'``) is started and killed by its own process handle;
nothing else is touched. Prints one line per run and the figures as a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

PROMPT = "Explain in two sentences why the sky is blue."


def run(threads: int, in_process: bool, max_new_tokens: int) -> float:
    """tok/s of one ``specd generate --json`` run."""
    cmd = [sys.executable, "-m", "specd_tools.cli", "generate", "--json", "--max-new-tokens",
           str(max_new_tokens), "--threads", str(threads), PROMPT]
    if in_process:
        cmd.append("--in-process")
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=1800)
    return json.loads(out.stdout)["tokens_per_second"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2, help="rounds of every cell")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per run")
    parser.add_argument("--no-service", action="store_true",
                        help="time --in-process only (no embedded service)")
    args = parser.parse_args()
    modes = ("in-process",) if args.no_service else ("in-process", "service")
    rates: dict[tuple[str, int, str], list[float]] = {}
    for rep in range(args.repeats):
        for load in ("quiet", "busy"):
            burner = (subprocess.Popen([sys.executable, "-c", "while True: pass"])
                      if load == "busy" else None)
            try:
                for mode in modes:
                    for threads in (1, 2):
                        rate = run(threads, mode == "in-process", args.max_new_tokens)
                        rates.setdefault((mode, threads, load), []).append(rate)
                        print(f"round {rep} {load:5s} {mode:10s} threads={threads} "
                              f"{rate:6.2f} tok/s  loadavg {os.getloadavg()[0]:.1f}",
                              flush=True)
            finally:
                if burner is not None:
                    burner.kill()
                    burner.wait()
    print("\n| path | threads | no load of ours, tok/s | beside one busy process, tok/s |")
    print("|---|---:|---|---|")
    for mode in modes:
        for threads in (1, 2):
            cells = [", ".join(f"{r:.1f}" for r in rates[(mode, threads, load)])
                     for load in ("quiet", "busy")]
            print(f"| {mode} | {threads} | {cells[0]} | {cells[1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

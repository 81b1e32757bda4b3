"""Times SmolLM2 target forwards (1, 2 and 4 new tokens after 300 cached, 2 torch threads)
run on the thread that loaded the model against another thread: why a target actor runs
every torch call on one `target_worker.actor.ComputeThread`.

    python scripts/forward_thread.py main             # load and forward on the main thread
    python scripts/forward_thread.py compute-thread   # both on one other thread
    python scripts/forward_thread.py other-thread     # load on main, forward on another

MODEL (``--model``, default ``/tmp/smollm2-hf``) is any `load_decoder` source. Run each mode
in its own process (the effect depends on which thread first ran parallel work), on a quiet
machine, with ``OMP_NUM_THREADS=1`` as Ray's actors have it.
"""

import argparse
from concurrent.futures import ThreadPoolExecutor

import torch
from linear_paths import median_ms  # this folder's sibling script (run as a script)

from target_worker.engine import TargetEngine
from target_worker.loader import load_decoder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("main", "compute-thread", "other-thread"))
    parser.add_argument("--model", default="/tmp/smollm2-hf")
    args = parser.parse_args()
    other = ThreadPoolExecutor(1)

    def load():
        torch.set_num_threads(2)
        decoder = load_decoder(args.model)
        TargetEngine(decoder, max_slots=1)  # packs the weights, as the actor does
        return decoder

    decoder = other.submit(load).result() if args.mode == "compute-thread" else load()
    on = (lambda fn: fn()) if args.mode == "main" else (lambda fn: other.submit(fn).result())
    times = []
    for rows in (1, 2, 4):
        cache = decoder.new_cache(1024)

        def prefill(cache=cache):
            with torch.inference_mode():
                decoder.forward_batch(list(range(100, 400)), 0, cache)

        def step(cache=cache, rows=rows):
            with torch.inference_mode():
                torch.set_num_threads(2)
                cache.truncate(300)
                decoder.forward_batch(list(range(500, 500 + rows)), 300, cache)

        on(prefill)
        times.append((rows, round(median_ms(lambda step=step: on(step), calls=15), 1)))
    print(args.mode, "ms per forward by new tokens:", times)


if __name__ == "__main__":
    main()

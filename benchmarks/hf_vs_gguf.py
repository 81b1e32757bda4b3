"""Load time and greedy tok/s of one model from its GGUF file vs from a Hugging Face directory.

``--convert DIR`` first writes DIR from the GGUF with transformers' own GGUF reader
(``AutoModelForCausalLM.from_pretrained(..., gguf_file=...)``, weights copied into a plain model
and ``save_pretrained``, float32;
needs the ``bench`` extra for accelerate) and the GGUF's tokenizer with its chat template.
Then rounds alternate the two sources (the machine may be shared: both see the same load):
each load runs in a fresh subprocess (``load_model``, imports excluded; the GGUF path with
its float32 weights cache warm, as every load after the first), and each decode is an
in-process greedy generation (plain and prompt lookup) on the code-edit prompt. Prints the
medians, the HF/GGUF ratios, the raw per-round figures (odd rounds run the sources in the
other order) and whether both produced the same tokens.

    python benchmarks/hf_vs_gguf.py --convert /tmp/smollm2-hf --rounds 3 --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

_LOAD = ("import sys, time, torch; torch.set_num_threads({threads}); "
         "from target_worker.loader import load_model; t = time.perf_counter(); "
         "load_model(sys.argv[1] if sys.argv[1] != 'default' else None); "
         "print(time.perf_counter() - t)")


def convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from target_worker.loader import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=torch.float32)
    # transformers refuses to save a model it loaded from GGUF ("quantized with gguf"): copy
    # the (already dequantized, un-permuted) weights into a plain model of the same config.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(out)
    load_tokenizer(gguf).save_pretrained(out)


def load_seconds(source: str, threads: int) -> float:
    proc = subprocess.run([sys.executable, "-c", _LOAD.format(threads=threads), source],
                          capture_output=True, text=True, check=True)
    return float(proc.stdout.strip().splitlines()[-1])


def decode(decoder, prompt: list[int], tokens: int, lookup: bool) -> tuple[float, list[int]]:
    from coordinator.step.speculative import speculative_decode_with
    from drafter_worker.prompt_lookup import PromptLookupSpeculator
    from drafter_worker.registry import DEFAULT_NGRAM_SIZE, LOOKUP_DRAFT_LEN
    from specd_core.request import SpeculativeOptions

    drafter = PromptLookupSpeculator(DEFAULT_NGRAM_SIZE, LOOKUP_DRAFT_LEN) if lookup else None
    t = time.perf_counter()
    result = speculative_decode_with(decoder, prompt, decoder.new_cache(), drafter,
                                     SpeculativeOptions(max_new_tokens=tokens))
    return len(result.generated_tokens) / (time.perf_counter() - t), result.generated_tokens


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", default=None, help="GGUF file (default: the SmolLM2 default model)")
    p.add_argument("--hf-dir", type=Path, default=None, help="an existing HF directory")
    p.add_argument("--convert", type=Path, default=None, metavar="DIR",
                   help="write the HF directory from the GGUF first (then use it)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    args = p.parse_args(argv)

    import torch

    from specd_tools.workloads import encode_workload_prompt, load_workload
    from target_worker.fetch import default_model_path
    from target_worker.loader import load_model

    torch.set_num_threads(args.threads)
    gguf = Path(args.gguf) if args.gguf else default_model_path()
    hf_dir = args.convert or args.hf_dir
    if hf_dir is None:
        p.error("give --hf-dir or --convert")
    if args.convert:
        t = time.perf_counter()
        convert(gguf, args.convert)
        print(f"converted {gguf.name} -> {args.convert} in {time.perf_counter() - t:.1f} s",
              file=sys.stderr)
    sources = {"gguf": str(gguf), "hf": str(hf_dir)}
    load_model(sources["gguf"])  # warm the GGUF weights cache (a first-ever load converts)
    models = {k: load_model(v) for k, v in sources.items()}
    tokenizer = models["gguf"][1]
    prompt = encode_workload_prompt(tokenizer, load_workload("code_edit").prompts[0])
    loads = {k: [] for k in sources}
    speed = {(k, m): [] for k in sources for m in ("plain", "lookup")}
    outputs = {}
    for r in range(args.rounds):
        order = list(sources) if r % 2 == 0 else list(reversed(sources))  # no order bias
        for k in order:
            loads[k].append(load_seconds(sources[k], args.threads))
        for mode in ("plain", "lookup"):
            for k in order:
                tps, toks = decode(models[k][0], prompt, args.tokens, mode == "lookup")
                speed[(k, mode)].append(tps)
                outputs[(k, mode)] = toks
    med = statistics.median
    report = {
        "load_s": {k: round(med(v), 3) for k, v in loads.items()},
        "load_ratio_hf_over_gguf": round(med(loads["hf"]) / med(loads["gguf"]), 3),
        "tok_s": {f"{k}/{m}": round(med(v), 2) for (k, m), v in speed.items()},
        "tok_s_ratio_hf_over_gguf": {
            m: round(med(speed[("hf", m)]) / med(speed[("gguf", m)]), 3)
            for m in ("plain", "lookup")},
        # Per round (the two sources back to back, so under the same load), then the median.
        "tok_s_paired_ratio_median": {
            m: round(med(h / g for h, g in zip(speed[("hf", m)], speed[("gguf", m)],
                                               strict=True)), 3)
            for m in ("plain", "lookup")},
        "load_paired_ratio_median": round(
            med(h / g for h, g in zip(loads["hf"], loads["gguf"], strict=True)), 3),
        "raw": {"load_s": loads, "tok_s": {f"{k}/{m}": [round(x, 2) for x in v]
                                           for (k, m), v in speed.items()}},
        "same_tokens": all(outputs[("hf", m)] == outputs[("gguf", m)]
                           for m in ("plain", "lookup")),
        "prompt_tokens": len(prompt), "new_tokens": args.tokens, "rounds": args.rounds,
        "threads": args.threads,
    }
    print(json.dumps(report, indent=2))
    return 0 if report["same_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())

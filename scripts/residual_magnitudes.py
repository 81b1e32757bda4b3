"""How large the target's residual streams are, and what a 16-bit wire keeps of them: the
rows a hidden-conditioned drafter gets (`Decoder.set_capture_layers`, EAGLE-3's layers
``(2, N // 2, N - 3)`` by default) next to the final-norm rows EAGLE-1 gets.

    python scripts/residual_magnitudes.py                    # SmolLM2, float32
    python scripts/residual_magnitudes.py --layers 2 15 27 --threads 1

Per layer (and ``norm``: the final-norm rows) over every position of a few prompts: the
largest |value|, the 99.99th percentile of |value|, the share of values float16 stores as
subnormals (|x| < 2**-14, where it keeps fewer than 11 significant bits), and the relative
error ``||x - x16|| / ||x||`` after a round trip through float16 and through bfloat16 (the
two 16-bit dtypes the drafter wire carries), and the largest relative error of one row.
Then the same at position 0 (the attention sink, where the largest values live) over random
one-token prompts, and what the drafter wire carries for 1 and ``len(layers)`` layers
(measured on the messages the coordinator's client builds).

Measured 2026-12 on SmolLM2-135M (float32, 30 layers, hidden 576), layers 2 / 15 / 27: max
|x| 290 / 27,312 / 27,212 over 233 positions of 5 prompts (final-norm rows: 50); without
each prompt's first position 227 / 137 / 443. Position 0 over 300 random first tokens: up to
355 / 27,998 / 27,897 (float16's largest finite value is 65,504: 2.3x headroom). float16's
round trip: relative error 1.7e-4 - 2.1e-4 per layer (worst row 3.8e-4), bfloat16's 1.6e-3 -
1.8e-3 (8x more); values float16 keeps only as subnormals: 0.01%. Wire: 1152 B of float16
per committed row and layer, a 4-position step 4,641 B (1 layer) / 13,857 B (3 layers), an
8192-position resend 9.4 / 28.3 MB.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from target_worker import loader  # noqa: E402

PROMPTS = (
    "The quick brown fox jumps over the lazy dog. " * 4,
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
    "fibonacci(n - 2)\n\nprint([fibonacci(i) for i in range(20)])\n",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n<|im_start|>user\nExplain in three sentences why the sky is blue."
    "<|im_end|>\n<|im_start|>assistant\n",
    "Paris is the capital of France. Berlin is the capital of Germany. Madrid is the "
    "capital of Spain. Rome is the capital of",
    "1, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 987, 1597, 2584",
)


def rows_for(decoder, tokens: list[int], layers: tuple[int, ...]) -> torch.Tensor:
    decoder.set_capture_layers(layers)
    try:
        _, hidden = decoder.forward_batch_with_hidden(tokens, 0, decoder.new_cache(),
                                                      last_logits_only=True)
    finally:
        decoder.set_capture_layers(())
    return hidden


def report(name: str, x: torch.Tensor) -> None:
    a = x.abs()
    tiny = torch.finfo(torch.float16).tiny  # 2**-14: float16's smallest normal number
    nonzero = a > 0
    sub = ((a < tiny) & nonzero).float().mean().item()
    norm = x.norm().item()

    def err(dtype: torch.dtype) -> tuple[float, float]:
        back = x.to(dtype).float()
        per_row = (x - back).norm(dim=1) / x.norm(dim=1).clamp_min(1e-30)
        return (x - back).norm().item() / norm, per_row.max().item()

    e16, r16 = err(torch.float16)
    eb, rb = err(torch.bfloat16)
    q = torch.quantile(a.flatten()[:: max(1, a.numel() // 4_000_000)], 0.9999).item()
    print(f"{name:>6}  max|x| {a.max().item():9.2f}  p99.99 {q:8.2f}  rms "
          f"{x.pow(2).mean().sqrt().item():7.3f}  fp16 subnormal {100 * sub:5.2f}%  "
          f"rel.err fp16 {e16:.2e} (worst row {r16:.2e})  bf16 {eb:.2e} (worst row {rb:.2e})"
          f"  fp16 overflow: {bool((a > torch.finfo(torch.float16).max).any())}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default SmolLM2)")
    p.add_argument("--layers", type=int, nargs="+", default=None,
                   help="capture layers (default: EAGLE-3's 2, N // 2, N - 3)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--first-tokens", type=int, default=300,
                   help="also the largest |value| at position 0 over this many random "
                        "one-token prompts (the attention sink; 0: skip)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    decoder, tokenizer = loader.load_model(args.model, "float32")
    n = decoder.config.n_layers
    layers = tuple(args.layers) if args.layers else (2, n // 2, n - 3)
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    print(f"{len(prompts)} prompts, {sum(map(len, prompts))} positions; n_layers {n}, "
          f"hidden {decoder.config.hidden_size}")
    with torch.inference_mode():
        norm = torch.cat([rows_for(decoder, t, ()) for t in prompts])
        streams = torch.cat([rows_for(decoder, t, layers) for t in prompts])
    h = decoder.config.hidden_size
    for i, layer in enumerate(layers):
        report(f"L{layer}", streams[:, i * h:(i + 1) * h])
    report("norm", norm)
    # Without each prompt's first position (its attention sink: a few dimensions hold
    # values ~100x the others'), the magnitudes of ordinary positions.
    rest = torch.cat([rows_for(decoder, t, layers)[1:] for t in prompts])
    for i, layer in enumerate(layers):
        report(f"L{layer}*", rest[:, i * h:(i + 1) * h])
    print("(* without each prompt's first position)")
    if args.first_tokens:
        gen = torch.Generator().manual_seed(0)
        firsts = torch.randint(0, decoder.config.vocab_size, (args.first_tokens,),
                               generator=gen).tolist()
        with torch.inference_mode():
            peaks = torch.stack([rows_for(decoder, [t], layers).abs().reshape(
                len(layers), h).amax(1) for t in firsts])
        for i, layer in enumerate(layers):
            print(f"L{layer} at position 0 over {len(firsts)} random first tokens: max|x| "
                  f"{peaks[:, i].min():.0f} to {peaks[:, i].max():.0f} (median "
                  f"{peaks[:, i].median():.0f}); float16 holds up to "
                  f"{torch.finfo(torch.float16).max:.0f}")
    wire_bytes(h, (1, len(layers)), decoder.config.max_seq_len)
    return 0


def wire_bytes(h: int, layer_counts, context: int) -> None:
    """What a drafter worker is sent, measured on the messages the coordinator's client
    builds (float16 rows): a decode step committing 4 positions, and a resend of a whole
    ``context``-token history, per layer count."""
    from drafter_worker.client import DrafterClient, ProposeJob

    client = DrafterClient("127.0.0.1:1", hidden_dtype="float16")
    for k in layer_counts:
        history = [1] * 40
        log = torch.zeros(len(history) - 1, k * h)
        client._known["r"] = len(history) - 4  # the worker holds all but this step's
        step = sum(i.ByteSize() for i in client._items(ProposeJob("r", history, 4,
                                                                  hidden_log=log)))
        client._known.clear()
        bare = client._items(ProposeJob("r", history[:1], 4, hidden_log=log[:0]))[0]
        long_log = torch.zeros(context - 1, k * h)
        resend = client._pack(client._items(ProposeJob("r", [1] * context, 4,
                                                       hidden_log=long_log)))
        print(f"drafter wire, {k} layer(s): {2 * k * h} B of float16 per committed row; a "
              f"step committing 4 positions {step} B (an item without rows {bare.ByteSize()}"
              f" B); a {context}-position resend {sum(r.ByteSize() for r in resend) / 1e6:.1f}"
              f" MB in {len(resend)} request(s)")


if __name__ == "__main__":
    raise SystemExit(main())

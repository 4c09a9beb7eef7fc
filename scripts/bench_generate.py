"""Time titanlike-generate's KV-cached decoding on a preset (random weights): prints a table.

    python scripts/bench_generate.py --flavor 124m,1b --new-tokens 256 [--device cuda] [--prompt-tokens 32]

The weights are the deterministic init (no checkpoint needed); the decoding work per token is the same
as with trained weights. Greedy, so every run decodes exactly --new-tokens tokens (no EOS stop).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from titanlike.hf.generate import generate  # noqa: E402
from titanlike.model.decoder import Transformer
from titanlike.model.shape import model_args  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="124m,1b")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"{name} | torch {torch.__version__} | {dtype} | prompt {a.prompt_tokens}, greedy, {a.new_tokens} new tokens")
    print(f"{'flavor':>8} | {'params':>8} | {'seconds':>8} | {'tok/s':>8}")
    for flavor in a.flavor.split(","):
        args = model_args(flavor)
        with torch.device("meta"):
            model = Transformer(args)
        model.to_empty(device=device)
        model.init_weights(0, a.prompt_tokens + a.new_tokens)
        model = model.to(dtype).eval()
        seeded = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, args.vocab_size, (a.prompt_tokens,), generator=seeded).tolist()
        generate(model, prompt, 8)  # warm-up: kernels, allocator
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = generate(model, prompt, a.new_tokens)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        params = sum(p.numel() for p in model.parameters())
        print(f"{flavor:>8} | {params / 1e6:>7.0f}M | {seconds:>8.2f} | {len(out) / seconds:>8.1f}")
        del model


if __name__ == "__main__":
    main()

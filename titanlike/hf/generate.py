"""titanlike-generate: sample text from a checkpoint step folder or an exported Hugging Face folder.

    titanlike-generate outputs/debug/checkpoint/step-150 --prompt "def main(" [--max-new-tokens 256]
        [--temperature 0.8] [--top-k 50] [--seed 0] [--device auto|cpu|cuda] [--tokenizer ...]

Temperature 0 is greedy (the most likely token each time). The prompt is encoded with the model's
own tokenizer (the run's, or the export's tokenizer.json) and starts with the tokenizer's BOS, or
else with its EOS, as every training document did. Generation stops at EOS or after
--max-new-tokens. Keys and values of past positions are cached, so each new token costs one
position's forward, not the whole sequence's. A step folder is read as the trusted output of this
run's own training (titanlike-export's checks); an exported folder through config.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from titanlike import fs
from titanlike.errors import ArgumentParser, Stopped, UserError, error_exit, say_error, stopped_exit, stops_unwind
from titanlike.model.decoder import Transformer

# --temperature: logits divided by it must stay finite float32 numbers (1e-320 made them inf, 1e308 made the
# masked ones NaN). Well inside both ends sampling is already greedy, or uniform, in effect.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-4, 1e4


class KVCache:
    """Keys and values of every layer for the positions seen so far: (batch, kv heads, max_len, head_dim)."""

    def __init__(self, model: Transformer, batch: int, max_len: int, device, dtype):
        a = model.args
        shape = (batch, a.n_kv_heads, max_len, a.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(a.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(a.n_layers)]
        self.length = 0


def _blocks_over_cache(model: Transformer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                       positions: torch.Tensor, visible_len: int, mask: torch.Tensor | None,
                       causal: bool = False) -> torch.Tensor:
    """The blocks of Transformer.forward for new hidden states h (batch, new, dim) at `positions`:
    each layer writes its keys and values there, then attends to the first `visible_len` cached
    positions under `mask` (new × visible_len, True = may attend; None = all), or causally
    (`causal`: the new positions are all there is, and no mask is built)."""
    for i, layer in enumerate(model.blocks()):
        attn = layer.attention
        q, k, v = attn.project(layer.attention_norm(h), cos, sin)
        cache.k[i].index_copy_(2, positions, k.transpose(1, 2))
        cache.v[i].index_copy_(2, positions, v.transpose(1, 2))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), cache.k[i][:, :, :visible_len],
                                             cache.v[i][:, :, :visible_len], attn_mask=mask, is_causal=causal,
                                             enable_gqa=attn.n_kv_heads != attn.n_heads)
        h = h + attn.wo(out.transpose(1, 2).reshape(h.shape[0], h.shape[1], -1))
        h = h + layer.feed_forward(layer.ffn_norm(h))
    return h


@torch.no_grad()
def forward_cached(model: Transformer, tokens: torch.Tensor, cache: KVCache, last_only: bool = False) -> torch.Tensor:
    """Logits of `tokens` (batch, new) at positions cache.length onwards, extending the cache; with
    `last_only`, of the last one alone (batch, 1, vocab): a long prompt's logits would be prompt × vocabulary.

    The same modules as Transformer.forward, attending to the cached keys and values as well.
    """
    start, new = cache.length, tokens.shape[1]
    end = start + new
    cos, sin = model.rope_cos[start:end], model.rope_sin[start:end]
    # New position j may see cached positions and new ones up to itself: causal within the new
    # block, everything before it. With one new token (decoding) that is no mask at all; into an empty
    # cache (a prompt) it is is_causal, no mask either: memory grows with the prompt, not its square.
    mask = (torch.ones(new, end, dtype=torch.bool, device=tokens.device).tril(diagonal=start)
            if new > 1 and start > 0 else None)
    positions = torch.arange(start, end, device=tokens.device)
    h = _blocks_over_cache(model, model.tok_embeddings(tokens), cos, sin, cache, positions, end, mask,
                           causal=new > 1 and start == 0)
    cache.length = end
    return model.output(model.norm(h[:, -1:] if last_only else h))


def sample(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator | None) -> torch.Tensor:
    """Next token ids (batch,) from last-position logits (batch, vocab)."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def decode_step(model: Transformer, token: torch.Tensor, pos: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Last-position logits (batch, vocab) of one new token (batch, 1) at position `pos` (a 1-element
    tensor), extending the cache. Unlike forward_cached, every shape is the same at every position:
    attention reads the whole cache with the positions after `pos` masked, so one CUDA graph of this
    function serves the whole generation (CudaGraphDecoder)."""
    cos, sin = model.rope_cos.index_select(0, pos), model.rope_sin.index_select(0, pos)
    max_len = cache.k[0].shape[2]
    visible = (torch.arange(max_len, device=pos.device) <= pos).view(1, -1)  # (new, cached)
    h = _blocks_over_cache(model, model.tok_embeddings(token), cos, sin, cache, pos, max_len, visible)
    return model.output(model.norm(h))[:, -1]


class CudaGraphDecoder:
    """decode_step captured once as a CUDA graph and replayed for every new token.

    Eager decoding launches each layer's dozens of small kernels from Python, and on a GPU that,
    not reading the weights, bounds a token's time whatever the model's size; a replay launches
    them all at once (measured before and after: docs/benchmarks/2026-11-23-one-gpu-generate-cuda-graph-resume-1b.md).
    """

    def __init__(self, model: Transformer, cache: KVCache):
        device = cache.k[0].device
        self.token = torch.zeros((1, 1), dtype=torch.long, device=device)
        # Warm up (lazy initialisation must not happen during capture) at the last position: it is
        # masked until generation reaches it, and overwritten then.
        self.pos = torch.full((1,), cache.k[0].shape[2] - 1, dtype=torch.long, device=device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            decode_step(model, self.token, self.pos, cache)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = decode_step(model, self.token, self.pos, cache)

    def __call__(self, token: int, pos: int) -> torch.Tensor:
        self.token.fill_(token)
        self.pos.fill_(pos)
        self.graph.replay()
        return self.logits


@torch.no_grad()
def generate(model: Transformer, prompt: list[int], max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
             eos_id: int | None = None, generator: torch.Generator | None = None,
             vocab_limit: int | None = None, static: bool | None = None) -> list[int]:
    """The new token ids after `prompt`, with a KV cache. vocab_limit masks padding rows of the
    vocabulary (ids the tokenizer does not have). The prompt goes through forward_cached in one
    piece; each new token through decode_step: replayed as a CUDA graph on a GPU (static unset or
    true), eager on a CPU with static true, else forward_cached (a CPU's default: no masked work)."""
    device = model.tok_embeddings.weight.device
    total = len(prompt) + max_new_tokens
    if model.rope_cos.shape[0] < total:
        model.init_rope(total)
    cache = KVCache(model, 1, total, device, model.tok_embeddings.weight.dtype)
    logits = forward_cached(model, torch.tensor([prompt], device=device), cache, last_only=True)[:, -1]
    if static is None:
        static = device.type == "cuda"
    step: Callable[[int, int], torch.Tensor]
    if static and device.type == "cuda" and max_new_tokens > 1:
        step = CudaGraphDecoder(model, cache)
    elif static:
        def step(token: int, pos: int) -> torch.Tensor:
            return decode_step(model, torch.tensor([[token]], device=device), torch.tensor([pos], device=device), cache)
    else:
        def step(token: int, pos: int) -> torch.Tensor:
            return forward_cached(model, torch.tensor([[token]], device=device), cache)[:, -1]
    out: list[int] = []
    for _ in range(max_new_tokens):
        if vocab_limit is not None and vocab_limit < logits.shape[-1]:
            logits[:, vocab_limit:] = float("-inf")
        token = int(sample(logits, temperature, top_k, generator)[0])
        out.append(token)
        if token == eos_id or len(out) == max_new_tokens:
            break
        logits = step(token, len(prompt) + len(out) - 1)
    return out


# ---- loading a model and its tokenizer -------------------------------------------------------------


def load(source: str, tokenizer: str, device: torch.device, trust_pickled_dcp: bool = False):
    """(model in eval mode on `device`, tokenizer) from a checkpoint step folder or a Hugging Face folder."""
    from titanlike.checkpoint.weights import is_dcp_folder, read_model_weights
    from titanlike.config.resolve import read_hf_config
    from titanlike.data.tokenizer import load_tokenizer, tokenizer_from_folder
    from titanlike.hf.export import first_nonfinite, run_tokenizer, tokenizer_fits, trained_window_of
    from titanlike.hf.interchange import read_hf_folder

    if not os.path.isdir(source):
        raise UserError(f"{source}: {fs.not_a_folder(source)} (give a checkpoint step folder or an exported folder)")
    if os.path.isfile(os.path.join(source, "config.json")) and not is_dcp_folder(source):
        margs = read_hf_config(source)
        state = read_hf_folder(source, margs)
        own = None
        if os.path.isfile(os.path.join(source, "tokenizer.json")):
            try:
                own = tokenizer_from_folder(source)
            except UserError:
                if not tokenizer:  # unreadable, and nothing given instead
                    raise
        if not tokenizer and own is None:
            raise UserError(f"{source} has no tokenizer.json; name one with --tokenizer")
        tok = load_tokenizer(tokenizer) if tokenizer else own
        tokenizer_fits(tok, margs.vocab_size, own, os.path.join(source, "tokenizer.json"))  # as export checks it
    else:
        margs, state = read_model_weights(source, trust_pickled_dcp, flag="--trust-pickled-dcp")
        tok = run_tokenizer(source, tokenizer, margs.vocab_size)
        # The context is the longest window the weights trained on, as the export writes it: RoPE positions
        # past it were never trained, and what comes out there is noise.
        margs = dataclasses.replace(margs, max_seq_len=min(margs.max_seq_len, trained_window_of(source) or 2**63))
    bad = first_nonfinite(state)  # NaN weights would generate garbage (or the first id) silently
    if bad:
        raise UserError(f"{source}: the weights hold non-finite values (NaN or inf): {bad}; they come from a run "
                        f"that diverged or a damaged file: use another checkpoint")
    with torch.device("meta"):
        model = Transformer(margs)
    model.to_empty(device="cpu")
    model.load_state_dict(state, strict=False, assign=False)
    if margs.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = model.to(device=device, dtype=dtype).eval()
    model.init_rope(min(margs.max_seq_len, 4096))
    return model, tok


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="titanlike-generate", description=__doc__.split("\n\n")[0],
                                epilog="\n\n".join(__doc__.split("\n\n")[2:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="a checkpoint step folder or an exported Hugging Face folder")
    p.add_argument("--prompt", default="", help="text to continue (default: none, start a new document)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens; 0 = all (default 50)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the sampling (default 0)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto = CUDA when available")
    p.add_argument("--tokenizer", default="", help="a tokenizer.json (or 'byte') instead of the model's own")
    p.add_argument("--trust-pickled-dcp", action="store_true",
                   help="read a checkpoint that titanlike did not write on this account: its .metadata is a "
                        "Python pickle, and loading it can run any code its author put there")
    a = p.parse_args(argv)
    if not a.source:
        p.error("the source is empty: give a checkpoint step folder or an exported folder")
    for name in ("max_new_tokens", "top_k"):
        if getattr(a, name) < 0:
            p.error(f"--{name.replace('_', '-')} {getattr(a, name)} must be >= 0")
    if not 0 <= a.seed < 2**63:
        p.error(f"--seed {a.seed} must be in [0, 2^63)")
    if not (a.temperature == 0 or MIN_TEMPERATURE <= a.temperature <= MAX_TEMPERATURE):
        p.error(f"--temperature {a.temperature:g} must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, "
                f"{MAX_TEMPERATURE:g}]: past those the logits divided by it overflow (or all become 0), and the "
                f"probabilities are not numbers")
    try:
        a.prompt.encode("utf-8")
    except UnicodeEncodeError:
        p.error("--prompt is not valid UTF-8 text")
    if a.device == "cuda" and not torch.cuda.is_available():
        say_error("error: --device cuda: no CUDA GPU is available")
        return 2
    device = torch.device("cuda" if a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available()) else "cpu")
    try:
        with stops_unwind():  # Ctrl-C, SIGTERM or SIGHUP while it loads or samples: one line, not a traceback
            return write_continuation(a, device)
    except UserError as e:
        return error_exit(e)
    except (KeyboardInterrupt, Stopped) as e:
        return stopped_exit(e, "nothing more was printed")


def write_continuation(a: argparse.Namespace, device: torch.device) -> int:
    """The text `a` asks for, from its source on `device`, on stdout; the speed on stderr."""
    model, tok = load(a.source, a.tokenizer, device, a.trust_pickled_dcp)
    prompt = ([tok.bos_id] if tok.bos_id is not None else [tok.eos_id]) + (
        [int(i) for i in tok.encode_batch([a.prompt])[0]] if a.prompt else [])
    room = model.args.max_seq_len - len(prompt)
    if a.max_new_tokens > room:
        raise UserError(f"--max-new-tokens {a.max_new_tokens}: the model's context is {model.args.max_seq_len} "
                        f"tokens and the prompt takes {len(prompt)}; ask for {max(room, 0)} or fewer")
    gen = torch.Generator(device=device).manual_seed(a.seed)
    t0 = time.perf_counter()
    new = generate(model, prompt, a.max_new_tokens, a.temperature, a.top_k, tok.eos_id, gen, vocab_limit=tok.vocab_size)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    text = tok.decode([i for i in new if i != tok.eos_id])
    sys.stdout.write(a.prompt + text + "\n")
    print(f"{len(new)} new tokens in {seconds:.2f}s ({len(new) / max(seconds, 1e-9):,.1f} tok/s) on {device.type}",
          file=sys.stderr)
    if model.args.attn_mask == "block_causal":
        print("the model trained with attention within each document (model.attn_mask = block_causal): the prompt "
              "and its continuation are read as one document", file=sys.stderr)
    return 0


def cli() -> None:
    """The `titanlike-generate` console script: same as `python -m titanlike.hf.generate`."""
    sys.exit(main())


if __name__ == "__main__":
    cli()

"""model.attn_mask = block_causal: attention within each document of a window (titanlike/model/masks.py),
refused where the data records no end-of-document id, and named in what leaves the run."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from conftest import metrics, train_here
from titanlike.config import ConfigError, load_config
from titanlike.data.prepare.driver import prepare
from titanlike.data.shards import write_shard
from titanlike.model.decoder import Transformer
from titanlike.model.masks import (
    BLOCK_SIZE,
    KERNEL_OPTIONS,
    document_ids,
    document_mask,
    kernel_options,
    masked_attention,
)
from titanlike.model.shape import model_args
from titanlike.preflight import check

END = 257
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def small_model(attn_mask: str, document_end: int | None = END) -> Transformer:
    args = dataclasses.replace(model_args("debug", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128),
                               attn_mask=attn_mask)
    model = Transformer(args, document_end=document_end)
    model.init_weights(seed=3, seq_len=64)
    return model.eval()


def test_document_ids_count_the_ends_before_each_token():
    tokens = torch.tensor([[5, 6, END, 7, END, END, 8]])
    assert document_ids(tokens, END).tolist() == [[0, 0, 0, 1, 1, 2, 3]]


@pytest.mark.parametrize("flex", [False, True])
def test_a_documents_logits_do_not_depend_on_what_precedes_it(flex):
    """The same document after another one or alone in the window: the same logits (RoPE is relative,
    and the mask hides the first document)."""
    model = small_model("block_causal")
    model.hooks.flex_attention = flex  # flex attention runs forward-only on a CPU: enough for this check
    gen = torch.Generator().manual_seed(0)
    first = torch.cat([torch.randint(0, 256, (1, 20), generator=gen), torch.tensor([[END]])], dim=1)
    doc = torch.randint(0, 256, (1, 30), generator=gen)
    with torch.no_grad():
        alone = model(doc)
        after = model(torch.cat([first, doc], dim=1))[:, first.shape[1]:]
        causal = small_model("causal")(torch.cat([first, doc], dim=1))[:, first.shape[1]:]
    torch.testing.assert_close(after, alone, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(causal, alone, rtol=1e-3, atol=1e-3)  # plain causal attention sees the first


def test_flex_and_dense_masks_agree_and_causal_is_untouched():
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    tokens[0, [5, 17, 30]] = END
    tokens[1, 40] = END
    model = small_model("block_causal")
    with torch.no_grad():
        dense = model(tokens)
        model.hooks.flex_attention = True
        flex = model(tokens)
        plain = small_model("causal")(tokens)
        without_end = small_model("block_causal", document_end=None)(tokens)  # inference: one document
    torch.testing.assert_close(flex, dense, rtol=1e-4, atol=1e-4)
    assert torch.equal(plain, without_end)
    assert document_mask(tokens, END).shape == (2, 1, 48, 48)


def windows(seq: int, layout: str, seed: int) -> torch.Tensor:
    """Three windows of `seq` random tokens cut into documents of 1 to 600 tokens, the middle one
    laid out by `layout`: random like the others, no end id at all, ends at its first and last
    positions, or ends on both sides of block boundaries."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (3, seq), generator=gen)
    for row in range(3):
        if row == 1 and layout != "random":
            continue
        ends = torch.randint(1, 601, (seq,), generator=gen).cumsum(0) - 1 - torch.randint(0, 600, (), generator=gen)
        tokens[row, ends[(ends >= 0) & (ends < seq)]] = END
    if layout == "edges":
        tokens[1, [0, seq // 2, seq - 1]] = END
    elif layout == "boundaries":
        tokens[1, [BLOCK_SIZE - 1, BLOCK_SIZE, 3 * BLOCK_SIZE - 1, 3 * BLOCK_SIZE + 1]] = END
    return tokens


def listed_blocks(num: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """(batch, heads, rows, columns) bool, the blocks a BlockMask's counts and index lists name, whose
    listed blocks come first, ascending."""
    listed = torch.arange(indices.shape[-1]) < num[..., None]
    ascending = torch.where(listed[..., 1:], indices[..., 1:] > indices[..., :-1], True)
    assert ascending.all()
    dense = torch.zeros(*indices.shape[:-1], indices.shape[-1] + 1, dtype=torch.bool)
    return dense.scatter_(-1, torch.where(listed, indices, indices.shape[-1]).long(), True)[..., :-1]


def assert_flex_equals_sdpa(mask, dense: torch.Tensor, seq: int) -> None:
    """Eager flex attention under `mask` gives SDPA's outputs under the dense mask (3 rows, 2 heads)."""
    from torch.nn.attention.flex_attention import flex_attention

    gen = torch.Generator().manual_seed(seq)
    q, k, v = (torch.randn(3, 2, seq, 16, generator=gen) for _ in range(3))
    with torch.no_grad():
        torch.testing.assert_close(flex_attention(q, k, v, block_mask=mask),
                                   torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seq", [512, 1024])
@pytest.mark.parametrize("layout", ["random", "no_end", "edges", "boundaries"])
def test_blocks_built_from_document_ranges_match_the_mask_evaluated_on_every_pair(seq, layout):
    """The BlockMask built from each block's document-id range: the same partial and full blocks as
    create_block_mask's (key blocks by query block, and query blocks by key block for the backward),
    what a kernel reads of it (full blocks, partial ones under the mask_mod) is the dense mask, and
    flex attention under it gives SDPA's outputs under the dense mask."""
    from torch.nn.attention.flex_attention import create_block_mask, create_mask

    tokens = windows(seq, layout, seed=seq + len(layout))
    mask = document_mask(tokens, END, flex=True)
    dense = document_mask(tokens, END, flex=False)
    reference = create_block_mask(mask.mask_mod, 3, None, seq, seq, device="cpu")
    blocks = {}
    for side in ["kv", "full_kv", "q", "full_q"]:
        blocks[side] = listed_blocks(getattr(mask, f"{side}_num_blocks"), getattr(mask, f"{side}_indices"))
        assert torch.equal(blocks[side], listed_blocks(getattr(reference, f"{side}_num_blocks"),
                                                       getattr(reference, f"{side}_indices"))), side
    partial, full = blocks["kv"], blocks["full_kv"]
    assert mask.kv_indices.shape == (3, 1, seq // BLOCK_SIZE, seq // BLOCK_SIZE) and mask.shape == (3, 1, seq, seq)
    assert torch.equal(mask.to_dense(), reference.to_dense())
    if layout == "no_end":  # one document: the diagonal partial, every block below it full
        ones = torch.ones(seq // BLOCK_SIZE, seq // BLOCK_SIZE, dtype=torch.bool)
        assert torch.equal(partial[1, 0], ones.diag().diag()) and torch.equal(full[1, 0], ones.tril(-1))

    def tokens_of(blocks):
        return blocks.repeat_interleave(BLOCK_SIZE, dim=-2).repeat_interleave(BLOCK_SIZE, dim=-1)

    read = tokens_of(full) | (tokens_of(partial) & create_mask(mask.mask_mod, 3, 1, seq, seq, device="cpu"))
    assert torch.equal(read, dense)

    assert_flex_equals_sdpa(mask, dense, seq)


@pytest.mark.parametrize("seq", [48, 200])
def test_a_window_off_the_block_size_falls_back_to_the_mask_on_every_pair(seq):
    """A window whose length is no multiple of the block size: create_block_mask's BlockMask, right."""
    tokens = windows(seq, "edges", seed=seq)
    mask = document_mask(tokens, END, flex=True)
    dense = document_mask(tokens, END, flex=False)
    assert mask.shape == (3, 1, seq, seq)
    assert_flex_equals_sdpa(mask, dense, seq)


@pytest.mark.slow
def test_compiled_flex_attention_reads_the_blocks_built_from_document_ranges():
    """Eager flex attention applies the mask_mod everywhere; the compiled CPU kernel reads the block
    lists (skips empty blocks, runs full ones unmasked): under them too, SDPA's outputs under the dense mask."""
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, 1024, 16, generator=gen) for _ in range(3))
    for layout in ["random", "no_end", "edges", "boundaries"]:
        tokens = windows(1024, layout, seed=len(layout))
        with torch.no_grad():
            torch.testing.assert_close(compiled(q, k, v, block_mask=document_mask(tokens, END, flex=True)),
                                       torch.nn.functional.scaled_dot_product_attention(
                                           q, k, v, attn_mask=document_mask(tokens, END, flex=False)),
                                       rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_on_a_gpu_the_blocks_built_from_document_ranges_give_the_dense_masks_gradients():
    """The CUDA path: the same blocks as create_block_mask's, and compiled flex attention's outputs and
    gradients (whose pass reads the query-side blocks) those of SDPA under the dense mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    tokens = windows(1024, "random", seed=1).cuda()
    mask = document_mask(tokens, END)
    reference = create_block_mask(mask.mask_mod, 3, None, 1024, 1024, device="cuda")
    for side in ["kv", "full_kv", "q", "full_q"]:
        assert torch.equal(getattr(mask, f"{side}_num_blocks"), getattr(reference, f"{side}_num_blocks")), side
        assert torch.equal(getattr(mask, f"{side}_indices"), getattr(reference, f"{side}_indices")), side
    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs = [torch.randn(3, 4, 1024, 64, device="cuda", generator=gen, requires_grad=True) for _ in range(3)]
    grad = torch.randn(3, 4, 1024, 64, device="cuda", generator=gen)
    results = []
    for attn_mask in [mask, document_mask(tokens, END, flex=False)]:
        out = masked_attention(*inputs, attn_mask, gqa=False)
        results.append((out, *torch.autograd.grad(out, inputs, grad)))
    for flex, dense in zip(*results):
        torch.testing.assert_close(flex, dense, rtol=2e-3, atol=2e-3)


def test_kernel_options_are_torchs_defaults_off_the_measured_gpus():
    """The measured flex kernel options apply to bf16 on a CUDA device of a measured kind; a CPU
    tensor, or float32, keeps torch's defaults."""
    assert kernel_options(torch.zeros(1, 2, 128, 64, dtype=torch.bfloat16)) is None
    assert kernel_options(torch.zeros(1, 2, 128, 64)) is None
    assert all(isinstance(cap, tuple) and head_dim > 0 for cap, head_dim in KERNEL_OPTIONS)


@pytest.mark.gpu
def test_flex_kernel_options_keep_attention_as_accurate():
    """The measured flex kernel options (KERNEL_OPTIONS) change tiles, not results: at the 124m
    shape in bf16, flex attention with them is as close to float32 SDPA under the dense mask as flex
    with torch's defaults, outputs and gradients; on an H100 they are the ones in use."""
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import flex_attention

    tokens = torch.randint(0, 256, (4, 2048), generator=torch.Generator().manual_seed(0)).cuda()
    for row, ends in enumerate(([100, 1600], [900], [], [5, 6, 2000])):
        tokens[row, ends] = END
    block_mask, dense = document_mask(tokens, END, flex=True), document_mask(tokens, END, flex=False)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(4, h, 2048, 64, device="cuda", generator=gen).bfloat16() for h in (12, 3, 3))
    grad = torch.randn(4, 12, 2048, 64, device="cuda", generator=gen).bfloat16()
    if torch.cuda.get_device_capability() == (9, 0):
        assert kernel_options(q) == KERNEL_OPTIONS[((9, 0), 64)]

    def run(attend, q, k, v):
        out = attend(q, k, v)
        out.backward(grad.to(out.dtype))
        return [out.detach().float(), *(t.grad.float() for t in (q, k, v))]

    def leaves(dtype):
        return [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]

    reference = run(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True),
                    *leaves(torch.float32))
    defaults = torch.compile(flex_attention)
    with_torch_defaults = run(lambda q, k, v: defaults(q, k, v, block_mask=block_mask, enable_gqa=True),
                              *leaves(torch.bfloat16))
    with_options = run(lambda q, k, v: masked_attention(q, k, v, block_mask, gqa=True), *leaves(torch.bfloat16))
    for name, ref, a, b in zip(("out", "dq", "dk", "dv"), reference, with_torch_defaults, with_options):
        err_defaults, err_options = (a - ref).abs().max().item(), (b - ref).abs().max().item()
        assert err_options <= 1.5 * err_defaults + 1e-3, (name, err_options, err_defaults)


def test_block_causal_trains_on_a_cpu(tmp_path):
    """Backward through the dense mask: a short run on short documents (several in a window), whose
    losses differ from a causal run's on the same windows."""
    # Documents of 12-14 tokens, so that every 64-token window holds several of them whatever the split.
    text = tmp_path / "short-text"
    text.mkdir()
    for i in range(200):
        (text / f"{i:03d}.txt").write_text(f"doc {i} ends")
    prepare(str(tmp_path / "short"), [str(text)], workers=1, val_fraction=0.2)
    data = tmp_path / "short"
    run = ("--training.steps", "2", "--data.seq_len", "64", "--training.local_batch_size", "2",
           "--metrics.log_freq", "1", "--validation.enable", "false", "--metrics.enable_tensorboard", "false",
           "--data.path", f"{data}/train")
    proc = train_here(tmp_path / "block", *run, "--model.attn_mask", "block_causal")
    train_here(tmp_path / "causal", *run)
    block, causal = metrics(tmp_path / "block"), metrics(tmp_path / "causal")
    assert [r["step"] for r in block] == [1, 2] and block[0]["loss"] != causal[0]["loss"]
    assert "attention within each document" in proc.stderr  # the model line says what it trains


def test_block_causal_needs_an_end_of_document_id(tmp_path):
    shards = tmp_path / "raw"
    shards.mkdir()
    write_shard(shards / "a.bin", np.arange(2000) % 250)
    with pytest.raises(ConfigError) as e:
        check(load_config(["--data.path", str(shards), "--model.attn_mask", "block_causal"]), 1)
    assert str(e.value) == (f"model.attn_mask = block_causal splits windows at the end-of-document id, and {shards} "
                            f"has no dataset.json beside it: re-make the data with titanlike-prepare, or use "
                            f"--model.attn_mask causal")
    (tmp_path / "dataset.json").write_text(json.dumps({"vocab_size": 258, "tokenizer": "byte"}))  # an old record
    with pytest.raises(ConfigError, match=r"and .*dataset.json records no eos_id: re-make the data"):
        check(load_config(["--data.path", str(shards), "--model.attn_mask", "block_causal"]), 1)
    (tmp_path / "dataset.json").write_text(json.dumps({"vocab_size": 258, "tokenizer": "byte", "eos_id": 257}))
    check(load_config(["--data.path", str(shards), "--model.attn_mask", "block_causal"]), 1)
    check(load_config(["--model.attn_mask", "block_causal"]), 1)  # the embedded corpus: byte tokens


@pytest.mark.slow
def test_flex_attention_inside_compiled_blocks_matches_the_dense_mask():
    """compile.enable puts flex attention inside each block's graph, fed by the RoPE kernel: its inputs
    are pinned to a contiguous layout there (masks.py), without which torch 2.13's CPU template was wrong."""
    model = small_model("block_causal")
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    tokens[0, 30] = END
    with torch.no_grad():
        dense = model(tokens)
        model.hooks.flex_attention = True
        for block in model.layers:
            block.compile(fullgraph=True)
        compiled = model(tokens)
    torch.testing.assert_close(compiled, dense, rtol=1e-4, atol=1e-4)

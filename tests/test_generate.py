"""titanlike-generate: the KV-cached decoder agrees with the plain model, and the command runs."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json

import pytest
import torch

from conftest import call, run_python, seal
from titanlike.hf.generate import KVCache, forward_cached, generate
from titanlike.model.decoder import Transformer
from titanlike.model.shape import ModelArgs

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SHAPE = ModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=160, vocab_size=97, rope_theta=10000.0,
                  qk_norm=True)


def model(args: ModelArgs = SHAPE, seed: int = 0) -> Transformer:
    m = Transformer(args)
    m.init_weights(seed, 64)
    with torch.no_grad():  # larger weights than the init's: varied argmaxes, not one token repeated
        for p in m.parameters():
            if p.ndim == 2:
                p.normal_(0, 8 / p.shape[1] ** 0.5, generator=torch.Generator().manual_seed(seed + p.numel()))
    return m.eval()


def argmax_loop(m: Transformer, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding with no cache: the whole sequence through Transformer.forward for every token."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(m(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("args", [SHAPE, dataclasses.replace(SHAPE, qk_norm=False, n_kv_heads=4, tie_embeddings=True)],
                         ids=["gqa-qknorm", "mha-tied"])
@pytest.mark.parametrize("static", [False, True], ids=["growing-cache", "static-shapes"])
def test_greedy_with_cache_equals_argmax_loop_without(args, static):
    """Both decoders: forward_cached (a CPU's default) and decode_step, the static-shape step that a
    GPU replays as a CUDA graph (the graph itself needs CUDA: scripts/bench_generate.py runs it)."""
    m = model(args)
    prompt = [5, 17, 42, 8, 8, 60]
    got = generate(m, prompt, 24, temperature=0.0, static=static)
    assert got == argmax_loop(m, prompt, 24)
    assert len(set(got)) > 4  # a real test: the sequence varies


def test_cached_prefill_in_pieces_equals_one_forward():
    m = model()
    tokens = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(0))
    m.init_rope(64)
    cache = KVCache(m, 1, 20, "cpu", torch.float32)
    pieces = [forward_cached(m, tokens[:, a:b], cache) for a, b in ((0, 7), (7, 8), (8, 20))]
    with torch.no_grad():
        torch.testing.assert_close(torch.cat(pieces, dim=1), m(tokens), rtol=1e-5, atol=1e-5)


def test_sampling_is_seeded_and_top_k_1_is_greedy():
    m = model()
    prompt = [1, 2, 3]
    draw = lambda seed, **kw: generate(m, prompt, 16, generator=torch.Generator().manual_seed(seed), **kw)  # noqa: E731
    assert draw(0, temperature=1.0) == draw(0, temperature=1.0)
    assert draw(0, temperature=5.0) != draw(1, temperature=5.0)
    assert draw(3, temperature=1.0, top_k=1) == generate(m, prompt, 16, temperature=0.0)
    # EOS stops it, and vocab_limit keeps padding ids out.
    first = generate(m, prompt, 16)[0]
    assert generate(m, prompt, 16, eos_id=first) == [first]
    hot = generate(m, prompt, 32, temperature=3.0, vocab_limit=50, generator=torch.Generator().manual_seed(0))
    assert max(hot) < 50


def test_command_on_a_step_folder(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    args = dataclasses.replace(SHAPE, vocab_size=320)
    m = model(args)
    step = tmp_path / "step-1"
    dcp.save({"model": get_model_state_dict(m)}, checkpoint_id=str(step), no_dist=True)
    (step / "model_args.json").write_text(json.dumps(dataclasses.asdict(args)))
    seal(str(step))  # the manifest a titanlike save writes: trusted as this account's
    from titanlike.hf.generate import main

    out, err = io.StringIO(), io.StringIO()  # main() in this process: a new one costs seconds of imports
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(step), "--prompt", "abc", "--max-new-tokens", "10", "--temperature", "0", "--device", "cpu"])
    assert rc == 0, err.getvalue()
    prompt = [256] + list(b"abc")
    new = generate(m, prompt, 10, eos_id=257, vocab_limit=258)
    assert out.getvalue() == "abc" + bytes(i for i in new if i < 256).decode("utf-8", errors="replace") + "\n"
    assert "new tokens in" in err.getvalue()
    rc, stderr = call(main, str(tmp_path / "nope"))
    lines = stderr.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: ")

    # Export and generate never import torchao, whose import prints notices of its own (an extension it could
    # not load, a pytree deprecation): transformers imports it when installed, which is not ours to quiet
    # (docs/troubleshooting.md, "Loading an exported folder in transformers").
    out = tmp_path / "exported"
    code = ("import sys; from titanlike.hf import export, generate; "
            f"assert export.main([{str(step)!r}, {str(out)!r}]) == 0; "
            f"assert generate.main([{str(out)!r}, '--max-new-tokens', '2', '--device', 'cpu']) == 0; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torchao', 'transformers')))")
    quiet = run_python("-c", code)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout.splitlines()[-1] == "[]"
    assert "Failed to load" not in quiet.stderr and "_pytree" not in quiet.stderr


# ---- what generate refuses, and what a long prompt costs ------------------------------------------------


def hf_folder(tmp_path, m: Transformer, name: str = "hf"):
    from titanlike.hf.interchange import write_hf_folder

    folder = tmp_path / name
    write_hf_folder(m.state_dict(), m.args, str(folder), torch.float32)
    return folder


def one_error(main, *argv: str) -> str:
    from conftest import call, error_lines

    rc, err = call(main, *argv)
    assert rc == 2, err
    (line,) = error_lines(err)
    assert "Traceback" not in err
    return line


def test_generate_refuses_non_finite_weights_naming_a_tensor(tmp_path):
    from titanlike.hf import generate as cmd

    m = model(dataclasses.replace(SHAPE, vocab_size=320))
    with torch.no_grad():
        m.blocks()[1].feed_forward.w2.weight[3, 5] = float("nan")
    line = one_error(cmd.main, str(hf_folder(tmp_path, m)), "--tokenizer", "byte", "--device", "cpu")
    assert "non-finite" in line and "layers.1.feed_forward.w2.weight" in line, line


def test_generate_refuses_a_seed_out_of_range(tmp_path):
    from titanlike.hf import generate as cmd

    folder = hf_folder(tmp_path, model(dataclasses.replace(SHAPE, vocab_size=320)))
    for seed in (str(10**23), "-1"):
        line = one_error(cmd.main, str(folder), "--tokenizer", "byte", "--device", "cpu", "--seed", seed)
        assert line.startswith(f"error: --seed {seed} must be"), line


@pytest.mark.parametrize("temperature", ["1e308", "1e-320", "5e-5", "2e4", "nan", "-1"])
def test_generate_refuses_a_temperature_past_its_bounds(tmp_path, temperature):
    """1e308 divided the masked logits into NaN and 1e-320 the others into inf: a traceback from the sampler."""
    from titanlike.hf import generate as cmd

    folder = hf_folder(tmp_path, model(dataclasses.replace(SHAPE, vocab_size=320)))
    line = one_error(cmd.main, str(folder), "--tokenizer", "byte", "--device", "cpu", "--temperature", temperature)
    expected = f"error: --temperature {float(temperature):g} must be 0 (greedy) or in [0.0001, 10000]"
    assert line.startswith(expected), line


def test_the_temperature_bounds_sample_finite_probabilities():
    """At either bound the logits divided by the temperature stay finite: sampling works, and at the low one
    it is the greedy choice."""
    from titanlike.hf.generate import MAX_TEMPERATURE, MIN_TEMPERATURE

    m, prompt = model(), [1, 2, 3]
    for t in (MIN_TEMPERATURE, MAX_TEMPERATURE):
        out = generate(m, prompt, 8, temperature=t, vocab_limit=90, generator=torch.Generator().manual_seed(0))
        assert len(out) == 8 and all(0 <= i < 90 for i in out)
    greedy = generate(m, prompt, 8, temperature=0.0, vocab_limit=90)
    assert generate(m, prompt, 8, temperature=MIN_TEMPERATURE, vocab_limit=90,
                    generator=torch.Generator().manual_seed(0)) == greedy


def test_a_config_json_nested_past_the_json_reader_is_one_line(tmp_path):
    """Every JSON file a user may hand over is read through fs.read_json: nesting 100,000 deep was a traceback."""
    from titanlike.hf import generate as cmd

    folder = hf_folder(tmp_path, model(dataclasses.replace(SHAPE, vocab_size=320)))
    (folder / "config.json").write_text('{"model_type": ' + "[" * 100_000 + "]" * 100_000 + "}")
    line = one_error(cmd.main, str(folder), "--tokenizer", "byte", "--device", "cpu")
    assert "config.json is not valid JSON for titanlike: it nests arrays or objects deeper than the JSON reader" \
        in line, line


def test_generate_refuses_a_tokenizer_larger_than_the_vocabulary(tmp_path):
    """As export does: the byte tokenizer's 258 ids into a model of 97."""
    from titanlike.hf import generate as cmd

    line = one_error(cmd.main, str(hf_folder(tmp_path, model())), "--tokenizer", "byte", "--device", "cpu")
    assert "the tokenizer has 258 ids but the model only 97" in line, line


def test_generate_refuses_a_tokenizer_smaller_than_the_folders_own(tmp_path):
    """As export does: --tokenizer byte on an exported model whose own tokenizer has 400 ids printed garbage."""
    from conftest import words_tokenizer
    from titanlike.hf import generate as cmd

    folder = hf_folder(tmp_path, model(dataclasses.replace(SHAPE, vocab_size=448)))
    words_tokenizer(folder / "tokenizer.json", 400)
    line = one_error(cmd.main, str(folder), "--tokenizer", "byte", "--device", "cpu")
    assert line.startswith("error: the tokenizer has 258 ids, fewer than the 400 of the one this model trained with ("
                           f"{folder}/tokenizer.json)"), line
    rc, err = call(cmd.main, str(folder), "--device", "cpu", "--max-new-tokens", "2")  # its own
    assert rc == 0, err


def test_a_long_prompt_builds_no_dense_mask_and_one_position_of_logits(monkeypatch):
    """The prompt goes through attention with is_causal (no prompt × prompt mask: 17 GB at 130k tokens) and
    only its last position through the output layer (not prompt × vocabulary logits)."""
    m = model()
    m.init_rope(400)
    prompt = [int(i) % 97 for i in torch.randint(0, 97, (300,), generator=torch.Generator().manual_seed(1))]
    expected = argmax_loop(m, prompt, 3)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    masks: list[int] = []

    def recording(q, k, v, attn_mask=None, **kw):
        masks.append(0 if attn_mask is None else attn_mask.numel())
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    rows: list[int] = []
    m.output.register_forward_hook(lambda mod, inp, out: rows.append(inp[0].shape[1]))
    for static in (False, True):
        masks.clear()
        rows.clear()
        assert generate(m, prompt, 3, static=static) == expected
        assert max(masks) <= len(prompt) + 3, masks  # a decode step's mask is one row at most
        assert max(rows) == 1, rows


def test_a_step_folder_generates_within_the_window_it_trained_on(trained_run):
    """The context of a step folder is the longest window its weights trained on (64 tokens here), as the
    export writes it, not model.max_seq_len (131072): positions past it were never trained."""
    from titanlike.hf.generate import main

    step = str(trained_run / "checkpoint" / "step-4")
    rc, err = call(main, step, "--max-new-tokens", "64", "--device", "cpu")
    assert rc == 2 and [line for line in err.splitlines() if line.startswith("error: ")] == [
        "error: --max-new-tokens 64: the model's context is 64 tokens and the prompt takes 1; ask for 63 or fewer"]
    rc, err = call(main, step, "--max-new-tokens", "63", "--temperature", "0", "--device", "cpu")
    assert rc == 0, err

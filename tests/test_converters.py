"""Model converters come in through one protocol (model/converter.py) and one registry (titanlike/converters.py):
a converter written here, a weight-only bf16 cast, plugs into a whole run by its registry entry alone (the
trainer, the checkpoint and the records untouched) and is converted, stepped, saved, resumed and reported as
float8 is. The float8 recipes' facts are one table (config/fp8.py RECIPES) that nothing outside float8/
bypasses by comparing recipe names."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import metrics, train_here
from titanlike import converters
from titanlike.config.fp8 import RECIPES, Fp8
from titanlike.model.converter import ConvertArgs, StepReport

ROOT = Path(__file__).resolve().parent.parent


class Bf16Weights:
    """A weight-only cast: after each update every block Linear's weight is rounded to bf16 (kept in fp32).
    Its state is the number of casts so far (a tensor: the checkpoint saves it with DCP)."""

    name = "bf16_weights"
    partial_load = True

    def __init__(self):
        self.model: nn.Module | None = None
        self.args: ConvertArgs | None = None
        self.steps: list[int] = []
        self.casts = torch.zeros((), dtype=torch.int64)
        self.loaded: int | None = None

    def linears(self) -> list[nn.Linear]:
        assert self.model is not None
        return [m for name, m in self.model.named_modules() if isinstance(m, nn.Linear) and name.startswith("layers")]

    def convert(self, model: nn.Module, args: ConvertArgs) -> None:
        self.model, self.args = model, args

    def compile_options(self) -> dict[str, object]:
        return {}

    def start(self, counters) -> None:
        pass

    def after_step(self, step: int) -> StepReport | None:
        with torch.no_grad():
            for linear in self.linears():
                linear.weight.copy_(linear.weight.to(torch.bfloat16))
        self.casts += 1
        self.steps.append(step)
        return StepReport(scalars={"bf16/casts": float(self.casts)}, note={"bf16_casts": int(self.casts)})

    def record(self) -> dict[str, float]:
        return {"bf16_linears": float(len(self.linears()))}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"casts": self.casts}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.casts = state.get("casts", torch.zeros((), dtype=torch.int64)).clone()
        self.loaded = int(self.casts)


def test_a_converter_plugs_in_by_its_registry_entry_alone(tmp_path, corpus, monkeypatch):
    """Registered, the cast is built for the run, converts the meta model with the run's facts, runs after every
    update (the saved weights are bf16 values), reports in every train record, and its state goes into the
    checkpoint under its name and comes back on a resume."""
    made: list[Bf16Weights] = []

    def build(run) -> Bf16Weights:
        made.append(Bf16Weights())
        return made[-1]

    monkeypatch.setitem(converters.CONVERTERS, "bf16_weights", build)
    run = ("--training.local_batch_size", "2", "--data.seq_len", "32", "--metrics.log_freq", "1",
           "--checkpoint.enable", "--checkpoint.interval", "2", "--validation.enable", "false")
    train_here(tmp_path, "--training.steps", "4", *run, corpus=corpus)
    first = made[0]
    assert first.args is not None and first.args.device == torch.device("cpu")
    assert (first.args.batch, first.args.seq_len, first.args.compiled) == (2, 32, False)
    assert first.steps == [1, 2, 3, 4]
    records = metrics(tmp_path)
    assert [r["bf16_casts"] for r in records] == [1, 2, 3, 4]  # each step's note joins its record
    assert all(r["bf16_linears"] == len(first.linears()) > 0 for r in records[1:])
    assert all(torch.equal(linear.weight, linear.weight.to(torch.bfloat16).float()) for linear in first.linears())

    train_here(tmp_path, "--training.steps", "6", *run, corpus=corpus)  # resumes from step 4
    resumed = made[1]
    assert resumed.loaded == 4 and resumed.steps == [5, 6] and int(resumed.casts) == 6


def test_the_converter_list_calls_each_in_the_registrys_order():
    """convert and compile_options go through every converter in order (a later one's options win a clash);
    a converter that reports nothing after a step sends nothing to the records."""
    calls: list[str] = []

    class Noop(Bf16Weights):
        def __init__(self, name: str, options: dict):
            super().__init__()
            self.name, self.options = name, options

        def convert(self, model, args):
            calls.append(self.name)

        def compile_options(self):
            return self.options

    group = converters.ModelConverters([Noop("a", {"x": 1, "y": 1}), Noop("b", {"y": 2})])
    group.convert(nn.Linear(2, 2), ConvertArgs(torch.device("cpu")))
    assert calls == ["a", "b"] and group.compile_options() == {"x": 1, "y": 2}
    assert list(group.states) == ["a", "b"]
    with pytest.raises(AssertionError, match="share a checkpoint entry"):
        converters.ModelConverters([Noop("a", {}), Noop("a", {})])


def test_the_recipes_table_is_fp8_recipes_choices_and_nothing_outside_float8_compares_recipe_names():
    """Every recipe fact is read from config/fp8.py RECIPES: its names are fp8.recipe's choices, and no module
    outside float8/ and that table compares a recipe's name (the all-gather default, the plan's activation
    bytes, the out-of-memory advice each read a fact)."""
    assert list(RECIPES) == list(typing.get_args(typing.get_type_hints(Fp8)["recipe"]))
    compare = re.compile(r"recipe\s*(==|!=|in\b|not in\b)|\.startswith\(\"rowwise|== \"tensorwise\"|"
                         r"!= \"tensorwise\"|== \"rowwise")
    assert compare.search('if cfg.fp8.recipe != "tensorwise" and sharded')  # the pattern finds what it guards
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for path in sorted((ROOT / "titanlike").rglob("*.py"))
             if "float8" not in path.relative_to(ROOT).parts and path.name != "fp8.py"
             for n, line in enumerate(path.read_text().splitlines(), 1) if compare.search(line.split("#")[0])]
    assert not found, "recipe names compared outside float8/ and config/fp8.py:\n" + "\n".join(found)


def test_a_recipe_with_the_weights_gradient_in_high_precision_counts_two_of_three_matmuls():
    """float8_matmul_share counts the matmuls the recipe runs in float8 (RECIPES' matmuls): rowwise_with_gw_hp
    keeps the weight's gradient in bf16, so its share is two thirds of rowwise's on the same layers."""
    from titanlike.float8 import Float8Options, layers
    from titanlike.model.decoder import Transformer
    from titanlike.model.shape import flops_per_token, model_args

    args = model_args("debug", n_layers=1)
    shares = {}
    for recipe in ("rowwise", "rowwise_with_gw_hp"):
        with torch.device("meta"):
            model = Transformer(args)
        layers.convert(model, Float8Options(recipe=recipe, emulate=True, auto_filter=False, filter_fqns=("output",)))
        shares[recipe] = layers.float8_matmul_share(model, flops_per_token(args, 64), recipe)
    assert shares["rowwise"] > 0
    assert shares["rowwise_with_gw_hp"] == pytest.approx(shares["rowwise"] * 2 / 3)

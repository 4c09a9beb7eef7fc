"""The docs cannot drift from the code: the configuration page is generated, and every option or
file the pages name must exist."""

from __future__ import annotations

import dataclasses
import importlib.util
import re

import pytest

from conftest import ROOT
from titanlike.config import field_docs, sections

DOCS = ROOT / "docs"


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_page_is_the_generated_one(gen):
    committed = (DOCS / "configuration.md").read_text()
    assert committed == gen.render(), "docs/configuration.md is stale: run python scripts/gen_config_docs.py"
    assert gen.main(["--check"]) == 0  # and the README's table, as CI's check reads them


def test_configuration_page_lists_every_key_with_type_default_and_docstring(gen):
    page = gen.render()
    for name, cls in sections().items():
        assert f"## [{name}]" in page
        docs, defaults = field_docs(cls), cls()
        for f in dataclasses.fields(cls):
            row = next(line for line in page.splitlines() if line.startswith(f"| `{name}.{f.name}` |"))
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]]
            assert len(cells) == 4, row
            assert cells[3] == docs[f.name].replace("|", "\\|")
            value = getattr(defaults, f.name)
            assert cells[2] == "*unset*" if value is None else cells[2].startswith("`"), row
    assert "| `training.device` | auto \\| cuda \\| cpu | `\"auto\"` |" in page
    assert "| `optimizer.betas` | a comma-separated list of a number | `[0.9, 0.95]` |" in page


def test_check_fails_on_a_stale_page(gen, tmp_path, monkeypatch, capsys):
    stale = tmp_path / "configuration.md"
    stale.write_text(gen.render().replace("Peak learning rate of AdamW.", "Peak learning rate."))
    readme = tmp_path / "README.md"
    readme.write_text((ROOT / "README.md").read_text())
    monkeypatch.setattr(gen, "PAGE", stale)
    monkeypatch.setattr(gen, "README", readme)
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    assert gen.main(["--check"]) == 1
    assert "configuration.md is out of date" in capsys.readouterr().err
    assert gen.main([]) == 0 and gen.main(["--check"]) == 0  # regenerated


def test_readme_option_table_is_the_generated_one(gen):
    readme = (ROOT / "README.md").read_text()
    assert readme == gen.render_readme(readme), \
        "README.md's option table is stale: run python scripts/gen_config_docs.py"
    table = readme[readme.index(gen.TABLE_START):readme.index(gen.TABLE_END)]
    for name, cls in sections().items():
        row = next(line for line in table.splitlines() if line.startswith(f"| {name} | "))
        listed = [key.split(" (")[0] for key in row.split(" | ")[1].rstrip(" |").split(", ")]
        assert listed == [f.name for f in dataclasses.fields(cls)], row


@dataclasses.dataclass
class MetricsWithANewOption:
    log_freq: int = 10
    """How often."""
    enable_tensorboard: bool = True
    """Event files."""
    brand_new: bool = False
    """An option another change adds."""


def test_a_new_option_makes_the_readme_table_stale(gen, tmp_path, monkeypatch, capsys):
    readme = tmp_path / "README.md"
    readme.write_text((ROOT / "README.md").read_text())
    monkeypatch.setattr(gen, "README", readme)
    monkeypatch.setattr(gen, "PAGE", tmp_path / "configuration.md")
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    monkeypatch.setattr(gen.config, "sections", lambda: {**sections(), "metrics": MetricsWithANewOption})
    gen.PAGE.write_text(gen.render())
    assert gen.main(["--check"]) == 1
    assert "README.md is out of date" in capsys.readouterr().err
    assert gen.main([]) == 0 and "| metrics | log_freq, enable_tensorboard, brand_new |" in readme.read_text()


def pages() -> list:
    return sorted(DOCS.glob("*.md")) + [ROOT / "README.md"]


def test_docs_name_only_options_that_exist():
    known = {f"{name}.{f.name}" for name, cls in sections().items() for f in dataclasses.fields(cls)}
    for page in pages():
        if page.name == "troubleshooting.md":  # it quotes mistyped options on purpose
            continue
        for section, key in re.findall(r"--([a-z_0-9]+)\.([a-z_0-9]+)", page.read_text()):
            if (section, key) != ("section", "key"):  # the placeholder in "--section.key value"
                assert f"{section}.{key}" in known, f"{page.name} names --{section}.{key}, which is no option"


def test_docs_links_point_to_files_that_exist():
    for page in pages():
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"

"""`python -m titanlike.data.prepare`: the titanlike-prepare command."""

from titanlike.data.prepare.cli import cli

cli()

"""`python -m hbm_guard` is the `hbm-guard` command."""

from hbm_guard._src.cli import cli

cli.run()

"""`python -m hbm_guard` is the `hbm-guard` command."""

from hbm_guard._src import cli

cli.run()

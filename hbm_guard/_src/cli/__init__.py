"""What a person reads: the report's page (`report_html`), preflight (`preflight`) and
the `hbm-guard` command line (`cli`).

May import: every other group."""

"""The E1000 record: libtpu's and XLA's out-of-memory messages parsed into a record
(`record`, its blocks in `record_blocks`), diagnosed against the E1000 page's
scenarios (`diagnose`), and the errors hbm_guard raises, one class each (`errors`).

May import: nothing of hbm_guard."""

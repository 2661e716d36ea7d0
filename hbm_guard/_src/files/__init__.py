"""What a fit writes and may read back: the report (`report`) and the plan cache
(`plan_cache`), each written atomically and untrusted when read (`untrusted`).

May import: record, memory, plans."""

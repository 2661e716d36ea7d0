"""Where the memory goes: a compiled (or early-checked) program's buffers read from its
dump (`buffer_dump`, `memory_dump`), named by the user's modules and lines
(`hlo_names`), summed by kind into a breakdown with each part's saving (`breakdown`),
and the predicted parts held against the compiled ones (`breakdown_check`).

May import: record."""

"""Train steps nobody on the drop-in wrote: three readings, each written by a session that
had not read the analysis's rules, with its author's own judgement of whether an exact
split exists (`expect_split`, with a `# why` before each case). Kept verbatim as written
(reading 3 after issue 55's rules landed); judged by `benchmarks/bench_outside.py`. Not
tests: judging all three takes minutes, and an author's judgement can be wrong (SAM's
two passes split exactly; a codebook passed in the batch's dict is read as the batch)."""

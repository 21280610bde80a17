"""Reading run folders back.

- spec: what a comparison asks for (algorithms, seeds, budget), parsed without torch;
- compare: the `covey compare` runner, one `covey train` process per algorithm and seed;
- data: run folders read back into per-run summaries, per-algorithm statistics and step series;
- report: report.md with its figures, summary table and claims table;
- claims: claims about the algorithms, each a test with a verdict computed from the runs;
- plots: `covey plot`, the curves of one run or of several overlaid.
"""

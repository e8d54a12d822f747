"""Reports from result rows: CSV + Markdown (report), rebuilding them (regenerate), diffs (compare),
bootstrap intervals (stats) and plots."""

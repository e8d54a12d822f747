"""Reports from result rows: CSV + Markdown (report), its prose paragraphs (sections), rebuilding them
(regenerate), diffs (compare), bootstrap intervals (stats), findings filled in from the rows (findings) and plots."""

"""Comparing runs: `runner sweep` runs a spec at several settings, `runner report` puts summaries side by side."""

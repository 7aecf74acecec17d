"""Reports: run summaries, tables and plots."""

"""Prompt datasets: the loader for user files (jsonl, parquet, saved HF datasets) and the built-in arithmetic task."""

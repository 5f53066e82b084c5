"""Developer commands, run as `python -m scripts.NAME`: benchmarks, export, quality, load tests."""

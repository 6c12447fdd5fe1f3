"""Command-line tools: serve wrapper, tiny model, bench."""

"""Everything that touches vLLM: scheduler subclasses and named patches."""

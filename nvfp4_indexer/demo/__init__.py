"""Demo models that produce real attention activations for the indexer (CPU, no network)."""

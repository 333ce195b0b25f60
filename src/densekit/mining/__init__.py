"""Hard-negative mining: candidates from BM25 or a dense model, filtered and sampled into examples."""

"""Training: examples, batches, objectives, and the one trainer every method runs through."""

"""Texts to vectors: length-ordered batches, sharded corpus encoding and the embedding store."""

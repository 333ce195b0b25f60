"""Retrieval: dense search over a Faiss index and BM25, both producing ranked runs."""

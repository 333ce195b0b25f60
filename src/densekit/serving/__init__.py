"""The HTTP search service over a Retriever."""

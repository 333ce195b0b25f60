"""Readers and writers for corpora, queries, relevance judgements and runs."""

from densekit.data.dataset import Dataset
from densekit.data.diagnostics import DataError, Diagnostics, Problem
from densekit.data.records import Document, Qrels, Run

__all__ = ["DataError", "Dataset", "Diagnostics", "Document", "Problem", "Qrels", "Run"]

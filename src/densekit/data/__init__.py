"""Readers and writers for corpora, queries, relevance judgements and runs."""

from densekit.data.dataset import Dataset
from densekit.data.records import Document, Qrels, Run
from densekit.diagnostics import DataError, Diagnostics, Problem

__all__ = ["DataError", "Dataset", "Diagnostics", "Document", "Problem", "Qrels", "Run"]

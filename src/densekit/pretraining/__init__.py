"""Retrieval-oriented pre-training: Condenser, coCondenser, RetroMAE (and plain MLM as a baseline)."""

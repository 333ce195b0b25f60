"""Crash-safe file output."""

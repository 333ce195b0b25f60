"""Hostile-input tests (issue 50), one per case of docs/hostile-input.md; security cases first."""

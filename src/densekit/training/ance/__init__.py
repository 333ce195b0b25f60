"""ANCE: hard negatives from an index that an inferencer refreshes while the trainer trains."""

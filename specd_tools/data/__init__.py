"""Data recipes for training drafters."""

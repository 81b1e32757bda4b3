"""Data recipes for training drafters, and the MT-Bench questions (`mt_bench/`, see its
NOTICE.md) for `specd bench serve`."""

"""specd's public wire API: Python code generated from ``protos/`` (see protos/generate.sh)."""

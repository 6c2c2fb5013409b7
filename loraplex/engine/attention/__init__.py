"""Attention over the paged KV cache, behind one seam: a backend per kernel family (registry.py)."""

"""Training our own reference models offline (no machine here can download weights)."""

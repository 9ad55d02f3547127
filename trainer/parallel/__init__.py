"""Parallelism applied to the plain model from outside: mesh, TP/SP, PP, sharded DP."""

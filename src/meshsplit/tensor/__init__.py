"""Operator split: one operator's weight divided over the tp axis."""

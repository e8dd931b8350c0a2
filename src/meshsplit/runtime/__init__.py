"""Applies a plan to a model (apply_plan), runs its steps (engine), checkpoints and trains it."""

"""The planner: predict each plan's step time and memory, choose one, and say why."""

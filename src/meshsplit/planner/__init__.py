"""The planner: predict each plan's step time and memory, choose one, and say why.

Two halves. The pure half takes numbers and returns numbers, and is tested without processes:
cost, search, explain, machine, workload, fit, cluster, paper, paper_model, paper_memory,
megatron_table. The half that measures runs the model or the machine: measure, sharing,
calibrate, simulate (the memory estimate). choose sits on both.
"""

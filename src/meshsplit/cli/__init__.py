"""The `meshsplit` command and its views: compare, plan, memory, timeline."""

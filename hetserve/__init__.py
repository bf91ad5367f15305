"""hetserve: plan, simulate and serve large language models on heterogeneous GPU pools.

Layers (dependencies point one way, see docs/design.md):
specs -> cost -> planner -> policies -> sim / runtime -> cli
"""

__version__ = "0.1.0"

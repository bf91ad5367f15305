"""Pool layouts (device groups with roles) and their value: the evaluator, the flow network and its max flow, and the bounded choice among candidates."""

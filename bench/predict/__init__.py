"""The prediction study: how closely the simulator predicts served runs, step by step and request by request."""

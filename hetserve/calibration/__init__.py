"""Calibration: probes the real engine, fits the cost model's efficiencies and fixed costs to them, and compares served runs with the simulator's prediction."""

"""The planning algorithms: HexGen-2 (partition, max flow, guided swaps), HexGen's genetic search, exact search and the baselines."""

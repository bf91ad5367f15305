"""Per-replica layout search: the pipeline stages, TP degrees and layer split of one replica on a given set of devices."""

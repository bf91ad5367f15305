"""Worker processes and the links between endpoints: one process per device, the wire format, authenticated sockets, rendezvous and Ray placement."""

"""`plait cluster`: share a cluster among many plait jobs — scheduling policies, a trace simulator."""

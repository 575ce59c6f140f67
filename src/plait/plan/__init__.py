"""Planning: the cost and memory model, the layout search, calibration, the cluster simulator and `plait bench memory`."""

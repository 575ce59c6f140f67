"""Communication: byte accounting of collectives (accounting), gradient compression (compression), plait's own
collective algorithms and their benchmark (algorithms, bench), who owns which tensor (placement) and
point-to-point tensor framing (p2p). The package imports nothing itself, so `plait --help` stays free of torch."""

"""`plait bench serve`: load generators that start `plait serve` on loopback and measure it.

Steady closed- and open-loop load (`serve`), burst - idle - burst under autoscaling (`serve_burst`) and streamed
generation under Poisson arrivals (`serve_generate`); the verb's parser is `cli`. Benchmarks against peer projects
live in the repository's benchmarks/ folder.
"""

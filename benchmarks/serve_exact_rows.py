"""What exact batching costs a lone request on this CPU: the forward time at each row count, and which row counts give
every row the bits it gets in a full batch (plait serve's exact sizes) or alone (one row).

`plait serve` answers each request bitwise as it would alone, whatever else shares its batch: it pads a batch to the
smallest row count whose rows equal the full batch's (plait.serve.executor.runner.exact_sizes). A lone request runs as that
many rows. Where one row is itself such a size (Intel CPUs under MKL's strict mode), exactness costs a lone request
nothing; where the one-row product takes a kernel of its own (MKL's matrix-vector path) whose sums differ in the
last bits, the lone request pays for the padded rows. This prints both, on the issue's 17 M-parameter MLP (digits,
width 2048, depth 5), with the thread count plait serve gives its model thread:

    python benchmarks/serve_exact_rows.py [--threads N] [--repeats 50]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--max-batch-size", type=int, default=16)
    a = ap.parse_args()
    import torch

    from plait.serve.executor.runner import exact_sizes, intel_cpu

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    dims = [64] + [2048] * 5 + [10]
    layers: list[torch.nn.Module] = []
    for i, (d_in, d_out) in enumerate(zip(dims, dims[1:])):
        layers += [torch.nn.Linear(d_in, d_out)] + ([torch.nn.ReLU()] if i < len(dims) - 2 else [])
    model = torch.nn.Sequential(*layers).eval()
    n = a.max_batch_size
    with torch.inference_mode():
        sizes = exact_sizes(model, [64], n)
        x = torch.randn(n, 64)
        alone = torch.cat([model(x[i:i + 1]) for i in range(n)])
        like_alone = [m for m in range(1, n + 1) if torch.equal(model(x[:m]), alone[:m])]
        print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, {a.threads} threads, "
              f"{'Intel' if intel_cpu() else 'not an Intel'} CPU, MKL_CBWR={os.environ.get('MKL_CBWR', 'unset')}, "
              f"load average {os.getloadavg()[0]:.2f}")
        print(f"row counts exact against a batch of {n}: {sizes}; a lone request runs as "
              f"{next(m for m in sizes if m >= 1)} row(s)")
        print(f"row counts whose every row equals that row alone: {like_alone}")
        print(f"{'rows':>5} {'ms per forward (median)':>24} {'/ one row':>10}")
        base = None
        for rows in sorted({1, 2, 4, 8, 10, n}):
            xs = x[:rows]
            for _ in range(5):
                model(xs)
            times = []
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                model(xs)
                times.append(time.perf_counter() - t0)
            med = statistics.median(times) * 1000
            base = base or med
            print(f"{rows:>5} {med:>24.2f} {med / base:>10.2f}")
    print(f"load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

"""plait serve (exact answers, the default; and --no-exact-batching) vs LitServe on the same model and requests.

    .venv/bin/python benchmarks/serve_vs_litserve.py RUN_DIR [--concurrency 1,4,16,64] [--duration 3] [--repeats 3]

Three servers, each started fresh in every repeat, in an order that rotates between repeats:
`plait serve RUN_DIR` (every answer bitwise the lone one), `plait serve --no-exact-batching`, and a
LitServe `LitAPI` that decodes the same KServe v2 JSON body, batches with LitServe's own batcher at
the same max batch size and timeout, runs the same weights and answers the logits as JSON. Each
side keeps its own default thread count: LitServe's model runs on torch's (every core), plait
serve's model thread on cores - 1 (its `--threads 0`: a core left to the HTTP loop). All bind
127.0.0.1 and are driven by plait's load generator (raw HTTP/1.1 keep-alive, closed loop).
Prints each run, then per concurrency the median req/s and p50 of each server and the ratios over the repeats (min / median / max):

- plait / LitServe req/s, which issue 39 wants >= 1 at every concurrency;
- exact / no-exact p50 latency at concurrency 1, which it wants within 5 % (exactness must not
  cost the lightest load).

LitServe comes with the bench extra (`pip install -e '.[bench]'`); it is never a plait dependency.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


try:  # at module level: LitServe spawns its workers, which unpickle the API by its module and name
    import litserve as ls
except ImportError:  # the plait sides run without it
    ls = None

if ls is not None:
    class API(ls.LitAPI):
        """The model behind LitServe: KServe v2 JSON in, the same logits out, batched by LitServe."""

        def __init__(self, model: str, threads: int, **kwargs):
            super().__init__(**kwargs)
            self.model_path, self.threads = model, threads

        def setup(self, device):
            import torch

            from plait.serve.model.load import ModelRef, load_model

            torch.set_num_threads(self.threads)
            self.model = load_model(ModelRef(self.model_path)).module

        def decode_request(self, request):
            import numpy as np

            t = request["inputs"][0]
            return np.asarray(t["data"], dtype=np.float32 if t["datatype"] == "FP32" else np.int64).reshape(t["shape"])

        def batch(self, inputs):
            import numpy as np

            return np.concatenate(inputs)

        def predict(self, x):
            import torch

            with torch.inference_mode():
                return self.model(torch.from_numpy(x)).numpy()

        def unbatch(self, output):
            return [row[None] for row in output]  # one row per request (the body holds one)

        def encode_response(self, y):
            return {"outputs": [{"name": "logits", "datatype": "FP32", "shape": list(y.shape),
                                 "data": y.reshape(-1).tolist()}]}


def litserve_server(model: str, port: int, max_batch_size: int, max_delay_ms: float) -> None:
    """Run in a child process: LitServe serving the model at /predict, until SIGTERM."""
    if ls is None:
        raise SystemExit("LitServe is not installed: pip install -e '.[bench]'")
    api = API(model, os.cpu_count() or 1, max_batch_size=max_batch_size, batch_timeout=max_delay_ms / 1000)
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=1)
    server.run(host="127.0.0.1", port=port, log_level="warning", generate_client_file=False)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LitServeProcess:
    def __init__(self, model: str, args):
        self.host, self.port = "127.0.0.1", free_port()
        self.proc = subprocess.Popen([sys.executable, __file__, model, "--litserve-server", "--port", str(self.port),
                                      "--max-batch-size", str(args.max_batch_size), "--max-delay-ms",
                                      str(args.max_delay_ms)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     cwd=ROOT, start_new_session=True)
        import httpx

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"LitServe did not start (exit code {self.proc.poll()})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def run_side(side: str, model: str, body: bytes, args) -> dict[int, tuple[float, float]]:
    """{concurrency: (req/s, p50 ms)} for one fresh server."""
    from plait.bench.serve import ServerProcess, _percentiles, closed_loop

    common = ["--max-batch-size", str(args.max_batch_size), "--max-delay-ms", str(args.max_delay_ms), "--max-queue", "4096"]
    if side == "litserve":
        server, path = LitServeProcess(model, args), "/predict"
    else:
        server = ServerProcess(model, common + (["--no-exact-batching"] if side == "no-exact" else []))
        path = f"/v2/models/{server.name}/infer"
    out = {}
    try:
        for c in args.concurrency:
            tput, lat, err = asyncio.run(closed_loop(server.host, server.port, path, body, c, args.warmup, args.duration))
            p50 = _percentiles(lat)[0]
            out[c] = (tput, p50)
            print(f"  {side:<9} c={c:<3} {tput:8.1f} req/s  p50 {p50:7.2f} ms  errors {err}", flush=True)
            if err:
                raise RuntimeError(f"{side}: {err} errors at concurrency {c}")
    finally:
        server.stop()
    return out


def spread(values: list[float]) -> str:
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--duration", type=float, default=3.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--max-delay-ms", type=float, default=5.0)
    p.add_argument("--litserve-server", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.litserve_server:
        litserve_server(args.model, args.port, args.max_batch_size, args.max_delay_ms)
        return 0
    try:
        import litserve  # noqa: F401
    except ImportError:
        print("LitServe is not installed: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    from plait.bench.serve import request_body
    from plait.serve.model.load import ModelRef, load_model

    body = request_body(load_model(ModelRef(args.model)), binary_outputs=False)  # every side answers JSON
    print(f"load average before: {os.getloadavg()[0]:.2f}; batching {args.max_batch_size} rows / {args.max_delay_ms:g} ms")
    sides = ["exact", "no-exact", "litserve"]
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    for r in range(args.repeats):
        order = sides[r % 3:] + sides[:r % 3]
        print(f"repeat {r + 1}/{args.repeats}: {', '.join(order)}", flush=True)
        for side in order:
            runs[side].append(run_side(side, args.model, body, args))
    print(f"load average after: {os.getloadavg()[0]:.2f}\n")
    print(f"{'conc':>5} | {'exact req/s':>11} {'p50':>7} | {'no-exact req/s':>14} {'p50':>7} | {'LitServe req/s':>14} "
          f"{'p50':>7} | {'plait/LitServe (min/med/max)':>28} | {'exact/no-exact p50':>18}")
    for c in args.concurrency:
        med = {s: (statistics.median(x[c][0] for x in runs[s]), statistics.median(x[c][1] for x in runs[s])) for s in sides}
        vs_lit = [e[c][0] / li[c][0] for e, li in zip(runs["exact"], runs["litserve"])]
        p50 = [e[c][1] / n[c][1] for e, n in zip(runs["exact"], runs["no-exact"])]
        print(f"{c:>5} | {med['exact'][0]:>11.1f} {med['exact'][1]:>7.2f} | {med['no-exact'][0]:>14.1f} "
              f"{med['no-exact'][1]:>7.2f} | {med['litserve'][0]:>14.1f} {med['litserve'][1]:>7.2f} | "
              f"{spread(vs_lit):>28} | {spread(p50):>18}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

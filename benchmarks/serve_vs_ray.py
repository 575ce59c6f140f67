"""plait serve vs Ray Serve (`@serve.batch`) on the same model, same requests, same concurrencies, on loopback.

    .venv/bin/python benchmarks/serve_vs_ray.py RUN_DIR [--concurrency 1,4,16] [--duration 3]

The plait side runs `plait serve RUN_DIR` with dynamic batching; the Ray side runs in the
benchmark-only venv .venv-bench (Ray is never a plait dependency), as a deployment that decodes
the same KServe v2 JSON request, batches with `@serve.batch` at the same max batch size and
wait, runs the same weights, and answers the logits. Both servers bind 127.0.0.1; the load
generator is plait's (raw HTTP/1.1 keep-alive, closed loop). Prints both tables side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH_PY = ROOT / ".venv-bench" / "bin" / "python"


def ray_server(model: str, port: int, max_batch_size: int, max_delay_ms: float, replicas: int) -> None:
    """Run inside .venv-bench: a Ray Serve deployment of the model, until SIGTERM."""
    import numpy as np
    import ray
    import torch
    from ray import serve
    from starlette.requests import Request

    from plait.serve.model.load import ModelRef, load_model

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    name = load_model(ModelRef(model)).registry_name

    @serve.deployment(num_replicas=replicas, max_ongoing_requests=256,
                      ray_actor_options={"num_cpus": max(1, (os.cpu_count() or 1) // replicas)})
    class Model:
        def __init__(self, path: str):
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // replicas))
            self.model = load_model(ModelRef(path)).module

        @serve.batch(max_batch_size=max_batch_size, batch_wait_timeout_s=max_delay_ms / 1000)
        async def forward(self, xs: list[np.ndarray]) -> list[np.ndarray]:
            sizes = [len(x) for x in xs]
            with torch.inference_mode():
                out = self.model(torch.from_numpy(np.concatenate(xs))).numpy()
            return list(np.split(out, np.cumsum(sizes)[:-1]))

        async def __call__(self, request: Request) -> dict:
            body = await request.json()
            t = body["inputs"][0]
            dtype = np.float32 if t["datatype"] == "FP32" else np.int64
            x = np.asarray(t["data"], dtype=dtype).reshape(t["shape"])
            y = await self.forward(x)
            return {"model_name": name, "outputs": [{"name": "logits", "datatype": "FP32", "shape": list(y.shape),
                                                     "data": y.reshape(-1).tolist()}]}

    serve.run(Model.bind(model), name="plait-bench", route_prefix=f"/v2/models/{name}/infer")
    print(f"ray ready at http://127.0.0.1:{port} serving '{name}'", flush=True)
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    while not stop:
        time.sleep(0.2)
    serve.shutdown()
    ray.shutdown()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(host: str, port: int, name: str, body: bytes, args) -> list[tuple]:
    from plait.bench.serve import _percentiles, closed_loop

    rows = []
    for c in args.concurrency:
        tput, lat, err = asyncio.run(closed_loop(host, port, f"/v2/models/{name}/infer", body, c, args.warmup, args.duration))
        rows.append((c, tput, *_percentiles(lat), err))
        print(f"  c={c:<3} {tput:8.1f} req/s  p50 {rows[-1][2]:7.2f} ms  p99 {rows[-1][4]:7.2f} ms  errors {err}", flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--duration", type=float, default=3.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--max-delay-ms", type=float, default=5.0)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--ray-server", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.ray_server:
        ray_server(args.model, args.port, args.max_batch_size, args.max_delay_ms, args.replicas)
        return 0
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if not BENCH_PY.exists():
        print(f"{BENCH_PY} is missing; create it: python3 -m venv .venv-bench && .venv-bench/bin/pip install "
              "'torch==2.13.0' && .venv-bench/bin/pip install -e . 'ray[serve]'", file=sys.stderr)
        return 2
    from plait.bench.serve import ServerProcess, request_body
    from plait.serve.model.load import ModelRef, load_model

    body = request_body(load_model(ModelRef(args.model)), binary_outputs=False)  # both answer JSON
    common = ["--max-batch-size", str(args.max_batch_size), "--max-delay-ms", str(args.max_delay_ms)]
    print(f"plait serve (batching {args.max_batch_size} rows / {args.max_delay_ms:g} ms, {args.replicas} replica(s)):")
    plait = ServerProcess(args.model, common + ["--replicas", str(args.replicas), "--max-queue", "4096"])
    try:
        ours = measure(plait.host, plait.port, plait.name, body, args)
    finally:
        plait.stop()
    port = free_port()
    print(f"Ray Serve (@serve.batch {args.max_batch_size} / {args.max_delay_ms:g} ms, {args.replicas} replica(s)), starting:")
    ray = subprocess.Popen([str(BENCH_PY), __file__, args.model, "--ray-server", "--port", str(port), *common,
                            "--replicas", str(args.replicas)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                           cwd=ROOT, start_new_session=True)
    try:
        line = ""
        for line in ray.stdout:
            if line.startswith("ray ready"):
                break
        if not line.startswith("ray ready"):
            print(f"Ray Serve did not start (exit code {ray.poll()})", file=sys.stderr)
            return 1
        name = line.rsplit("'", 2)[1]
        theirs = measure("127.0.0.1", port, name, body, args)
    finally:
        ray.terminate()
        try:
            ray.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(ray.pid, signal.SIGKILL)
    print()
    print(f"{'':>5} | {'plait serve':^32} | {'Ray Serve @serve.batch':^32} |")
    print(f"{'conc':>5} | {'req/s':>9} {'p50 ms':>10} {'p99 ms':>10} | {'req/s':>9} {'p50 ms':>10} {'p99 ms':>10} | plait/ray")
    for a, b in zip(ours, theirs):
        ratio = a[1] / b[1] if b[1] else float("inf")
        print(f"{a[0]:>5} | {a[1]:>9.1f} {a[2]:>10.2f} {a[4]:>10.2f} | {b[1]:>9.1f} {b[2]:>10.2f} {b[4]:>10.2f} | {ratio:6.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

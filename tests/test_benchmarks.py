"""benchmarks/overhead.py compares like with like: its hand-written loop and plait's trainer take the same steps (the
same weights, batches, schedule and clipping), so a ratio of their step times measures plait and nothing else."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
STEPS = 6


def _both(scheme: str, run_dir: str):
    """Rank task: the raw loop and plait's trainer, every step logged (log.every = 1)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    import overhead  # noqa: PLC0415 -- benchmarks/ is not a package; its path is set just above

    _, losses, norms = overhead.raw_loop("mlp", 2, STEPS, 0, scheme, every=1)
    zero = f"parallel.zero={0 if scheme == 'ddp' else 3}"
    got = overhead.plait_loop("mlp", 2, STEPS, 0, run_dir, (zero,), every=1)
    windowed = overhead.plait_loop("mlp", 2, STEPS, 0, run_dir + "-w", (zero,), every=3)  # logged at 1, 3, 6
    return losses, norms, got, overhead.agreement(losses, windowed[1], every=3) if windowed else None


@pytest.mark.parametrize("scheme", ["ddp", "fsdp"])
def test_the_raw_loop_and_plait_take_the_same_steps(pool2, scheme, tmp_path):
    losses, norms, (times, logged), windowed = pool2.run(_both, scheme, str(tmp_path / "run"))[0]
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1)) and len(times) == STEPS
    assert losses[-1] < losses[0]  # it trains: the comparison is not of two runs standing still
    assert [r["loss"] for r in logged] == pytest.approx(losses, abs=1e-5)
    assert [r["grad_norm"] for r in logged] == pytest.approx(norms, rel=1e-4)
    # the benchmark's own check, over logging windows (step 1 alone, then 2-3, 4-6), finds the same agreement
    assert windowed <= 1e-5


def _all():
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    import all as bench_all  # noqa: PLC0415 -- benchmarks/ is not a package; its path is set just above

    return bench_all


def test_all_measures_each_baseline_twice_and_judges_against_the_a_a_floor(capsys):
    """benchmarks/all.py: every repeat measures each side once and each baseline twice, the order rotating; a ratio's
    verdict says met, not met, or not met within the A/A floor (the baseline over itself)."""
    b = _all()
    order: list[str] = []
    values = {"base": [10.0, 11.0, 10.0, 9.5, 10.0, 10.0], "fast": [9.0] * 3, "slow": [10.4] * 3, "slower": [20.0] * 3}

    def measure(side, ctx):  # the values of each side in the order it is measured
        order.append(side)
        return {"s": values[side][sum(1 for s in order if s == side) - 1]}

    rows = [b.Row("fast / base", "fast", "base", "s", "lower", 1.0), b.Row("slow / base", "slow", "base", "s", "lower", 1.02),
            b.Row("slower / base", "slower", "base", "s", "lower", 1.02), b.Row("peer", "fast", "base", "s", "lower", None)]
    group = b.Group("g", ["base", "fast", "slow", "slower"], rows, measure)
    a = argparse.Namespace(repeats=3, max_load=1e9, max_other_cpu=1e9, quiet_wait=0)
    done = b.run_group(group, a, Path("."))
    assert len(order) == 15 and order[:5] == ["base", "fast", "slow", "slower", "base"]
    assert order[5:10] == ["fast", "slow", "slower", "base", "base"]  # rotated by one
    judged = [b.judge(r, done["measured"]) for r in rows]
    assert [j["verdict"] for j in judged] == ["met", "not met, within the A/A floor", "not met", "(peer, for reference)"]
    # repeat 1: base 10, its control 11; repeat 2 (rotated) the control first: 10, then base 9.5; repeat 3: 10, 10
    assert judged[0]["aa_ratios"] == pytest.approx([1.1, 10 / 9.5, 1.0]) and judged[0]["floor"] == pytest.approx(0.1)
    assert judged[2]["ratio"] == pytest.approx({"min": 2.0, "median": 2.0, "max": 20 / 9.5})
    md = b.table([{"group": "g", **done, "rows": judged}, {"group": "h", "skipped": "x is not installed"}])
    assert md.splitlines()[3].startswith("| slow / base | 1.040 / 1.040 / 1.095 | 1.000 / 1.053 / 1.100 | 0.100 | <= 1.02 | "
                                         "not met, within the A/A floor | ")
    assert md.splitlines()[-1] == "| h | - | - | - | - | skipped: x is not installed | - |"


def test_all_refuses_an_unknown_group(capsys):
    with pytest.raises(SystemExit):
        _all().main(["--only", "own-loop,nope"])
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        "--only nope: no such group (the groups: own-loop, small-step, gpt, serve, tune, deepspeed, llm, finetune)")


# ---------------------------------------------------------------------------------------------------------------
# benchmarks/serve_vs_vllm.py: the parts that need no vLLM, then the same-token check against it where it is installed

def _sv():
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    import serve_vs_vllm  # noqa: PLC0415 -- benchmarks/ is not a package; its path is set just above

    return serve_vs_vllm


def test_serve_vs_vllm_workloads_are_token_ids_in_their_ranges_and_repeatable():
    sv = _sv()
    for kind, (lo, hi), (olo, ohi) in (("mixed", (8, 512), (4, 256)), ("shared", (392, 512), (4, 256)),
                                       ("long", (2048, 4096), (4, 128))):
        work = sv.prompts(kind, 40, seed=3)
        assert work == sv.prompts(kind, 40, seed=3) and work != sv.prompts(kind, 40, seed=4)
        assert all(lo <= len(p) <= hi and olo <= n <= ohi for p, n in work)
        assert all(3 <= i < sv.VOCAB for p, _ in work for i in p)  # never [UNK], <s> or </s>
    shared = sv.prompts("shared", 5, seed=1)
    assert all(p[:384] == shared[0][0][:384] for p, _ in shared) and len({tuple(p[384:]) for p, _ in shared}) == 5
    times = sv.arrivals(4000, 20.0, seed=1)
    assert times[0] == 0 and times == sorted(times) and times[-1] / 3999 == pytest.approx(1 / 20, rel=0.05)
    assert sv.arrivals(5, None, seed=1) == [0.0] * 5


def test_serve_vs_vllm_reads_chunked_server_sent_events_split_anywhere():
    """The raw client: chunk boundaries fall inside events and inside the chunked framing's lines."""
    import asyncio

    sv = _sv()
    events = [{"choices": [{"text": f"t{i}"}]} for i in range(3)] + [{"choices": [], "usage": {"completion_tokens": 3}}]
    stream = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    pieces = [stream[i:i + 7] for i in range(0, len(stream), 7)]
    framed = b"".join(f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in pieces) + b"0\r\n\r\n"
    bodies = []

    async def serve(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
        bodies.append(json.loads(await reader.readexactly(length)))
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for i in range(0, len(framed), 5):
            writer.write(framed[i:i + 5])
            await writer.drain()
        writer.close()

    async def main():
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        seen = []
        async with server:
            got = await sv.post(port, {"prompt": [5, 6], "stream": True}, seen.append)
        return got, seen

    (status, got), seen = asyncio.run(main())
    assert status == 200 and got == events and seen == events and bodies == [{"prompt": [5, 6], "stream": True}]


def test_serve_vs_vllm_compares_ids_and_says_when_it_could_only_compare_text():
    sv = _sv()
    a = [{"ids": [1, 2, 3], "text": "x"}, {"ids": [4, 5, 6, 7], "text": "y"}]
    b = [{"ids": [1, 2, 3], "text": " x"}, {"ids": [4, 5, 9, 7], "text": " y"}]
    got = sv.compare(a, b)
    assert (got["by"], got["equal"], got["of"]) == ("token ids", 1, 2)
    assert got["first_difference"] == {"prompt": 1, "at": 2, "plait": [4, 5, 6, 7], "vllm": [4, 5, 9, 7]}  # from 2 before
    text = sv.compare([{"ids": None, "text": "x y"}], [{"ids": [1], "text": " x y"}])  # vLLM's leading space
    assert text["equal"] == 1 and text["by"].startswith("text (ids NOT compared")


def test_serve_vs_vllm_takes_ratios_over_paired_sessions_and_each_sides_a_a_floor(tmp_path):
    sv = _sv()
    plan = sv.Plan("10m", tmp_path, {"mixed": 4}, ("mixed",), ("capacity",), {"capacity": 1.0}, tmp_path, {},
                   rate={"mixed": {"capacity": 2.0}})

    def run(tok_s, ttft, itl):
        return {"mixed/capacity": {"tok_s": tok_s, "req_s": 1.0, "ttft_p50": 1.0, "ttft_p99": ttft, "itl_p50": 1.0,
                                   "itl_p99": itl, "rss_mib": 100.0}}

    done = {"sessions": {"plait": [run(100, 10, 4)], "plait#2": [run(110, 10, 4)],
                         "vllm": [run(50, 20, 2)], "vllm#2": [run(40, 20, 4)]}}
    plait, vllm = sv.figures(plan, done)
    assert plait["tok_s"] == 105 and vllm["tok_s"] == 45
    assert plait["aa_floor"] == pytest.approx({"tok_s": 0.1, "ttft_p99": 0.0, "itl_p99": 0.0})
    assert vllm["aa_floor"] == pytest.approx({"tok_s": 0.2, "ttft_p99": 0.0, "itl_p99": 1.0})
    # pairs in order: plait/vllm (100/50) and plait#2/vllm#2 (110/40)
    assert plait["vs_vllm"] == pytest.approx({"tok_s": (2.0 + 2.75) / 2, "ttft_p99": 0.5, "itl_p99": (2 + 1) / 2})
    assert "vs_vllm" not in vllm
    line = sv.table([plait, vllm]).splitlines()[2]
    assert line.startswith("| mixed | capacity 2 | plait | 105 |") and line.endswith("| 0.10, 0.00, 0.00 | 2.38, 0.50, 1.50 |")


@pytest.mark.slow
def test_plait_and_vllm_give_the_same_greedy_token_ids(tmp_path):
    """The benchmark's own check on a small random Llama: both servers, token-id prompts, ids compared."""
    sv = _sv()
    if sv.ensure_vllm(install=False):
        pytest.skip(f"vLLM's venv is missing; make it with: {sv.INSTALL}")
    model = sv.make_model(tmp_path / "m", 128, 2)
    check = [(p, 16) for p, _ in sv.prompts("mixed", 8, seed=11)]
    answers = {}
    for side in ("plait", "vllm"):
        srv = sv.Server(side, model, tmp_path / f"{side}.log", [])
        try:
            found = sv.probe(srv.port, srv.name)
            answers[side] = sv.greedy(srv.port, found, check)
        finally:
            srv.stop()
    got = sv.compare(answers["plait"], answers["vllm"])
    assert (got["equal"], got["of"]) == (8, 8), got
    assert all(len(x["ids"] or x["text"]) for x in answers["vllm"])

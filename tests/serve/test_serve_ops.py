"""Operations: Prometheus metrics, access log, graceful SIGTERM, CLI errors, and --quantize int8."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading

import httpx
import numpy as np
import pytest
import torch

from plait.cli import main
from plait.serve.entrypoints.server import ServerThread
from plait.serve.model.load import ModelRef, load_model
from plait.serve.model.quantize import accuracy_change
from plait.serve.service import ServeOptions, Service
from serve_helpers import gpt_run, infer_json, kill_tree, mlp_run  # noqa: F401

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def test_prometheus_metrics(mlp_run):  # noqa: F811
    with ServerThread(mlp_run / "model.safetensors", ServeOptions(max_delay_ms=0)) as srv:
        with httpx.Client(base_url=srv.url) as c:
            for rows in (1, 3):
                assert c.post("/v2/models/mlp/infer", json=infer_json(np.zeros((rows, 1, 8, 8), np.float32))).status_code == 200
            assert c.post("/v2/models/mlp/infer", content=b"nope").status_code == 400
            text = c.get("/metrics").text
    assert 'plait_requests_total{code="200",endpoint="infer"} 2.0' in text
    assert 'plait_requests_total{code="400",endpoint="infer"} 1.0' in text
    assert 'plait_request_latency_seconds_count{endpoint="infer"} 3.0' in text
    assert "plait_batch_size_count 2.0" in text and "plait_batch_size_sum 4.0" in text
    assert 'plait_batch_size_bucket{le="2.0"} 1.0' in text  # the 1-row batch; the 3-row one is above
    assert "plait_queue_depth 0.0" in text and "plait_replica_restarts_total 0.0" in text


def test_bad_options_and_busy_port_exit_2(mlp_run, capsys):  # noqa: F811
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", str(mlp_run), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: 127.0.0.1:{port} is already in use; pass another --port (or stop what listens there)\n"
    for args, message in ((["--max-batch-size", "0"], "error: --max-batch-size = 0 must be >= 1\n"),
                          (["--replicas", "2", "--pp", "2"], "error: --replicas 2 and --pp 2 cannot be combined yet; "
                                                             "use replicas of a whole model or one pipeline\n"),
                          (["--timeout-ms", "0"], "error: --timeout-ms = 0.0 must be a finite number > 0\n"),
                          (["--name", "a/b"], "error: --name 'a/b' must be letters, digits, '_', '.' or '-' "
                                              "(it becomes part of URLs)\n")):
        assert main(["serve", str(mlp_run), "--port", "0", *args]) == 2
        assert capsys.readouterr().err == message
    assert main(["serve", str(mlp_run / "nothing"), "--port", "0"]) == 2
    assert "does not exist; pass a run directory or an exported model.safetensors" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", str(mlp_run), "--quantize", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err


def test_quantize_int8_changes_little_and_says_how_much(mlp_run):  # noqa: F811
    pytest.importorskip("torchao.quantization", reason="--quantize int8 uses torchao (the lowbit and dev extras)")
    fp32 = load_model(ModelRef(str(mlp_run)))
    int8 = load_model(ModelRef(str(mlp_run), "int8"))
    kinds = {type(m.weight).__name__ for m in int8.module.modules() if isinstance(m, torch.nn.Linear)}
    assert kinds == {"Int8Tensor"}  # torchao's int8 weight-only, the path `plait compress --quantize int8` takes
    line = accuracy_change(fp32.module, int8.module, int8, str(mlp_run))
    m = re.fullmatch(r"int8: validation loss ([\d.]+) -> ([\d.]+) \(([-+][\d.]+)\), accuracy ([\d.]+) -> ([\d.]+) "
                     r"\(([-+][\d.]+)\) on 64 validation samples", line)
    assert m, line
    l32, l8, dl, a32, a8, da = map(float, m.groups())
    assert abs(l8 - l32) < 0.05 and abs(a8 - a32) <= 0.05 and dl == pytest.approx(l8 - l32, abs=2e-4)
    file_line = accuracy_change(fp32.module, int8.module, int8, str(mlp_run / "model.safetensors"))
    assert file_line.startswith("int8: top-1 agreement with fp32 ") and file_line.endswith("on 256 random inputs")
    service = Service(str(mlp_run), ServeOptions(quantize="int8"))
    x = torch.randn(4, 1, 8, 8)
    with torch.inference_mode():
        torch.testing.assert_close(service.served.module(x), fp32.module(x), atol=0.05, rtol=0)


@pytest.mark.slow
def test_sigterm_finishes_the_stream_in_flight_then_exits(gpt_run):  # noqa: F811
    """`plait serve` in its own process: SIGTERM mid-stream lets the stream finish, refuses new work, exits 0."""
    proc = subprocess.Popen([sys.executable, "-m", "plait", "serve", str(gpt_run), "--port", "0", "--quantize", "int8",
                             "--max-delay-ms", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        accuracy = proc.stdout.readline()
        assert re.match(r"int8: validation loss [\d.]+ -> [\d.]+ \([-+][\d.]+\) on \d+ validation samples$", accuracy)
        assert proc.stdout.readline() == "in-process: starting\n"
        banner = proc.stdout.readline()
        assert "serving 'gpt' (gpt, lm, checkpoint step_0000002)" in banner, banner
        url = re.search(r"at (http://127\.0\.0\.1:\d+)", banner).group(1)
        tokens, done = [], []
        first = threading.Event()

        def stream():
            body = {"prompt": "def ", "max_new_tokens": 400, "temperature": 0, "stream": True}
            with httpx.stream("POST", url + "/v1/generate", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and "index" in line:
                        tokens.append(json.loads(line[6:])["token"])
                        first.set()
                    elif line.startswith("event: done"):
                        done.append(True)

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(60), "no token arrived"
        proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert not t.is_alive() and done == [True] and len(tokens) == 400  # the stream in flight completed
        assert proc.wait(60) == 0
        err = proc.stderr.read()
        assert err.rstrip().endswith("plait serve: stopped")
        log = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
        assert {"ts", "method", "path", "status", "latency_ms", "client", "bytes"} == log[-1].keys()
        assert (log[-1]["method"], log[-1]["path"], log[-1]["status"]) == ("POST", "/v1/generate", 200)
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/v2/health/live")
    finally:
        kill_tree(proc)


def test_the_loaded_heap_is_frozen_out_of_full_collections():
    """plait serve freezes what it loaded (a full collection of it paused every stream for ~250 ms); garbage goes first."""
    import gc
    import weakref

    from plait.serve.model.load import freeze_loaded

    class Node:
        pass

    held = [Node() for _ in range(1000)]  # long-lived objects, as a loaded model's and its modules' are
    junk = Node()
    junk.me = junk  # a cycle: only a collection frees it
    gone = weakref.ref(junk)
    del junk
    try:
        frozen = freeze_loaded()
        assert gone() is None  # collected before the freeze, not kept for the process's life
        assert frozen == gc.get_freeze_count() >= len(held)
        walked = {id(o) for o in gc.get_objects()}
        assert not any(id(h) in walked for h in held)  # in no generation that a collection walks
    finally:
        gc.unfreeze()
    assert id(held[0]) in {id(o) for o in gc.get_objects()}

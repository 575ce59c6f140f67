"""`plait bench serve --generate`: the generation workload against real servers (in-process here: the same HTTP,
the same engine), every token counted, the engine's gauges read from /metrics, the table, JSON and plot."""

import json

import pytest
import torch

import plait.bench.serve_generate as bg
from plait.errors import ConfigError
from plait.serve.entrypoints.server import ServerThread
from plait.serve.service import ServeOptions

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

CORPUS = "the cat sat on a mat and the dog ran to the park where a bird sang in a tree while children played " * 20


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny LlamaForCausalLM (every weight drawn at random) and a BPE tokenizer trained here."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("hf") / "tiny-llama"
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([CORPUS], trainers.BpeTrainer(vocab_size=80, special_tokens=["[UNK]"]))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=256, eos_token_id=None, bos_token_id=None))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.15)
    model.save_pretrained(d)
    tok.save(str(d / "tokenizer.json"))
    return d


class InProcessServer:
    """bench's ServerProcess, as a ServerThread: the flags the benchmark passes become ServeOptions."""

    def __init__(self, model, args):
        opts = ServeOptions(max_queue=int(args[args.index("--max-queue") + 1]),
                            scheduler="static" if "--scheduler" in args else "continuous",
                            prefix_caching="--no-prefix-caching" not in args,
                            max_batch_size=int(args[args.index("--max-batch-size") + 1]))
        self.thread = ServerThread(model, opts).start()
        self.host, self.port = "127.0.0.1", self.thread.port

    def stop(self):
        self.thread.stop()


def test_the_benchmark_counts_every_token_and_reads_the_engines_gauges(hf_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bg, "ServerProcess", InProcessServer)
    opts = bg.GenerateOptions(requests=6, rate=200.0, prompt_tokens=(8, 40), new_tokens=(2, 6), out=tmp_path,
                              serve_args=["--max-batch-size", "4"])
    assert bg.run_generate(str(hf_dir), opts) == 0
    rows = json.loads((tmp_path / "bench_generate.json").read_text())["rows"]
    assert [r["config"] for r in rows] == ["static, mixed", "continuous, mixed", "continuous + prefix cache, shared"]
    served = bg.load_model(bg.ModelRef(str(hf_dir)))
    mixed, shared = bg.workloads(served, opts)
    assert [r["output_tokens"] for r in rows] == [sum(n for *_, n in mixed)] * 2 + [sum(n for *_, n in shared)]
    assert [r["errors"] for r in rows] == [0, 0, 0]
    static, cont, prefix = rows
    assert static["kv_blocks"] is None and static["prefix_hit_rate"] is None  # no engine, no gauges
    per_block = 2 * 2 * 16 * 2 * 8 * 4  # K and V x layers x block tokens x kv heads x head dim x fp32 bytes
    assert cont["kv_blocks"] == prefix["kv_blocks"] == 64 * 2**20 // per_block
    # Each shared prompt: 36 tokens of system prompt (2 full blocks of 16) and 4 of its own: at most 32 / 40 cached.
    assert cont["prefix_hit_rate"] == 0.0 and 0.4 < prefix["prefix_hit_rate"] <= 32 / 40
    assert cont["preempted"] == 0 and cont["peak_running"] <= 6  # sampled every 0.1 s: may see none running
    assert cont["peak_kv_blocks_used"] <= 6 * 3  # 46 tokens at most per sequence: 3 blocks of 16
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[:3] == ["configuration", "req/s", "tok/s"]
    assert [line.split(",")[0] for line in out[3:6]] == ["static", "continuous", "continuous + prefix cache"]
    assert out[7].startswith("continuous / static output tokens/s: ")
    assert (tmp_path / "bench_generate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_prompts_have_the_lengths_asked_for_and_a_shared_prefix(hf_dir):
    served = bg.load_model(bg.ModelRef(str(hf_dir)))
    opts = bg.GenerateOptions(requests=20, rate=10.0, prompt_tokens=(8, 40), new_tokens=(3, 9))
    mixed, shared = bg.workloads(served, opts)
    arrivals = [a for a, *_ in mixed]
    assert arrivals == sorted(arrivals) and arrivals == [a for a, *_ in shared]
    lengths = [len(served.tokenizer.encode(p)) for _, p, _ in mixed]
    assert all(8 - 2 <= n <= 40 + 2 for n in lengths)  # re-encoding the decoded text may join or split a word
    assert all(3 <= n <= 9 for *_, n in mixed)
    system = served.tokenizer.decode(bg.prompt_ids(served.tokenizer, bg.random.Random(1), 36))
    assert all(p.startswith(system) for _, p, _ in shared)


def test_bad_ranges_and_models_are_refused(monkeypatch):
    from types import SimpleNamespace

    with pytest.raises(ConfigError) as e:
        bg.parse_range("9:3", "--prompt-tokens")
    assert str(e.value) == "--prompt-tokens '9:3': give LO:HI with 1 <= LO <= HI, e.g. 8:256"
    assert bg.parse_range("7", "--new-tokens") == (7, 7)
    monkeypatch.setattr(bg, "load_model", lambda ref: SimpleNamespace(can_generate=False, spec=SimpleNamespace(
        task="classification")))
    with pytest.raises(ConfigError) as e:
        bg.run_generate("runs/mlp", bg.GenerateOptions())
    assert str(e.value) == ("--generate: runs/mlp is not a language model (classification); leave --generate out to "
                            "load-test its inference endpoint")

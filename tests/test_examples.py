"""Every shipped example config is valid, with the process count it is written for; the 3-D one runs end to end."""

import json
import math
from pathlib import Path

import pytest

from helpers import plait
from plait.cli import main
from plait.config import load_config
from plait.parallel.layout import Layout
from plait.train.job import load_job
from plait.train.trainer import train

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.toml"))
# what each example is written for (its header comment says so): a new example gets its line here
PROCESSES = {"cnn-digits.toml": 1, "deepfm-mp.toml": 2, "gpt-3d.toml": 8, "gpt-ddp.toml": 2, "gpt-pp.toml": 2,
             "gpt-tp.toml": 2, "mlp-digits.toml": 2, "llama-sft.toml": 1, "llama-lora.toml": 2, "llama-dpo.toml": 2}
# The recipes that fine-tune a Hugging Face checkpoint (train.init_from, which a user downloads): checked and run here
# on a tiny random Llama with the same files (config.json, model.safetensors, tokenizer.json and a chat template)
RECIPES = ("llama-sft.toml", "llama-lora.toml", "llama-dpo.toml")
ROOT = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from hf_helpers import llama_dir

    return llama_dir(tmp_path_factory.mktemp("tiny-llama"), max_position_embeddings=2048)


def checkpoint_for(path: Path, tiny: Path) -> list[str]:
    return ["--set", f"train.init_from={tiny}"] if path.name in RECIPES else []


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_config_is_valid(path, tmp_path, capsys, monkeypatch, tiny_llama):
    monkeypatch.chdir(ROOT)  # the recipes' data paths are the repository's examples/data/
    run = tmp_path / "run"
    assert main(["train", str(path), "--dry-run", "--out", str(run), *checkpoint_for(path, tiny_llama)]) == 0
    assert f"config valid; {PROCESSES[path.name]} process(es); wrote {run / 'config.toml'}" in capsys.readouterr().out
    overrides = [f"train.init_from={tiny_llama}"] if path.name in RECIPES else []
    assert Layout.from_config(load_job(path, overrides)).world_size == PROCESSES[path.name]


def recipe(name: str, tiny: Path):
    """The recipe as written on the tiny checkpoint, for 2 steps of rows of 96 tokens (a chat row is padded to
    model.context: 16 rows of 1024 tokens are seconds of CPU a step even on this model; 128, model.context's default,
    would take the checkpoint's 2048), its data path made absolute for the pool's ranks."""
    cfg = load_config(ROOT / "examples" / name, [f"train.init_from={tiny}", "train.steps=2", "model.context=96",
                                                 "log.progress=false"])
    cfg.data.path = str(ROOT / cfg.data.path)
    return cfg


def records(run: Path) -> tuple[dict, list[dict]]:
    return (json.loads((run / "summary.json").read_text()),
            [m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in m])


def test_the_sft_recipe_runs_as_written_on_a_tiny_checkpoint(tiny_llama, tmp_path):
    train(recipe("llama-sft.toml", tiny_llama), tmp_path / "sft")
    summary, steps = records(tmp_path / "sft")
    assert (summary["steps"], summary["world_size"], len(steps)) == (2, 1, 2)
    assert summary["data"]["examples"] == 24 and summary["trainable_params"] == summary["params"]
    assert math.isfinite(summary["val_loss"]) and summary["sample"]
    assert (tmp_path / "sft" / "hf" / "tokenizer.json").is_file() and (tmp_path / "sft" / "report.html").is_file()


@pytest.mark.parametrize("name", ["llama-lora.toml", "llama-dpo.toml"])
def test_the_two_process_recipes_run_as_written_on_a_tiny_checkpoint(name, tiny_llama, pool2, tmp_path):
    from helpers import rank0_params

    pool2.run(rank0_params, recipe(name, tiny_llama), tmp_path / "run")
    summary, steps = records(tmp_path / "run")
    assert (summary["steps"], summary["world_size"], len(steps)) == (2, 2, 2)
    assert math.isfinite(summary["val_loss"]) and summary["sample"]
    if name == "llama-lora.toml":  # rank-8 adapters, r x (in + out) each: q and o 32 -> 32, k and v 32 -> 16 (2 kv
        # heads of 8), gate, up and down 32 <-> 64, in both blocks
        assert summary["trainable_params"] == 2 * 8 * (2 * (32 + 32) + 2 * (32 + 16) + 3 * (32 + 64))
    else:
        assert summary["parallel"]["strategy"] == "zero3" and summary["preference"]["beta"] == 0.1
        assert steps[0]["loss"] == pytest.approx(math.log(2)) and "reward_margin" in steps[-1]


def test_there_are_examples():
    assert [p.name for p in EXAMPLES] == sorted(PROCESSES)


# The 3-D example, shrunk to seconds of training: the default GPT at width 32 with 1 block per stage, 2 steps of
# 2 micro-batches per pipeline at a learning rate that moves step 2 (a gradient averaged wrongly shows in its loss), no
# evaluation. 8 gloo processes: what it costs is their start-up.
SHRINK = ["model.layers=2", "model.width=32", "model.heads=2", "model.context=32", "train.steps=2",
          "train.global_batch_size=8", "train.micro_batch_size=2", "train.eval_every=0", "train.eval_samples=0",
          "train.sample_tokens=0", "optim.warmup_steps=0", "optim.lr=1e-2", "log.every=1", "log.progress=false",
          "log.report=false", "checkpoint.every=0"]


def losses(run: Path) -> list[float]:
    return [m["loss"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in m]


@pytest.mark.slow
def test_the_3d_example_trains_on_8_processes_as_one_process_does(tmp_path):
    path = Path(__file__).parent.parent / "examples" / "gpt-3d.toml"
    run = tmp_path / "3d"
    r = plait("train", path, "--out", run, *(a for o in SHRINK for a in ("--set", o)), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "8 processes (dp=2 tp=2 pp=2, pipeline-1f1b)" in r.stdout, r.stdout
    s = json.loads((run / "summary.json").read_text())
    assert (s["world_size"], s["steps"], s["grad_accum"]) == (8, 2, 2)
    assert s["parallel"] == {"dp": 2, "tp": 2, "pp": 2, "cp": 1, "strategy": "pipeline-1f1b"}
    assert (s["pipeline"]["stages"], s["pipeline"]["microbatches"], s["pipeline"]["schedule"]) == (2, 2, "1f1b")
    assert len(s["memory"]["per_rank"]) == 8
    # the same job in one process: the 3-D layout reproduces its losses (README: within 1e-4 for the mixes)
    one = load_config(path, [*SHRINK, "parallel.dp=1", "parallel.tp=1", "parallel.pp=1"])
    train(one, tmp_path / "one")
    three_d = losses(run)
    assert len(three_d) == 2 and all(math.isfinite(x) for x in three_d), three_d
    assert three_d == pytest.approx(losses(tmp_path / "one"), abs=1e-4)

"""train.objective = "dpo" / "ipo" / "simpo" on data.name = "preference" (plait.train.preference).

Checked here, with nothing beyond plait's own dependencies: each loss is its paper's formula computed by hand from
each sequence's log-probabilities, every sequence run alone through the model (so the packed row, the prompt's
masking and the reference pass are checked with it); the reference log-probabilities do not depend on the world size;
the chosen/rejected reward margin grows on a toy preference set and is in metrics.jsonl, summary.json and the
report; dp2, dp2 + ZeRO-3 and LoRA at dp2 + ZeRO-3 follow the one-process run (plain SGD: per-step loss and gradient
norm within 1e-5 relative, final weights within 1e-5); what is refused is refused before launch.
tests/train/test_preference_trl.py compares the per-step loss with TRL's DPOTrainer where TRL is installed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from helpers import assert_follows, params_after, rank0_params, step_losses
from hf_helpers import llama_dir
from plait.config import load_config
from plait.data.preference import PairEncoder, read_pairs
from plait.data.sources import build_data
from plait.errors import ConfigError, DataError
from plait.models import build_model
from plait.train.job import check_job
from plait.train.preference import PreferenceLoss, reference_logps

WORDS = "the cat sat on the mat and the dog ran to the park where a bird sang in the tree".split()


def toy_pairs(n: int = 48, seed: int = 1) -> list[dict]:
    """Chosen completions from the first eight words, rejected ones from the rest: a preference a model can learn."""
    import random

    rng = random.Random(seed)
    return [{"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 7))),
             "chosen": " " + " ".join(rng.choice(WORDS[:8]) for _ in range(rng.randint(1, 5))),
             "rejected": " " + " ".join(rng.choice(WORDS[8:]) for _ in range(rng.randint(1, 5)))} for _ in range(n)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("pref")


@pytest.fixture(scope="module")
def toy(root):
    return write_jsonl(root / "toy.jsonl", toy_pairs())


@pytest.fixture(scope="module")
def ckpt(root):
    return llama_dir(root / "llama")


# ---- the losses against the papers' formulas, by hand

CHAR_LLAMA = ["model.name='llama'", "model.vocab_size=0", "model.layers=2", "model.width=32", "model.heads=4",
              "model.kv_heads=2", "model.hidden=48", "model.context=64", "data.name='preference'"]


def alone(model, ids, start: int) -> float:
    """log pi(completion | prompt) of one sequence run on its own: the sum of its completion tokens' log-probs."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.as_tensor(ids[:-1], dtype=torch.long)[None])[0].double(), -1)
    return sum(float(logp[j, int(ids[j + 1])]) for j in range(start - 1, len(ids) - 1))


@pytest.fixture(scope="module")
def by_hand(toy):
    """A policy and a reference (two initialisations) on the toy pairs: the loss object's inputs, and each pair's
    (c, r, c_ref, r_ref, |y_w|, |y_l|) computed sequence by sequence."""
    cfg = load_config(None, [*CHAR_LLAMA, f"data.path='{toy}'", "train.objective='dpo'"])
    bundle = build_data(cfg.data, cfg.model)
    torch.manual_seed(0)
    policy = build_model(cfg.model, bundle.spec).eval()
    torch.manual_seed(1)
    ref = build_model(cfg.model, bundle.spec).eval()
    reference_logps(ref, [bundle.train], torch.device("cpu"))
    rows = torch.arange(6)
    x, y = bundle.train.fetch(rows)
    raw = [ex for _, ex in read_pairs(toy)]
    encode = PairEncoder(bundle.tokenizer, None, "")
    terms = []
    for i in rows.tolist():
        chosen, rejected, start = encode("", raw[int(bundle.train.source_index[i])])
        terms.append((alone(policy, chosen, start), alone(policy, rejected, start), alone(ref, chosen, start),
                      alone(ref, rejected, start), len(chosen) - start, len(rejected) - start))
    with torch.no_grad():
        logits = policy(x)
    return logits, y, terms


def log_sigmoid(z: float) -> float:
    return -math.log1p(math.exp(-z))


def test_dpo_is_the_papers_loss(by_hand):
    """Rafailov et al. 2023: -log sigma(beta [(log pi(y_w|x) - log pi_ref(y_w|x)) - (log pi(y_l|x) - log pi_ref(y_l|x))]),
    the mean over the pairs; the implicit rewards beta (log pi - log pi_ref), their margin and accuracy likewise."""
    logits, y, terms = by_hand
    beta = 0.3
    loss = PreferenceLoss("dpo", beta)
    with torch.enable_grad():
        got = float(loss(logits, y))
    want = sum(-log_sigmoid(beta * ((c - cr) - (r - rr))) for c, r, cr, rr, _, _ in terms) / len(terms)
    assert got == pytest.approx(want, abs=1e-5)
    assert abs(want - math.log(2)) > 1e-2  # the two models differ: the formula is not at its starting value
    f = loss.fields()
    margins = [beta * ((c - cr) - (r - rr)) for c, r, cr, rr, _, _ in terms]
    assert f["reward_margin"] == pytest.approx(sum(margins) / len(terms), abs=1e-5)
    assert f["reward_chosen"] == pytest.approx(sum(beta * (c - cr) for c, _, cr, *_ in terms) / len(terms), abs=1e-5)
    assert f["reward_accuracy"] == pytest.approx(sum(m > 0 for m in margins) / len(terms))
    assert f["logp_rejected"] == pytest.approx(sum(t[1] for t in terms) / len(terms), abs=1e-4)
    assert loss.fields() == {}  # the window restarts after each record


def test_ipo_is_the_papers_loss_per_token(by_hand):
    """Azar et al. 2023 (eq. 17): ((margin) - 1 / (2 beta))^2 with the log-ratios per completion token, as TRL (and the
    IPO authors, per TRL's note) have it."""
    logits, y, terms = by_hand
    beta = 0.5
    got = float(PreferenceLoss("ipo", beta)(logits, y))
    want = sum(((c - cr) / nc - (r - rr) / nr - 1 / (2 * beta)) ** 2 for c, r, cr, rr, nc, nr in terms) / len(terms)
    assert got == pytest.approx(want, abs=1e-5)


def test_simpo_needs_no_reference(by_hand):
    """Meng et al. 2024: -log sigma(beta (log pi(y_w|x) / |y_w| - log pi(y_l|x) / |y_l|) - gamma)."""
    logits, y, terms = by_hand
    beta, gamma = 2.0, 0.5
    y = y.clone()
    y[:, 2] = float("nan")  # no reference pass for simpo
    got = float(PreferenceLoss("simpo", beta, gamma)(logits, y))
    want = sum(-log_sigmoid(beta * (c / nc - r / nr) - gamma) for c, r, _, _, nc, nr in terms) / len(terms)
    assert got == pytest.approx(want, abs=1e-5)
    with pytest.raises(RuntimeError, match="reference"):
        PreferenceLoss("dpo", beta)(logits, y)


def test_the_reference_pass_is_the_same_whatever_the_world_size(toy, pool2):
    """Rank k computes chunks k, k + world, ... and an all-reduce gives everyone all: bitwise what one process finds."""
    one = pool2.run(reference_numbers, str(toy), False)[0]
    two = pool2.run(reference_numbers, str(toy), True)
    assert torch.equal(one, two[0]) and torch.equal(two[0], two[1])
    assert not torch.isnan(one).any() and (one < 0).all()


def reference_numbers(toy: str, distributed: bool) -> torch.Tensor | None:
    """Pool task: the toy pairs' reference log-probabilities from this rank (rank 0 alone unless distributed)."""
    import torch.distributed as dist

    cfg = load_config(None, [*CHAR_LLAMA, f"data.path='{toy}'", "train.objective='dpo'"])
    bundle = build_data(cfg.data, cfg.model)
    torch.manual_seed(0)
    model = build_model(cfg.model, bundle.spec)
    if not distributed and dist.get_rank() != 0:
        return None
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    reference_logps(model, [bundle.train], torch.device("cpu"), rank, world, chunk=4)
    return bundle.train.y[:, 2, :2].clone()


# ---- a toy preference set: the margin grows, and the run says so

TRAIN = ["data.name='preference'", "train.objective='dpo'", "parallel.dp=1", "model.context=64",
         "train.global_batch_size=8", "train.micro_batch_size=4", "log.progress=false", "train.eval_samples=8",
         "train.eval_batch_size=4"]


@pytest.fixture(scope="module")
def toy_run(ckpt, toy, root):
    run = root / "toy-run"
    cfg = load_config(None, [*TRAIN, f"train.init_from='{ckpt}'", f"data.path='{toy}'", "train.steps=24",
                             "optim.lr=3e-3", "optim.warmup_steps=0", "log.every=4", "train.eval_every=12",
                             "train.sample_tokens=8", "checkpoint.every=0", "train.dpo_beta=0.5"])
    params_after(cfg, run)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return run, records


def test_the_margin_grows_on_a_toy_preference_set(toy_run):
    run, records = toy_run
    steps = [r for r in records if "reward_margin" in r]
    margins = [r["reward_margin"] for r in steps]
    assert [r["step"] for r in steps] == [1, 4, 8, 12, 16, 20, 24]
    assert margins[0] == 0.0 and steps[0]["loss"] == pytest.approx(math.log(2))  # the reference is the start
    assert margins[-1] > margins[3] > margins[1] > 0, margins
    assert margins[-1] > 0.5 and steps[-1]["reward_accuracy"] >= 0.75, steps[-1]
    assert steps[-1]["reward_chosen"] > steps[-1]["reward_rejected"]
    assert steps[-1]["loss"] < math.log(2) - 0.1
    val = [r for r in records if "val_reward_margin" in r]
    assert len(val) == 2 and val[1]["val_reward_margin"] > val[0]["val_reward_margin"] > 0, val
    assert 0 <= val[1]["val_reward_accuracy"] <= 1
    summary = json.loads((run / "summary.json").read_text())
    assert summary["preference"]["objective"] == "dpo" and summary["preference"]["beta"] == 0.5
    assert summary["preference"]["reward_margin"] == margins[-1]
    assert summary["data"]["examples"] == 48 and summary["data"]["dropped"] == 0
    page = (run / "report.html").read_text()
    assert 'src="preference.png"' in page and (run / "preference.png").stat().st_size > 1000


# ---- layouts: dp2, ZeRO-3 and LoRA follow one process (plain SGD)

SGD = ["checkpoint.every=0", "optim.name='sgd'", "optim.momentum=0", "optim.weight_decay=0", "optim.grad_clip=0",
       "optim.warmup_steps=0", "optim.lr=2.0", "optim.schedule='constant'", "log.every=1", "train.steps=4",
       "train.eval_samples=0", "train.sample_tokens=0", "log.report=false"]
LORA = ["finetune.lora_rank=4", "finetune.lora_alpha=32", "optim.lr=10.0"]  # B starts at 0: step 1 moves only B
LAYOUTS = {"dp2": ([], ["parallel.dp=2"]), "dp2-zero3": ([], ["parallel.dp=2", "parallel.zero=3"]),
           "lora-dp2-zero3": (LORA, ["parallel.dp=2", "parallel.zero=3", "train.micro_batch_size=2"])}


@pytest.fixture(scope="module")
def one_process(ckpt, toy, root):
    cache: dict = {}

    def get(*more: str):
        if more not in cache:
            run = root / f"one-{len(cache)}"
            cfg = load_config(None, [*TRAIN, f"train.init_from='{ckpt}'", f"data.path='{toy}'", *SGD, *more])
            cache[more] = params_after(cfg, run), step_losses(run)
        return cache[more]

    return get


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_follow_one_process(name, one_process, ckpt, toy, pool2, tmp_path):
    finetune, layout = LAYOUTS[name]
    ref = one_process(*finetune)
    losses = [loss for loss, _ in ref[1]]
    assert max(abs(x - losses[0]) for x in losses) > 0.01, losses  # the steps move it: a wrong scale would show
    cfg = load_config(None, [*TRAIN, f"train.init_from='{ckpt}'", f"data.path='{toy}'", *SGD, *finetune, *layout])
    got = pool2.run(rank0_params, cfg, tmp_path / "run")[0]
    assert_follows(ref, got, tmp_path / "run", 4, rel=1e-5, atol=1e-5)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["world_size"], summary["parallel"]["strategy"]) == (2, "zero3" if "zero3" in name else "ddp")
    gaps = [(abs(a - b) / abs(a), abs(g - h) / abs(g)) for (a, g), (b, h) in zip(ref[1], step_losses(tmp_path / "run"))]
    print(f"{name}: loss {max(x for x, _ in gaps):.1e}, grad norm {max(y for _, y in gaps):.1e} (relative); weights "
          f"{max(float((ref[0][k] - got[k]).abs().max()) for k in got):.1e}")


def test_a_resumed_run_continues_the_trajectory(one_process, ckpt, toy, root):
    """The reference pass runs on the starting weights before the checkpoint is loaded: steps 3-4 after a resume from
    step 2 are the uninterrupted run's."""
    run = root / "resumed"
    cfg = load_config(None, [*TRAIN, f"train.init_from='{ckpt}'", f"data.path='{toy}'", *SGD, "train.stop_after=2"])
    params_after(cfg, run)
    cfg = load_config(None, [*TRAIN, f"train.init_from='{ckpt}'", f"data.path='{toy}'", *SGD])
    assert_follows(one_process(), params_after(cfg, run, resume=True), run, 4, rel=1e-6, atol=1e-6)


# ---- refusals

def test_what_is_refused_before_launch(toy, tmp_path):
    def refusal(*more) -> str:
        with pytest.raises((ConfigError, DataError)) as e:
            check_job(load_config(None, [*CHAR_LLAMA, f"data.path='{toy}'", "train.objective='dpo'", "parallel.dp=1",
                                         *more]))
        return str(e.value)

    assert "set train.objective to one of dpo, ipo or simpo" in refusal("train.objective='supervised'")
    assert "set data.name = 'preference'" in refusal("data.name='chat'")
    assert "plait's llama reads; model.name = 'gpt'" in refusal("model.name='gpt'")
    assert "tested with data parallel and ZeRO 1-3 only (here tp = 2" in refusal("parallel.tp=2")
    assert "train.loss cannot apply" in refusal("train.loss='focal'")
    assert "must be > 0" in refusal("train.dpo_beta=0")

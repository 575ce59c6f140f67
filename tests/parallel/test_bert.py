"""Encoder fine-tuning (the books' BERT chapters): a BertForSequenceClassification checkpoint, made here with every
weight drawn at random, fine-tuned on a text-classification table through `model.hf_class` and `train.init_from`, the
table's text column encoded with the checkpoint's tokenizer (its [CLS] ... [SEP], an attention mask over padding).

One process learns the task (validation accuracy reported); dp2 and dp2 + ZeRO-3 (FSDP units: the model's
_no_split_modules, BertLayer and BertEmbeddings) keep its trajectory with plain SGD.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from helpers import TINY_GPT
from plait.config import load_config

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

GOOD, BAD = ["good", "great", "fine", "lovely"], ["bad", "awful", "poor", "grim"]
FILLER = "the a of movie film plot cast it was and very quite so but to me story acting".split()
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
SGD = ("optim.name='sgd'", "optim.lr=0.1", "optim.momentum=0", "optim.weight_decay=0", "optim.grad_clip=0",
       "optim.schedule='constant'", "optim.warmup_steps=0", "log.every=1", "train.steps=4", "checkpoint.every=0")


def bert_dir(d, labels: int = 2, base_only: bool = False):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(SPECIAL + GOOD + BAD + FILLER)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                       special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    config = transformers.BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=48, max_position_embeddings=64, num_labels=labels,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0)
    torch.manual_seed(0)
    model = (transformers.BertModel if base_only else transformers.BertForSequenceClassification)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():  # every weight drawn, norms and biases included
            p.normal_(1.0 if name.endswith("LayerNorm.weight") else 0.0, 0.1)
    model.save_pretrained(d)
    tok.save(str(d / "tokenizer.json"))
    return d


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    rng = random.Random(0)
    lines = ["review,label"]
    for i in range(240):
        words = [rng.choice(FILLER) for _ in range(rng.randint(3, 12))]  # some rows longer than model.context
        words.insert(rng.randrange(len(words) + 1), rng.choice(GOOD if i % 2 else BAD))
        lines.append(f"{' '.join(words)},{'pos' if i % 2 else 'neg'}")
    path = tmp_path_factory.mktemp("reviews") / "reviews.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return bert_dir(tmp_path_factory.mktemp("bert") / "bert")


def config(checkpoint, table, *more):
    own = [o for o in TINY_GPT if not o.startswith(("model.context", "optim.lr", "optim.warmup"))]
    return load_config(None, [*own, "model.hf_class='AutoModelForSequenceClassification'",
                              f"train.init_from='{checkpoint}'", "data.name='table'", f"data.path='{table}'",
                              "data.text_column='review'", "data.target='label'", "model.context=12",
                              "train.global_batch_size=16", "train.micro_batch_size=4", "train.eval_samples=0",
                              *more])


def test_the_text_is_encoded_with_the_checkpoints_tokenizer(bert, table):
    from plait.data import build_data
    from plait.train.job import check_job

    cfg = config(bert, table)
    check_job(cfg)
    assert cfg.data.tokenizer == str(bert / "tokenizer.json")
    assert cfg.model.options == {"hf_class": "AutoModelForSequenceClassification", "path": str(bert), "num_labels": 2}
    bundle = build_data(cfg.data, cfg.model)
    x = bundle.train.x[0]
    assert x.shape == (2, 12) and x.dtype == torch.long and bundle.spec.num_classes == 2
    n = int(x[1].sum())
    assert x[0, 0] == 2 and x[0, n - 1] == 3 and (x[0, n:] == 0).all() and (x[1, :n] == 1).all()  # [CLS] .. [SEP] pad
    assert 0 < bundle.stats["truncated"] < bundle.stats["examples"] == 240


def test_fine_tuning_learns_the_task_and_reports_accuracy(bert, table, tmp_path):
    from plait.train.trainer import train

    train(config(bert, table, "train.steps=40", "optim.lr=3e-3", "optim.warmup_steps=0", "train.eval_samples=48", "parallel.dp=1"),
          tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["val_accuracy"] >= 0.9, summary


@pytest.fixture(scope="module")
def reference(bert, table, tmp_path_factory):
    import test_equivalence

    ref = test_equivalence.trajectory(config(bert, table, *SGD, "parallel.dp=1"), tmp_path_factory.mktemp("ref") / "r")
    from safetensors.torch import load_file

    saved = load_file(str(bert / "model.safetensors"))
    # the run started from the checkpoint: four small SGD steps leave each weight near its saved value
    assert (ref.params["classifier.weight"] - saved["classifier.weight"]).abs().max() < 0.05
    return ref


@pytest.mark.parametrize("layout", [("parallel.dp=2",), ("parallel.dp=2", "parallel.zero=3")], ids=["dp2", "dp2-zero3"])
def test_dp2_and_zero3_keep_the_one_process_trajectory(pool2, reference, bert, table, tmp_path, layout):
    import test_equivalence

    got = pool2.run(test_equivalence.trajectory, config(bert, table, *SGD, *layout), tmp_path)[0]
    test_equivalence.assert_same_trajectory(reference, got)


def test_a_base_checkpoint_gets_a_fresh_head_and_other_labels_are_refused(table, tmp_path, capsys):
    from plait.errors import ConfigError
    from plait.train.job import check_job
    from plait.train.trainer import train

    base = bert_dir(tmp_path / "base", base_only=True)  # BertModel: no classifier, names without the bert. prefix
    train(config(base, table, *SGD, "parallel.dp=1"), tmp_path / "run")
    assert "has no classifier.weight, classifier.bias: kept at their fresh initialisation" in capsys.readouterr().out
    three = bert_dir(tmp_path / "three", labels=3)
    with pytest.raises(ConfigError, match=r"tensor classifier.weight has shape \[3, 32\] there and \[2, 32\] in the "
                                          r"model \(a classifier: the checkpoint's labels against the data's classes\)"):
        check_job(config(three, table))
    with pytest.raises(ConfigError, match=r"model.hf_class = 'AutoModelForSequenceClassification' is built from a "
                                          "Hugging Face directory's config.json; set train.init_from"):
        check_job(config(three, table, "train.init_from=''"))

"""What a data source tells the model builder and the loss, and the bundle every source returns.

The bundle lives here, below every source module, so that sources.py (which lists the sources) and
the sources in their own files (images, packed, table, user) all import it at the top.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plait.data.tokenizer import CharTokenizer

SPLIT_SEED = 0  # the train/validation split never depends on train.seed


@dataclass
class DataSpec:
    name: str
    task: str  # "lm": next-token prediction; "classification": one label per sample; "binary": a 0/1 label (logit out);
    # "fewshot": one N-way K-shot episode per sample, a label per query row (plait.data.episodes)
    input_shape: list = field(default_factory=list)  # one sample's input shape
    vocab_size: int = 0  # lm
    num_classes: int = 0  # classification
    tokens_per_sample: int = 0  # lm: the loss is a mean over this many tokens per sample
    cardinalities: list = field(default_factory=list)  # clicks: categories per categorical field (ids lead each row)
    dense_features: int = 0  # clicks: real-valued features after the categorical ids
    class_weights: list = field(default_factory=list)  # classification: per-class loss weights (data.class_weights)
    masked_targets: bool = False  # lm: targets of -100 are not trained; the loss is a mean per row (chat)
    packed: bool = False  # lm: inputs are (batch, 2, context), ids then each example's positions (data.pack)
    # lm: each row a preference pair, chosen then rejected sequence, packed; targets (batch, 3, T) float64 of the two
    # completions' next tokens and the reference log-probabilities (plait.data.preference)
    preference: bool = False
    # fewshot: ways, shots, queries, one image's input_shape, and how the learner adapts (plait.data.episodes)
    episode: dict = field(default_factory=dict)
    image_shape: list = field(default_factory=list)  # image + text: each row's image (its pixels lead the row)


@dataclass
class DataBundle:
    train: Any
    val: Any
    spec: DataSpec
    tokenizer: CharTokenizer | None = None
    unigram_val_loss: float | None = None  # lm: cross-entropy of a unigram model fitted on train, on val
    ground_truth_val_loss: float | None = None  # clicks: the generating model's own loss on val (the best possible)
    stats: dict = field(default_factory=dict)  # what the source counted (chat: examples, truncated), in summary.json
    tasks: list = field(default_factory=list)  # data.stream: each task's (train, val) in order (plait.data.stream)

"""What a data source tells the model builder and the loss."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DataSpec:
    name: str
    task: str  # "lm": next-token prediction; "classification": one label per sample; "binary": a 0/1 label (logit out)
    input_shape: list = field(default_factory=list)  # one sample's input shape
    vocab_size: int = 0  # lm
    num_classes: int = 0  # classification
    tokens_per_sample: int = 0  # lm: the loss is a mean over this many tokens per sample
    cardinalities: list = field(default_factory=list)  # clicks: categories per categorical field (ids lead each row)
    dense_features: int = 0  # clicks: real-valued features after the categorical ids
    class_weights: list = field(default_factory=list)  # classification: per-class loss weights (data.class_weights)

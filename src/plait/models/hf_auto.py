"""`model.hf_class`: any transformers class, built from a Hugging Face directory's config.json.

    model = build(hf_class="AutoModelForSequenceClassification", path="bert-dir", num_labels=2)

The model is built with fresh weights (`from_config`, seeded like every plait model) and train.init_from
then loads the directory's tensors by their own names (plait.train.weights): a head the checkpoint lacks (a
pre-trained encoder given a classifier) keeps its fresh weights, with a note. A classification head is
sized to the data's classes (`num_labels`), so a checkpoint trained with other labels is refused by its
classifier's shape.
"""

from __future__ import annotations

from pathlib import Path

from plait.errors import ConfigError
from plait.extras import install_command

FACTORY = "plait.models.hf_auto:build"


def build(hf_class: str, path: str, num_labels: int = 0, **overrides):
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"model.hf_class builds a transformers model: {install_command('hf')} (transformers)") from None
    cls = getattr(transformers, hf_class, None)
    if cls is None or not hasattr(cls, "from_config"):
        raise ConfigError(f"model.hf_class = {hf_class!r} is not a transformers model class; give one such as "
                          "AutoModelForSequenceClassification, BertForSequenceClassification or AutoModelForCausalLM")
    try:
        config = transformers.AutoConfig.from_pretrained(str(Path(path)), local_files_only=True, **overrides)
    except Exception as e:  # noqa: BLE001 -- transformers' own errors for a config.json it cannot read
        raise ConfigError(f"train.init_from = {path!r}: transformers cannot read its config.json "
                          f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    if num_labels and config.num_labels != num_labels:
        config.num_labels = num_labels  # id2label and label2id follow
    try:
        return cls.from_config(config)
    except ValueError as e:  # an Auto class given a config it has no model for
        raise ConfigError(f"model.hf_class = {hf_class!r} cannot build {type(config).__name__} ({str(e)[:200]})") from None

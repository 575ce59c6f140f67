"""The [data] section: the data sources' names and their keys. Torch-free.

SOURCE_NAMES is the registry's list of sources (plait.data.sources builds each by its name); data.name's
choices and description come from it.
"""

from __future__ import annotations

import dataclasses
import math

from plait.config import keys, opt
from plait.errors import ConfigError

SOURCE_NAMES = ("stdlib-text", "digits", "synthetic", "clicks", "text", "tensors", "images", "packed", "table", "chat",
                "large-digits", "digit-captions", "preference")
# Sources that read the user's files: data.path names them (unless data.factory replaces the source).
FILE_SOURCES = ("text", "tensors", "images", "packed", "table", "chat", "preference")
AUGMENTATIONS = ("random_crop", "hflip", "noise", "randaugment")


@keys("data")
class DataKeys:
    name: str = opt(
        "stdlib-text",
        "data source: stdlib-text, digits, large-digits (digits enlarged data.digit_scale times at random places on a "
        "data.canvas_size canvas), digit-captions (digits with generated captions, for model.name = 'vlm'), "
        "synthetic, clicks, text (a file or folder), tensors (.npy/.pt), "
        "images (a folder with one sub-folder per class), packed (a folder written by `plait data pack`), table (a CSV or "
        "Parquet file), chat (a JSONL file of prompt/completion pairs or conversations), preference (a JSONL file of "
        "prompt/chosen/rejected pairs, for train.objective = 'dpo', 'ipo' or 'simpo'); ignored when factory is set",
        SOURCE_NAMES,
    )
    factory: str = opt("", "'package.module:function' returning your own map-style dataset (__len__, __getitem__ giving "
                           "(input, target); optional collate) or a (train, val) pair; called with **data.options")
    options: dict = opt({}, "keyword arguments passed to data.factory")
    features: list = opt([], "table: the feature columns (empty: every column but data.target)")
    target: str = opt("", "table: the column to predict")
    text_column: str = opt("", "table: a text column as the input instead of numeric features, encoded with "
                               "data.tokenizer (its special tokens added; padded or cut to model.context, with an "
                               "attention mask)")
    task: str = opt("auto", "table and data.factory: classification or regression (mse loss); auto: regression when the "
                            "targets are non-integer numbers", ("auto", "classification", "regression"))
    path: str = opt("", "text: a text file or a folder of files; tensors: a .npy or .pt file; images: a folder of "
                        "class folders; packed: the folder `plait data pack` wrote; chat, preference: a JSONL file")
    pack: bool = opt(False, "chat: fill each row of model.context tokens with consecutive examples; text, stdlib-text: "
                            "each file is a document; either way attention is confined to each example or document "
                            "and positions restart at each (plait's gpt and llama; not with pp)")
    val_fraction: float = opt(0.1, "share of files (text) or samples (others) held out for validation")
    min_char_count: int = opt(50, "text: characters seen fewer times in training map to <unk>")
    tokenizer: str = opt("", "text: a Hugging Face tokenizer.json to encode with (the tokenizers library) instead of "
                             "characters; set from train.init_from when it is a Hugging Face directory with one")
    synthetic_samples: int = opt(4096, "synthetic and clicks: number of samples generated", minimum=1)
    synthetic_features: int = opt(64, "synthetic: features per sample", minimum=1)
    synthetic_classes: int = opt(10, "synthetic: number of classes", minimum=1)
    clicks_cardinalities: list = opt([8, 64, 512, 4096, 32768], "clicks: categories per categorical field")
    clicks_dense: int = opt(4, "clicks: real-valued features per sample", minimum=1)
    prefetch: int = opt(2, "batches prepared ahead of compute by a background thread (0: none)", minimum=0)
    augment_shift: int = opt(1, "contrastive views of images: random shift of up to this many pixels (0: none)")
    augment_noise: float = opt(0.1, "contrastive views: std of the Gaussian noise added to every input")
    augment: list = opt([], "training-time augmentations of images, in order: random_crop, hflip, noise (std "
                            "data.augment_noise), randaugment (data.randaugment_n operations at "
                            "data.randaugment_magnitude), each seeded per (seed, sample index, epoch)")
    randaugment_n: int = opt(2, "randaugment: operations applied to each image", minimum=1)
    randaugment_magnitude: int = opt(9, "randaugment: the magnitude of every operation, 0 (none) to 10; one number "
                                        "for plait tune to search", minimum=0)
    workers: int = opt(0, "processes that fetch and decode batches (images, packed shards) in parallel; the order "
                          "stays the sampler's (0: the background thread only)")
    canvas_size: int = opt(256, "large-digits: the canvas's side in pixels", minimum=8)
    digit_scale: int = opt(4, "large-digits: each 8 x 8 digit is enlarged this many times (nearest neighbour)",
                           minimum=1)
    image_size: int = opt(32, "images: every image is resized to image_size x image_size pixels (RGB)")
    on_bad_sample: str = opt("error", "images and packed data: a sample that cannot be decoded is an error naming "
                                      "the file, or is skipped (replaced by the next good one) and counted",
                             ("error", "skip"))
    exclude: str = opt("", "an audit.json from `plait data audit`: train without the samples it flags")
    sampler: str = opt("shuffle", "training order: shuffle (a permutation per epoch) or balanced (each batch drawn with "
                                  "replacement, every class equally likely; seeded per step)", ("shuffle", "balanced"))
    mix: str = opt("none", "synthetic training samples: mixup (two samples blended) or cutmix (a box of one pasted into "
                           "another), soft labels to match, seeded per (seed, sample, epoch) (plait.data.mix)",
                   ("none", "mixup", "cutmix"))
    mix_alpha: float = opt(0.2, "data.mix: the mixing weight is drawn from Beta(mix_alpha, mix_alpha)", above=0,
                           finite=True)
    curriculum: dict = opt({}, "easiest samples first: {score = 'length' | 'loss' | 'FILE.json', pacing = 'linear' | "
                               "'root', start = 0.2, full_at = 0.5, model = RUN_DIR (score 'loss')}: step s draws from "
                               "the easiest fraction start..1 of the training split, all of it from full_at x "
                               "train.steps (plait.data.curriculum); {} off")
    class_weights: str = opt("none", "classification loss weights: none, or balanced (n / (classes * class count) on the "
                                     "training split)", ("none", "balanced"))

    def check(self, cfg) -> None:
        if self.curriculum:
            check_curriculum(self.curriculum, cfg)
        if self.augment_shift < 0 or not 0.0 <= self.augment_noise < math.inf:
            raise ConfigError(f"data.augment_shift = {self.augment_shift} and data.augment_noise = {self.augment_noise} "
                              "must be >= 0 (and finite)")
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction = {self.val_fraction} must be between 0 and 1 (exclusive)")
        cards = self.clicks_cardinalities
        if not cards or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 2 for c in cards):
            raise ConfigError(f"data.clicks_cardinalities = {cards} must be a non-empty list of integers >= 2, e.g. "
                              "[8, 64, 512]")
        bad = [a for a in self.augment if a not in AUGMENTATIONS]
        if bad:
            raise ConfigError(f"data.augment = {self.augment}: {bad} unknown; use any of {', '.join(AUGMENTATIONS)}")
        if self.image_size < 4 or self.workers < 0:
            raise ConfigError(f"data.image_size = {self.image_size} must be >= 4 and data.workers = {self.workers} >= 0")
        if self.pack and not self.factory and self.name not in ("chat", "text", "stdlib-text"):
            raise ConfigError(f"data.pack = true marks documents in chat, text and stdlib-text data; data.name = "
                              f"{self.name!r}: set data.pack=false")
        if self.pack and not self.factory and (cfg.model.factory or cfg.model.name not in ("gpt", "llama")):
            model = "model.factory's model" if cfg.model.factory else f"model.name = {cfg.model.name!r}"
            raise ConfigError(f"data.pack = true gives each row's positions with its tokens, which plait's gpt and llama "
                              f"read; {model} does not: set data.pack=false")
        if self.pack and cfg.parallel.pp > 1:
            raise ConfigError(f"data.pack = true with parallel.pp = {cfg.parallel.pp}: the later stages do not see each "
                              "example's positions; set data.pack=false or parallel.pp=1")
        if self.name == "large-digits" and 8 * self.digit_scale > self.canvas_size:
            raise ConfigError(f"data.digit_scale = {self.digit_scale} makes {8 * self.digit_scale}-pixel digits, larger "
                              f"than data.canvas_size = {self.canvas_size}; lower the scale or raise the canvas")
        if self.name in FILE_SOURCES and not self.path and not self.factory:
            raise ConfigError(f"data.name = {self.name!r} needs data.path (a file or folder); set --set data.path=...")


@keys("data")
class EpisodeKeys:
    ways: int = opt(3, "train.objective = meta: classes per few-shot episode (N-way)", minimum=2)
    shots: int = opt(5, "train.objective = meta: support samples per class (K-shot), what the learner adapts on",
                     minimum=1)
    queries: int = opt(5, "train.objective = meta: query samples per class, what an episode is scored on", minimum=1)
    holdout_classes: int = opt(3, "train.objective = meta: the source's last classes, never trained on; validation "
                                  "episodes draw from them alone", minimum=1)
    episodes: int = opt(10000, "train.objective = meta: training episodes, episode i drawn from (train.seed, i)",
                        minimum=1)


@keys("data")
class StreamKeys:
    stream: list = opt([], "continual learning: tasks or data versions trained one after another, each a table of "
                           "[data] keys over these, e.g. [{classes = [0, 1, 2, 3, 4]}, {classes = [5, 6, 7, 8, 9]}]; "
                           "train.steps is cut into equal spans (plait.data.stream); [] off")
    classes: list = opt([], "classification: keep only these classes (both splits, labels unchanged); [] all")
    replay: float = opt(0.0, "data.stream: the share of each batch after the first task drawn from the earlier "
                             "tasks' training samples (experience replay)", minimum=0, finite=True)

    def check(self, cfg) -> None:
        if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in self.classes):
            raise ConfigError(f"data.classes = {self.classes} must be a list of class indices >= 0, e.g. [0, 1, 2]")
        if self.replay >= 1:
            raise ConfigError(f"data.replay = {self.replay} must be below 1 (it is the share of each batch drawn from "
                              "earlier tasks), e.g. 0.25")
        if self.replay and not self.stream:
            raise ConfigError("data.replay replays earlier tasks of data.stream; set data.stream or data.replay=0")
        if self.stream:
            check_stream(self.stream, cfg)


def check_stream(stream: list, cfg) -> None:
    names = {f.name for f in dataclasses.fields(cfg.data)}
    if len(stream) < 2 or not all(isinstance(e, dict) for e in stream):
        raise ConfigError(f"data.stream = {stream!r} must list two or more tasks, each a table of [data] keys, e.g. "
                          "[{classes = [0, 1, 2, 3, 4]}, {classes = [5, 6, 7, 8, 9]}]")
    for k, entry in enumerate(stream):
        bad = sorted(set(entry) - names) + sorted(n for n in ("stream", "replay") if n in entry)
        if bad:
            raise ConfigError(f"data.stream[{k}] sets {bad}, which are not [data] keys a task can set; use keys such "
                              "as classes, path, exclude or name")
    if cfg.train.steps < len(stream):
        raise ConfigError(f"data.stream has {len(stream)} tasks but train.steps = {cfg.train.steps}: give every "
                          "task at least one step")
    if cfg.data.curriculum or cfg.data.sampler != "shuffle":
        raise ConfigError("data.stream orders the samples itself (task by task); data.curriculum and data.sampler = "
                          "'balanced' cannot apply too: turn them off")


CURRICULUM_KEYS = {"score", "pacing", "start", "full_at", "model"}


def check_curriculum(c: dict, cfg) -> None:
    unknown = sorted(set(c) - CURRICULUM_KEYS)
    if unknown:
        raise ConfigError(f"data.curriculum has unknown keys {unknown}; it takes score, pacing, start, full_at and model, "
                          "e.g. {score = 'length', pacing = 'root', start = 0.2}")
    score = c.get("score")
    if not isinstance(score, str) or not score:
        raise ConfigError("data.curriculum.score is missing: 'length', 'loss' or a JSON file of one score per sample")
    if c.get("pacing", "linear") not in ("linear", "root"):
        raise ConfigError(f"data.curriculum.pacing = {c['pacing']!r}: choose linear or root")
    for key, default in (("start", 0.2), ("full_at", 0.5)):
        v = c.get(key, default)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v <= 1:
            raise ConfigError(f"data.curriculum.{key} = {v!r} must be a number in (0, 1], e.g. {default}")
    if score == "loss" and not (c.get("model") or cfg.train.init_from):
        raise ConfigError("data.curriculum.score = 'loss' scores samples by a trained model's loss: set "
                          "data.curriculum.model = RUN_DIR (or train.init_from)")
    if cfg.data.sampler != "shuffle":
        raise ConfigError(f"data.curriculum orders the samples itself; data.sampler = {cfg.data.sampler!r} cannot "
                          "apply too: set data.sampler='shuffle'")

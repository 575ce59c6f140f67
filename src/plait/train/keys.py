"""The training loop's keys: [train], [optim], [checkpoint], [log], [distill], and its callbacks' keys.

Torch-free: `plait config show` lists them without importing torch. The optimizers' names are
published here (plait.train.optim builds them by these names); the trackers' come from
plait.report.trackers.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

from plait.config import keys, opt
from plait.errors import ConfigError
from plait.extras import install_command
from plait.report.trackers import TRACKERS

# optim.name: every optimizer plait builds (plait.train.optim), and those whose update is elementwise, so that a step
# on a shard of a tensor is that shard of the whole step (what ZeRO and chunked offload need).
OPTIMIZERS = ("adamw", "sgd", "lamb", "lars", "adamw8bit")
ELEMENTWISE_OPTIMIZERS = ("adamw", "sgd")
# not elementwise, but right on ZeRO-2/3's DTensor shards: one norm per tensor (lamb, lars: DTensor reduces it), and
# block-quantized states (adamw8bit: each rank's shard in its own blocks)
DTENSOR_OPTIMIZERS = ("lamb", "lars", "adamw8bit")
SAMPLE_PROMPT = "def "  # train.sample_prompt's default, for the default job's Python text
# train.objective: the preference objectives (plait.train.preference), trained on data.name = "preference"
PREFERENCE_OBJECTIVES = ("dpo", "ipo", "simpo")


@keys("train")
class TrainKeys:
    steps: int = opt(400, "optimizer steps of the whole run (resumed steps included); the LR schedule spans them",
                     minimum=1)
    stop_after: int = opt(0, "end this session after this step and checkpoint it (0: run to train.steps)", minimum=0)
    global_batch_size: int = opt(32, "samples per optimizer step, summed over data-parallel ranks", minimum=1)
    micro_batch_size: int = opt(16, "samples per forward/backward; accumulation = global / (micro * dp)", minimum=1)
    seed: int = opt(1234, "seed for model init and the data order")
    init_seed: int = opt(-1, "seed for model init alone (-1: train.seed); member k of model.ensemble starts from "
                             "init_seed + k", minimum=-1)
    eval_every: int = opt(100, "evaluate on validation data every N steps and at the end (0: only at the end)",
                          minimum=0)
    eval_samples: int = opt(256, "validation samples per evaluation", minimum=0)
    eval_batch_size: int = opt(16, "samples per validation batch (fixed, so the figure is layout-independent)",
                               minimum=1)
    sample_tokens: int = opt(200, "language models: tokens (characters) to generate as a sample at the end (0: none)",
                             minimum=0)
    sample_prompt: str = opt(SAMPLE_PROMPT, "language models: prompt for the generated sample; data.name = 'chat': a "
                                            "user's turn through the chat template (left as it is: the first "
                                            "held-out example's opening)")
    objective: str = opt("supervised", "supervised (the data's labels), contrastive (two augmented views per sample, "
                                       "NT-Xent against the whole global batch, a linear probe at the end) or meta "
                                       "(few-shot episodes, train.meta_algorithm; plait.models.fewshot); dpo, ipo, "
                                       "simpo: preference tuning on data.name = 'preference' (train.dpo_beta; "
                                       "plait.train.preference)",
                         ("supervised", "contrastive", "meta", *PREFERENCE_OBJECTIVES))
    temperature: float = opt(0.5, "train.objective = contrastive: the NT-Xent temperature")
    loss: str = opt("", "'package.module:function' (outputs, targets) -> the micro-batch's mean loss, instead of the "
                        "data's task loss (cross-entropy, mse, ...); 'focal': focal loss (train.focal_gamma); "
                        "validation reports it as val_loss")
    focal_gamma: float = opt(2.0, "train.loss = 'focal': the focusing exponent gamma (0: cross-entropy)", minimum=0,
                             finite=True)
    eval_metrics: list = opt([], "'package.module:function' (outputs, targets) -> a batch mean, each reported as "
                                 "val_<function> at every evaluation")
    init_from: str = opt("", "start from these weights: a run directory (its latest checkpoint), a model.safetensors or "
                             "a Hugging Face directory (config.json sets [model]); names and shapes must match; "
                             "step, optimizer and schedule start fresh")
    trust_factory: bool = opt(False, "train.init_from a run directory whose model.factory is not this job's (nor "
                                     "plait's own): build it anyway (importing and calling that code)")

    def check(self, cfg) -> None:
        if not 0.0 < self.temperature < math.inf:
            raise ConfigError(f"train.temperature = {self.temperature} must be > 0, e.g. 0.5")


@keys("train")
class MetaKeys:
    meta_algorithm: str = opt("reptile", "train.objective = meta: reptile (theta moves optim.lr of the way to the "
                                         "adapted weights) or fomaml (first-order MAML: the query loss's gradient at "
                                         "the adapted weights)", ("reptile", "fomaml"))
    inner_steps: int = opt(5, "train.objective = meta: plain SGD steps on each episode's support set", minimum=1)
    inner_lr: float = opt(0.1, "train.objective = meta: the learning rate of those steps", above=0, finite=True)


@keys("train")
class PreferenceKeys:
    dpo_beta: float = opt(0.1, "train.objective = dpo: beta, the strength of the pull to the reference model (TRL's "
                               "DPOConfig.beta); ipo: tau, the target log-ratio margin is 1 / (2 beta); simpo: the "
                               "reward's scale", above=0, finite=True)
    simpo_gamma: float = opt(0.5, "train.objective = simpo: gamma, the target reward margin (TRL's "
                                  "CPOConfig.simpo_gamma)", minimum=0, finite=True)

    def check(self, cfg) -> None:
        preference_data = cfg.data.name == "preference" and not cfg.data.factory
        if (cfg.train.objective in PREFERENCE_OBJECTIVES) != preference_data:
            if preference_data:
                raise ConfigError("data.name = 'preference' holds prompt/chosen/rejected pairs: set train.objective to "
                                  "one of dpo, ipo or simpo (or use data.name = 'chat' for supervised fine-tuning)")
            raise ConfigError(f"train.objective = {cfg.train.objective!r} trains on prompt/chosen/rejected pairs: set "
                              "data.name = 'preference' and data.path to their JSONL file")


LOSS_NORMALIZATIONS = ("sequences", "tokens")  # train.loss_normalization (plait.train.loss)


@keys("train")
class LossNormKeys:
    loss_normalization: str = opt("sequences", "chat data: sequences (the mean over each row's trained tokens, then "
                                               "over the rows) or tokens (the mean over every trained token of the "
                                               "global batch, as TRL's SFTTrainer and torchtune normalise); both "
                                               "layout-independent", LOSS_NORMALIZATIONS)

    def check(self, cfg) -> None:
        if self.loss_normalization == "sequences":
            return
        if cfg.data.name != "chat" or cfg.train.loss:
            raise ConfigError(f"train.loss_normalization = 'tokens' normalises the chat loss over the trained tokens; "
                              f"data.name = {cfg.data.name!r}, train.loss = {cfg.train.loss!r} has none: set "
                              "data.name = 'chat' and train.loss = '' (or train.loss_normalization = 'sequences')")
        if cfg.parallel.cp > 1 or cfg.distill.teacher:
            raise ConfigError("train.loss_normalization = 'tokens' is untested with parallel.cp > 1 and [distill]; "
                              "set parallel.cp = 1 and distill.teacher = '' (or train.loss_normalization = "
                              "'sequences')")


@keys("train")
class ContinualKeys:
    ewc: float = opt(0.0, "data.stream: elastic weight consolidation's lambda, the pull of each finished task's "
                          "weights weighted by its Fisher information (plait.train.continual); 0 off", minimum=0,
                     finite=True)
    ewc_samples: int = opt(256, "train.ewc: training samples of a finished task its Fisher diagonal is averaged over",
                           minimum=1)

    def check(self, cfg) -> None:
        if self.ewc and not cfg.data.stream:
            raise ConfigError("train.ewc consolidates the tasks of data.stream; set data.stream or train.ewc=0")
        if self.ewc and cfg.precision.dtype == "fp16":
            raise ConfigError("train.ewc adds its penalty's gradient to unscaled gradients; precision.dtype = 'fp16' "
                              "scales them: use bf16 or fp32")


EARLY_STOP_METRICS = {"val_loss": "min", "val_accuracy": "max"}  # what early stopping and keep_best can follow
EARLY_STOP_KEYS = {"metric", "patience", "min_delta"}


@keys("train")
class EarlyStopKeys:
    early_stop: dict = opt({}, "stop when a validation metric has not improved for `patience` evaluations: "
                               "{metric = 'val_loss', patience = 3, min_delta = 0.0}; {} off")

    def check(self, cfg) -> None:
        spec = self.early_stop
        if not spec:
            return
        unknown = sorted(set(spec) - EARLY_STOP_KEYS)
        if unknown:
            raise ConfigError(f"train.early_stop has unknown keys {unknown}; it takes metric, patience and min_delta, "
                              "e.g. {metric = 'val_loss', patience = 3, min_delta = 0.0}")
        if spec.get("metric", "val_loss") not in EARLY_STOP_METRICS:
            raise ConfigError(f"train.early_stop.metric = {spec['metric']!r}: choose one of {sorted(EARLY_STOP_METRICS)}")
        p = spec.get("patience", 3)
        if not isinstance(p, int) or isinstance(p, bool) or p < 1:
            raise ConfigError(f"train.early_stop.patience = {p!r} must be an integer >= 1 (evaluations without improvement)")
        d = spec.get("min_delta", 0.0)
        if not isinstance(d, (int, float)) or isinstance(d, bool) or d < 0:
            raise ConfigError(f"train.early_stop.min_delta = {d!r} must be a number >= 0")


@keys("train")
class MemoryKeys:
    activation_compression: str = opt("none", "what autograd saves for backward, stored as bf16 (half of fp32's bytes) "
                                              "or int8 with a scale per row (about a quarter); backward computes with "
                                              "the decompressed tensors (approximate gradients)",
                                      ("none", "bf16", "int8"))
    channels_last: bool = opt(False, "convolutional models: weights and image batches in channels-last memory layout "
                                     "(NHWC), which many convolution kernels run faster")


TARGET_KEYS = {"metric", "value"}


@keys("train")
class TargetKeys:
    target: dict = opt({}, "record when a validation metric first reaches a value: step, samples/tokens, wall time, "
                           "device-hours (and launch.device_hour_cost's cost): {metric = 'val_loss', value = 2.0}; {} off")

    def check(self, cfg) -> None:
        spec = self.target
        if not spec:
            return
        unknown = sorted(set(spec) - TARGET_KEYS)
        if unknown:
            raise ConfigError(f"train.target has unknown keys {unknown}; it takes metric and value, e.g. "
                              "{metric = 'val_loss', value = 2.0}")
        if spec.get("metric", "val_loss") not in EARLY_STOP_METRICS:
            raise ConfigError(f"train.target.metric = {spec['metric']!r}: choose one of {sorted(EARLY_STOP_METRICS)}")
        v = spec.get("value")
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise ConfigError(f"train.target.value = {v!r} must be a number, e.g. {{metric = 'val_loss', value = 2.0}}")


@keys("optim")
class OptimKeys:
    name: str = opt("adamw", "optimizer: adamw, sgd, lamb or lars (layer-wise trust ratios, You et al.), adamw8bit "
                             "(torchao's 8-bit AdamW states)", OPTIMIZERS)
    lr: float = opt(6e-3, "peak learning rate", finite=True, above=0)
    weight_decay: float = opt(0.01, "decoupled weight decay (adamw) or L2 (sgd)", minimum=0, finite=True)
    betas: list = opt([0.9, 0.95], "adamw: (beta1, beta2)")
    eps: float = opt(1e-8, "adamw: epsilon", finite=True)
    momentum: float = opt(0.9, "sgd: momentum", finite=True)
    warmup_steps: int = opt(30, "linear warmup steps from 0 to lr", minimum=0)
    schedule: str = opt("cosine", "after warmup: cosine decay to min_lr_ratio * lr, or constant", ("cosine", "constant"))
    min_lr_ratio: float = opt(0.1, "final learning rate as a fraction of lr (cosine)", finite=True)
    grad_clip: float = opt(1.0, "clip the global gradient norm to this value (0: off)", minimum=0, finite=True)
    lr_scaling: str = opt("none", "scale lr by train.global_batch_size / base_batch_size: none, linear (Goyal et al. "
                                  "2017) or sqrt (Krizhevsky 2014)", ("none", "linear", "sqrt"))
    base_batch_size: int = opt(32, "lr_scaling: the global batch size at which optim.lr was tuned")
    trust_coefficient: float = opt(0.001, "lars: eta in the layer-wise rate eta * |w| / (|g| + weight_decay * |w|)")
    fused: bool = opt(False, "adamw and sgd: torch's fused implementation, one kernel for every parameter's update "
                             "(the same arithmetic; plait whatif --change fuse_optimizer predicts what it saves)")

    def check(self, cfg) -> None:
        if len(self.betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in self.betas):
            raise ConfigError(f"optim.betas = {self.betas} must be two numbers in [0, 1), e.g. [0.9, 0.95]")
        if self.base_batch_size < 1:
            raise ConfigError(f"optim.base_batch_size = {self.base_batch_size} must be >= 1 (the batch size optim.lr "
                              "was tuned at)")
        if not 0 < self.trust_coefficient < math.inf:
            raise ConfigError(f"optim.trust_coefficient = {self.trust_coefficient} must be > 0, e.g. 0.001")
        if self.fused and self.name not in ("adamw", "sgd"):
            raise ConfigError(f"optim.fused = true is torch's fused AdamW and SGD; optim.name = {self.name!r} has no "
                              "fused form: set optim.fused=false")
        if self.name == "adamw8bit" and importlib.util.find_spec("torchao") is None:
            raise ConfigError(f"optim.name = 'adamw8bit' uses torchao's AdamW8bit: {install_command('lowbit')} "
                              "(torchao), or set optim.name='adamw'")


@keys("checkpoint")
class CheckpointKeys:
    every: int = opt(100, "write a checkpoint every N steps (0: only the final one)", minimum=0)
    keep: int = opt(2, "checkpoints to keep (the newest); at least 1", minimum=1)
    keep_best: str = opt("", "also keep the checkpoint with the best validation metric (val_loss or val_accuracy) as "
                             "checkpoints/best; '' off")
    async_: bool = opt(False, "write checkpoints in the background (DCP async_save); training waits only for "
                              "the copy to memory")

    def check(self, cfg) -> None:
        if self.keep_best and self.keep_best not in EARLY_STOP_METRICS:
            raise ConfigError(f"checkpoint.keep_best = {self.keep_best!r}: choose one of {sorted(EARLY_STOP_METRICS)} "
                              "(or '' for off)")
        if (self.keep_best or cfg.train.early_stop) and not cfg.train.eval_every:
            what = "train.early_stop" if cfg.train.early_stop else "checkpoint.keep_best"
            raise ConfigError(f"{what} decides at evaluations: set train.eval_every (e.g. --set train.eval_every=50)")


@keys("log")
class LogKeys:
    every: int = opt(10, "write a metrics.jsonl line (and refresh the progress bar text) every N steps", minimum=1)
    progress: bool = opt(True, "show a live progress bar on rank 0")
    report: bool = opt(True, "write report.html with plots at the end")
    profile_steps: list = opt([], "torch.profiler Chrome traces of steps [first, last] to RUN_DIR/traces/rank<r>.json")
    trackers: list = opt([], "live views of the metrics besides metrics.jsonl (rank 0): \"tensorboard\" (event files in "
                             "RUN_DIR/tensorboard), \"mlflow\" (a file store in RUN_DIR/mlruns), \"wandb\" (an offline run "
                             "in RUN_DIR/wandb); each needs its extra of the same name")

    def check(self, cfg) -> None:
        ps = self.profile_steps
        if ps and (len(ps) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in ps)
                   or not 1 <= ps[0] <= ps[1]):
            raise ConfigError(f"log.profile_steps = {ps} must be [first, last] with 1 <= first <= last, e.g. [10, 12]")
        for tracker in self.trackers:
            if not isinstance(tracker, str) or tracker not in TRACKERS:
                raise ConfigError(f"log.trackers: {tracker!r} is not a tracker plait writes; choose from {sorted(TRACKERS)}")
            package = TRACKERS[tracker][0]
            if importlib.util.find_spec(package) is None:
                raise ConfigError(f"log.trackers = [{tracker!r}] needs the {package} package: {install_command(tracker)}")


@keys("distill")
class DistillKeys:
    teacher: str = opt("", "knowledge distillation from this run directory's model (eval mode, no gradient); '' off")
    # defaults: what benchmarks/finetune.py found best (docs/finetune.md: 0.5 and 2 did worse than no teacher)
    temperature: float = opt(1.0, "distillation: softmax temperature of teacher and student logits")
    alpha: float = opt(0.9, "distillation: weight of the soft-target KL term (x temperature^2); 1 - alpha: the hard labels")

    def check(self, cfg) -> None:
        if not self.teacher:
            return
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"distill.alpha = {self.alpha} must be in [0, 1] (the weight of the soft-target term), "
                              "e.g. 0.5")
        if not 0.0 < self.temperature < float("inf"):
            raise ConfigError(f"distill.temperature = {self.temperature} must be > 0, e.g. 2.0")
        if not (Path(self.teacher) / "config.toml").is_file():
            raise ConfigError(f"distill.teacher = {self.teacher!r} is not a plait run directory (no config.toml); "
                              "give the --out of a trained run")

"""The typed config: one dataclass per TOML section, every field with a one-line doc.

Usage::

    cfg = load_config("job.toml", overrides=["parallel.dp=2", "train.steps=100"])
    print(format_config(cfg))          # what `plait config show` prints
    text = dump_config(cfg)            # the resolved TOML written to a run dir

Unknown keys, wrong types and impossible layouts raise ConfigError before any
worker starts; the message names the key, the rule and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plait.errors import ConfigError

# --------------------------------------------------------------------------- helpers


def opt(default: Any, doc: str, choices: tuple | None = None, accepts: tuple = ()) -> Any:
    """A config field with its one-line description (and allowed values, if a fixed set).

    accepts: further types taken and converted to the field's type (launch.nnodes takes 2 or "1:2").
    """
    meta = {"doc": doc, "choices": choices, "accepts": accepts}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


# --------------------------------------------------------------------------- sections


@dataclass
class ModelConfig:
    name: str = opt("gpt", "registered model: gpt, mlp, cnn (ignored when factory is set)")
    factory: str = opt("", "'package.module:function' returning your own nn.Module; called with **options")
    options: dict = opt({}, "keyword arguments passed to the factory")
    layers: int = opt(4, "gpt: number of transformer blocks")
    heads: int = opt(4, "gpt: attention heads per block (must divide width)")
    width: int = opt(128, "gpt: embedding width d_model; mlp/cnn: hidden width")
    context: int = opt(128, "gpt: context length in tokens (the training sequence length)")
    vocab_size: int = opt(0, "gpt: vocabulary size; 0 takes the data's tokenizer size")
    tie_embeddings: bool = opt(True, "gpt: share the token embedding with the output head")
    activation: str = opt("gelu", "gpt: the dense blocks' GELU: exact, or gelu_tanh (the tanh approximation of GPT-2)",
                          ("gelu", "gelu_tanh"))
    norm_eps: float = opt(1e-5, "gpt: epsilon of every LayerNorm")
    dropout: float = opt(0.0, "dropout probability (0 keeps trajectories layout-independent)")
    depth: int = opt(2, "mlp and deepfm: hidden layers; cnn: convolution blocks")
    embedding_dim: int = opt(8, "deepfm: embedding width per categorical field")
    moe_experts: int = opt(0, "gpt: experts per mixture-of-experts block (0: dense feed-forward blocks)")
    moe_top_k: int = opt(1, "gpt MoE: experts each token is routed to (1: Switch; 2: GShard, Mixtral)")
    moe_every: int = opt(1, "gpt MoE: every k-th block is a mixture of experts (1: all; 2: blocks 1, 3, ...)")
    moe_capacity_factor: float = opt(0.0, "gpt MoE: training capacity per expert and sequence = factor * tokens * "
                                          "top_k / experts; extra assignments are dropped (0: dropless)")
    moe_aux_weight: float = opt(0.01, "gpt MoE: weight of the Switch load-balancing loss added to the training loss")
    projection_dim: int = opt(32, "train.objective = contrastive: width of the projection head on top of the encoder")


@dataclass
class DataConfig:
    name: str = opt(
        "stdlib-text",
        "data source: stdlib-text, digits, synthetic, clicks, text (a file or folder), tensors (.npy/.pt), "
        "images (a folder with one sub-folder per class), packed (a folder written by `plait data pack`), table (a CSV or "
        "Parquet file; ignored when factory is set)",
        ("stdlib-text", "digits", "synthetic", "clicks", "text", "tensors", "images", "packed", "table"),
    )
    factory: str = opt("", "'package.module:function' returning your own map-style dataset (__len__, __getitem__ giving "
                           "(input, target); optional collate) or a (train, val) pair; called with **data.options")
    options: dict = opt({}, "keyword arguments passed to data.factory")
    features: list = opt([], "table: the feature columns (empty: every column but data.target)")
    target: str = opt("", "table: the column to predict")
    task: str = opt("auto", "table and data.factory: classification or regression (mse loss); auto: regression when the "
                            "targets are non-integer numbers", ("auto", "classification", "regression"))
    path: str = opt("", "text: a text file or a folder of files; tensors: a .npy or .pt file; images: a folder of "
                        "class folders; packed: the folder `plait data pack` wrote")
    val_fraction: float = opt(0.1, "share of files (text) or samples (others) held out for validation")
    min_char_count: int = opt(50, "text: characters seen fewer times in training map to <unk>")
    tokenizer: str = opt("", "text: a Hugging Face tokenizer.json to encode with (the tokenizers library) instead of "
                             "characters; set from train.init_from when it is a Hugging Face directory with one")
    synthetic_samples: int = opt(4096, "synthetic and clicks: number of samples generated")
    synthetic_features: int = opt(64, "synthetic: features per sample")
    synthetic_classes: int = opt(10, "synthetic: number of classes")
    clicks_cardinalities: list = opt([8, 64, 512, 4096, 32768], "clicks: categories per categorical field")
    clicks_dense: int = opt(4, "clicks: real-valued features per sample")
    prefetch: int = opt(2, "batches prepared ahead of compute by a background thread (0: none)")
    augment_shift: int = opt(1, "contrastive views of images: random shift of up to this many pixels (0: none)")
    augment_noise: float = opt(0.1, "contrastive views: std of the Gaussian noise added to every input")
    augment: list = opt([], "training-time augmentations of images, in order: random_crop, hflip, noise (std "
                            "data.augment_noise), each seeded per (seed, sample index, epoch)")
    workers: int = opt(0, "processes that fetch and decode batches (images, packed shards) in parallel; the order "
                          "stays the sampler's (0: the background thread only)")
    image_size: int = opt(32, "images: every image is resized to image_size x image_size pixels (RGB)")
    on_bad_sample: str = opt("error", "images and packed data: a sample that cannot be decoded is an error naming "
                                      "the file, or is skipped (replaced by the next good one) and counted",
                             ("error", "skip"))
    exclude: str = opt("", "an audit.json from `plait data audit`: train without the samples it flags")
    sampler: str = opt("shuffle", "training order: shuffle (a permutation per epoch) or balanced (each batch drawn with "
                                  "replacement, every class equally likely; seeded per step)", ("shuffle", "balanced"))
    class_weights: str = opt("none", "classification loss weights: none, or balanced (n / (classes * class count) on the "
                                     "training split)", ("none", "balanced"))


@dataclass
class TrainConfig:
    steps: int = opt(400, "optimizer steps of the whole run (resumed steps included); the LR schedule spans them")
    stop_after: int = opt(0, "end this session after this step and checkpoint it (0: run to train.steps)")
    global_batch_size: int = opt(32, "samples per optimizer step, summed over data-parallel ranks")
    micro_batch_size: int = opt(16, "samples per forward/backward; accumulation = global / (micro * dp)")
    seed: int = opt(1234, "seed for model init and the data order")
    eval_every: int = opt(100, "evaluate on validation data every N steps and at the end (0: only at the end)")
    early_stop: dict = opt({}, "stop when a validation metric has not improved for `patience` evaluations: "
                               "{metric = 'val_loss', patience = 3, min_delta = 0.0}; {} off")
    eval_samples: int = opt(256, "validation samples per evaluation")
    eval_batch_size: int = opt(16, "samples per validation batch (fixed, so the figure is layout-independent)")
    activation_checkpointing: bool = opt(False, "recompute each block's activations in backward to save memory")
    compile: bool = opt(False, "torch.compile each block")
    sample_tokens: int = opt(200, "gpt: characters to generate as a sample at the end (0: none)")
    sample_prompt: str = opt("def ", "gpt: prompt for the generated sample")
    objective: str = opt("supervised", "supervised (the data's labels) or contrastive (two augmented views per sample, "
                                       "NT-Xent against the whole global batch, a linear probe at the end)",
                         ("supervised", "contrastive"))
    temperature: float = opt(0.5, "train.objective = contrastive: the NT-Xent temperature")
    loss: str = opt("", "'package.module:function' (outputs, targets) -> the micro-batch's mean loss, instead of the "
                        "data's task loss (cross-entropy, mse, ...); validation reports it as val_loss")
    eval_metrics: list = opt([], "'package.module:function' (outputs, targets) -> a batch mean, each reported as "
                                 "val_<function> at every evaluation")
    init_from: str = opt("", "start from these weights: a run directory (its latest checkpoint), a model.safetensors or "
                             "a Hugging Face GPT-2 directory (config.json sets [model]); names and shapes must match; "
                             "step, optimizer and schedule start fresh")


@dataclass
class OptimConfig:
    name: str = opt("adamw", "optimizer: adamw, sgd, lamb or lars (layer-wise trust ratios, You et al.), adamw8bit "
                             "(torchao's 8-bit AdamW states)", ("adamw", "sgd", "lamb", "lars", "adamw8bit"))
    lr: float = opt(6e-3, "peak learning rate")
    weight_decay: float = opt(0.01, "decoupled weight decay (adamw) or L2 (sgd)")
    betas: list = opt([0.9, 0.95], "adamw: (beta1, beta2)")
    eps: float = opt(1e-8, "adamw: epsilon")
    momentum: float = opt(0.9, "sgd: momentum")
    warmup_steps: int = opt(30, "linear warmup steps from 0 to lr")
    schedule: str = opt("cosine", "after warmup: cosine decay to min_lr_ratio * lr, or constant", ("cosine", "constant"))
    min_lr_ratio: float = opt(0.1, "final learning rate as a fraction of lr (cosine)")
    grad_clip: float = opt(1.0, "clip the global gradient norm to this value (0: off)")
    lr_scaling: str = opt("none", "scale lr by train.global_batch_size / base_batch_size: none, linear (Goyal et al. "
                                  "2017) or sqrt (Krizhevsky 2014)", ("none", "linear", "sqrt"))
    base_batch_size: int = opt(32, "lr_scaling: the global batch size at which optim.lr was tuned")
    trust_coefficient: float = opt(0.001, "lars: eta in the layer-wise rate eta * |w| / (|g| + weight_decay * |w|)")


@dataclass
class ParallelConfig:
    dp: int | str = opt(2, "data-parallel degree (model replicas); \"auto\": fill the machine's processes (every local "
                           "GPU, or launch.nproc_per_node) divided by tp x pp")
    tp: int = opt(1, "tensor-parallel degree (each block's matrices split across ranks)")
    pp: int = opt(1, "pipeline-parallel degree (stages of consecutive blocks)")
    zero: int = opt(0, "ZeRO stage on the dp axis: 0 off, 1 optimizer states, 2 + gradients, 3 + parameters",
                    (0, 1, 2, 3))
    offload: str = opt("none", "optimizer state out of device memory: none; disk (memory-mapped files under "
                       "RUN_DIR/offload, zero 0/1); optimizer (host memory, GPU runs, zero 0/1); params (FSDP2's CPU "
                       "offload of parameters, gradients and state, GPU runs, zero 2/3)",
                       ("none", "disk", "optimizer", "params"))
    shard_init: bool = opt(True, "zero 2/3, tp or pp: build the model on the meta device and materialise only this "
                           "rank's shards (the same values as a single process's initialisation)")
    pp_schedule: str = opt("1f1b", "pipeline schedule: gpipe, 1f1b, interleaved-1f1b or pipedream (PipeDream-2BW: 1F1B "
                           "with no flush between steps, weights stashed in two versions, updates one version stale)",
                           ("gpipe", "1f1b", "interleaved-1f1b", "pipedream"))
    microbatches: int = opt(0, "pipeline micro-batches per step (0: global_batch_size / (micro_batch_size * dp))")
    virtual_stages: int = opt(1, "interleaved-1f1b: model chunks per pipeline rank")
    pp_split: list | str = opt([], "block indices where pipeline stages begin, e.g. [2] (empty: balance by parameters; "
                                   "\"auto\": by each block's time measured on each pipeline rank, HetPipe-style)")
    sequence_parallel: bool = opt(False, "with tp: shard LayerNorm/dropout activations along the sequence")
    sync: str = opt("allreduce", "how dp replicas agree: allreduce, ps (parameter server) or gossip",
                    ("allreduce", "ps", "gossip"))
    ps_servers: int = opt(1, "ps: parameter-server processes, in addition to the dp workers")
    ps_mode: str = opt("sync", "ps: sync, async, or ssp (bounded staleness)", ("sync", "async", "ssp"))
    ps_placement: str = opt("dedicated", "ps: dedicated (ps_servers processes beside the workers) or colocated (every "
                            "worker also serves 1/dp of the parameters, BytePS-style; no server processes)",
                            ("dedicated", "colocated"))
    staleness: int = opt(0, "ps ssp: steps a worker may run ahead of the slowest one")
    gossip_every: int = opt(1, "gossip: average with graph neighbours every N steps")
    gossip_topology: str = opt("ring", "gossip: ring or exponential graph", ("ring", "exponential"))
    gossip_async: bool = opt(False, "gossip: AD-PSGD, each active (even) rank averages with one random passive "
                                    "neighbour after its step, no global barrier (needs sync = 'gossip', even dp)")
    compression: str = opt("none", "dp all-reduce compression: none, fp16, bf16, powersgd, topk or int8",
                           ("none", "fp16", "bf16", "powersgd", "topk", "int8"))
    powersgd_rank: int = opt(2, "compression = powersgd: rank of the low-rank approximation")
    topk_ratio: float = opt(0.01, "compression = topk: fraction of gradient entries sent")
    allreduce: str = opt("native", "DDP's gradient all-reduce: native (torch.distributed's) or plait's own ring, tree "
                         "(halving-doubling) or hierarchical (plait.comm.algorithms), as a DDP comm hook",
                         ("native", "ring", "tree", "hierarchical"))
    allreduce_local_size: int = opt(0, "allreduce = hierarchical: consecutive ranks per node (0: the processes per "
                                       "node, LOCAL_WORLD_SIZE)")
    embedding_sharding: str = opt("none", "deepfm: shard embedding tables over dp ranks: none, table (whole tables) "
                                          "or row (rows of every table); the dense part stays data parallel",
                                  ("none", "table", "row"))
    ep: int = opt(1, "expert-parallel degree: each MoE layer's experts split over ep data-parallel ranks "
                     "(ep divides dp and model.moe_experts); the dense part stays data parallel")
    hetero: str = opt("", "data parallel on devices of unequal speed: 'auto' gives each rank a share of the global "
                          "batch proportional to its measured throughput, '1,3' fixes relative speeds; '' off")
    hetero_every: int = opt(20, "parallel.hetero = 'auto': re-measure and re-split every N steps")


@dataclass
class PrecisionConfig:
    dtype: str = opt("fp32", "compute dtype under autocast: fp32, bf16 or fp16 (fp16 uses loss scaling)", ("fp32", "bf16", "fp16"))


@dataclass
class CheckpointConfig:
    every: int = opt(100, "write a checkpoint every N steps (0: only the final one)")
    keep: int = opt(2, "checkpoints to keep (the newest); at least 1")
    keep_best: str = opt("", "also keep the checkpoint with the best validation metric (val_loss or val_accuracy) as "
                             "checkpoints/best; '' off")
    async_: bool = opt(False, "write checkpoints in the background (DCP async_save); training waits only for "
                              "the copy to memory")


@dataclass
class LaunchConfig:
    nproc_per_node: int | str = opt(0, "worker processes on this machine; 0 = what the layout needs; \"auto\": every "
                                       "local GPU (on CPU: what the layout needs)")
    nnodes: str = opt("1", "machines in the job: N, or MIN:MAX for an elastic job that goes on with MIN to MAX",
                      accepts=(int,))
    node_rank: int = opt(0, "this machine's index in the job (0 hosts the rendezvous)")
    rdzv_endpoint: str = opt("", "host:port of the rendezvous (node 0); empty for a single machine")
    local_addr: str = opt("", "this machine's address as the others reach it (default: node 0 takes the host of "
                              "rdzv_endpoint, other nodes their hostname)")
    rdzv_backend: str = opt("c10d", "torchrun rendezvous backend: c10d or static", ("c10d", "static"))
    max_restarts: int = opt(0, "times torchrun's agent restarts failed workers")
    on_resize: str = opt("dp", "an elastic job whose world size changed: dp (keep tp and pp, adapt data parallelism) "
                               "or replan (when tp x pp or the batch no longer divides, the fastest fitting layout "
                               "plait plan finds for the new size)", ("dp", "replan"))
    heartbeat_s: int = opt(5, "elastic jobs (c10d rendezvous): seconds between a node's heartbeats; a node silent for "
                              "3 of them is dropped and the others re-form without it")
    launcher: str = opt("torchrun", "what starts the workers: torchrun (its elastic agent) or ray (a Ray Train TorchTrainer "
                                    "on RAY_ADDRESS or a local Ray cluster; pip install 'plait[ray]')", ("torchrun", "ray"))
    backend: str = opt("auto", "process-group backend: auto (nccl on CUDA, else gloo), gloo or nccl", ("auto", "gloo", "nccl"))
    device: str = opt("auto", "auto (cuda when available, else cpu), cpu or cuda", ("auto", "cpu", "cuda"))
    timeout_s: int = opt(300, "seconds a collective may wait before it is an error naming the ranks that did not join")
    check_collectives: bool = opt(False, "fingerprint every collective and compare across ranks (slower; finds the "
                                         "mismatch behind a hang)")


TRACKERS = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}  # log.trackers: name -> the package it needs


@dataclass
class LogConfig:
    every: int = opt(10, "write a metrics.jsonl line (and refresh the progress bar text) every N steps")
    progress: bool = opt(True, "show a live progress bar on rank 0")
    report: bool = opt(True, "write report.html with plots at the end")
    profile_steps: list = opt([], "torch.profiler Chrome traces of steps [first, last] to RUN_DIR/traces/rank<r>.json")
    trackers: list = opt([], "live views of the metrics besides metrics.jsonl (rank 0): \"tensorboard\" (event files in "
                             "RUN_DIR/tensorboard), \"mlflow\" (a file store in RUN_DIR/mlruns), \"wandb\" (an offline run "
                             "in RUN_DIR/wandb); each its extra: pip install 'plait[NAME]'")


@dataclass
class FederatedConfig:
    strategy: str = opt("fedavg", "plait fed: fedavg, fedprox (+ mu), fedadam (server Adam) or fedsgd (the one-gradient baseline)",
                        ("fedavg", "fedprox", "fedadam", "fedsgd"))
    rounds: int = opt(30, "plait fed: communication rounds")
    clients: int = opt(10, "plait fed: data owners; the training set is partitioned into this many parts")
    clients_per_round: float = opt(1.0, "plait fed: clients sampled per round: a fraction (<= 1) or a count (> 1)")
    min_clients: int = opt(2, "plait fed: quorum; a round with fewer valid updates by its deadline leaves the model as it is")
    local_epochs: int = opt(2, "plait fed: passes over its own data each client makes per round (fedsgd: one full-batch gradient)")
    local_batch_size: int = opt(16, "plait fed: samples per local SGD step")
    local_lr: float = opt(0.1, "plait fed: clients' SGD learning rate (fedsgd: the server's gradient step)")
    local_momentum: float = opt(0.0, "plait fed: clients' SGD momentum (reset every round)")
    mu: float = opt(0.01, "plait fed: fedprox proximal weight: clients add mu/2 * |w - w_global|^2 to their loss")
    server_lr: float = opt(0.0, "plait fed: server step on the averaged update; 0 = 1.0 (fedavg/fedprox/fedsgd) or 0.01 (fedadam)")
    server_betas: list = opt([0.9, 0.99], "plait fed: fedadam (beta1, beta2) of the server optimizer")
    server_tau: float = opt(1e-3, "plait fed: fedadam adaptivity tau (Adam's epsilon, Reddi et al. 2021)")
    partition: str = opt("dirichlet", "plait fed: how the training set is split: iid, dirichlet (label skew, alpha) or shards",
                         ("iid", "dirichlet", "shards"))
    alpha: float = opt(0.5, "plait fed: Dirichlet concentration; small = each client sees few labels")
    shards_per_client: int = opt(2, "plait fed: partition = shards: label-sorted shards each client gets")
    aggregator: str = opt("mean", "plait fed: combine updates by weighted mean, coordinate-wise median or trimmed_mean",
                          ("mean", "median", "trimmed_mean"))
    trim_fraction: float = opt(0.1, "plait fed: trimmed_mean: share of the largest and smallest values dropped per coordinate")
    clip_norm: float = opt(0.0, "plait fed: the server scales every update's L2 norm down to this (0: off)")
    norm_bound: float = opt(5.0, "plait fed: updates above this multiple of the round's median norm are scaled to it (0: off)")
    secure_aggregation: bool = opt(False, "plait fed: pairwise-masked updates; the server learns only their sum (Bonawitz et al.)")
    dp_noise_multiplier: float = opt(0.0, "plait fed: client-level DP: Gaussian noise std / clip norm (0: no DP)")
    dp_clip_norm: float = opt(1.0, "plait fed: client-level DP: each client's update is clipped to this L2 norm")
    dp_delta: float = opt(1e-5, "plait fed: client-level DP: the delta of the (epsilon, delta) reported per round")
    round_deadline_s: float = opt(60.0, "plait fed server: seconds a round waits for its clients before using the quorum")
    start_timeout_s: float = opt(300.0, "plait fed server: seconds to wait for all clients to connect (then: the quorum suffices)")
    heartbeat_timeout_s: float = opt(10.0, "plait fed server: a client silent this long is not sampled")
    host: str = opt("127.0.0.1", "plait fed server: address to bind (0.0.0.0 to accept other machines)")
    port: int = opt(8470, "plait fed server: TCP port (0: any free port, written to RUN_DIR/endpoint.json)")
    stop_at_accuracy: float = opt(0.0, "plait fed: end the run once test accuracy reaches this (0: run every round)")
    sim_dropout: float = opt(0.0, "plait fed simulate: chance that a sampled client drops out mid-round")


@dataclass
class FinetuneConfig:
    freeze: list = opt([], "glob patterns over parameter names to freeze (no gradient, optimizer state or traffic), "
                           "e.g. ['tok_emb*', 'blocks.0.*']")
    lora_rank: int = opt(0, "LoRA: rank of the adapters on the target Linear layers (0: off); the base stays frozen")
    lora_alpha: float = opt(16.0, "LoRA: the adapter output is scaled by lora_alpha / lora_rank")
    lora_targets: list = opt(["*attn.q", "*attn.v"], "LoRA: glob patterns over the names of the Linear layers to adapt")
    quantize_base: str = opt("none", "QLoRA: store the adapted layers' frozen base weights in 4-bit NormalFloat (nf4, "
                                     "bitsandbytes: plait[qlora]) or not (none)", ("none", "nf4"))
    progressive_freeze: bool = opt(False, "freeze model.blocks front to back during training (FreezeOut): block i of L "
                                          "after floor(t0 + i (T - t0) / L) steps, t0 = progressive_freeze_start * T")
    progressive_freeze_start: float = opt(0.5, "progressive_freeze: the share of train.steps before block 0 freezes")


@dataclass
class DistillConfig:
    teacher: str = opt("", "knowledge distillation from this run directory's model (eval mode, no gradient); '' off")
    temperature: float = opt(2.0, "distillation: softmax temperature of teacher and student logits")
    alpha: float = opt(0.5, "distillation: weight of the soft-target KL term (x temperature^2); 1 - alpha: the hard labels")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    log: LogConfig = field(default_factory=LogConfig)
    federated: FederatedConfig = field(default_factory=FederatedConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)

    @property
    def node_range(self) -> tuple[int, int]:
        """(min, max) machines: launch.nnodes = "N" gives (N, N), "MIN:MAX" an elastic range."""
        text = str(self.launch.nnodes).strip()
        try:
            lo, _, hi = text.partition(":")
            lo_n, hi_n = int(lo), int(hi or lo)
        except ValueError:
            raise ConfigError(f"launch.nnodes = {text!r} must be N or MIN:MAX, e.g. 2 or '1:2'") from None
        if not 1 <= lo_n <= hi_n:
            raise ConfigError(f"launch.nnodes = {text!r}: need 1 <= MIN <= MAX")
        return lo_n, hi_n

    @property
    def max_nodes(self) -> int:
        return self.node_range[1]

    @property
    def elastic(self) -> bool:
        """Whether the world may change size while the job runs (fewer nodes, or restarts after failures)."""
        lo, hi = self.node_range
        return lo < hi or self.launch.max_restarts > 0


SECTIONS: dict[str, type] = {f.name: typing.get_type_hints(Config)[f.name] for f in dataclasses.fields(Config)}


# --------------------------------------------------------------------------- parsing


def _type_name(tp: Any) -> str:
    if isinstance(tp, types.UnionType):  # int | str: a number or "auto"
        return 'a whole number or "auto"' if set(tp.__args__) == {int, str} else " or ".join(map(_type_name, tp.__args__))
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list", dict: "a table"}.get(
        tp, str(tp)
    )


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check a TOML value against a field's type; ints are accepted where floats are expected."""
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if (tp is int or isinstance(tp, types.UnionType) and int in tp.__args__) and isinstance(value, bool):
        ok = False
    else:
        ok = isinstance(value, tp)
    if not ok:
        raise ConfigError(
            f"{key} = {value!r} has the wrong type: it must be {_type_name(tp)}; "
            f"fix the value in the config or --set {key}=<{_type_name(tp)}>"
        )
    return value


def _fields(section_type: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(section_type)}


def config_from_dict(data: dict, source: str = "config") -> Config:
    """Build a Config from a nested dict (a parsed TOML file); rejects unknown sections and keys."""
    cfg = Config()
    for section, values in data.items():
        if section not in SECTIONS:
            raise ConfigError(
                f"unknown section [{section}] in {source}; valid sections: {', '.join(SECTIONS)}"
            )
        if not isinstance(values, dict):
            raise ConfigError(f"[{section}] in {source} must be a table of keys, not {values!r}")
        for key, value in values.items():
            set_value(cfg, f"{section}.{key}", value, source=source)
    return cfg


def set_value(cfg: Config, dotted: str, value: Any, source: str = "--set") -> None:
    """Set `section.key` on cfg after checking that the key exists and the type matches."""
    parts = dotted.split(".")
    if len(parts) != 2:
        raise ConfigError(f"'{dotted}' from {source} is not of the form section.key (e.g. train.steps)")
    section, key = parts
    key = KEYWORD_FIELDS.get(key, key)
    if section not in SECTIONS:
        raise ConfigError(f"unknown section '{section}' in '{dotted}' from {source}; valid sections: {', '.join(SECTIONS)}")
    fields = _fields(SECTIONS[section])
    if key not in fields:
        close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.6)
        raise ConfigError(
            f"unknown key '{dotted}' in {source}; keys of [{section}]: {', '.join(map(toml_key, fields))}"
            + (f" (did you mean {section}.{close[0]}?)" if close else "")
        )
    tp = typing.get_type_hints(SECTIONS[section])[key]
    if isinstance(value, fields[key].metadata.get("accepts") or ()) and not isinstance(value, bool):
        value = tp(value)
    value = _coerce(dotted, value, tp)
    setattr(getattr(cfg, section), key, value)


def parse_override(text: str) -> tuple[str, Any]:
    """Parse `section.key=value`; the value is read as a TOML literal, else taken as a plain string."""
    if "=" not in text:
        raise ConfigError(f"--set '{text}' must be of the form section.key=value (e.g. --set train.steps=100)")
    key, raw = text.split("=", 1)
    key, raw = key.strip(), raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key, value


def apply_overrides(cfg: Config, overrides: list[str]) -> Config:
    """Apply `--set section.key=value` overrides in order.

    For string keys an unquoted value is taken literally, so `data.path=2024-01-01`
    stays a path rather than becoming a TOML date.
    """
    for text in overrides:
        key, value = parse_override(text)
        raw = text.split("=", 1)[1].strip()
        if _field_type(key) is str and not isinstance(value, str) and raw[:1] not in ("'", '"'):
            value = raw
        set_value(cfg, key, value, source=f"--set {text}")
    return cfg


def _field_type(dotted: str):
    section, _, key = dotted.partition(".")
    if section not in SECTIONS:
        return None
    return typing.get_type_hints(SECTIONS[section]).get(key)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, validate: bool = True) -> Config:
    """Load a TOML config (or the built-in default job when path is None), apply overrides, validate."""
    if path is None:
        cfg = Config()
    else:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist; pass an existing .toml file or none for the default job")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p} is not valid TOML: {e}") from None
        cfg = config_from_dict(data, source=str(p))
    apply_overrides(cfg, overrides or [])
    if isinstance(cfg.parallel.dp, str) or isinstance(cfg.launch.nproc_per_node, str):
        resolve_auto(cfg)
    if validate:
        validate_config(cfg)
    return cfg


def local_gpus(device: str = "auto") -> int:
    """GPUs on this machine that launch.device lets plait use (0 on CPU or with launch.device = 'cpu')."""
    if device == "cpu":
        return 0
    import torch  # lazily: only an "auto" asks, and plait --help must not import torch

    return torch.cuda.device_count()


def resolve_auto(cfg: Config, gpus: int | None = None) -> list[str]:
    """Replace launch.nproc_per_node = "auto" and parallel.dp = "auto" by numbers, before anything launches.

    nproc_per_node: every local GPU, or on CPU 0 (the layout's need). dp: the processes of the job (nproc_per_node,
    else the GPUs, times the machines; minus parameter servers) divided by tp x pp; on CPU without
    nproc_per_node, 1. gpus: the local GPU count (default: local_gpus()). Returns what was decided, in words (also
    in auto_notes(cfg)).
    """
    lc, p = cfg.launch, cfg.parallel
    for key, value in (("launch.nproc_per_node", lc.nproc_per_node), ("parallel.dp", p.dp)):
        if isinstance(value, bool) or not isinstance(value, int) and value != "auto":
            raise ConfigError(f"{key} = {value!r} must be a whole number or \"auto\"; e.g. --set {key}=auto")
    if gpus is None:
        gpus = local_gpus(lc.device)
    notes = []
    if lc.nproc_per_node == "auto":
        lc.nproc_per_node = gpus
        notes.append(f"launch.nproc_per_node = auto -> {gpus} (every local GPU)" if gpus else
                     "launch.nproc_per_node = auto -> 0: no GPU here, the layout's processes")
    if p.dp == "auto":
        nodes = cfg.max_nodes
        per_node = lc.nproc_per_node or gpus
        servers = p.ps_servers if p.sync == "ps" and p.ps_placement == "dedicated" else 0
        model = p.tp * p.pp
        if not per_node:
            p.dp = 1
            notes.append("parallel.dp = auto -> 1: no GPU here and launch.nproc_per_node is not set (set it to the "
                         "processes to fill)")
        else:
            workers = per_node * nodes - servers
            what = (f"{per_node} process{'es' * (per_node > 1)} per machine"
                    + (f" x {nodes} machines" if nodes > 1 else "") + (f" - {servers} parameter servers" if servers else ""))
            if workers < model or workers % model:
                raise ConfigError(
                    f"parallel.dp = auto: {what} = {workers} is not a multiple of parallel.tp ({p.tp}) x parallel.pp "
                    f"({p.pp}) = {model}; set parallel.dp to a number, or launch.nproc_per_node to a multiple of {model}")
            p.dp = workers // model
            notes.append(f"parallel.dp = auto -> {p.dp} ({what}" + (f" / tp {p.tp} x pp {p.pp}" if model > 1 else "")
                         + ")")
    cfg.__dict__["_auto_notes"] = auto_notes(cfg) + notes
    return notes


def auto_notes(cfg: Config) -> list[str]:
    """What load_config decided for the "auto" values of cfg, in words (empty when there were none)."""
    return list(cfg.__dict__.get("_auto_notes", []))


# TOML keys that are Python keywords live in fields with a trailing underscore.
KEYWORD_FIELDS = {"async": "async_"}


def toml_key(field_name: str) -> str:
    return field_name[:-1] if field_name.endswith("_") else field_name


def config_to_dict(cfg: Config) -> dict:
    """The config as nested dicts with the TOML spelling of every key."""
    return {section: {toml_key(k): v for k, v in values.items()} for section, values in dataclasses.asdict(cfg).items()}


def dump_config(cfg: Config) -> str:
    """The config as TOML text (every key), loadable by load_config."""
    import tomli_w

    return tomli_w.dumps(config_to_dict(cfg))


def format_config(cfg: Config) -> str:
    """Every key with its value and one-line description, as `plait config show` prints it."""
    import tomli_w

    def literal(value: Any) -> str:
        if isinstance(value, dict):
            return "{" + ", ".join(f"{k} = {literal(v)}" for k, v in value.items()) + "}"
        if isinstance(value, list):
            return "[" + ", ".join(literal(v) for v in value) + "]"
        return tomli_w.dumps({"v": value}).strip()[len("v = "):]

    lines = []
    for section, section_type in SECTIONS.items():
        lines.append(f"[{section}]")
        obj = getattr(cfg, section)
        for f in dataclasses.fields(section_type):
            assignment = f"{toml_key(f.name)} = {literal(getattr(obj, f.name))}"
            lines.append(f"{assignment:<36} # {f.metadata.get('doc', '')}")
        lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------- validation

# Keys whose non-default values name schemes this version cannot run yet: (key, default, what).
UNAVAILABLE: list[tuple[str, object, str]] = []


def _refuse_unavailable(cfg: Config) -> None:
    for key, default, what in UNAVAILABLE:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value != default:
            raise ConfigError(
                f"{key} = {value!r}: {what} is not available in this version of plait; set {key}={default!r}"
            )


def _check_choice(cfg: Config, dotted: str) -> None:
    section, key = dotted.split(".")
    f = _fields(SECTIONS[section])[key]
    choices = f.metadata.get("choices")
    value = getattr(getattr(cfg, section), key)
    if choices and value not in choices:
        raise ConfigError(f"{dotted} = {value!r} is not one of: {', '.join(map(str, choices))}; set one of those")


def _positive(cfg: Config, dotted: str, minimum: int | float = 1) -> None:
    section, key = dotted.split(".")
    value = getattr(getattr(cfg, section), key)
    if value < minimum:
        raise ConfigError(f"{dotted} = {value} must be >= {minimum}; set --set {dotted}=<value >= {minimum}>")


def validate_config(cfg: Config) -> Config:
    """Reject impossible values, section by section, with a message naming the key, the rule and the fix.

    Rules that need to know a scheme or a model (which layouts combine, whether a model can be cut
    into pipeline stages) belong to the scheme or the model: plait.train.job.check_job runs them.
    """
    for section, section_type in SECTIONS.items():
        for f in dataclasses.fields(section_type):
            _check_choice(cfg, f"{section}.{f.name}")
    for key in ("parallel.dp", "parallel.tp", "parallel.pp", "train.steps", "train.global_batch_size",
                "train.micro_batch_size", "train.eval_batch_size", "checkpoint.keep",
                "log.every", "launch.timeout_s", "launch.heartbeat_s", "data.synthetic_samples", "data.synthetic_features",
                "data.synthetic_classes", "model.width", "model.depth", "model.embedding_dim", "data.clicks_dense",
                "model.projection_dim"):
        _positive(cfg, key)
    for key in ("train.eval_every", "train.eval_samples", "checkpoint.every", "launch.nproc_per_node",
                "launch.max_restarts", "launch.node_rank", "optim.warmup_steps", "optim.weight_decay",
                "optim.grad_clip", "data.prefetch", "train.sample_tokens", "train.stop_after"):
        _positive(cfg, key, 0)
    for key in ("optim.lr", "optim.eps", "optim.momentum", "optim.weight_decay", "optim.grad_clip", "optim.min_lr_ratio"):
        section, name = key.split(".")
        if not math.isfinite(getattr(cfg.optim, name)):
            raise ConfigError(f"{key} = {getattr(cfg.optim, name)} must be a finite number")
    if cfg.optim.lr <= 0:
        raise ConfigError(f"optim.lr = {cfg.optim.lr} must be > 0")
    if cfg.data.augment_shift < 0 or not 0.0 <= cfg.data.augment_noise < math.inf:
        raise ConfigError(f"data.augment_shift = {cfg.data.augment_shift} and data.augment_noise = {cfg.data.augment_noise} "
                          "must be >= 0 (and finite)")
    if not 0.0 < cfg.train.temperature < math.inf:
        raise ConfigError(f"train.temperature = {cfg.train.temperature} must be > 0, e.g. 0.5")
    if not 0.0 < cfg.data.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction = {cfg.data.val_fraction} must be between 0 and 1 (exclusive)")
    if not 0.0 <= cfg.model.dropout < 1.0:
        raise ConfigError(f"model.dropout = {cfg.model.dropout} must be in [0, 1)")
    if len(cfg.optim.betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in cfg.optim.betas):
        raise ConfigError(f"optim.betas = {cfg.optim.betas} must be two numbers in [0, 1), e.g. [0.9, 0.95]")

    _refuse_unavailable(cfg)
    if cfg.max_nodes > 1 and not cfg.launch.rdzv_endpoint:
        raise ConfigError(
            f"launch.nnodes = {cfg.launch.nnodes} needs launch.rdzv_endpoint = 'host:port' of node 0 "
            "(e.g. --set launch.rdzv_endpoint=10.0.0.1:29500)"
        )
    if cfg.launch.node_rank >= cfg.max_nodes:
        raise ConfigError(
            f"launch.node_rank = {cfg.launch.node_rank} must be < launch.nnodes = {cfg.launch.nnodes}"
        )
    if cfg.launch.rdzv_endpoint and ":" not in cfg.launch.rdzv_endpoint:
        raise ConfigError(f"launch.rdzv_endpoint = {cfg.launch.rdzv_endpoint!r} must be host:port, e.g. 10.0.0.1:29500")
    ps = cfg.log.profile_steps
    if ps and (len(ps) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in ps) or not 1 <= ps[0] <= ps[1]):
        raise ConfigError(f"log.profile_steps = {ps} must be [first, last] with 1 <= first <= last, e.g. [10, 12]")
    for tracker in cfg.log.trackers:
        if not isinstance(tracker, str) or tracker not in TRACKERS:
            raise ConfigError(f"log.trackers: {tracker!r} is not a tracker plait writes; choose from {sorted(TRACKERS)}")
        if importlib.util.find_spec(TRACKERS[tracker]) is None:
            raise ConfigError(f"log.trackers = [{tracker!r}] needs the {TRACKERS[tracker]} package: "
                              f"pip install 'plait[{tracker}]'")
    cards = cfg.data.clicks_cardinalities
    if not cards or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 2 for c in cards):
        raise ConfigError(f"data.clicks_cardinalities = {cards} must be a non-empty list of integers >= 2, e.g. [8, 64, 512]")
    bad = [a for a in cfg.data.augment if a not in ("random_crop", "hflip", "noise")]
    if bad:
        raise ConfigError(f"data.augment = {cfg.data.augment}: {bad} unknown; use any of random_crop, hflip, noise")
    if cfg.data.image_size < 4 or cfg.data.workers < 0:
        raise ConfigError(f"data.image_size = {cfg.data.image_size} must be >= 4 and data.workers = {cfg.data.workers} "
                          ">= 0")
    if cfg.data.name in ("text", "tensors", "images", "packed", "table") and not cfg.data.path and not cfg.data.factory:
        raise ConfigError(f"data.name = {cfg.data.name!r} needs data.path (a file or folder); set --set data.path=...")
    _validate_federated(cfg)
    return cfg


def _validate_federated(cfg: Config) -> None:
    """The [federated] section: ranges, and the combinations a federated round cannot run."""
    f = cfg.federated
    for key in ("rounds", "clients", "min_clients", "local_epochs", "local_batch_size", "shards_per_client"):
        _positive(cfg, f"federated.{key}")
    for key in ("mu", "server_lr", "clip_norm", "norm_bound", "dp_noise_multiplier", "port", "stop_at_accuracy"):
        _positive(cfg, f"federated.{key}", 0)
    for key in ("clients_per_round", "local_lr", "local_momentum", "mu", "server_lr", "server_tau", "alpha", "trim_fraction",
                "clip_norm", "norm_bound", "dp_noise_multiplier", "dp_clip_norm", "dp_delta", "round_deadline_s",
                "start_timeout_s", "heartbeat_timeout_s", "stop_at_accuracy", "sim_dropout"):
        if not math.isfinite(getattr(f, key)):
            raise ConfigError(f"federated.{key} = {getattr(f, key)} must be a finite number")
    for key in ("clients_per_round", "local_lr", "server_tau", "alpha", "dp_clip_norm", "round_deadline_s", "start_timeout_s",
                "heartbeat_timeout_s"):
        if getattr(f, key) <= 0:
            raise ConfigError(f"federated.{key} = {getattr(f, key)} must be > 0")
    if f.clients_per_round > 1 and (f.clients_per_round != int(f.clients_per_round) or f.clients_per_round > f.clients):
        raise ConfigError(
            f"federated.clients_per_round = {f.clients_per_round}: above 1 it is a count of clients and must be a whole "
            f"number <= federated.clients ({f.clients}); or give a fraction in (0, 1]"
        )
    if f.min_clients > f.clients:
        raise ConfigError(f"federated.min_clients ({f.min_clients}) must be <= federated.clients ({f.clients})")
    if f.port > 65535:
        raise ConfigError(f"federated.port = {f.port} must be in 0..65535")
    if not 0 <= f.trim_fraction < 0.5:
        raise ConfigError(f"federated.trim_fraction = {f.trim_fraction} must be in [0, 0.5)")
    if not (0 < f.dp_delta < 1):
        raise ConfigError(f"federated.dp_delta = {f.dp_delta} must be in (0, 1)")
    if not (0 <= f.sim_dropout < 1) or not (0 <= f.local_momentum < 1) or f.stop_at_accuracy > 1:
        raise ConfigError(
            f"federated.sim_dropout ({f.sim_dropout}) and federated.local_momentum ({f.local_momentum}) must be in [0, 1), "
            f"federated.stop_at_accuracy ({f.stop_at_accuracy}) in [0, 1]"
        )
    if len(f.server_betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in f.server_betas):
        raise ConfigError(f"federated.server_betas = {f.server_betas} must be two numbers in [0, 1), e.g. [0.9, 0.99]")
    if f.partition == "shards" and f.clients * f.shards_per_client < 1:
        raise ConfigError("federated.partition = 'shards' needs clients * shards_per_client >= 1")
    if f.secure_aggregation and f.aggregator != "mean":
        raise ConfigError(
            f"federated.aggregator = {f.aggregator!r} needs each update in the clear, but federated.secure_aggregation = true "
            "shows the server only their sum; set federated.aggregator='mean' or secure_aggregation=false"
        )
    if f.dp_noise_multiplier > 0 and f.aggregator != "mean":
        raise ConfigError(
            f"federated.aggregator = {f.aggregator!r} with differential privacy: the accountant covers the noised mean only; "
            "set federated.aggregator='mean' or federated.dp_noise_multiplier=0"
        )

"""A training job's config, checked whole: its sections, its model and every parallel scheme's keys.

    cfg = load_job("job.toml", ["parallel.pp=2"])   # ConfigError before any worker starts
    layout = check_job(cfg)                           # the same checks on a Config built in code

plait.config checks each section on its own; what needs a model or a scheme (can this model be
cut into pipeline stages, does ZeRO-1 combine with tensor parallel) is asked of the model
registry and of each scheme here, so the CLI, the launcher, the planner and train() agree.

It reads declarations only (plait.models.keys, plait.parallel.schemes, plait.finetune.keys, plait.data.packmeta):
importing this module imports no torch, and neither does checking a job that builds no model to check it. A job
that does (a model.factory asked for its cut points, LoRA's targets, a Hugging Face directory) imports torch then.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from plait import data, finetune, models
from plait.config import Config, load_config, validate_config
from plait.data.packmeta import source_name
from plait.errors import ConfigError
from plait.finetune.keys import active as finetune_active
from plait.finetune.keys import check_layout
from plait.models.hf_auto import FACTORY as HF_CLASS_FACTORY
from plait.models.keys import check_config as check_model
from plait.parallel.layout import Layout
from plait.parallel.schemes import check_config as check_layout_config
from plait.refs import import_object
from plait.train.keys import DTENSOR_OPTIMIZERS, ELEMENTWISE_OPTIMIZERS, PREFERENCE_OBJECTIVES

if TYPE_CHECKING:
    import torch


def check_job(cfg: Config, user_data: bool = True) -> Layout:
    """Validate cfg for training; returns its Layout. A Hugging Face train.init_from sets cfg.model from its config.json."""
    if cfg.model.hf_class:
        use_hf_class(cfg)
    elif cfg.train.init_from:
        from plait.models.hf import apply_hf_config, is_hf_dir  # lazily: only a run from weights reads them (torch)

        if is_hf_dir(cfg.train.init_from):
            apply_hf_config(cfg.model, cfg.data, cfg.train.init_from)
    validate_config(cfg)
    check_model(cfg.model, source_name(cfg.data))  # packed data: the source it was packed from
    if cfg.model.factory:
        models.load_factory(cfg.model.factory)  # one that does not import fails here, once, not in every worker
    layout = check_layout_config(cfg)
    check_objective(cfg, layout)
    check_layout(cfg, layout)
    if finetune_active(cfg):
        check_finetune(cfg)
    if cfg.model.patch_size:  # the patches against the images' size, before any worker starts
        import torch

        with torch.device("meta"):
            models.build_model(cfg.model, data.build_data(cfg.data, cfg.model).spec)
    check_composition(cfg, layout)
    check_user_code(cfg, layout, user_data)
    check_optimizer(cfg, layout)
    if cfg.data.tokenizer and not Path(cfg.data.tokenizer).is_file():
        raise ConfigError(f"data.tokenizer = {cfg.data.tokenizer!r} does not exist; give a Hugging Face tokenizer.json")
    if cfg.train.init_from and not Path(cfg.train.init_from).exists():
        raise ConfigError(f"train.init_from = {cfg.train.init_from!r} does not exist; give a run directory or a "
                          ".safetensors file")
    check_init_factory(cfg)
    return layout


def check_finetune(cfg: Config) -> None:
    """[finetune]'s patterns against the model's names (on the meta device) before any worker starts; an empty
    finetune.lora_targets becomes the model's usual ones here, so that config.toml records what the run adapts."""
    model = shapes_only(cfg.model, data.build_data(cfg.data, cfg.model).spec)
    if cfg.finetune.lora_rank and not cfg.finetune.lora_targets:
        cfg.finetune.lora_targets = finetune.usual_targets(model)
    finetune.check_progressive(cfg, finetune.apply_finetune(model, cfg.finetune))


def shapes_only(model_cfg, spec) -> torch.nn.Module:
    """The model on the meta device, for its names and shapes. A model.factory that loads weights (transformers'
    from_pretrained refuses the meta device) is built on the CPU instead: it works, at the cost of one more read."""
    import torch

    try:
        with torch.device("meta"):
            return models.build_model(model_cfg, spec)
    except RuntimeError as e:
        if not (model_cfg.factory and "from_pretrained" in str(e)):
            raise
    return models.build_model(model_cfg, spec)


def check_init_factory(cfg: Config) -> None:
    """train.init_from a run directory builds that run's model: a model.factory it names is code, run only when it is
    this job's own factory, plait's, or train.trust_factory says so."""
    run = Path(cfg.train.init_from) if cfg.train.init_from else None
    if run is None or not (run / "config.toml").is_file() or cfg.train.trust_factory:
        return
    factory = load_config(run / "config.toml", validate=False).model.factory
    if factory and factory != cfg.model.factory and not factory.startswith("plait."):
        raise ConfigError(f"train.init_from = {str(run)!r} names model.factory = {factory!r}: building its model would "
                          "import and call that code; set train.trust_factory=true only if you trust the run directory "
                          "and that code")


def use_hf_class(cfg: Config) -> None:
    """model.hf_class: the model is that transformers class, built from train.init_from's config.json by
    plait.models.hf_auto (as model.factory), its classification head sized to the data's classes; the directory's
    tokenizer.json is the data's."""
    import torch

    from plait.models.hf import hf_native_parts, is_hf_dir  # lazily: only a transformers class reads them (torch)

    m, source = cfg.model, cfg.train.init_from
    if not source or not is_hf_dir(source):
        raise ConfigError(f"model.hf_class = {m.hf_class!r} is built from a Hugging Face directory's config.json; set "
                          "train.init_from to one (a folder with config.json and model.safetensors)")
    if m.factory and m.factory != HF_CLASS_FACTORY:
        raise ConfigError(f"model.hf_class = {m.hf_class!r} and model.factory = {m.factory!r} both build the model; "
                          "unset one")
    tok = Path(source) / "tokenizer.json"
    if tok.is_file() and not cfg.data.tokenizer:
        cfg.data.tokenizer = str(tok)
    spec = data.build_data(cfg.data, cfg.model).spec
    own = {k: v for k, v in m.options.items() if k not in ("hf_class", "path", "num_labels")}
    m.factory = HF_CLASS_FACTORY
    m.options = {**own, "hf_class": m.hf_class, "path": str(source),
                 **({"num_labels": spec.num_classes} if spec.task == "classification" else {})}
    with torch.device("meta"):  # the checkpoint's names and shapes against the model, before any worker starts
        hf_native_parts(source, models.build_model(m, spec))


def check_composition(cfg: Config, layout: Layout) -> None:
    """What distillation and the evaluation callbacks ask of the layout."""
    # tp: the teacher reads the student's input on every tp rank, and the student's logits come out whole there (the
    # head's all-gather), so each tp rank computes the same soft loss; pp: the last stage runs the teacher on the
    # local batch it loads too, one piece per micro-batch loss
    if cfg.distill.teacher and layout.cp > 1:
        raise ConfigError(f"distill.teacher with parallel.cp = {layout.cp}: the teacher would read each rank's share of "
                          "a sequence without the rest of it (context parallel splits every sequence, and the teacher "
                          "has no ring attention); set parallel.cp=1 or distill.teacher=''")
    if cfg.distill.teacher and (layout.sync != "allreduce" or cfg.train.objective != "supervised"):
        raise ConfigError(f"distill.teacher runs the whole teacher on the student's input next to the student's logits "
                          f"on each rank: it needs sync = 'allreduce' and train.objective = 'supervised' (here sync = "
                          f"{layout.sync!r}); change the layout or set distill.teacher=''")
    if cfg.data.stream and not layout.every_rank_evaluates:
        raise ConfigError("data.stream evaluates every task at the end of each; the parameter server's workers do not "
                          "evaluate (parallel.sync = 'ps'): use allreduce or gossip")
    if cfg.train.ewc and not layout.data_parallel_only:
        raise ConfigError(f"train.ewc adds its penalty to the parameters each rank holds whole or as ZeRO shards: it "
                          f"needs tp = pp = ep = 1 and sync = 'allreduce' (here tp = {layout.tp}, pp = {layout.pp}, "
                          f"ep = {layout.ep}, sync = {layout.sync!r}); use data parallel or ZeRO")
    if (cfg.train.early_stop or cfg.checkpoint.keep_best) and not layout.every_rank_evaluates:
        raise ConfigError("train.early_stop and checkpoint.keep_best need every rank to evaluate; the parameter "
                          "server's workers do not (parallel.sync = 'ps'): use allreduce or gossip")


def check_user_code(cfg: Config, layout: Layout, user_data: bool = True) -> None:
    """A user's data (data.factory, or a table), loss and metrics, imported and tried before any worker starts.

    user_data=False leaves the data to the caller, which builds it next anyway (the trainer: once per worker, not twice).
    """
    if user_data and (cfg.data.factory or cfg.data.name == "table"):
        data.build_data(cfg.data, cfg.model)  # a dataset without __len__, samples that do not collate, a missing column
    if cfg.train.loss and cfg.train.loss != "focal":
        import_object("train.loss", cfg.train.loss)
    for ref in cfg.train.eval_metrics:
        if not isinstance(ref, str):
            raise ConfigError(f"train.eval_metrics = {cfg.train.eval_metrics}: each entry is 'package.module:function'")
        import_object("train.eval_metrics", ref)
    if cfg.train.eval_metrics and not layout.outputs_on_one_rank:
        raise ConfigError("train.eval_metrics are computed on the whole model's outputs: pipeline stages "
                          f"(parallel.pp = {layout.pp}) and the parameter server do not have them on one rank; "
                          "use pp = 1 and allreduce, or leave train.eval_metrics empty")


def metric_name(ref: str) -> str:
    """train.eval_metrics entry -> the key it is reported under: 'pkg.mod:mae' -> 'val_mae'."""
    return "val_" + ref.rpartition(":")[2].rpartition(".")[2]


def check_optimizer(cfg: Config, layout: Layout) -> None:
    """Optimizers whose update needs whole tensors, against the layout."""
    name = cfg.optim.name
    # ZeRO-2/3 step FSDP2's DTensor shards: LAMB's and LARS's per-tensor norms are reduced across the shards (the
    # trust ratio is the whole tensor's), and adamw8bit quantizes each rank's own shard in its blocks (none crosses
    # a shard's edge); offload's plain chunks have neither
    sharded_norms = name in DTENSOR_OPTIMIZERS and layout.offload not in ("disk", "optimizer")
    if layout.elementwise_optimizer_only and name not in ELEMENTWISE_OPTIMIZERS and not sharded_norms:
        if layout.zero:
            raise ConfigError(f"optim.name = {name!r} cannot be sharded by ZeRO-{layout.zero} (its update is not "
                              f"elementwise, and ZeRO-2/3 shard each tensor); use one of "
                              f"{', '.join(ELEMENTWISE_OPTIMIZERS + DTENSOR_OPTIMIZERS)}, or parallel.zero=1 "
                              "(whole tensors per rank)")
        raise ConfigError(f"parallel.offload = {layout.offload!r} updates the optimizer state chunk by chunk, which needs "
                          f"an elementwise optimizer; optim.name = {name!r} is not one: use one of "
                          f"{', '.join(ELEMENTWISE_OPTIMIZERS)} or set parallel.offload='none'")
    if name == "adamw8bit" and (layout.ps or layout.sync == "ps"):  # tp's DTensor shards: each in its own blocks
        raise ConfigError("optim.name = 'adamw8bit' keeps block-quantized states per whole tensor: the parameter "
                          "server's shards of them are not supported; use data parallel or optim.name='adamw'")


def check_objective(cfg: Config, layout: Layout) -> None:
    """train.objective = 'contrastive': image or vector data, plain data parallel, negatives from the whole batch."""
    if cfg.train.objective == "meta":
        check_meta(cfg, layout)
    if cfg.train.objective in PREFERENCE_OBJECTIVES:
        from plait.train.preference import check_preference  # lazily: the preference loss's module (torch)

        check_preference(cfg, layout)
    if cfg.train.objective != "contrastive":
        return
    if cfg.data.name not in ("digits", "synthetic", "tensors"):
        raise ConfigError(f"train.objective = 'contrastive' makes two augmented views of image or vector inputs; "
                          f"data.name = {cfg.data.name!r} has none: use digits, synthetic or tensors, or "
                          "train.objective='supervised'")
    if not layout.data_parallel_only:
        raise ConfigError(f"train.objective = 'contrastive' gathers every rank's embeddings over the dp axis: it needs "
                          f"tp = pp = 1, sync = 'allreduce' and no embedding_sharding (here tp = {layout.tp}, pp = "
                          f"{layout.pp}, sync = {layout.sync!r}); change the layout or train.objective")
    if cfg.model.factory:  # a user's model must output one embedding per sample: ask it on the meta device
        import torch

        from plait.data.augment import two_views  # lazily: the augmentations (torch)

        spec = two_views(data.build_data(cfg.data, cfg.model), cfg.data, cfg.train.seed).spec
        with torch.device("meta"):
            models.build_model(cfg.model, spec)
    if layout.grad_accum != 1:
        raise ConfigError(
            f"train.objective = 'contrastive' takes its negatives from the whole global batch, which must be one "
            f"micro-batch per rank: train.micro_batch_size ({cfg.train.micro_batch_size}) * parallel.dp ({layout.dp}) "
            f"must equal train.global_batch_size ({cfg.train.global_batch_size}); set "
            f"train.micro_batch_size={cfg.train.global_batch_size // layout.dp}")


def check_meta(cfg: Config, layout: Layout) -> None:
    """train.objective = 'meta': episodes of a classification source, on data parallel and ZeRO 1-3 layouts."""
    d = cfg.data
    if not layout.data_parallel_only:
        raise ConfigError(f"train.objective = 'meta' adapts a whole copy of the model to each episode on its rank: it "
                          f"needs tp = pp = ep = 1 and sync = 'allreduce' (here tp = {layout.tp}, pp = {layout.pp}, "
                          f"ep = {layout.ep}, sync = {layout.sync!r}); use data parallel or ZeRO")
    other = [k for k, on in (("data.augment", d.augment), ("data.mix", d.mix != "none"), ("data.curriculum",
             d.curriculum), ("data.sampler = 'balanced'", d.sampler != "shuffle"), ("model.ensemble",
             cfg.model.ensemble > 1), ("distill.teacher", cfg.distill.teacher), ("model.patch_size",
             cfg.model.patch_size)) if on]
    if d.holdout_classes < d.ways:
        raise ConfigError(f"data.ways = {d.ways} classes per episode, but validation episodes draw from "
                          f"data.holdout_classes = {d.holdout_classes}: hold out at least data.ways classes")
    if other:
        raise ConfigError(f"train.objective = 'meta' trains on episodes it draws itself; {', '.join(other)} cannot "
                          "apply to them: turn it off or use train.objective='supervised'")


def load_job(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """load_config + check_job: a config ready to train."""
    cfg = load_config(path, overrides)
    check_job(cfg)
    return cfg

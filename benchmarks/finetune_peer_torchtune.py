"""torchtune's own recipes on the rows plait trained on, in plait's order: run with .venv-torchtune's Python (torchtune
0.6, torchao 0.15, the same torch), never imported by plait or its suite. benchmarks/finetune_vs_peers.py and
tests/train/test_finetune_peers.py write the job and read the answer:

    .venv-torchtune/bin/python benchmarks/finetune_peer_torchtune.py job.json answer.json

The job is finetune_peer_trl.py's (plus "world": the processes). Each run is one `tune run` of the recipe a user would
pick: full_finetune_single_device / lora_finetune_single_device on one process, full_finetune_distributed /
lora_finetune_distributed (FSDP2) with --nproc_per_node 2, device=cpu, dtype=fp32, torch.optim.AdamW,
CEWithChunkedOutputLoss (the recipe divides the batch's summed loss by its trained tokens). The recipes take their
dataset, tokenizer, model builder, scheduler and metric logger as `_component_` paths, so this file is also the
module those paths name (on PYTHONPATH): the dataset is the job's pre-tokenized rows ({"tokens", "labels"}, in order:
shuffle false), the tokenizer only a pad id, the model torchtune's llama3 / lora_llama3 builder with the checkpoint's
shape (lora_a starting at plait's initial A, when given: lora_b starts at zero on both sides), the scheduler constant,
and the logger records each step's loss and the time it was logged. The checkpoint is read by torchtune's
FullModelHFCheckpointer (model_type LLAMA3).
"""

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# bitsandbytes' NF4 levels (bitsandbytes.functional.get_4bit_type("nf4"), float32)
NF4_LEVELS = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
              -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
              0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023,
              1.0]
RECIPES = {("full", 1): "full_finetune_single_device", ("lora", 1): "lora_finetune_single_device",
           ("full", 2): "full_finetune_distributed", ("lora", 2): "lora_finetune_distributed"}
TUNE_NAMES = {"q_proj": "attn.q_proj", "k_proj": "attn.k_proj", "v_proj": "attn.v_proj", "o_proj": "attn.output_proj",
              "gate_proj": "mlp.w1", "down_proj": "mlp.w2", "up_proj": "mlp.w3"}


# ---------------------------------------------------------------------------------------------------------------
# the components the recipe's config names (imported by torchtune inside the recipe's process)

class PadOnly:
    """What the recipes read of a tokenizer when the dataset is already tokens: the pad id."""

    pad_id = 0
    max_seq_len = None


def tokenizer(**_):
    return PadOnly()


def rows(tokenizer, path: str, packed: bool = False):
    """The job's rows in order, as torchtune's SFT datasets give them: unshifted tokens and labels (-100 untrained)."""
    return [{"tokens": r["input_ids"], "labels": r["labels"]} for r in json.loads(Path(path).read_text())]


def constant(optimizer, num_training_steps: int, last_epoch: int = -1):
    import torch

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0, last_epoch)


def model(lora_attn_modules=None, apply_lora_to_mlp=False, lora_rank=0, lora_alpha=0.0, quantize_base=False,
          initial_a: str = "", exact_levels: bool = False, **shape):
    """torchtune's llama3 (or lora_llama3) of the checkpoint's shape; lora_a from plait's initial A where given."""
    import torch
    from torchtune.models.llama3 import llama3, lora_llama3

    if not lora_rank:
        return llama3(**shape)
    m = lora_llama3(lora_attn_modules=list(lora_attn_modules), apply_lora_to_mlp=apply_lora_to_mlp,
                    apply_lora_to_output=False, lora_rank=lora_rank, lora_alpha=lora_alpha, lora_dropout=0.0,
                    quantize_base=quantize_base, **shape)
    if quantize_base and exact_levels:
        m.register_load_state_dict_post_hook(bnb_levels)
    if initial_a:
        params = dict(m.named_parameters())
        with torch.no_grad():
            for name, value in json.loads(Path(initial_a).read_text()).items():
                block, rest = name.removeprefix("blocks.").split(".", 1)
                layer = TUNE_NAMES[rest.removesuffix(".lora_A").split(".")[-1]]
                params[f"layers.{block}.{layer}.lora_a.weight"].copy_(torch.tensor(value))
    return m


def bnb_levels(module, incompatible) -> None:
    """torchao's NF4 table keeps four decimals of each level (-0.6962 for bitsandbytes' -0.69619280...); with
    exact_levels the loaded NF4 tensors decode with bitsandbytes' float32 levels, so that torchtune holds the weights
    plait and TRL hold (the codes do not change: each level's nearest neighbour is the same in both tables)."""
    import torch
    from torchao.dtypes.nf4tensor import NF4Tensor

    levels = torch.tensor(NF4_LEVELS)
    for m in module.modules():
        w = getattr(m, "weight", None)
        if isinstance(w, NF4Tensor):
            w.nf4 = levels.to(w.nf4.dtype)


class Steps:
    """A metric logger that keeps each step's loss and when it was logged, and writes them with the process's peak
    RSS when the recipe closes it (rank 0's file; each rank's RSS in its own)."""

    def __init__(self, path: str, **_):
        self.path, self.losses, self.ends, self.t0 = path, [], [], time.perf_counter()

    def log_config(self, config) -> None: ...

    def log(self, name, data, step) -> None: ...

    def log_dict(self, payload, step) -> None:
        self.ends.append(time.perf_counter() - self.t0)
        self.losses.append(float(payload["loss"]))

    def close(self) -> None:
        rank = int(os.environ.get("RANK", "0"))
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        Path(f"{self.path}.{rank}").write_text(json.dumps({"losses": self.losses, "ends": self.ends, "peak_rss": rss}))

    def __del__(self) -> None: ...


# ---------------------------------------------------------------------------------------------------------------
# the driver (in .venv-torchtune, outside the recipe)

def shape_of(model_dir: str) -> dict:
    c = json.loads((Path(model_dir) / "config.json").read_text())
    return {"vocab_size": c["vocab_size"], "num_layers": c["num_hidden_layers"], "num_heads": c["num_attention_heads"],
            "num_kv_heads": c["num_key_value_heads"], "embed_dim": c["hidden_size"], "max_seq_len":
            c["max_position_embeddings"], "intermediate_dim": c["intermediate_size"], "attn_dropout": 0.0,
            "norm_eps": c["rms_norm_eps"], "rope_base": c.get("rope_theta") or c.get("rope_parameters", {}).get(
                "rope_theta", 10000.0)}


def recipe_config(model_dir: str, job: dict, work: Path, world: int) -> dict:
    lora = job.get("lora")
    m = {"_component_": "finetune_peer_torchtune.model", **shape_of(model_dir)}
    if lora:
        attn = [t for t in lora["targets"] if t in ("q_proj", "k_proj", "v_proj")]
        attn += ["output_proj"] if "o_proj" in lora["targets"] else []
        mlp = {"gate_proj", "up_proj", "down_proj"}
        if mlp & set(lora["targets"]) and not mlp <= set(lora["targets"]):
            raise SystemExit(f"torchtune adapts the MLP whole (apply_lora_to_mlp): targets {lora['targets']}")
        m.update(lora_attn_modules=attn, apply_lora_to_mlp=bool(mlp & set(lora["targets"])), lora_rank=lora["r"],
                 lora_alpha=float(lora["alpha"]), quantize_base=job["method"] == "qlora",
                 exact_levels=bool(job.get("exact_levels")))
        if lora.get("A"):
            (work / "A.json").write_text(json.dumps(lora["A"]))
            m["initial_a"] = str(work / "A.json")
    (work / "rows.json").write_text(json.dumps(job["rows"]))
    cfg = {
        "output_dir": str(work / "out"), "model": m, "seed": 0, "shuffle": False, "device": "cpu", "dtype": "fp32",
        "tokenizer": {"_component_": "finetune_peer_torchtune.tokenizer"},
        "dataset": {"_component_": "finetune_peer_torchtune.rows", "path": str(work / "rows.json"), "packed": False},
        "checkpointer": {"_component_": "torchtune.training.FullModelHFCheckpointer", "checkpoint_dir": model_dir,
                         "checkpoint_files": ["model.safetensors"], "recipe_checkpoint": None,
                         "output_dir": str(work / "out"), "model_type": "LLAMA3"},
        "resume_from_checkpoint": False, "save_adapter_weights_only": True,
        "batch_size": job["batch"] // world, "epochs": 1, "max_steps_per_epoch": len(job["rows"]) // job["batch"],
        "gradient_accumulation_steps": 1, "clip_grad_norm": None, "compile": False,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": job["lr"], "betas": [0.9, 0.95], "eps": 1e-8,
                      "weight_decay": 0.0},
        "lr_scheduler": {"_component_": "finetune_peer_torchtune.constant"},
        "loss": {"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss"},
        "metric_logger": {"_component_": "finetune_peer_torchtune.Steps", "path": str(work / "steps")},
        "log_every_n_steps": 1, "log_peak_memory_stats": False, "enable_activation_checkpointing": False,
        "enable_activation_offloading": False, "optimizer_in_bwd": False,
    }
    if world > 1:
        cfg.update(fsdp_cpu_offload=False, fsdp_reshard_after_forward=True)
    return cfg


def run(model_dir: str, job: dict) -> dict:
    world = job.get("world", 1)
    work = Path(tempfile.mkdtemp(prefix=f"tt-{job['name']}-"))
    (work / "cfg.yaml").write_text(json.dumps(recipe_config(model_dir, job, work, world)))  # JSON is YAML
    recipe = RECIPES[("full" if job["method"] == "full" else "lora", world)]
    tune = str(Path(sys.executable).with_name("tune"))
    cmd = [tune, "run", *(["--nproc_per_node", str(world)] if world > 1 else []), recipe, "--config",
           str(work / "cfg.yaml")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-6000:]}")
    ranks = [json.loads(p.read_text()) for p in sorted(work.glob("steps.*"))]
    tokens = [sum(len(x["input_ids"]) for x in job["rows"][s:s + job["batch"]])
              for s in range(0, len(job["rows"]), job["batch"])]
    return {"losses": ranks[0]["losses"], "ends": ranks[0]["ends"], "tokens": tokens, "world": world,
            "peak_rss": max(x["peak_rss"] for x in ranks)}


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    answer = {r["name"]: run(job["model"], r) for r in job["runs"]}
    with open(sys.argv[2], "w") as f:
        json.dump(answer, f)


if __name__ == "__main__":
    main()

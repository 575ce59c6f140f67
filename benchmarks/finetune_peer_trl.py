"""TRL's SFTTrainer on the rows plait trained on, in plait's order: run with .venv-trl's Python (TRL, transformers, peft,
bitsandbytes and the same torch), never imported by plait or its suite. benchmarks/finetune_vs_peers.py and
tests/train/test_finetune_peers.py write the job and read the answer:

    .venv-trl/bin/python benchmarks/finetune_peer_trl.py job.json answer.json
    .venv-trl/bin/torchrun --standalone --nproc_per_node 2 benchmarks/finetune_peer_trl.py job.json answer.json

job.json: {"model": HF dir, "runs": [run, ...]}; a run: {"name", "method": "full" | "lora" | "qlora", "lr", "batch"
(the global batch: per device x processes, no accumulation), "rows": [{"input_ids", "labels"}, ...] already in the
order the steps take them (steps x batch), "lora": {"r", "alpha", "targets", "A": {plait's name: its initial
lora_A}} (lora and qlora), "fsdp": true (dp > 1: FSDP's full sharding through Accelerate)}.
The rows are pre-tokenized (input_ids with their labels, -100 where the loss does not look), so SFTTrainer skips its
own tokenization and label building; its collator pads each batch. Its loss is the mean over the batch's trained
tokens (num_items_in_batch across the ranks). answer.json: per run, TRL's loss at each step (compute_loss's value,
as the step computes it, summed over the ranks' shares), the wall time at the end of each step, the tokens each step
took (non-padding inputs, every rank's) and the process's peak RSS (ru_maxrss, the largest over the ranks).
"""

import json
import os
import resource
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from datasets import Dataset
from torch.utils.data import SequentialSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import SFTConfig, SFTTrainer


class Clock(TrainerCallback):
    def __init__(self):
        self.ends: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())


class InOrder(SFTTrainer):
    """SFTTrainer taking the dataset's rows in order, recording each step's loss."""

    losses: list

    def _get_train_sampler(self, *args, **kwargs):
        return SequentialSampler(self.train_dataset)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if model.training:
            self.losses.append(loss.detach().clone())
        return loss


def load(model_dir: str, method: str):
    kwargs = {"dtype": torch.float32, "attn_implementation": "eager"}
    if method == "qlora":
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                           bnb_4bit_compute_dtype=torch.float32,
                                                           bnb_4bit_use_double_quant=False,
                                                           bnb_4bit_quant_storage=torch.uint8)
        kwargs["device_map"] = {"": "cpu"}
    return AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)


def peft_name(plait_name: str) -> str:
    """blocks.0.attn.q_proj.lora_A -> base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"""
    block, rest = plait_name.removeprefix("blocks.").split(".", 1)
    layer = rest.removesuffix(".lora_A").replace("attn.", "self_attn.")
    return f"base_model.model.model.layers.{block}.{layer}.lora_A.default.weight"


def run(model_dir: str, job: dict) -> dict:
    torch.manual_seed(0)
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    model = load(model_dir, job["method"])
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.pad_token = tok.pad_token or tok.eos_token
    # every rank reads all the rows in order; Accelerate gives rank r every world-th batch of batch / world rows,
    # so a step's global batch is rows [s * batch, (s + 1) * batch), split in contiguous shares as plait splits it
    rows = job["rows"]
    steps = len(job["rows"]) // job["batch"]
    extra = {}
    if job.get("fsdp"):
        extra = {"fsdp": "full_shard", "fsdp_config": {"version": 2, "reshard_after_forward": True}}
    args = SFTConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=job["batch"] // world,
                     gradient_accumulation_steps=1, max_steps=steps, learning_rate=job["lr"],
                     lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95,
                     adam_epsilon=1e-8, max_grad_norm=0.0, optim="adamw_torch", max_length=None,
                     report_to=[], logging_steps=1, save_strategy="no", use_cpu=True, seed=0, bf16=False, fp16=False,
                     dataloader_drop_last=False, disable_tqdm=True, dataset_num_proc=None,
                     **{**extra, **job.get("args", {})})
    peft_config = None
    lora = job.get("lora")
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], target_modules=lora["targets"],
                                 lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    clock = Clock()
    trainer = InOrder(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok,
                      peft_config=peft_config, callbacks=[clock])
    if job["method"] == "qlora" and not job.get("bf16_adapters"):
        # SFTTrainer casts a quantized model's adapters to bf16 by design (the QLoRA paper's recipe; trl 1.16's
        # sft_trainer.py), whatever bf16 says; the comparison is fp32, so they go back before the optimizer exists
        for param in trainer.model.parameters():
            if param.requires_grad:
                param.data = param.data.float()
    if lora and lora.get("A"):
        params = dict(trainer.model.named_parameters())
        with torch.no_grad():
            for name, value in lora["A"].items():
                params[peft_name(name)].copy_(torch.tensor(value))
    trainer.losses = []
    start = time.perf_counter()
    trainer.train()
    losses = torch.stack(trainer.losses) if trainer.losses else torch.zeros(0)
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024], dtype=torch.float64)
    if dist.is_initialized():  # each rank's loss is its share of the batch's token mean (x world, DDP averages)
        dist.all_reduce(losses)
        losses /= world
        dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    tokens = [sum(len(r["input_ids"]) for r in job["rows"][s:s + job["batch"]]) for s in range(0, len(job["rows"]),
                                                                                                 job["batch"])]
    return {"losses": losses.tolist(), "ends": [t - start for t in clock.ends], "tokens": tokens,
            "peak_rss": int(rss.item()), "world": world}


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    answer = {r["name"]: run(job["model"], r) for r in job["runs"]}
    if int(os.environ.get("RANK", "0")) == 0:
        with open(sys.argv[2], "w") as f:
            json.dump(answer, f)


if __name__ == "__main__":
    main()

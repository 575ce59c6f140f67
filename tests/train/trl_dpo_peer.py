"""TRL's DPOTrainer on the pairs plait trained on, in plait's order: run with .venv-trl's Python (TRL, transformers,
peft and the same torch), never imported by the suite. tests/train/test_preference_trl.py writes the job and reads
the answer:

    .venv-trl/bin/python tests/train/trl_dpo_peer.py job.json answer.json

job.json: {"model": HF dir, "runs": [{"name", "loss_type", "beta", "lr", "max_length", "batch", "examples": [pair,
...], "lora": {"r", "alpha", "targets", "A": {peft's name: plait's initial lora_A}} (optional)}]}, each run's examples
already in the order its steps take them (steps x batch). With "lora", TRL trains peft adapters whose A starts as
plait's did (B starts at zero on both sides), and its reference is the base with the adapters off (use_adapter).
answer.json: per run, TRL's loss at each step (its own _compute_loss, recorded as the step computes it) and the ids
TRL's tokenization gave each example (prompt_ids, chosen_ids, rejected_ids).
"""

import json
import sys
import tempfile

import torch
from datasets import Dataset
from torch.utils.data import SequentialSampler
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer


class InOrder(DPOTrainer):
    """DPOTrainer taking the dataset's rows in order, recording each step's loss."""

    losses: list

    def _get_train_sampler(self, *args, **kwargs):
        return SequentialSampler(self.train_dataset)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if model.training:
            self.losses.append(float(loss.detach()))
        return loss


def run(model_dir: str, job: dict) -> dict:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    tok = AutoTokenizer.from_pretrained(model_dir)
    steps = len(job["examples"]) // job["batch"]
    args = DPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=job["batch"],
                     gradient_accumulation_steps=1, max_steps=steps, learning_rate=job["lr"],
                     lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95,
                     adam_epsilon=1e-8, max_grad_norm=0.0, optim="adamw_torch", beta=job["beta"],
                     loss_type=[job["loss_type"]], max_length=job["max_length"], truncation_mode="keep_start",
                     report_to=[], logging_steps=1, save_strategy="no", use_cpu=True, seed=0, bf16=False,
                     fp16=False, dataloader_drop_last=False, disable_tqdm=True)
    lora = job.get("lora")
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], target_modules=lora["targets"], lora_dropout=0.0,
                                 bias="none", task_type="CAUSAL_LM")
    trainer = InOrder(model=model, args=args, train_dataset=Dataset.from_list(job["examples"]), processing_class=tok,
                      peft_config=peft_config)
    if lora:
        params = dict(trainer.model.named_parameters())
        with torch.no_grad():
            for name, value in lora["A"].items():
                params[name].copy_(torch.tensor(value))
    trainer.losses = []
    ids = [{k: list(row[k]) for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for row in trainer.train_dataset]
    trainer.train()
    return {"losses": trainer.losses, "ids": ids}


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    answer = {r["name"]: run(job["model"], r) for r in job["runs"]}
    with open(sys.argv[2], "w") as f:
        json.dump(answer, f)


if __name__ == "__main__":
    main()

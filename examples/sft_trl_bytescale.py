# examples/sft_trl.py under hybrid data parallelism: 7 lines differ (6 added, 1 changed).
# torchrun --nproc_per_node 8 examples/sft_trl_bytescale.py   (on CPU, as without bytescale, TRL needs
# args=SFTConfig(use_cpu=True, bf16=False))
# README, "Transformers' Trainer and TRL's SFTTrainer".
import torch.distributed as dist
from bytescale import LoaderConfig, PlannerConfig
from bytescale.integrations import hdp_trainer
from trl import SFTTrainer
from datasets import load_dataset

dist.init_process_group("bytescale")
dataset = load_dataset("roneneldan/TinyStories", split="train[:1%]")

trainer = hdp_trainer(SFTTrainer)(
    model="Qwen/Qwen2.5-0.5B-Instruct",
    train_dataset=dataset,
    planner=PlannerConfig(capacity=16384),  # tokens per micro-batch per GPU
    loader=LoaderConfig(tokens_per_batch=1 << 20),  # tokens per optimizer step
)
trainer.train()

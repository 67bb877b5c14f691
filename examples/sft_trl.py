# TRL's SFTTrainer example as TRL documents it (the SFTTrainer docstring of TRL 1.16), unchanged,
# as a script: torchrun --nproc_per_node 8 examples/sft_trl.py
# examples/sft_trl_bytescale.py is the same script under HDP (README,
# "Transformers' Trainer and TRL's SFTTrainer").
from trl import SFTTrainer
from datasets import load_dataset

dataset = load_dataset("roneneldan/TinyStories", split="train[:1%]")

trainer = SFTTrainer(
    model="Qwen/Qwen2.5-0.5B-Instruct",
    train_dataset=dataset,
)
trainer.train()

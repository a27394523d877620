"""LoRA: low-rank adapters on GPT-2's four matrices per block, attached to model.py's GPT from outside.

spec.py (what to adapt, checked once), layer.py (the module swapped in for an nn.Linear, and merging it back),
peft.py (the adapter directory in peft's format, both ways), merge.py (`gpt2port merge`), gguf.py (llama.cpp's
LoRA GGUF), train.py (what `gpt2port finetune --lora` adds to a run). model.py knows nothing of any of it.
"""

"""Fine-tuning a converted checkpoint (`gpt2port finetune`): text data as tokens (text.py, data.py), the optimizer
and schedule (optim.py), one process or many on PyTorch's distributed stack (dist.py), the loop (loop.py), its state
on disk (state.py), what it shows (report.py, plot.py), and the command's orchestration (finetune.py)."""

"""`finetune --sample-every N`: a sample of the model's text every N steps, as nanoGPT prints them, so that a run
shows what it is learning. The prompt is the held-out text's first tokens; top-k 50 from a seed of its own (the
run's random state is never touched: resume stays bit for bit); the model's own forward, in eval mode, then back."""

from __future__ import annotations

from gpt2port.checkpoint import load_tokenizer

PROMPT_TOKENS, NEW_TOKENS, TOP_K = 8, 32, 50


def sampler(model, ckpt_dir, val, seed: int, every: int, progress):
    """sample(done): after step `done`, every `every` steps and after the last, the text to progress.sample. Every
    rank samples alike (a sharded forward is collective); progress prints on the first alone."""
    from gpt2port.fast import OFF
    from gpt2port.generate import generate

    tokenizer = load_tokenizer(ckpt_dir)
    prompt = [int(t) for t in val[:PROMPT_TOKENS]]
    plain = getattr(model, "module", model)  # DDP's wrapper: its forward would wait for the other ranks' backward

    def sample(done: int) -> None:
        if done % every and done != progress.steps:
            return
        was = plain.training
        plain.eval()
        try:
            new = generate(plain, [prompt], NEW_TOKENS, top_k=TOP_K, temperature=1.0, seed=seed + done, fast=OFF)[0]
        finally:
            plain.train(was)
        progress.sample(done, tokenizer.decode(prompt + new))

    return sample

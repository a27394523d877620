"""What verify feeds every implementation: natural-text prompts with ours' greedy continuation, the known-answer
prompt of the official GPT-2, and random ids over the whole context."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from gpt2port.errors import GPT2PortError
from gpt2port.verification.stages import Stages

# Natural text of four kinds (prose, facts, fiction, code), 24-29 GPT-2 tokens each. They are cut to a common
# length so that they form one batch: the greedy continuation then costs 20 passes over the weights, not 80.
PROMPTS = (
    "The quick brown fox jumps over the lazy dog. It was the best of times, it was the worst of times.",
    "The Eiffel Tower, completed in 1889 for the World's Fair, stands 330 metres tall and was once the tallest "
    "structure on Earth.",
    "She opened the letter slowly, afraid of what it might say. The first line read: \"Dear Margaret, I am sorry to "
    "tell you that",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
)
GREEDY_TOKENS = 20
RANDOM_BATCH = 2  # > 1, so batching itself is exercised
SEED = 1234
# From transformers' own test suite: greedy from "The dog" with the real openai-community/gpt2 weights.
KNOWN_ANSWER = {"repo": "gpt2", "prompt": [464, 3290], "new_tokens": 18,
                "expected": [464, 3290, 373, 1043, 287, 257, 2214, 1474, 262, 16246, 286, 2688, 290, 2688, 27262,
                             13, 198, 198, 464, 3290]}


@dataclass
class Input:
    name: str
    kind: str  # "prompt" (natural text + ours' greedy continuation), "known" (known-answer prompt), "random"
    ids: torch.Tensor  # (B, T) int64
    texts: list[str] | None = None
    text_len: int = 0  # leading tokens of each row that are natural text (loss is measured on them)
    prompt_len: int = 0  # tokens before the greedy continuation
    greedy: torch.Tensor | None = None  # (B, n) ours' greedy tokens; ids holds all but the last
    step_logits: torch.Tensor | None = None  # (B, n, vocab): ours' logits that chose each greedy token
    expected: list[int] | None = None  # the known answer's new tokens

    def greedy_cols(self) -> slice:
        """Positions in ids whose next-token logits chose the greedy tokens."""
        return slice(self.prompt_len - 1, self.prompt_len - 1 + self.greedy.shape[1])


def make_inputs(stages: Stages, tokenizer_dirs: list[Path], tokens: int | None, known_answer: bool, notes: list[str],
                say) -> list[Input]:
    n_new = min(GREEDY_TOKENS, stages.n_positions // 2)
    gen = torch.Generator().manual_seed(SEED)
    enc = _tokenizer(tokenizer_dirs, notes)
    encoded = [enc.encode(t) for t in PROMPTS] if enc is not None else []
    if encoded and max(max(ids) for ids in encoded) < stages.vocab_size:
        length = min(min(len(ids) for ids in encoded), stages.n_positions - n_new)
        prompt, texts = torch.tensor([ids[:length] for ids in encoded]), list(PROMPTS)
    else:
        notes.append("no natural-text prompts: greedy continuations start from random ids, no loss measured")
        prompt, texts = torch.randint(stages.vocab_size, (2, 8), generator=gen), None
    inputs = [_greedy_input(stages, "prompts", "prompt", prompt, n_new, texts, say)]
    if known_answer:
        known = _greedy_input(stages, "known answer", "known", torch.tensor([KNOWN_ANSWER["prompt"]]),
                              KNOWN_ANSWER["new_tokens"], ["The dog"], say)
        known.expected = KNOWN_ANSWER["expected"][known.prompt_len:]
        inputs.append(known)
    length = min(tokens or stages.n_positions, stages.n_positions)
    if length < 2:
        raise GPT2PortError(f"--tokens {tokens}: need at least 2 tokens")
    if length < stages.n_positions:
        notes.append(f"random ids cover {length} of {stages.n_positions} positions (--tokens)")
    inputs.append(Input(f"random {RANDOM_BATCH}x{length}", "random",
                        torch.randint(stages.vocab_size, (RANDOM_BATCH, length), generator=gen)))
    if not stages.kv_cached:
        notes.append("the model has no KV-cached decoding: each greedy step was recomputed over the whole sequence")
    return inputs


def _tokenizer(dirs: list[Path], notes: list[str]):
    from gpt2port.tokenizer import from_directory

    problems = []
    for d in dirs:
        try:
            return from_directory(d if d.is_dir() else d.parent)
        except GPT2PortError as e:
            problems.append(str(e))
    notes.append(f"no usable tokenizer ({'; '.join(problems)})")
    return None


@torch.no_grad()
def _greedy_input(stages: Stages, name, kind, prompt: torch.Tensor, n_new: int, texts, say) -> Input:
    """Ours' greedy continuation of a (B, T) prompt batch, keeping the logits of every step."""
    say(f"ours: greedy continuation of the {name}")
    T = prompt.shape[1]
    chosen, steps = zip(*stages.greedy(prompt, n_new))
    greedy = torch.stack(chosen, dim=1)
    return Input(name, kind, torch.cat([prompt, greedy[:, :-1]], dim=1), texts=texts,
                 text_len=T if texts and kind == "prompt" else 0, prompt_len=T, greedy=greedy,
                 step_logits=torch.stack(steps, dim=1))

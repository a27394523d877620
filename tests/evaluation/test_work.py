"""What `gpt2port eval` runs, counted: the vocabulary projection only at the positions a task scores, and batches
whose padding adds little to the tokens the examples themselves hold (each was a large share of the time: the head
is a third of a forward at 124M, and padding was two thirds of LAMBADA's tokens before batches were cut by length)."""

from __future__ import annotations

import pytest

from gpt2port.checkpoint import load_tokenizer
from gpt2port.evaluation import choices, data
from gpt2port.evaluation.windows import perplexity
from gpt2port.model import GPT
from scripts.eval_data import sentences, write_lambada
from tests.evaluation.conftest import english


class Counted:
    """Tokens fed to the model, and rows fed to its head, over a run."""

    def __init__(self, model):
        self.fed = self.head = 0
        model.register_forward_pre_hook(lambda m, args, kwargs: self._fed(args[0]), with_kwargs=True)
        model.lm_head.register_forward_pre_hook(lambda m, args: self._head(args[0]))

    def _fed(self, idx):
        self.fed += idx.numel()

    def _head(self, x):
        self.head += x.numel() // x.size(-1)


@pytest.fixture()
def loaded(realistic):
    _, ckpt = realistic
    return GPT.from_pretrained(ckpt), load_tokenizer(ckpt)


def _lambada(loaded, lambada_file) -> tuple[Counted, int, int]:
    """(what ran, tokens the examples read alone, tokens they are scored on)."""
    model, tok = loaded
    pairs = data.lambada(lambada_file)
    encoded = [choices.encode_pair(tok, p.context, p.continuations[0]) for p in pairs]
    counted = Counted(model)
    choices.score(model, tok, pairs, tokens_per_batch=1024)
    return counted, sum(len(c) + len(k) - 1 for c, k in encoded), sum(len(k) for _, k in encoded)


def test_lambada_heads_only_the_continuations(loaded, lambada_file):
    counted, _, scored = _lambada(loaded, lambada_file)
    assert scored <= counted.head <= 2 * scored, (counted.head, scored)


def test_lambada_batches_pad_little(loaded, tmp_path):
    """A few texts past the context among many short ones, as LAMBADA's lengths spread (5 to 180 tokens)."""
    found = sentences(english())[:80]
    long = [" ".join(found[i : i + 4]) for i in range(0, 12, 4)]
    counted, own, _ = _lambada(loaded, write_lambada(tmp_path / "lambada.jsonl", long + found[12:]))
    assert own <= counted.fed <= (1 + choices.WASTE) * own, (counted.fed, own)  # as cut before: 1.22 * own


def test_hellaswag_heads_each_context_once(loaded, hellaswag_file):
    model, tok = loaded
    pairs = data.hellaswag(hellaswag_file)
    endings = sum(len(choices.encode_pair(tok, p.context, c)[1]) for p in pairs for c in p.continuations)
    counted = Counted(model)
    choices.score(model, tok, pairs)
    # one row per context (its prediction of an ending's first token), then each ending's own positions but its last
    # one, padded to the longest ending of a batch
    assert len(pairs) + endings - 4 * len(pairs) <= counted.head <= len(pairs) + 1.5 * endings, (counted.head, endings)


def test_perplexity_heads_only_the_tokens_a_window_predicts(loaded, text_file):
    model, tok = loaded
    text = text_file.read_text()
    ids = tok.encode(text)
    counted = Counted(model)
    context = model.config.n_positions
    result = perplexity(model, ids, text, context // 4, tokens_per_batch=4 * context)
    # the first batch heads its four windows whole (its first is scored on all its positions); every later one only
    # its last stride positions
    assert counted.head <= result["tokens"] + 3 * context, (counted.head, result["tokens"])
    assert counted.fed >= 3 * result["tokens"]  # each token read by four windows: the work is in the forward


def test_the_products_run_on_the_prefill_kernel(realistic):
    """Every matrix of a model `eval` loads is a FastLinear over the same Parameters, its many-row products on the
    kernel generation's prefill uses (oneDNN for fp32 where this PyTorch has it working): ~15% of eval's time here."""
    import torch.nn as nn

    from gpt2port.evaluation.load import load
    from gpt2port.fast.kernels import LINEAR, ONEDNN, FastLinear, onednn_works

    _, ckpt = realistic
    model = load(ckpt, None, "cpu").model
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is FastLinear for m in linears)
    assert {m.rows for m in linears} == {ONEDNN if onednn_works() else LINEAR}
    assert model.lm_head.weight is model.tok_emb.weight  # still tied: the same Parameters
    plain = GPT.from_pretrained(ckpt)
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in plain.state_dict().items()}

"""Which repo a NAME means, and which of its files a conversion needs."""

from __future__ import annotations

from pathlib import Path

from gpt2port.checkpoint import CONFIG, default_dir, root
from gpt2port.config import HUB_REPOS, canonical_name, is_known_name
from gpt2port.errors import GPT2PortError
from gpt2port.formats import WEIGHT_FILES
from gpt2port.tokenizer import TOKENIZER_FILES

SIDE_FILES = (CONFIG, *TOKENIZER_FILES)


def resolve_name(name: str) -> tuple[str, Path]:
    """(Hub repo id, default output directory) for a model NAME/alias or a repo id like distilbert/distilgpt2."""
    if "/" in name and not is_known_name(name):
        return name.strip("/"), root() / name.rstrip("/").rsplit("/", 1)[-1]
    try:
        canonical = canonical_name(name)
    except GPT2PortError as e:
        raise GPT2PortError(f"{e}; or give a Hub repo id such as distilbert/distilgpt2") from None
    return HUB_REPOS[canonical], default_dir(canonical)


def select_files(available: set[str]) -> tuple[list[str], str]:
    """(side files to fetch, the weights entry) from the repo's root file names: see WEIGHT_FILES."""
    weights = next((w for w in WEIGHT_FILES if w in available), "")
    return [n for n in SIDE_FILES if n in available], weights

"""Fill a directory with random-weight GPT-2 repos in the real Hub layouts, for scripts/fake_hub.py to serve.
Run from the repository root:

    python -m scripts.fill_fake_hub DIR --sizes gpt2[,gpt2-medium,...] [--also-tf-files] [--revisions main,v1.0]

Every size becomes openai-community/<size>, laid out like the real repo: the 2019 hub-layout model.safetensors
(bare keys, per-layer attn.bias buffers), config.json, vocab.json, merges.txt, tokenizer.json,
tokenizer_config.json, generation_config.json, README.md, .gitattributes. With --also-tf-files the repo also
carries the formats the real one has and gpt2port must never fetch (pytorch_model.bin beside the safetensors,
tf_model.h5, flax_model.msgpack, rust_model.ot, 64.tflite, onnx/...): decoys of random bytes, which a download
test can watch for in the request log. The size "tiny" adds small fixture repos instead:
    gpt2port-fixtures/tiny            hub layout, revisions main and v1 (different weights), with decoys
    gpt2port-fixtures/tiny-bin-only   pytorch_model.bin only (older repos)
    gpt2port-fixtures/tiny-sharded    save_pretrained shards + model.safetensors.index.json
Each revision is its own directory (DIR/<org>/<name>/<revision>/); weights differ per revision (seed + index).
gpt2-large and gpt2-xl are written tensor by tensor (no model in memory).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

from scripts import hf_fixtures

OFFICIAL_ORG = "openai-community"
FIXTURE_ORG = "gpt2port-fixtures"
STREAMED_SIZES = ("gpt2-large", "gpt2-xl")  # building these models in memory costs 3-6 GB for nothing
DECOYS = {  # files the real openai-community/gpt2 repo carries beside the ones gpt2port needs
    "pytorch_model.bin": 96 << 10,
    "tf_model.h5": 96 << 10,
    "flax_model.msgpack": 96 << 10,
    "rust_model.ot": 64 << 10,
    "64.tflite": 32 << 10,
    "onnx/decoder_model.onnx": 64 << 10,
    "onnx/config.json": 0,
}
GITATTRIBUTES = "".join(f"*{ext} filter=lfs diff=lfs merge=lfs -text\n" for ext in
                        (".bin", ".h5", ".msgpack", ".onnx", ".ot", ".safetensors", ".tflite"))

_tokenizer_json: bytes | None = None


def tokenizer_json() -> bytes:
    """A tokenizer.json for the GPT-2 BPE, built once by the `tokenizers` library from the genuine files."""
    global _tokenizer_json
    if _tokenizer_json is None:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

        files = hf_fixtures.tokenizer_files()
        tok = Tokenizer(models.BPE.from_file(str(files["vocab.json"]), str(files["merges.txt"])))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
        with tempfile.TemporaryDirectory() as d:
            tok.save(os.path.join(d, "tokenizer.json"), pretty=False)
            _tokenizer_json = Path(d, "tokenizer.json").read_bytes()
    return _tokenizer_json


def write_hub_repo(root: Path, repo_id: str, model=None, *, layout: str = "hub", revision: str = "main",
                   dtype: str = "fp32", decoys: bool = False, extras: bool = True, size: str | None = None,
                   seed: int = 0) -> Path:
    """One revision of one repo: ROOT/<org>/<name>/<revision>/. Give `model` (an HF GPT2LMHeadModel, not
    modified) or `size` (a full-size name, written tensor by tensor). Returns the revision directory.

    The revision is built in a temporary directory under ROOT and renamed into place only when complete: a fill
    that fails half-way leaves no half-written repo for the stand-in Hub to serve (or a later fill to skip)."""
    root = Path(root)
    out = root / repo_id / revision
    root.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(dir=root, prefix=".building-"))
    try:
        _write_revision(build, repo_id, model, layout, revision, dtype, decoys, extras, size, seed)
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        build.rename(out)
    finally:
        shutil.rmtree(build, ignore_errors=True)  # gone already after the rename; what a failure left otherwise
    return out


def _write_revision(out: Path, repo_id: str, model, layout: str, revision: str, dtype: str, decoys: bool,
                    extras: bool, size: str | None, seed: int) -> None:
    if model is not None:
        hf_fixtures.write_repo(copy.deepcopy(model), out, layout, dtype, tokenizer=True)
    else:
        if layout != "hub":
            raise ValueError("streamed repos exist only in the hub layout")
        hf_fixtures.write_random_hub_file(out / "model.safetensors", size, dtype, seed)
        for name, path in hf_fixtures.tokenizer_files().items():
            shutil.copyfile(path, out / name)
    if extras:
        (out / "tokenizer.json").write_bytes(tokenizer_json())
        (out / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 1024}) + "\n")
        (out / "generation_config.json").write_text(
            json.dumps({"_from_model_config": True, "bos_token_id": 50256, "eos_token_id": 50256}, indent=2) + "\n")
        (out / "README.md").write_text(f"# {repo_id}\n\nRandom weights in the layout of the real repo "
                                       f"(revision {revision}), made by scripts/fill_fake_hub.py for tests.\n")
        (out / ".gitattributes").write_text(GITATTRIBUTES)
    if decoys:
        rng = random.Random(f"{repo_id}@{revision}")
        for name, n in DECOYS.items():
            p = out / name
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(b"{}" if n == 0 else rng.randbytes(n))


def fill(root: Path, sizes: list[str], also_tf_files: bool = False, revisions: list[str] = ("main",),
         dtype: str = "fp32", seed: int = 0, log=print) -> list[str]:
    """Write every requested repo; returns their ids."""
    made = []
    for size in sizes:
        if size == "tiny":
            made += _fill_tiny(Path(root), dtype, seed, log)
            continue
        if size not in hf_fixtures.PRESETS:
            raise SystemExit(f"unknown size {size!r} (known: tiny, {', '.join(hf_fixtures.PRESETS)})")
        repo_id = f"{OFFICIAL_ORG}/{size}"
        for i, rev in enumerate(revisions):
            log(f"writing {repo_id}@{rev} ...")
            if size in STREAMED_SIZES:
                write_hub_repo(root, repo_id, size=size, revision=rev, dtype=dtype, decoys=also_tf_files,
                               seed=seed + i)
            else:
                model = hf_fixtures.make_hf_model(hf_fixtures.hf_config(size), seed=seed + i)
                write_hub_repo(root, repo_id, model, revision=rev, dtype=dtype, decoys=also_tf_files)
                del model
        made.append(repo_id)
    return made


def _fill_tiny(root: Path, dtype: str, seed: int, log) -> list[str]:
    config = hf_fixtures.hf_config(hf_fixtures.TINY)
    main = hf_fixtures.make_hf_model(config, seed=seed)
    other = hf_fixtures.make_hf_model(config, seed=seed + 1)
    repos = {
        f"{FIXTURE_ORG}/tiny": [("main", main, "hub", True), ("v1", other, "hub", True)],
        f"{FIXTURE_ORG}/tiny-bin-only": [("main", main, "bin", False)],
        f"{FIXTURE_ORG}/tiny-sharded": [("main", main, "sharded", False)],
    }
    for repo_id, revs in repos.items():
        for rev, model, layout, decoys in revs:
            log(f"writing {repo_id}@{rev} ({layout}) ...")
            write_hub_repo(root, repo_id, model, layout=layout, revision=rev, dtype=dtype, decoys=decoys)
    return list(repos)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", type=Path)
    ap.add_argument("--sizes", default="tiny", help="comma list of tiny, gpt2, gpt2-medium, gpt2-large, gpt2-xl")
    ap.add_argument("--also-tf-files", action="store_true", help="add decoy files the real repos carry")
    ap.add_argument("--revisions", default="main", help="comma list of revision names, e.g. main,v1.0")
    ap.add_argument("--dtype", default="fp32", choices=list(hf_fixtures.DTYPES))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    revisions = [r.strip() for r in args.revisions.split(",") if r.strip()]
    made = fill(args.root, sizes, args.also_tf_files, revisions, args.dtype, args.seed)
    print(f"{args.root}: {', '.join(made)}")


if __name__ == "__main__":
    main()

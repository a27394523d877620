"""The gpt2port target: a gpt2port checkpoint (checkpoint.py), with the source's provenance and file hashes."""

from __future__ import annotations

from gpt2port import checkpoint
from gpt2port.hashing import BackgroundHasher
from gpt2port.layouts import GPT2PORT


def write(job) -> int:
    """The writer for "gpt2port" (job: a conversion.Job). Returns the bytes written."""
    source = job.source
    if source.layout is GPT2PORT:  # re-writing a checkpoint: its provenance carries over, with a note of this
        prev = checkpoint.read_manifest(source.root)
        meta = checkpoint.derived_manifest(prev, job.dtype, "exports", str(source.root.resolve()))
        return checkpoint.write(job.out, source.config, job.items, lambda: {**meta, "warnings": job.warnings},
                                source.tokenizer_files, job.force, job.progress, source.read_files())
    hasher = BackgroundHasher(source.reader.files + source.side_files(), job.known_sha256, job.hashes)

    def manifest() -> dict:  # called once the weights are written: the hashes are ready by then
        return checkpoint.manifest(job.dtype, source.config, {
            "path": str(source.path.resolve()),
            "dtype": str(source.dtype()).removeprefix("torch."),
            "files": hasher.results(),
            **job.facts,
        }, job.warnings)

    # A failure stops the hashes with the session they belong to (convert closes it).
    return checkpoint.write(job.out, source.config, job.items, manifest, source.tokenizer_files, job.force,
                            job.progress, source.read_files())

"""`gpt2port download`: a NAME or repo id -> verified files in the Hugging Face cache -> a converted checkpoint
(-> verified, on request). The orchestrator: hub.fetch gets the files, conversion converts them from the cache
snapshot with the hashes already checked, verification proves the result."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from gpt2port.checkpoint import WEIGHTS, read_manifest
from gpt2port.records import recorded_size
from gpt2port.conversion import ConvertResult, convert
from gpt2port.dtypes import DTYPE_LABELS, parse_dtype
from gpt2port.errors import GPT2PortError
from gpt2port.fsio import check_replaceable
from gpt2port.hub.fetch import Fetcher, Snapshot, gb
from gpt2port.hub.names import resolve_name
from gpt2port.progress import byte_progress
from gpt2port.verification import run_verify


@dataclass
class DownloadResult:
    out: Path
    repo: str
    revision: str
    commit: str
    snapshot: Snapshot | None  # None when the checkpoint was already up to date (nothing fetched)
    converted: ConvertResult | None  # None when up to date
    report: object | None  # verify report when --verify was given
    seconds: float

    @property
    def up_to_date(self) -> bool:
        """The checkpoint was already there, of the same commit and dtype: nothing fetched or written."""
        return self.snapshot is None


def download(name: str, revision: str | None = None, out: str | Path | None = None, dtype=None, force: bool = False,
             verify: bool = False, quiet: bool = False, log: Callable[[str], None] = lambda s: None) -> DownloadResult:
    """`gpt2port download`: NAME or repo id -> verified HF files -> checkpoint at `out` (default ./checkpoints/NAME)."""
    t0 = time.perf_counter()
    repo, default_out = resolve_name(name)
    out = Path(out) if out is not None else default_out
    out_dtype = parse_dtype(dtype)
    if force and out.is_dir() and any(out.iterdir()):  # (a link to one: the conversion replaces its target)
        check_replaceable(Path(os.path.realpath(out)))  # before a byte is fetched: only what gpt2port wrote
    f = Fetcher(repo, revision, quiet, log)
    f.resolve()
    # Decided before any file moves: a finished checkpoint of this very commit needs nothing; anything else
    # already at `out` needs --force.
    if _up_to_date(out, repo, f.commit, out_dtype, force):
        report = _run_verify(out, quiet) if verify else None
        return DownloadResult(out, f.repo, f.revision, f.commit, None, None, report, time.perf_counter() - t0)
    snapshot = f.fetch_all()
    provenance = {"repo": repo, "revision": snapshot.revision, "commit": snapshot.commit,
                  "endpoint": f.endpoint, "sha256_checked": "every file, against the hashes the Hub announced"}
    with byte_progress("converting", quiet) as progress:
        converted = convert(snapshot.path, out, dtype=out_dtype, force=force, provenance=provenance,
                            known_sha256=snapshot.sha256, progress=progress)
    report = _run_verify(out, quiet) if verify else None
    return DownloadResult(out, f.repo, f.revision, f.commit, snapshot, converted, report, time.perf_counter() - t0)


def _up_to_date(out: Path, repo: str, commit: str, dtype, force: bool) -> bool:
    if not out.exists() or (out.is_dir() and not any(out.iterdir())) or force:
        return False
    if not out.is_dir():
        raise GPT2PortError(f"{out}: exists and is not a directory")
    manifest = read_manifest(out)
    src = manifest.get("source", {})
    same = src.get("repo") == repo and src.get("commit") == commit and (out / WEIGHTS).is_file()
    if same and dtype is not None:
        same = manifest.get("dtype") == DTYPE_LABELS[dtype]
    if same and recorded_size(manifest, WEIGHTS) == (out / WEIGHTS).stat().st_size:
        return True
    held = f" (holds {src['repo']}@{str(src.get('commit', '?'))[:12]}, {manifest.get('dtype', '?')})" \
        if src.get("repo") else ""
    raise GPT2PortError(f"{out}: already exists{held}; use --force to replace it, or --out to choose another place")


def _run_verify(out: Path, quiet: bool):
    report = run_verify(out, reference=None, dtype=None, tokens=None, progress=not quiet)
    if not report.passed:
        first = next(iter(report.failures), "see the report")
        raise GPT2PortError(f"{out}: written, but verify FAILED ({first}); run `gpt2port verify {out}` for the "
                            f"full report")
    return report


def summary(r: DownloadResult) -> str:
    """The one screen printed after a download (r: hub.DownloadResult)."""
    lines = [f"{r.out}  <-  {r.repo}@{r.revision} (commit {r.commit[:12]})"]
    s = r.snapshot
    if s is None:
        lines.append("  checkpoint  already up to date (same repo, commit and dtype): nothing fetched or rewritten")
    else:
        if s.offline:
            lines.append(f"  source      the Hugging Face cache, offline: {s.path}")
        elif s.downloaded_bytes:
            rate = s.downloaded_bytes / max(s.download_seconds, 1e-9)
            lines.append(f"  downloaded  {gb(s.downloaded_bytes)} in {s.download_seconds:.1f}s ({gb(int(rate))}/s)")
        else:
            lines.append(f"  downloaded  nothing: all {len(s.sha256)} files were in the Hugging Face cache")
        lines.append(f"  checked     sha256 of {len(s.sha256)} files ({gb(s.total_bytes)}) against the Hub's hashes")
        c = r.converted
        lines.append(f"  converted   {c.n_params:,} parameters, {DTYPE_LABELS.get(c.dtype, c.dtype)}, "
                     f"{gb(c.bytes_written)} in {c.seconds:.1f}s")
    if r.report is not None:
        n = len(r.report.checks)
        lines.append(f"  verified    gpt2port verify passed ({n} checks against the reference)")
    lines.append(f"  total       {r.seconds:.1f}s")
    for w in (s.warnings if s else []) + (list(r.converted.warnings) if r.converted else []):
        lines.append(f"  warning     {w}")
    return "\n".join(lines)

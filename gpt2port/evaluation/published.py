"""Published datasets by name (`--data lambada`): fetched from the Hugging Face Hub into its cache by huggingface_hub,
so HF_ENDPOINT, HF_HOME, HF_TOKEN and HF_HUB_OFFLINE work as they do for `download`; each file is checked against
the hash the Hub announced for it (the cache names its copy after it: sha256 for an LFS file, the git blob sha1 for a
small one), as `download` checks a cached file, and a bad copy is removed from the cache. The next run reads the
cache without network. Offline and not cached: one line saying to pass --data FILE.

Only plain files: jsonl, text, a zip (read with the standard library). The Hub's parquet copies would need pyarrow,
which gpt2port does not depend on; datasets published only that way, or off the Hub, are named with where to get
them.
"""

from __future__ import annotations

import io
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

from gpt2port import inputs
from gpt2port.errors import GPT2PortError


@dataclass(frozen=True)
class Source:
    task: str
    repo: str  # a dataset repo on the Hub
    file: str
    member: str | None = None  # the file to read inside a zip
    revision: str = "main"
    rows_joined: bool = False  # read as Hugging Face's wikitext loader made its rows, joined as the HF guide joins them

    def where(self, commit: str | None = None) -> str:
        inside = f" ({self.member})" if self.member else ""
        return f"{self.repo}@{(commit or self.revision)[:12]}/{self.file}{inside}"


WIKITEXT_2 = ("ggml-org/ci", "wikitext-2-raw-v1.zip", "wikitext-2-raw/wiki.test.raw")  # the wikitext-2-raw-v1 archive
SOURCES = {
    # the test split as the Hugging Face perplexity guide scores it, and the raw file as llama.cpp's perplexity does
    "wikitext-2": Source("perplexity", *WIKITEXT_2, rows_joined=True),
    "wikitext-2-raw": Source("perplexity", *WIKITEXT_2),
    # OpenAI's LAMBADA test file, as the harness's lambada_openai reads it (its `default` config), at the commit
    # whose copy docs/eval.md gives the hash of
    "lambada": Source("lambada", "EleutherAI/lambada_openai", "data/lambada_test.jsonl",
                      revision="900124bf3b8235c6daf21033af9948b3f07346c4"),
}
ELSEWHERE = {  # published, but not as a plain file on the Hub
    "wikitext-103": ("perplexity", "wikitext-103-raw-v1's wiki.test.raw (Salesforce/wikitext on the Hub holds "
                                   "parquet)"),
    "hellaswag": ("hellaswag", "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"),
}
NAMES = (*SOURCES, *ELSEWHERE)


@dataclass
class Fetched:
    path: Path  # the verified file in the Hugging Face cache
    text: bytes | None  # a zip member's bytes
    source: str  # repo@commit/file, as the result records it
    sha256: str


def fetch(name: str, task: str, quiet: bool = False) -> Fetched:
    """The published dataset `name` for `task`, from the cache or the Hub, verified."""
    kind, where = (SOURCES[name].task, None) if name in SOURCES else ELSEWHERE[name]
    if kind != task:
        raise GPT2PortError(f"--data {name}: a {kind} dataset, not one for --task {task}")
    if where is not None:
        raise GPT2PortError(f"--data {name}: not published as a plain file on the Hugging Face Hub; fetch {where} "
                            f"and pass --data FILE")
    source = SOURCES[name]
    import huggingface_hub as hf

    from huggingface_hub.errors import LocalEntryNotFoundError

    from gpt2port.hub.fetch import hf_bars, is_connection_error, first_line

    offline = hf.is_offline_mode()
    cached = hf.try_to_load_from_cache(source.repo, source.file, revision=source.revision, repo_type="dataset")
    try:
        with hf_bars(quiet):
            if not offline and not isinstance(cached, str):
                # one request without retries first: a Hub out of reach is one line at once, where the download's
                # own request retries five times over half a minute
                hf.get_hf_file_metadata(hf.hf_hub_url(source.repo, source.file, repo_type="dataset",
                                                      revision=source.revision))
            path = Path(hf.hf_hub_download(source.repo, source.file, repo_type="dataset", revision=source.revision,
                                           local_files_only=offline))
    except Exception as e:  # noqa: BLE001 - one line for the user whatever the client raised
        if offline or is_connection_error(e) or isinstance(e, LocalEntryNotFoundError):
            why = ("offline mode is on (HF_HUB_OFFLINE=1)" if offline
                   else f"the Hub at {hf.constants.ENDPOINT} cannot be reached")
            raise GPT2PortError(f"--data {name}: {source.where()} is not in the Hugging Face cache and {why}; run "
                                f"with network access, or pass --data FILE") from None
        raise GPT2PortError(f"--data {name}: fetching {source.where()} failed: {first_line(e)}") from None
    commit = path.parents[source.file.count("/")].name  # the cache's snapshots/<commit>/<file>
    sha256 = _check(name, source, path)
    text = None
    if source.member is not None:
        try:
            with inputs.open_binary(path, what="a zip archive") as f, zipfile.ZipFile(f) as archive:
                text = archive.read(source.member)  # its CRC checked as it is read
        except (zipfile.BadZipFile, KeyError) as e:
            raise GPT2PortError(f"--data {name}: {path}: no readable {source.member} ({e})") from None
        if source.rows_joined:
            text = rows_joined(text, f"--data {name}: {source.member}")
    return Fetched(path, text, source.where(commit), sha256)


def rows_joined(raw: bytes, what: str) -> bytes:
    """WikiText's text as `datasets.load_dataset("wikitext", ...)` gives it, joined as the HF perplexity guide joins it
    (`"\n\n".join(test["text"])`): Hugging Face's wikitext loader made a row of each line of the raw file as Python's
    text mode reads it (its newline kept), a blank or all-whitespace line an empty row."""
    lines = io.TextIOWrapper(io.BytesIO(raw), encoding="utf-8")
    try:
        return "\n\n".join(line if line.strip() else "" for line in lines).encode("utf-8")
    except UnicodeDecodeError:
        raise GPT2PortError(f"{what}: not UTF-8 text") from None


def _check(name: str, source: Source, path: Path) -> str:
    """sha256 of the cached file, after checking it against the hash its cache name announces; a bad copy is
    removed (the blob and its link, nothing outside the cache) and the run refused."""
    from gpt2port.fsio import hf_cache_dir, is_inside
    from gpt2port.hashing import hash_file
    from gpt2port.hub.fetch import cached_file

    announced = cached_file(source.file, path)
    sha256, git_sha1 = hash_file(path, git=True)
    want, got = (announced.sha256, sha256) if announced.sha256 else (announced.git_sha1, git_sha1)
    if want is None:
        raise GPT2PortError(f"--data {name}: {path}: its cache entry names no hash to check it against; pass the "
                            f"file as --data FILE if you trust it")
    if got != want:
        blob = Path(os.path.realpath(path))
        if is_inside(blob, hf_cache_dir()) and not blob.is_symlink():
            for p in (blob, path):
                p.unlink(missing_ok=True)
        raise GPT2PortError(f"--data {name}: {source.where()} failed its integrity check (content hash {got}, the "
                            f"Hub announced {want}); the copy was removed from the cache: run again")
    return sha256

"""One Hub repo at one pinned commit -> verified files in the Hugging Face cache.

Everything network-related is huggingface_hub's own machinery, so its cache (HF_HOME / HF_HUB_CACHE), tokens
(HF_TOKEN, `hf auth login`), HF_ENDPOINT and HF_HUB_OFFLINE behave as in the rest of the HF ecosystem, and files
already cached are never transferred again. What this adds:

- only what conversion needs: config.json, the tokenizer files, and ONE weights format (names.select_files);
- a pinned commit: the revision is resolved once and every file comes from that commit;
- integrity, which huggingface_hub does not check (it compares sizes only): every file is hashed and compared with
  the hash the Hub announced (sha256 for LFS files, the git blob sha1 for small ones). A bad copy is removed from
  the cache and fetched once more; a second failure stops the download.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from gpt2port.config import GPTConfig
from gpt2port.errors import GPT2PortError
from gpt2port.inputs import read_json
from gpt2port.formats import WEIGHT_FILES
from gpt2port.formats.shards import shard_names
from gpt2port.fsio import hf_cache_dir
from gpt2port.hashing import hash_file
from gpt2port.hub.names import SIDE_FILES, select_files
from gpt2port.progress import byte_progress

SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
GIT_SHA1_RE = re.compile(r"^[0-9a-f]{40}$")
SPACE_MARGIN = 64 << 20  # keep a little room: a disk filled to the last byte fails in unhelpful places


@dataclass
class RemoteFile:
    """One repo file and the hash the Hub announced for it (from the API listing, or the cache's blob name)."""
    name: str
    size: int | None
    sha256: str | None = None  # LFS files: sha256 of the content
    git_sha1: str | None = None  # small files: git blob id = sha1(b"blob <size>\0" + content)


@dataclass
class Snapshot:
    """Verified files of one commit, in the HF cache."""
    repo: str
    revision: str
    commit: str
    path: Path  # the cache's snapshots/<commit> directory
    sha256: dict[str, str]  # file name -> verified sha256
    downloaded_bytes: int
    download_seconds: float  # time inside the transfers of those bytes (API calls and hashing excluded)
    total_bytes: int
    offline: bool  # resolved from the cache only (HF_HUB_OFFLINE, or the Hub unreachable)
    seconds: float
    warnings: list[str] = field(default_factory=list)



class Fetcher:
    """One repo at one pinned commit: list, choose, download, hash, retry."""

    def __init__(self, repo: str, revision: str | None, quiet: bool, log: Callable[[str], None]):
        import huggingface_hub as hf

        self.hf = hf
        self.api = hf.HfApi()
        self.repo = repo
        self.revision = revision or "main"
        self.quiet = quiet
        self.log = log
        self.offline = hf.is_offline_mode()
        self.endpoint = hf.constants.ENDPOINT
        self.cache = hf_cache_dir()
        self.commit = ""
        self.remote: dict[str, RemoteFile] = {}
        self.paths: dict[str, Path] = {}
        self.downloaded = 0
        self.download_seconds = 0.0
        self.warnings: list[str] = []

    @property
    def where(self) -> str:
        return f"{self.repo}@{self.commit[:12]}" if self.commit else f"{self.repo}@{self.revision}"

    # -- which commit, which files --
    def resolve(self) -> None:
        """Pin the revision to a commit (written to the cache's refs/, so offline runs find it) and list it."""
        errors = self.hf.errors
        try:
            rev = self.api.resolve_revision(self.repo, revision=self.revision, local_files_only=self.offline)
        except errors.RevisionResolutionError:
            raise GPT2PortError(self._unreachable_message()) from None
        except Exception as e:  # noqa: BLE001 - one line for the user whatever the client raised
            raise GPT2PortError(self._hub_error(e)) from None
        self.commit = rev.resolved
        if not self.offline:
            try:
                info = self.api.model_info(self.repo, revision=self.commit, files_metadata=True)
                self.remote = {s.rfilename: RemoteFile(s.rfilename, s.size, s.lfs.sha256 if s.lfs else None,
                                                       None if s.lfs else s.blob_id)
                               for s in info.siblings or [] if "/" not in s.rfilename}
                return
            except Exception as e:  # noqa: BLE001 - out of reach: the cache serves; else one line
                if not is_connection_error(e):
                    raise GPT2PortError(self._hub_error(e)) from None
                self.offline = True
                self.warnings.append(f"the Hub at {self.endpoint} cannot be reached ({first_line(e)}); "
                                     f"using the cached copy of {self.where}")
        self.remote = self._cached_listing()

    def _cached_listing(self) -> dict[str, RemoteFile]:
        """Offline: the files of this commit present in the cache; the announced hash is the blob's name."""
        found = {}
        for name in (*SIDE_FILES, *WEIGHT_FILES):
            path = self.hf.try_to_load_from_cache(self.repo, name, revision=self.commit)
            if isinstance(path, str):
                found[name] = cached_file(name, Path(path))
        if not any(w in found for w in WEIGHT_FILES):
            raise GPT2PortError(f"{self.where}: the weights are not in the Hugging Face cache ({self.cache}) and "
                                f"{self._why_offline()}; run again with network access to finish the download")
        return found

    def choose(self) -> list[str]:
        side, weights = select_files(set(self.remote))
        if not weights:
            others = sorted(self.remote) or ["no files"]
            raise GPT2PortError(f"{self.where}: no PyTorch weights to convert (looked for {', '.join(WEIGHT_FILES)};"
                                f" the repo has {', '.join(others[:12])}{' ...' if len(others) > 12 else ''})")
        return side + [weights]

    # -- transfer --
    def expect(self, names: list[str], index: str) -> None:
        """Shards named by an index must exist: in the repo listing, or offline in the cache."""
        for name in names:
            if name not in self.remote and self.offline:
                cached = self.hf.try_to_load_from_cache(self.repo, name, revision=self.commit)
                if not isinstance(cached, str):
                    raise GPT2PortError(f"{self.where}: {name} is not in the Hugging Face cache and "
                                        f"{self._why_offline()}")
                self.remote[name] = cached_file(name, Path(cached))
            if name not in self.remote:
                raise GPT2PortError(f"{self.where}: {name} is listed in {index} but missing from the repo")

    def fetch(self, name: str) -> Path:
        """One file into the cache (a no-op, without network, when the commit's copy is already there)."""
        cached = self.hf.try_to_load_from_cache(self.repo, name, revision=self.commit)
        t0 = time.perf_counter()
        try:
            path = self.hf.hf_hub_download(self.repo, name, revision=self.commit, local_files_only=self.offline)
        except Exception as e:  # noqa: BLE001 - KeyboardInterrupt passes; huggingface_hub removes its temp file
            raise GPT2PortError(self._file_error(name, e)) from None
        if not isinstance(cached, str):
            self.downloaded += Path(path).stat().st_size
            self.download_seconds += time.perf_counter() - t0
        self.paths[name] = Path(path)
        return Path(path)

    def check_space(self, names: list[str]) -> None:
        """Refuse a download that cannot fit in the cache before transferring gigabytes of it."""
        missing = [n for n in names
                   if not isinstance(self.hf.try_to_load_from_cache(self.repo, n, revision=self.commit), str)]
        need = sum(self.remote[n].size or 0 for n in missing)
        if not need:
            return
        probe = self.cache
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        free = shutil.disk_usage(probe).free
        if free < need + SPACE_MARGIN:
            raise GPT2PortError(f"{self.cache}: not enough free space for {self.where}: the download needs "
                                f"{gb(need)}, {gb(free)} is free (set HF_HOME or HF_HUB_CACHE to use another disk)")

    def fetch_all(self) -> Snapshot:
        """Every needed file of the pinned commit into the cache, small ones first, then verified."""
        t0 = time.perf_counter()
        names = self.choose()
        *side, weights = names
        self.log(f"{self.where}: {', '.join(names)}" + (" (from the cache, offline)" if self.offline else ""))
        digests: dict[str, str] = {}
        with hf_bars(self.quiet):
            # Small files first, checked before they are read: a non-GPT-2 repo is refused before its weights move.
            for name in side:
                self.fetch(name)
            digests.update(self.verify(side))
            if "config.json" in self.paths:
                GPTConfig.from_hf_config(read_json(self.paths["config.json"]), f"{self.where}/config.json")
            weight_files = [weights]
            if weights.endswith(".index.json"):
                self.fetch(weights)
                digests.update(self.verify([weights]))
                weight_files = shard_names(self.paths[weights])
                self.expect(weight_files, weights)
                self.log(f"{self.where}: {len(weight_files)} shards: {', '.join(weight_files)}")
            if not self.offline:
                self.check_space(weight_files)
            for name in weight_files:
                self.fetch(name)
            digests.update(self.verify(weight_files))
        snapshot_dirs = {p.parent for p in self.paths.values()}
        if len(snapshot_dirs) != 1:
            raise GPT2PortError(f"{self.where}: files resolved to more than one snapshot directory: "
                                f"{sorted(map(str, snapshot_dirs))}")
        return Snapshot(self.repo, self.revision, self.commit, snapshot_dirs.pop(), digests, self.downloaded,
                        self.download_seconds, sum(p.stat().st_size for p in self.paths.values()), self.offline,
                        time.perf_counter() - t0, self.warnings)

    # -- integrity --
    def verify(self, names: list[str]) -> dict[str, str]:
        """sha256 of every file, each checked against the announced hash; a bad copy is evicted and fetched again
        once. Returns name -> sha256."""
        digests, bad = self._hash_all(names)
        if bad and not self.offline:
            for name, got, want in bad:
                self._evict(name)  # first: a blob that is not the cache's own is refused, not announced as removed
                self.warnings.append(f"{self.where}: {name} arrived corrupted ({got} instead of the announced "
                                     f"{want}); removed it from the cache and downloaded it again")
                self.log(f"warning: {self.warnings[-1]}")
                self.fetch(name)
            again, bad = self._hash_all([b[0] for b in bad])
            digests.update(again)
        if bad:
            name, got, want = bad[0]
            self._evict(name)
            tail = ("run again with network access to fetch a good copy" if self.offline
                    else "the bad copy was removed from the cache; run again, and if it persists the Hub or a proxy "
                         "is serving damaged data")
            raise GPT2PortError(f"{self.where}: {name} failed its integrity check: content hash {got}, the Hub "
                                f"announced {want}; {tail}")
        return digests

    def _hash_all(self, names: list[str]):
        total = sum(self.paths[n].stat().st_size for n in names)
        digests, bad = {}, []
        done = 0
        with byte_progress("checking sha256", self.quiet) as progress:
            for name in names:
                remote = self.remote[name]
                sha256, git_sha1 = hash_file(self.paths[name], lambda n: progress and progress(done + n, total),
                                             git=True)
                done += self.paths[name].stat().st_size
                digests[name] = sha256
                if remote.sha256 is not None and sha256 != remote.sha256:
                    bad.append((name, f"sha256 {sha256}", remote.sha256))
                elif remote.sha256 is None and remote.git_sha1 is not None and git_sha1 != remote.git_sha1:
                    bad.append((name, f"git sha1 {git_sha1}", remote.git_sha1))
                elif remote.sha256 is None and remote.git_sha1 is None:
                    self.warnings.append(f"{self.where}: {name}: no announced hash to check it against")
        return digests, bad

    def _evict(self, name: str) -> None:
        """Remove a bad file from the cache: the blob and this snapshot's link to it, and nothing outside the
        cache. A blob that is itself a link (a user's file, a cache spread over disks) is not the cache's own
        copy: it is left, with its target, and the download refused naming it."""
        pointer = self.paths.get(name)
        if pointer is None:
            return
        repo_dir = os.path.realpath(self.cache / f"models--{self.repo.replace('/', '--')}")
        blob = Path(os.path.normpath(pointer.parent / os.readlink(pointer))) if pointer.is_symlink() else pointer
        real = os.path.realpath(blob)
        if os.path.islink(blob) or os.path.commonpath([real, repo_dir]) != repo_dir:
            raise GPT2PortError(f"{blob}: the cached {name} of {self.where} failed its integrity check, and it is "
                                f"not a file of the cache but a link to {real}; left as it is: remove the link "
                                f"and run again")
        for p in dict.fromkeys([blob, pointer]):
            try:
                p.unlink()
            except FileNotFoundError:
                pass

    # -- messages --
    def _why_offline(self) -> str:
        return ("offline mode is on (HF_HUB_OFFLINE=1)" if self.hf.is_offline_mode()
                else f"the Hub at {self.endpoint} cannot be reached")

    def _unreachable_message(self) -> str:
        return (f"{self.repo}: revision {self.revision!r} is not in the Hugging Face cache ({self.cache}) and "
                f"{self._why_offline()}")

    def _hub_error(self, e: Exception) -> str:
        errors = self.hf.errors
        if isinstance(e, errors.GatedRepoError):
            return (f"{self.repo}: gated repo; accept its terms on the Hub, then set HF_TOKEN (or run "
                    f"`hf auth login`)")
        if isinstance(e, errors.RepositoryNotFoundError):
            return (f"{self.repo}: repository not found on {self.endpoint} (if it is private, set HF_TOKEN or run "
                    f"`hf auth login`)")
        if isinstance(e, errors.RevisionNotFoundError):
            return f"{self.repo}: revision {self.revision!r} not found (a branch, tag or commit hash)"
        if isinstance(e, errors.HFValidationError):
            return f"{self.repo!r} is not a valid Hub repo id ({first_line(e)})"
        if is_connection_error(e):
            return self._unreachable_message()
        return f"{self.where}: the Hub request failed: {first_line(e)}"

    def _file_error(self, name: str, e: Exception) -> str:
        errors = self.hf.errors
        if isinstance(e, errors.RemoteEntryNotFoundError):
            return f"{self.where}: {name} is missing on the Hub"
        if isinstance(e, errors.LocalEntryNotFoundError):
            return f"{self.where}: {name} is not in the Hugging Face cache and {self._why_offline()}"
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return f"{self.where}: downloading {name} failed: no space left on device ({self.cache})"
        if isinstance(e, (errors.RepositoryNotFoundError, errors.RevisionNotFoundError)):
            return self._hub_error(e)
        return f"{self.where}: downloading {name} failed: {first_line(e)} (run again to resume)"


def is_connection_error(e: BaseException) -> bool:
    """Connection refused, timeouts, offline mode: the Hub is out of reach, as opposed to the Hub saying no."""
    if isinstance(e, ConnectionError):  # OfflineModeIsEnabled is one
        return True
    names = {c.__name__ for c in type(e).__mro__}
    return bool(names & {"ConnectError", "TimeoutException", "NetworkError", "TransportError"})


def cached_file(name: str, path: Path) -> RemoteFile:
    """The cache names each blob after the ETag the Hub announced when it arrived: sha256 for LFS files, the git
    blob sha1 otherwise. That is what a cached file is checked against when the Hub cannot be asked."""
    blob = Path(os.readlink(path)).name if path.is_symlink() else path.name  # the cache's name, not a link's target's
    size = path.stat().st_size
    if SHA256_RE.match(blob):
        return RemoteFile(name, size, sha256=blob)
    if GIT_SHA1_RE.match(blob):
        return RemoteFile(name, size, git_sha1=blob)
    return RemoteFile(name, size)


class hf_bars:
    """huggingface_hub's own download bars (bytes, rate), silenced with --quiet. On a non-TTY they hide themselves.
    Its retry chatter ("'[Errno 111] Connection refused' thrown while requesting HEAD ...", "Retrying in 1s [Retry
    1/5]", two lines a try) is silenced always: what failed is gpt2port's one line."""

    def __init__(self, quiet: bool):
        self.quiet = quiet

    def __enter__(self):
        import logging

        self._hub_log = logging.getLogger("huggingface_hub")
        self._level = self._hub_log.level
        self._hub_log.setLevel(logging.ERROR)
        if self.quiet:
            from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars

            self._was_disabled = are_progress_bars_disabled()
            disable_progress_bars()
        return self

    def __exit__(self, *exc):
        self._hub_log.setLevel(self._level)
        if self.quiet and not self._was_disabled:
            from huggingface_hub.utils import enable_progress_bars

            enable_progress_bars()


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"

"""A stand-in for the Hugging Face Hub on 127.0.0.1: the endpoints huggingface_hub calls to download a model.

No machine in this project reaches the real Hub, so the download path is tested against this server, over real
HTTP. It speaks just enough of the Hub's protocol for `HfApi.model_info` / `repo_info` / `resolve_revision`,
`list_repo_tree`, `get_paths_info`, `hf_hub_download` and `snapshot_download` (huggingface_hub 2.x, plain HTTP:
set HF_HUB_DISABLE_XET=1), with the Hub's status codes and X-Error-Code headers; and `hf_hub_download` of a dataset
repo's file (ROOT/datasets/<org>/<name>/<revision>/...).

On-disk layout (scripts/fill_fake_hub.py writes it):

    ROOT/<org>/<name>/<revision>/<files...>

Each directory under a repo is one commit; its name is the branch or tag that points at it ("main", "v1.0"), or
a 40-hex commit hash, which is then its commit. Otherwise the commit hash is derived from the repo id, the directory
name and every file's sha256, so changing a file "moves" the branch to a new commit, as a push would. A revision
is found by name or by its 40-hex commit hash.

Files are stored in LFS when their suffix says so (.safetensors, .bin, .h5, ...) or when they are larger than
10 MiB, as on the Hub: their ETag / X-Linked-Etag is the sha256 of the content and the API lists
lfs={sha256, size, pointerSize}; other files have a git blob sha1 as ETag and blobId. LFS downloads are
redirected (302) to a "CDN" on another host name (localhost instead of 127.0.0.1), as the Hub redirects to its
CDN, so the client's redirect handling (metadata taken from the 302, auth header dropped) runs for real.

Test switches (attributes of FakeHub, or POST /_fake/faults with a JSON body when run as a process):
    corrupt   {path: times}            flip one byte in the body of the next `times` GETs (-1: always)
    cut       {path: {"at": N, "times": k}}   close the connection once byte N of the file has been sent
    throttle  {path: bytes_per_second} send the body slowly (for interrupting a download)
    status    {path: [code, times]}    answer GET/HEAD of the file with this HTTP status
The request log (GET /_fake/log; FakeHub.log) records method, path, range, status, kind and whether an
Authorization header came along. With a token (--token), every /api and /resolve request needs
"Authorization: Bearer <token>", as a private repo does.

Usage (from the repository root): python -m scripts.fake_hub --root DIR [--port 8765] [--token T] [--no-cdn]
Then:  HF_ENDPOINT=http://127.0.0.1:8765 HF_HUB_DISABLE_XET=1 gpt2port download gpt2
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".h5", ".msgpack", ".onnx", ".ot", ".tflite", ".pt", ".pth", ".ckpt",
                ".gguf", ".npz", ".zip", ".tar.gz")
LFS_MIN_SIZE = 10 << 20  # the Hub refuses larger files in plain git
CHUNK = 1 << 20
COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
CREATED = "2019-02-18T00:00:00.000Z"


class HubError(Exception):
    """An error answer, the way the Hub words it: status code + X-Error-Code header."""

    def __init__(self, status: int, code: str | None, message: str, commit: str | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.commit = status, code, message, commit


class FileFacts:
    def __init__(self, path: Path, relpath: str, size: int, sha256: str):
        self.path, self.relpath, self.size, self.sha256 = path, relpath, size, sha256
        self.lfs = relpath.endswith(LFS_SUFFIXES) or size > LFS_MIN_SIZE
        if self.lfs:
            self.pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()
            self.blob_id = git_blob_sha1(self.pointer)
        else:
            self.pointer = None
            self.blob_id = git_blob_sha1_of_file(path)

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.blob_id

    def tree_entry(self) -> dict:
        entry = {"type": "file", "oid": self.blob_id, "size": self.size, "path": self.relpath}
        if self.lfs:
            entry["lfs"] = {"oid": self.sha256, "size": self.size, "pointerSize": len(self.pointer)}
        return entry

    def sibling(self, blobs: bool) -> dict:
        s = {"rfilename": self.relpath}
        if blobs:
            s.update(size=self.size, blobId=self.blob_id)
            if self.lfs:
                s["lfs"] = {"sha256": self.sha256, "size": self.size, "pointerSize": len(self.pointer)}
        return s


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def git_blob_sha1_of_file(path: Path) -> str:
    h = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


class Store:
    """The repos under ROOT, with file hashes computed once per (path, size, mtime)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._hashes: dict[tuple, FileFacts] = {}
        self._lock = threading.Lock()

    def repo_dir(self, repo_id: str) -> Path:
        """A model repo "org/name" is ROOT/org/name; a dataset repo ("datasets/org/name") ROOT/datasets/org/name."""
        parts = repo_id.split("/")
        if len(parts) != 2 + (parts[0] == "datasets") or any(p in ("", ".", "..") or p.startswith(".") for p in parts):
            raise HubError(404, "RepoNotFound", f"Repository {repo_id} not found")
        d = self.root.joinpath(*parts)
        if not d.is_dir() or not any(p.is_dir() for p in d.iterdir()):
            raise HubError(404, "RepoNotFound", f"Repository {repo_id} not found")
        return d

    def revisions(self, repo_id: str) -> dict[str, Path]:
        return {p.name: p for p in sorted(self.repo_dir(repo_id).iterdir()) if p.is_dir()}

    def resolve(self, repo_id: str, revision: str) -> tuple[str, Path]:
        """(commit hash, directory) for a branch/tag name or a commit hash."""
        revs = self.revisions(repo_id)
        if revision in revs:
            return self.commit(repo_id, revs[revision]), revs[revision]
        if COMMIT_RE.match(revision):
            for d in revs.values():
                if self.commit(repo_id, d) == revision:
                    return revision, d
        raise HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")

    def files(self, rev_dir: Path) -> list[FileFacts]:
        out = []
        for p in sorted(rev_dir.rglob("*")):
            if p.is_file():
                out.append(self.facts(p, p.relative_to(rev_dir).as_posix()))
        return out

    def facts(self, path: Path, relpath: str) -> FileFacts:
        st = path.stat()
        key = (str(path), st.st_size, st.st_mtime_ns)
        with self._lock:
            found = self._hashes.get(key)
            if found is None:
                h = hashlib.sha256()
                with open(path, "rb") as f:
                    while chunk := f.read(CHUNK):
                        h.update(chunk)
                found = self._hashes[key] = FileFacts(path, relpath, st.st_size, h.hexdigest())
        return found

    def commit(self, repo_id: str, rev_dir: Path) -> str:
        """A directory named by a commit hash is that commit (as a source pinned to a real commit expects); any
        other's hash is made from its name and files (it moves when they change, as a branch does after a push)."""
        if COMMIT_RE.fullmatch(rev_dir.name):
            return rev_dir.name
        h = hashlib.sha1(f"fake-hub commit\n{repo_id}\n{rev_dir.name}\n".encode())
        for f in self.files(rev_dir):
            h.update(f"{f.relpath} {f.sha256}\n".encode())
        return h.hexdigest()

    def file(self, rev_dir: Path, relpath: str, commit: str) -> FileFacts:
        path = rev_dir / relpath
        if ".." in relpath.split("/") or not path.is_file():
            raise HubError(404, "EntryNotFound", f"{relpath} does not exist on this revision", commit)
        return self.facts(path, relpath)


class FakeHub:
    """The server. `with FakeHub(root) as hub:` serves on hub.url from a background thread."""

    def __init__(self, root, host: str = "127.0.0.1", port: int = 0, cdn_host: str | None = "localhost",
                 token: str | None = None):
        self.store = Store(Path(root))
        self.token = token
        self.log: list[dict] = []
        self.faults: dict[str, dict] = {"corrupt": {}, "cut": {}, "throttle": {}, "status": {}}
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer((host, port), _handler_for(self))
        self._server.daemon_threads = True
        self.host, self.port = self._server.server_address[:2]
        self.cdn_host = cdn_host
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "FakeHub":
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-hub", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._server.serve_forever()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # -- test helpers -------------------------------------------------------------------------------------------------
    def reset(self) -> None:
        with self._lock:
            self.log.clear()
            for v in self.faults.values():
                v.clear()

    def file_gets(self) -> list[str]:
        """Repo-relative paths of every file body sent (200/206), whether from /resolve or the CDN."""
        with self._lock:
            return [e["file"] for e in self.log if e["method"] == "GET" and e["file"] and e["status"] in (200, 206)]

    def entries(self) -> list[dict]:
        with self._lock:
            return [dict(e) for e in self.log]

    def requested_files(self) -> set[str]:
        """Every file path that was asked about at all (HEAD or GET)."""
        with self._lock:
            return {e["file"] for e in self.log if e["file"]}

    def set_faults(self, faults: dict) -> None:
        with self._lock:
            for kind, table in faults.items():
                if kind not in self.faults:
                    raise ValueError(f"unknown fault kind {kind!r} (known: {', '.join(self.faults)})")
                self.faults[kind].update(table)

    def _take_fault(self, kind: str, relpath: str):
        """The fault set for this file, counting down its `times` (None when there is none left)."""
        with self._lock:
            table = self.faults[kind]
            if relpath not in table:
                return None
            value = table[relpath]
            if kind == "throttle":
                return value
            times = value if kind == "corrupt" else value["times"] if kind == "cut" else value[1]
            if times == 0:
                return None
            if times > 0:
                if kind == "corrupt":
                    table[relpath] = times - 1
                elif kind == "cut":
                    table[relpath] = {**value, "times": times - 1}
                else:
                    table[relpath] = [value[0], times - 1]
            return value

    def _record(self, entry: dict) -> None:
        with self._lock:
            self.log.append(entry)


def _handler_for(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "fake-hub/1"

        def log_message(self, fmt, *args):  # the request log replaces stderr chatter
            pass

        def do_HEAD(self):
            self._dispatch("HEAD")

        def do_GET(self):
            self._dispatch("GET")

        def do_POST(self):
            self._dispatch("POST")

        # -- routing ------------------------------------------------------------------------------------------------
        def _dispatch(self, method: str) -> None:
            split = urlsplit(self.path)
            # Split before unquoting: a revision like refs%2Fpr%2F1 is one path segment.
            segs = [unquote(s) for s in split.path.split("/")[1:]]
            # Logged as it starts (status filled in when known), so a test can see a transfer in progress.
            self._entry = {"method": method, "path": split.path, "query": split.query,
                           "range": self.headers.get("Range"), "auth": self.headers.get("Authorization") is not None,
                           "kind": None, "file": None, "status": None, "done": False}
            hub._record(self._entry)
            try:
                self._route(method, segs, parse_qs(split.query))
            except HubError as e:
                self._error(e)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True
            finally:
                self._entry["done"] = True

        def _route(self, method, segs, query):
            if segs[:1] == ["_fake"]:
                return self._control(method, segs[1:])
            if segs[:1] == ["_cdn"] and len(segs) >= 5 and method in ("GET", "HEAD"):
                self._entry["kind"] = "cdn"
                n = 3 + (segs[1] == "datasets")  # the segments up to the repo's name
                repo_id = "/".join(segs[1:n])
                commit, rev_dir = hub.store.resolve(repo_id, segs[n])
                f = hub.store.file(rev_dir, "/".join(segs[n + 1:]), commit)
                return self._send_file(method, f, commit, cdn=True)
            if segs == ["api", "agent-harnesses"] and method == "GET":
                # huggingface_hub >= 2 fetches this registry once a day (best effort); an empty one detects nothing.
                self._entry["kind"] = "api"
                return self._json({"standardEnvVars": [], "harnesses": {}}, None)
            if segs[:2] == ["api", "models"] and len(segs) >= 4:
                self._entry["kind"] = "api"
                self._check_auth()
                repo_id = "/".join(segs[2:4])
                rest = segs[4:]
                if not rest and method == "GET":
                    return self._model_info(repo_id, "main", query)
                if len(rest) == 2 and rest[0] == "revision" and method == "GET":
                    return self._model_info(repo_id, rest[1], query)
                if len(rest) >= 2 and rest[0] == "tree" and method == "GET":
                    return self._tree(repo_id, rest[1], "/".join(rest[2:]), query)
                if len(rest) == 2 and rest[0] == "paths-info" and method == "POST":
                    return self._paths_info(repo_id, rest[1])
            n = 2 + (segs[:1] == ["datasets"])  # /datasets/org/name/resolve/...: a dataset repo's file
            if len(segs) >= n + 3 and segs[n] == "resolve" and method in ("GET", "HEAD"):
                self._entry["kind"] = "resolve"
                self._check_auth()
                repo_id = "/".join(segs[:n])
                commit, rev_dir = hub.store.resolve(repo_id, segs[n + 1])
                f = hub.store.file(rev_dir, "/".join(segs[n + 2:]), commit)
                self._entry["file"] = f.relpath
                return self._resolve(method, repo_id, commit, f)
            raise HubError(404, None, f"Sorry, we can't find the page you are looking for: {self.path}")

        def _check_auth(self):
            if hub.token is not None and self.headers.get("Authorization") != f"Bearer {hub.token}":
                # The Hub answers 401 + RepoNotFound for private repos without the right token.
                raise HubError(401, "RepoNotFound", "Repository not found (private: send a valid token)")

        # -- API ----------------------------------------------------------------------------------------------------
        def _model_info(self, repo_id, revision, query):
            commit, rev_dir = hub.store.resolve(repo_id, revision)
            files = hub.store.files(rev_dir)
            blobs = query.get("blobs", ["false"])[0].lower() == "true"
            org = repo_id.split("/")[0]
            config = {}
            cfg = rev_dir / "config.json"
            if cfg.is_file():
                try:
                    raw = json.loads(cfg.read_text())
                    config = {k: raw[k] for k in ("architectures", "model_type") if k in raw}
                except (ValueError, UnicodeDecodeError):
                    pass
            modified = datetime.datetime.fromtimestamp(max((f.path.stat().st_mtime for f in files), default=0),
                                                       datetime.timezone.utc)
            info = {
                "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24], "id": repo_id, "modelId": repo_id,
                "author": org, "sha": commit, "lastModified": modified.strftime("%Y-%m-%dT%H:%M:%S.000Z"),
                "createdAt": CREATED, "private": hub.token is not None, "disabled": False, "gated": False,
                "downloads": 0, "likes": 0, "library_name": "transformers", "pipeline_tag": "text-generation",
                "tags": ["transformers", "gpt2", "text-generation"], "config": config,
                "siblings": [f.sibling(blobs) for f in files],
                "usedStorage": sum(f.size for f in files),
            }
            self._json(info, commit)

        def _tree(self, repo_id, revision, path, query):
            commit, rev_dir = hub.store.resolve(repo_id, revision)
            recursive = query.get("recursive", ["false"])[0].lower() == "true"
            base = rev_dir / path if path else rev_dir
            if not base.is_dir():
                raise HubError(404, "EntryNotFound", f"{path} does not exist on this revision", commit)
            entries = []
            children = sorted(base.rglob("*") if recursive else base.iterdir())
            for p in children:
                rel = p.relative_to(rev_dir).as_posix()
                if p.is_dir():
                    oid = hashlib.sha1(f"tree {commit} {rel}".encode()).hexdigest()
                    entries.append({"type": "directory", "oid": oid, "size": 0, "path": rel})
                else:
                    entries.append(hub.store.facts(p, rel).tree_entry())
            self._json(entries, commit)

        def _paths_info(self, repo_id, revision):
            commit, rev_dir = hub.store.resolve(repo_id, revision)
            length = int(self.headers.get("Content-Length") or 0)
            form = parse_qs(self.rfile.read(length).decode()) if length else {}
            out = []
            for rel in form.get("paths", []):
                p = rev_dir / rel
                if ".." in rel.split("/") or not p.exists():
                    continue  # the Hub silently skips paths that do not exist
                if p.is_dir():
                    out.append({"type": "directory", "oid": hashlib.sha1(f"tree {commit} {rel}".encode()).hexdigest(),
                                "size": 0, "path": rel})
                else:
                    out.append(hub.store.facts(p, rel).tree_entry())
            self._json(out, commit)

        # -- files --------------------------------------------------------------------------------------------------
        def _resolve(self, method, repo_id, commit, f: FileFacts):
            self._status_fault(f)
            if f.lfs and hub.cdn_host:
                # Like the Hub: LFS content lives on a CDN; the metadata travels on the redirect itself.
                location = (f"http://{hub.cdn_host}:{hub.port}/_cdn/{quote(repo_id)}/{commit}/{quote(f.relpath)}")
                self._entry["status"] = 302
                self.send_response(302)
                self.send_header("Location", location)
                self.send_header("X-Repo-Commit", commit)
                self.send_header("X-Linked-Etag", f'"{f.sha256}"')
                self.send_header("X-Linked-Size", str(f.size))
                self.send_header("ETag", f'"{f.blob_id}"')
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self._send_file(method, f, commit, cdn=False)

        def _status_fault(self, f: FileFacts):
            fault = hub._take_fault("status", f.relpath)
            if fault is not None:
                raise HubError(int(fault[0]), None, f"injected HTTP {fault[0]}")

        def _send_file(self, method, f: FileFacts, commit: str, cdn: bool):
            self._entry["file"] = f.relpath
            if cdn:
                self._status_fault(f)
            start, end = 0, f.size  # [start, end)
            rng = self.headers.get("Range")
            partial = False
            if rng:
                m = re.fullmatch(r"bytes=(\d*)-(\d*)", rng.strip())
                if not m or (not m.group(1) and not m.group(2)):
                    raise HubError(416, None, f"bad range {rng!r}")
                if m.group(1):
                    start = int(m.group(1))
                    end = min(f.size, int(m.group(2)) + 1) if m.group(2) else f.size
                else:  # suffix range: the last N bytes
                    start = max(0, f.size - int(m.group(2)))
                if start >= f.size and f.size > 0:
                    self._entry["status"] = 416
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{f.size}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                partial = True
            self._entry["status"] = 206 if partial else 200
            self.send_response(206 if partial else 200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(end - start))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("ETag", f'"{f.etag}"')
            self.send_header("Content-Disposition", f'inline; filename*=UTF-8\'\'{quote(f.path.name)}; '
                                                    f'filename="{f.path.name}";')
            if partial:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{f.size}")
            if not cdn:
                self.send_header("X-Repo-Commit", commit)
                if f.lfs:
                    self.send_header("X-Linked-Etag", f'"{f.sha256}"')
                    self.send_header("X-Linked-Size", str(f.size))
            self.end_headers()
            if method == "HEAD":
                return
            self._stream(f, start, end)

        def _stream(self, f: FileFacts, start: int, end: int):
            corrupt = hub._take_fault("corrupt", f.relpath) is not None
            cut = hub._take_fault("cut", f.relpath)
            rate = hub._take_fault("throttle", f.relpath)
            flip_at = f.size // 2  # the byte the "corrupt" fault flips, wherever the range starts
            stop = end if cut is None else max(start, min(end, int(cut["at"])))
            chunk = CHUNK if not rate else max(1, min(CHUNK, int(rate) // 10))
            pos = start
            t0 = time.monotonic()
            with open(f.path, "rb") as fh:
                fh.seek(start)
                while pos < stop:
                    data = fh.read(min(chunk, stop - pos))
                    if not data:
                        break
                    if corrupt and pos <= flip_at < pos + len(data):
                        data = bytearray(data)
                        data[flip_at - pos] ^= 0x01
                        data = bytes(data)
                    self.wfile.write(data)
                    pos += len(data)
                    if rate:
                        ahead = (pos - start) / rate - (time.monotonic() - t0)
                        if ahead > 0:
                            time.sleep(ahead)
            if cut is not None and stop < end:
                self._entry["cut_at"] = stop
                self.wfile.flush()
                self.close_connection = True
                try:
                    self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        # -- control and helpers ------------------------------------------------------------------------------------
        def _control(self, method, segs):
            self._entry["kind"] = "control"
            if segs == ["log"] and method == "GET":
                with hub._lock:
                    log = [dict(e) for e in hub.log]
                return self._json(log, None)
            if segs == ["faults"] and method == "POST":
                length = int(self.headers.get("Content-Length") or 0)
                try:
                    hub.set_faults(json.loads(self.rfile.read(length) or b"{}"))
                except ValueError as e:
                    raise HubError(400, None, str(e)) from None
                return self._json(hub.faults, None)
            if segs == ["reset"] and method == "POST":
                hub.reset()
                return self._json({}, None)
            raise HubError(404, None, "unknown control endpoint")

        def _json(self, obj, commit: str | None):
            body = json.dumps(obj).encode()
            self._entry["status"] = 200
            self.send_response(200)
            self.send_header("Content-Type", "application/json; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            if commit:
                self.send_header("X-Repo-Commit", commit)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _error(self, e: HubError):
            body = json.dumps({"error": e.message}).encode()
            self._entry["status"] = e.status
            self.send_response(e.status)
            self.send_header("Content-Type", "application/json; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            if e.code:
                self.send_header("X-Error-Code", e.code)
            self.send_header("X-Error-Message", e.message)
            if e.commit:
                self.send_header("X-Repo-Commit", e.commit)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

    return Handler


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=True, type=Path, help="directory of repos: ROOT/<org>/<name>/<revision>/...")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--token", default=None, help="require this bearer token (a private repo)")
    ap.add_argument("--no-cdn", action="store_true", help="serve LFS files directly instead of redirecting")
    args = ap.parse_args()
    if not args.root.is_dir():
        ap.error(f"{args.root}: not a directory (fill it with python -m scripts.fill_fake_hub)")
    hub = FakeHub(args.root, args.host, args.port, cdn_host=None if args.no_cdn else "localhost", token=args.token)
    repos = sorted(f"{o.name}/{r.name}" for o in args.root.iterdir() if o.is_dir() for r in o.iterdir() if r.is_dir())
    print(f"fake hub serving {len(repos)} repos from {args.root} on {hub.url}", flush=True)
    for r in repos:
        print(f"  {r}  ({', '.join(hub.store.revisions(r))})", flush=True)
    print(f"use: HF_ENDPOINT={hub.url} HF_HUB_DISABLE_XET=1 gpt2port download NAME", flush=True)
    try:
        hub.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        hub._server.server_close()


if __name__ == "__main__":
    main()

"""Hugging Face Hub ids (`ORG/NAME`, `ORG/NAME:QUANT`): resolved from a hub cache written the way
huggingface_hub writes it (blobs, snapshot symlinks, refs, the tree listing, with the library's own
functions), offline; downloaded from a local stand-in for the Hub serving real files, with HF_TOKEN, into
the hub cache; the errors for ids that are not cached or do not exist name the id."""

from __future__ import annotations

import hashlib
import http.server
import importlib
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from tiny_models import build_tiny_model

from ladle import LLM, SamplingParams
from ladle.model.config import ModelConfig
from ladle.model.hub import hub_model_path
from ladle.model.kernels import loader
from ladle.model.loader import resolve_model_path

GREEDY = SamplingParams(max_tokens=6, temperature=0)
PROMPT = [1, 400, 3000, 17, 9000, 42]


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty hub cache in HF_HUB_CACHE, HF_HUB_OFFLINE=1, and converted GGUFs in a private ladle cache.
    huggingface_hub reads its environment variables at import: its constants are reloaded to see them."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    loader.native_kernels()  # loaded (or built once per machine) from the usual cache: only models go private
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("LADLE_CACHE_DIR", str(tmp_path / "ladle-cache"))
    importlib.reload(constants)
    yield cache
    monkeypatch.undo()
    importlib.reload(constants)


def online(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> None:
    """Downloads allowed, from `endpoint` (a local stand-in for huggingface.co)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    importlib.reload(constants)


def cache_repo(cache: Path, repo_id: str, files: dict[str, Path], revision: str = "main",
               not_downloaded: tuple[str, ...] = ()) -> Path:
    """Put `files` (name in the repo -> file here) into the hub cache as snapshot_download leaves them:
    content-addressed blobs, the snapshot's relative symlinks to them, refs/REVISION holding the commit and
    the commit's tree listing (which also lists the repo's `not_downloaded` files). Returns the snapshot."""
    from huggingface_hub._tree_cache import TreeCacheEntry, write_tree_cache
    from huggingface_hub.file_download import (
        _cache_commit_hash_for_specific_revision, _create_symlink, repo_folder_name,
    )

    storage = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    commit = hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()
    snapshot = storage / "snapshots" / commit
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    entries = {}
    for name, source in files.items():
        data = source.read_bytes()
        git_sha1 = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        lfs = name.endswith((".safetensors", ".gguf"))  # the Hub names LFS blobs by sha256, others by git sha1
        blob = storage / "blobs" / (hashlib.sha256(data).hexdigest() if lfs else git_sha1)
        blob.write_bytes(data)
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        _create_symlink(str(blob), str(snapshot / name), new_blob=True)
        entries[name] = TreeCacheEntry(size=len(data), blob_id=git_sha1,
                                       lfs_sha256=blob.name if lfs else None, lfs_size=len(data) if lfs else None)
    for name in not_downloaded:
        entries[name] = TreeCacheEntry(size=1 << 20, blob_id=hashlib.sha1(name.encode()).hexdigest(),
                                       lfs_sha256=hashlib.sha256(name.encode()).hexdigest(), lfs_size=1 << 20)
    _cache_commit_hash_for_specific_revision(str(storage), revision, commit)
    write_tree_cache(str(storage), commit, entries)
    return snapshot


def folder_files(folder: Path) -> dict[str, Path]:
    return {p.name: p for p in folder.iterdir() if p.is_file()}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("llama"), smollm2_dir)


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return build_tiny_model("qwen2", tmp_path_factory.mktemp("qwen2"), smollm2_dir)


def test_a_cached_id_is_what_huggingface_hub_sees_and_generates(hub_cache: Path, tiny_llama: Path) -> None:
    from huggingface_hub import scan_cache_dir

    snapshot = cache_repo(hub_cache, "org/tiny", folder_files(tiny_llama))
    (repo,) = scan_cache_dir(hub_cache).repos
    assert (repo.repo_id, repo.repo_type, repo.nb_files) == ("org/tiny", "model", len(folder_files(tiny_llama)))
    (rev,) = repo.revisions
    assert rev.refs == {"main"} and rev.snapshot_path == snapshot
    assert resolve_model_path("org/tiny") == snapshot
    llm = LLM("org/tiny", num_kv_blocks=64)
    assert llm.engine.model_path == snapshot
    out = llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    assert out == LLM(str(tiny_llama), num_kv_blocks=64).generate([PROMPT], GREEDY)[0].outputs[0].token_ids


def test_revision_picks_its_snapshot(hub_cache: Path, tiny_llama: Path, tiny_qwen2: Path) -> None:
    main = cache_repo(hub_cache, "org/tiny", folder_files(tiny_llama))
    v2 = cache_repo(hub_cache, "org/tiny", folder_files(tiny_qwen2), revision="v2")
    assert main != v2
    assert resolve_model_path("org/tiny") == main
    assert resolve_model_path("org/tiny", revision="v2") == v2
    assert resolve_model_path("org/tiny", revision=v2.name) == v2  # a commit hash
    assert ModelConfig.from_folder(resolve_model_path("org/tiny", revision="v2")).model_type == "qwen2"
    llm = LLM("org/tiny", revision="v2", num_kv_blocks=64)
    assert llm.engine.model_config.model_type == "qwen2" and llm.engine.model_path == v2
    with pytest.raises(FileNotFoundError, match="'org/tiny'.*HF_HUB_OFFLINE is set"):
        resolve_model_path("org/tiny", revision="v3")  # not cached, and offline


def test_download_dir_is_the_hub_cache_looked_in(hub_cache: Path, tmp_path: Path, tiny_llama: Path) -> None:
    other = tmp_path / "elsewhere"
    snapshot = cache_repo(other, "org/tiny", folder_files(tiny_llama))
    assert resolve_model_path("org/tiny", download_dir=str(other)) == snapshot
    with pytest.raises(FileNotFoundError, match="'org/tiny'"):
        resolve_model_path("org/tiny")  # not in HF_HUB_CACHE


def test_an_existing_path_wins_over_an_id(hub_cache: Path, tmp_path: Path, tiny_llama: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    cache_repo(hub_cache, "org/tiny", folder_files(tiny_llama))
    local = tmp_path / "work" / "org" / "tiny"
    local.mkdir(parents=True)
    for name, f in folder_files(tiny_llama).items():
        (local / name).symlink_to(f)
    monkeypatch.chdir(tmp_path / "work")
    assert resolve_model_path("org/tiny") == Path("org/tiny")


@pytest.fixture(scope="module")
def two_ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A GGUF repo's files: a tiny llama as `*-Q8_0.gguf`, a tiny qwen2 as `*-Q4_K_M.gguf`."""
    from test_loader import _write_tiny_gguf

    out = tmp_path_factory.mktemp("ggufs")
    files = {"tiny-Q8_0.gguf": "llama", "tiny-Q4_K_M.gguf": "qwen2"}
    for name, arch in files.items():
        _write_tiny_gguf(out / name, arch)
    return {name: out / name for name in files} | {"README.md": _readme(out)}


def _readme(folder: Path) -> Path:
    (folder / "README.md").write_text("# tiny GGUFs\n")
    return folder / "README.md"


def test_quant_picks_one_gguf_of_a_repo(hub_cache: Path, two_ggufs: dict[str, Path]) -> None:
    """The repo also holds a Q6_K file never downloaded, as when a user fetched only some quants."""
    snapshot = cache_repo(hub_cache, "org/tiny-GGUF", two_ggufs, not_downloaded=("tiny-Q6_K.gguf",))
    assert hub_model_path("org/tiny-GGUF:Q4_K_M") == snapshot / "tiny-Q4_K_M.gguf"
    assert hub_model_path("org/tiny-GGUF:q8_0") == snapshot / "tiny-Q8_0.gguf"  # case-insensitive
    assert ModelConfig.from_folder(resolve_model_path("org/tiny-GGUF:q4_k_m")).model_type == "qwen2"
    llm = LLM("org/tiny-GGUF:Q8_0", num_kv_blocks=64)
    assert llm.engine.model_config.model_type == "llama"
    assert len(llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids) == GREEDY.max_tokens
    with pytest.raises(ValueError, match=r"'org/tiny-GGUF'.*'Q5_K_M'.*available: Q4_K_M, Q8_0"):
        resolve_model_path("org/tiny-GGUF:Q5_K_M")
    with pytest.raises(ValueError, match=r"'org/tiny-GGUF'.*several GGUF files.*Q4_K_M, Q8_0"):
        resolve_model_path("org/tiny-GGUF")
    with pytest.raises(ValueError, match=r"available: Q4_K_M, Q8_0"):
        resolve_model_path("org/tiny-GGUF:Q4_K")  # a tag, not a prefix of one
    with pytest.raises(ValueError, match=r"'Q6_K'.*available: Q4_K_M, Q8_0"):  # offline: what is cached
        resolve_model_path("org/tiny-GGUF:Q6_K")


def test_a_model_folder_missing_a_shard_is_not_taken_from_the_cache(hub_cache: Path, tiny_llama: Path) -> None:
    cache_repo(hub_cache, "org/tiny", folder_files(tiny_llama), not_downloaded=("model-00002-of-00002.safetensors",))
    with pytest.raises(FileNotFoundError, match="'org/tiny'.*HF_HUB_OFFLINE is set"):
        resolve_model_path("org/tiny")


def test_offline_and_not_cached_names_the_id(hub_cache: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"model 'org/missing' is neither a local path nor in the "
                                                r"Hugging Face cache .*and HF_HUB_OFFLINE is set"):
        resolve_model_path("org/missing")
    with pytest.raises(FileNotFoundError, match=r"'org/missing:Q4_K_M'"):
        resolve_model_path("org/missing:Q4_K_M")


class FakeHub(http.server.BaseHTTPRequestHandler):
    """Answers every API call as huggingface.co answers for a repo that does not exist (401 with
    X-Error-Code RepoNotFound), or a revision that does not (404 RevisionNotFound)."""

    def do_GET(self) -> None:
        code, error = (404, "RevisionNotFound") if "/revision/nope" in self.path else (401, "RepoNotFound")
        self.send_response(code)
        self.send_header("X-Error-Code", error)
        self.send_header("Content-Type", "application/json")
        body = b'{"error": "Repository not found"}'
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def fake_hub() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


class ServedHub(http.server.BaseHTTPRequestHandler):
    """A local stand-in for huggingface.co serving real files: the routes and headers huggingface_hub's
    downloads read (the repo's info, its tree listing, HEAD and GET of /{repo}/resolve/{revision}/{file},
    LFS files named by their sha256). Every repo is private: a request without `Bearer TOKEN` is answered
    as the Hub answers it (401, RepoNotFound). Each request is logged as (method, path, Authorization)."""

    repos: dict[str, dict[str, bytes]] = {}  # repo id -> file name -> content
    log: list[tuple[str, str, str | None]] = []
    TOKEN = "hf_ladle_test_token"

    @staticmethod
    def commit(repo: str) -> str:
        return hashlib.sha1(f"{repo}@main".encode()).hexdigest()

    @staticmethod
    def lfs(name: str) -> bool:
        return name.endswith((".safetensors", ".gguf"))

    def _reply(self, code: int, body: bytes = b"", headers: dict[str, str] | None = None,
               send_body: bool = True) -> None:
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def _handle(self, send_body: bool) -> None:
        from urllib.parse import unquote, urlsplit

        self.log.append((self.command, self.path, self.headers.get("Authorization")))
        path = unquote(urlsplit(self.path).path)
        api = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+)|/tree/([^/]+))?", path)
        resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        repo = (api or resolve)[1] if (api or resolve) else None
        if repo not in self.repos or self.headers.get("Authorization") != f"Bearer {self.TOKEN}":
            body = b'{"error": "Repository not found"}'
            return self._reply(401, body, {"X-Error-Code": "RepoNotFound", "Content-Type": "application/json"},
                               send_body)
        files, commit = self.repos[repo], self.commit(repo)
        if api and api[3] is not None:  # the tree listing
            tree = [{"type": "file", "path": name, "size": len(data), "oid": _git_sha1(data),
                     **({"lfs": {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}}
                        if self.lfs(name) else {})} for name, data in files.items()]
            return self._reply(200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, send_body)
        if api:
            info = {"id": repo, "modelId": repo, "sha": commit, "private": True,
                    "siblings": [{"rfilename": name} for name in files]}
            return self._reply(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, send_body)
        name = resolve[3]
        if name not in files:
            return self._reply(404, b"", {"X-Error-Code": "EntryNotFound"}, send_body)
        data = files[name]
        headers = {"X-Repo-Commit": commit, "ETag": f'"{_git_sha1(data)}"', "Content-Type": "application/octet-stream"}
        if self.lfs(name):
            headers |= {"X-Linked-Etag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Linked-Size": str(len(data))}
        self._reply(200, data, headers, send_body)

    def do_GET(self) -> None:
        self._handle(send_body=True)

    def do_HEAD(self) -> None:
        self._handle(send_body=False)

    def log_message(self, *args) -> None:
        pass


def _git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@pytest.fixture
def served_hub(tiny_llama: Path, two_ggufs: dict[str, Path]) -> Iterator[str]:
    """The stand-in serving a tiny Llama's folder as `org/tiny` and two GGUFs as `org/tiny-GGUF`."""
    ServedHub.repos = {"org/tiny": {name: f.read_bytes() for name, f in folder_files(tiny_llama).items()},
                       "org/tiny-GGUF": {name: f.read_bytes() for name, f in two_ggufs.items()}}
    ServedHub.log = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ServedHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_model_not_cached_is_downloaded_into_the_hub_cache_with_the_token(
        hub_cache: Path, served_hub: str, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A private repo: refused without HF_TOKEN, downloaded with it (the token on every request) into
    HF_HUB_CACHE as huggingface_hub's own cache scan reads it, then served offline from there."""
    from huggingface_hub import scan_cache_dir

    online(monkeypatch, served_hub)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_TOKEN_PATH", str(hub_cache.parent / "no-token"))  # no `hf auth login` token either
    with pytest.raises(FileNotFoundError, match=r"'org/tiny' is neither a local path nor a model on the Hugging "
                                                r"Face Hub \(if it is private, log in"):
        resolve_model_path("org/tiny")  # private: not found without the token
    assert ServedHub.log and all(auth is None for _, _, auth in ServedHub.log)
    ServedHub.log.clear()
    monkeypatch.setenv("HF_TOKEN", ServedHub.TOKEN)
    path = resolve_model_path("org/tiny")
    assert ServedHub.log and all(auth == f"Bearer {ServedHub.TOKEN}" for _, _, auth in ServedHub.log)
    # in the hub cache, laid out by huggingface_hub: a snapshot of the commit, symlinks to content-named blobs
    assert path == hub_cache / "models--org--tiny" / "snapshots" / ServedHub.commit("org/tiny")
    (repo,) = scan_cache_dir(hub_cache).repos
    (rev,) = repo.revisions
    assert repo.repo_id == "org/tiny" and rev.refs == {"main"} and rev.snapshot_path == path
    served = ServedHub.repos["org/tiny"]
    wanted = {n for n in served if n.endswith((".json", ".safetensors", ".jinja")) or n.startswith("tokenizer")}
    assert {f.file_name for f in rev.files} == wanted and wanted >= {"config.json", "model.safetensors"}
    for f in rev.files:
        assert f.file_path.is_symlink() and f.blob_path.parent.name == "blobs"
        assert f.file_path.read_bytes() == served[f.file_name]
    # then offline, from the cache alone: no request, and the same model as the folder it was served from
    ServedHub.log.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    importlib.reload(importlib.import_module("huggingface_hub.constants"))
    assert resolve_model_path("org/tiny") == path and not ServedHub.log
    out = LLM("org/tiny", num_kv_blocks=64).generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    assert out == LLM(str(tiny_llama), num_kv_blocks=64).generate([PROMPT], GREEDY)[0].outputs[0].token_ids


def test_a_gguf_quant_downloads_that_file_alone(hub_cache: Path, served_hub: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """ORG/NAME:QUANT downloads the one GGUF file the quant names, with the token, into the hub cache."""
    online(monkeypatch, served_hub)
    monkeypatch.setenv("HF_TOKEN", ServedHub.TOKEN)
    path = hub_model_path("org/tiny-GGUF:q4_k_m")
    assert path.name == "tiny-Q4_K_M.gguf" and path.read_bytes() == ServedHub.repos["org/tiny-GGUF"][path.name]
    assert path.parent == hub_cache / "models--org--tiny-GGUF" / "snapshots" / ServedHub.commit("org/tiny-GGUF")
    assert sorted(p.name for p in path.parent.iterdir()) == ["tiny-Q4_K_M.gguf"]  # not the Q8_0, not the README
    assert all(auth == f"Bearer {ServedHub.TOKEN}" for _, _, auth in ServedHub.log)


def test_unknown_id_and_revision_online_name_them(hub_cache: Path, fake_hub: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    online(monkeypatch, fake_hub)
    with pytest.raises(FileNotFoundError, match=r"model 'org/missing' is neither a local path nor a model on "
                                                r"the Hugging Face Hub"):
        resolve_model_path("org/missing")
    with pytest.raises(ValueError, match=r"revision 'nope' not found in model 'org/tiny'"):
        resolve_model_path("org/tiny", revision="nope")


def test_unreachable_hub_names_the_id(hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        online(monkeypatch, f"http://127.0.0.1:{s.getsockname()[1]}")
        with pytest.raises(FileNotFoundError, match=r"model 'org/missing' .*Hub could not be reached"):
            resolve_model_path("org/missing")


def test_serve_exits_2_naming_a_missing_id(tmp_path: Path) -> None:
    """The environment as a user sets it, read by a fresh process."""
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "ladle.cli", "serve", "org/missing"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert ("ladle serve: model 'org/missing' is neither a local path nor in the Hugging "
            f"Face cache ({tmp_path})") in proc.stderr, proc.stderr


def test_revision_and_download_dir_flags_reach_the_engine_config() -> None:
    import argparse

    from ladle.config import add_engine_arguments, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    config = engine_config_from_args(parser.parse_args(["org/tiny", "--revision", "v2", "--download-dir", "/d"]))
    assert (config.model, config.revision, config.download_dir) == ("org/tiny", "v2", "/d")


def test_a_hub_id_is_served_under_its_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ladle.config import EngineConfig
    from ladle.server.context import served_model_name

    assert served_model_name(EngineConfig(model="org/tiny")) == "org/tiny"  # as vLLM names it
    assert served_model_name(EngineConfig(model="org/tiny-GGUF:Q4_K_M")) == "org/tiny-GGUF:Q4_K_M"
    (tmp_path / "org" / "tiny").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert served_model_name(EngineConfig(model="org/tiny")) == "tiny"  # a local folder: its name

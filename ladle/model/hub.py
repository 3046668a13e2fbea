"""Models named by a Hugging Face Hub id: `ORG/NAME` (a model folder) or `ORG/NAME:QUANT` (one GGUF file
of a repo, as llama.cpp and Ollama name them).

The local hub cache (HF_HOME, HF_HUB_CACHE, or `download_dir`) is looked in first; only a model that is
not there is downloaded, with huggingface_hub's progress bars, unless HF_HUB_OFFLINE is set.
huggingface_hub is imported only when an id is resolved, so the CLI starts fast.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

# what ladle reads from a model folder: config, safetensors weights, tokenizer and chat template
MODEL_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*"]
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?::(?P<quant>[\w.-]+))?$")
# a quant tag in a GGUF file name: Q4_K_M, IQ3_XS, Q8_0, F16, BF16, ... between separators
QUANT_TAG = re.compile(r"(?<![A-Za-z0-9])((?:I?Q\d\w*?|BF16|F16|F32))(?=(?:-\d{5}-of-\d{5})?\.gguf$)", re.I)


@dataclass(frozen=True)
class HubModel:
    repo_id: str
    quant: str | None = None  # ORG/NAME:QUANT picks one GGUF file
    revision: str | None = None  # branch, tag or commit; None: the default branch
    cache_dir: str | None = None  # None: huggingface_hub's (HF_HUB_CACHE, else HF_HOME/hub)

    @property
    def name(self) -> str:
        return f"{self.repo_id}:{self.quant}" if self.quant else self.repo_id


def parse_hub_id(model: str) -> tuple[str, str | None] | None:
    """(repo id, quant) when `model` reads as `ORG/NAME` or `ORG/NAME:QUANT`, else None."""
    m = HUB_ID.match(model)
    if m is None or "--" in m["repo"] or ".." in m["repo"]:
        return None
    return m["repo"], m["quant"]


def hub_model_path(model: str, revision: str | None = None, download_dir: str | None = None) -> Path:
    """The local path of hub model `model`: its snapshot folder, or for `ORG/NAME:QUANT` the GGUF file.

    Raises FileNotFoundError (not cached and not downloadable) or ValueError (no such quant, revision).
    """
    parsed = parse_hub_id(model)
    if parsed is None:
        raise ValueError(f"{model!r} is not a Hugging Face model id (ORG/NAME or ORG/NAME:QUANT)")
    hub = HubModel(parsed[0], parsed[1], revision, download_dir)
    from huggingface_hub import constants

    offline = constants.is_offline_mode()
    cached = _cached(hub, offline)
    if cached is not None:
        return cached
    if offline:
        raise FileNotFoundError(f"model {hub.name!r} is neither a local path nor in the Hugging Face cache "
                                f"({_cache_dir(hub)}), and HF_HUB_OFFLINE is set: download it once with "
                                "network access")
    return _download(hub)


def _cached(hub: HubModel, offline: bool) -> Path | None:
    """The model from the local cache, without any network call; None when it is not (fully) there.
    Offline, a cached GGUF repo is all there is: a quant it lacks is an error that lists those it has."""
    if hub.quant is None:
        folder = _cached_snapshot(hub, MODEL_FILES, partial=False)
        if folder is not None and _is_model_folder(_files(folder)):
            return folder
    folder = _cached_snapshot(hub, ["*.gguf"], partial=True)  # a GGUF repo's quants are downloaded one by one
    ggufs = _ggufs(_files(folder)) if folder is not None else []
    if ggufs and (offline or hub.quant is None or _matching(ggufs, hub.quant)):
        return folder / pick_gguf(ggufs, hub)
    return None  # not downloaded yet: the Hub may have it


def _cached_snapshot(hub: HubModel, patterns: list[str], partial: bool) -> Path | None:
    """The revision's snapshot folder in the cache, if every file of the repo matching `patterns` is in it
    (as far as the cached listing of the repo tells), or if `partial`, whatever it holds."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(hub.repo_id, revision=hub.revision, cache_dir=hub.cache_dir,
                                      local_files_only=True, allow_patterns=patterns))
    except IncompleteSnapshotError as e:
        return Path(e.snapshot_path) if partial else None
    except LocalEntryNotFoundError:
        return None


def _files(folder: Path) -> list[str]:
    return [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]


def _download(hub: HubModel) -> Path:
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download

    with _hub_errors(hub):
        info = HfApi().model_info(hub.repo_id, revision=hub.revision)  # one request, no retries
        files = [s.rfilename for s in info.siblings or []]
        if hub.quant is None and _is_model_folder(files):
            return Path(snapshot_download(hub.repo_id, revision=hub.revision, cache_dir=hub.cache_dir,
                                          allow_patterns=MODEL_FILES))
        ggufs = _ggufs(files)
        if not ggufs:
            raise ValueError(f"model {hub.name!r} on the Hugging Face Hub has neither config.json with "
                             "safetensors weights nor a .gguf file")
        filename = pick_gguf(ggufs, hub)
        return Path(hf_hub_download(hub.repo_id, filename, revision=hub.revision, cache_dir=hub.cache_dir))


def pick_gguf(ggufs: list[str], hub: HubModel) -> str:
    """The one GGUF file of `ggufs` that `hub.quant` names (case-insensitively), or the only one there is."""
    if hub.quant is None:
        if len(ggufs) == 1:
            return ggufs[0]
        raise ValueError(f"model {hub.name!r} holds several GGUF files: name one as {hub.repo_id}:QUANT, "
                         f"with QUANT one of {', '.join(_quants(ggufs))}")
    found = _matching(ggufs, hub.quant)
    if len(found) == 1:
        return found[0]
    if not found:
        raise ValueError(f"no GGUF file of model {hub.repo_id!r} matches quant {hub.quant!r}; "
                         f"available: {', '.join(_quants(ggufs))}")
    raise ValueError(f"quant {hub.quant!r} matches several GGUF files of model {hub.repo_id!r} "
                     f"({', '.join(found)}); ladle loads a single-file GGUF")


def _matching(ggufs: list[str], quant: str) -> list[str]:
    tag = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(quant)}(?![A-Za-z0-9_])", re.I)
    return [f for f in ggufs if tag.search(PurePosixPath(f).name)]


def _quants(ggufs: list[str]) -> list[str]:
    """Each file's quant tag (its name when it has none), as a user would type it after the colon."""
    tags = []
    for f in ggufs:
        m = QUANT_TAG.search(PurePosixPath(f).name)
        tags.append(m[1] if m else PurePosixPath(f).name)
    return sorted(set(tags))


def _ggufs(files: list[str]) -> list[str]:
    return sorted(f for f in files if f.lower().endswith(".gguf"))


def _is_model_folder(files: list[str]) -> bool:
    return "config.json" in files and any(f.endswith(".safetensors") for f in files)


def _cache_dir(hub: HubModel) -> str:
    from huggingface_hub import constants

    return hub.cache_dir or constants.HF_HUB_CACHE


@contextmanager
def _hub_errors(hub: HubModel) -> Iterator[None]:
    """Turns huggingface_hub's errors into FileNotFoundError or ValueError messages that name the model."""
    import httpx2  # huggingface_hub's HTTP client
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    name = hub.name
    try:
        yield
    except GatedRepoError as e:
        raise FileNotFoundError(f"model {name!r} is gated on the Hugging Face Hub: accept its terms on "
                                "huggingface.co and log in (`hf auth login` or HF_TOKEN)") from e
    except RepositoryNotFoundError as e:
        raise FileNotFoundError(f"model {name!r} is neither a local path nor a model on the Hugging Face Hub "
                                "(if it is private, log in with `hf auth login` or HF_TOKEN)") from e
    except RevisionNotFoundError as e:
        raise ValueError(f"revision {hub.revision!r} not found in model {hub.repo_id!r} on the Hugging Face "
                         "Hub") from e
    except (httpx2.TransportError, OSError) as e:  # no network, the Hub down, a failed download
        raise FileNotFoundError(f"model {name!r} is neither a local path nor in the Hugging Face cache "
                                f"({_cache_dir(hub)}), and the Hub could not be reached "
                                f"({type(e).__name__}: {e})") from e

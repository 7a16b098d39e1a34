"""Models by Hugging Face id: a local folder is used as it is, the built-in models' names
(`peregrine-demo`, `peregrine-demo-draft`) name their packaged folders, and an id is fetched (or
found in the local cache) through huggingface_hub. Only what the engine reads is downloaded:
config and generation config, safetensors weights and the tokenizer files."""
from __future__ import annotations

import re
from pathlib import Path

from peregrine.demo import demo_draft_path, demo_model_path

# NOTE: no pickle weights (*.bin, *.pt): the loader refuses them anyway.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "merges.txt",
                  "vocab.txt", "*.jinja"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def is_repo_id(name: str) -> bool:
    """True for names shaped like a hub id ("org/name" or "name") that are not local paths."""
    return bool(_REPO_ID.match(name)) and ".." not in name and not Path(name).exists()


# The built-in models by name (the demo model is served as `peregrine-demo`).
BUILT_IN = {"peregrine-demo": demo_model_path, "peregrine-demo-draft": demo_draft_path}


def resolve_model_path(name: str, revision: str | None = None,
                       download_dir: str | None = None) -> str:
    """A local folder for `name`: the folder itself, a built-in model's packaged folder, or the
    hub id's snapshot (fetched or cached).

    huggingface_hub reads HF_TOKEN, HF_HUB_OFFLINE and HF_ENDPOINT from the environment itself.
    """
    if Path(name).is_dir():
        return name
    if name in BUILT_IN:
        return str(BUILT_IN[name]())
    if not is_repo_id(name):
        raise ValueError(f"model {name!r} is neither a local folder nor a Hugging Face model id "
                         "(org/name)")
    return _snapshot(name, revision, download_dir)


def _snapshot(repo_id: str, revision: str | None, download_dir: str | None) -> str:
    from huggingface_hub import errors, snapshot_download
    try:
        return str(snapshot_download(repo_id, revision=revision, cache_dir=download_dir,
                                     allow_patterns=ALLOW_PATTERNS))
    except errors.GatedRepoError as e:
        raise ValueError(f"{repo_id!r} is gated on the Hugging Face Hub: accept its license there "
                         "and set HF_TOKEN") from e
    except errors.RepositoryNotFoundError as e:
        raise ValueError(f"{repo_id!r} was not found on the Hugging Face Hub (or is private: "
                         "set HF_TOKEN)") from e
    except errors.RevisionNotFoundError as e:
        raise ValueError(f"{repo_id!r} has no revision {revision!r}") from e
    except (errors.LocalEntryNotFoundError, errors.HfHubHTTPError, OSError) as e:
        raise ValueError(f"could not fetch {repo_id!r}: the Hugging Face Hub could not be reached "
                         "and the model is not in the local cache; pass a local model folder "
                         "instead") from e

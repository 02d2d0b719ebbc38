"""Model sources given as a Hugging Face hub id (ORG/NAME): fetched with huggingface_hub,
safetensors and side files only (never pickle checkpoints)."""

from __future__ import annotations

import re
from pathlib import Path

from fuselm.converter.errors import UserError

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
# What a conversion reads: weights (safetensors only), config, tokenizer, generation config.
ALLOW = ["*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json",
         "tokenizer*", "special_tokens_map.json", "chat_template.*", "vocab.json",
         "merges.txt", "added_tokens.json"]


def is_hub_id(src: str | Path) -> bool:
    """ORG/NAME that is not a local path (an existing folder always wins)."""
    text = str(src)
    return not Path(text).exists() and HUB_ID.match(text) is not None \
        and not text.endswith(".gguf")


def download_command(repo_id: str) -> str:
    return f"hf download {repo_id} --local-dir {repo_id.split('/')[1]}"


def resolve_source(src: str | Path) -> Path:
    """A local folder/file as is; a hub id downloaded (into the HF cache) first."""
    if not is_hub_id(src):
        return Path(src)
    repo_id = str(src)
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import RepositoryNotFoundError
    except ImportError:  # pragma: no cover - transformers depends on huggingface_hub
        raise UserError(f"{repo_id} is not a local folder; download it with "
                        f"`{download_command(repo_id)}` and convert that folder") from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=ALLOW))
    except RepositoryNotFoundError:
        raise UserError(f"{repo_id}: no such local folder, and the hub has no such model "
                        "(or it is gated: log in with `hf auth login`)") from None
    except Exception as e:  # offline, DNS, proxy, timeouts: all mean "cannot reach the hub"
        raise UserError(
            f"{repo_id} is not a local folder and the Hugging Face hub cannot be reached "
            f"({type(e).__name__}); on a machine with network run "
            f"`{download_command(repo_id)}`, then `fuselm convert "
            f"{repo_id.split('/')[1]} -o OUT`") from None

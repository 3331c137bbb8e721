"""Finding a checkpoint: a local directory, or a Hugging Face hub id resolved as the hub's own
client resolves it (HF_ENDPOINT, HF_HUB_CACHE and HF_HUB_OFFLINE honoured).

Kept apart from the weight loader so that resolving a name needs neither torch nor transformers.
"""

from __future__ import annotations

from pathlib import Path

from vacpack.errors import ModelNotFoundError

_CHECKPOINT_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


def resolve_model_path(
    name_or_path: str, revision: str | None = None, required_file: str = "config.json"
) -> Path:
    """A checkpoint directory (holding `required_file`: a LoRA adapter's is
    adapter_config.json), resolved as huggingface_hub resolves a model name.

    A path that exists locally wins. Otherwise a valid hub id ("name" or "org/name", dots
    allowed) goes to the hub (HF_ENDPOINT) at `revision`, through the hub cache (HF_HUB_CACHE),
    which is all there is in offline mode (HF_HUB_OFFLINE=1). The error says what was tried
    locally and on the hub.
    """
    local = Path(name_or_path).expanduser()
    if local.is_dir():
        if not (local / required_file).is_file():
            raise ModelNotFoundError(f"model directory {str(local)!r} has no {required_file}")
        return local
    tried_locally = f"{str(local.absolute())!r} is not a directory"
    if local.exists():
        raise ModelNotFoundError(f"model {name_or_path!r}: {tried_locally} (a file?)")
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    looks_like_path = name_or_path.startswith((".", "/", "~"))
    try:
        validate_repo_id(name_or_path)
    except HFValidationError:
        looks_like_path = True
    if looks_like_path:
        raise ModelNotFoundError(
            f"model {name_or_path!r}: {tried_locally}, and it is not a Hugging Face hub id "
            "('name' or 'org/name')"
        )
    model_dir = Path(_download_from_hub(name_or_path, revision, tried_locally))
    if not (model_dir / required_file).is_file():
        raise ModelNotFoundError(
            f"model {name_or_path!r}: the hub repository has no {required_file} "
            f"({str(model_dir)!r})"
        )
    return model_dir


def _download_from_hub(repo_id: str, revision: str | None, tried_locally: str) -> str:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"on the Hugging Face hub at {constants.ENDPOINT} (revision {revision or 'main'!r})"
    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=_CHECKPOINT_FILES)
    except RevisionNotFoundError:
        problem = "the repository has no such revision"
    except RepositoryNotFoundError:
        problem = "no such repository (or it is private or gated and no token was given)"
    except LocalEntryNotFoundError as error:
        if constants.HF_HUB_OFFLINE:
            problem = (
                f"offline mode (HF_HUB_OFFLINE=1) and not in the cache {constants.HF_HUB_CACHE}"
            )
        else:
            cause = error.__cause__ or error
            problem = (
                f"the hub could not be reached and it is not in the cache "
                f"{constants.HF_HUB_CACHE} ({type(cause).__name__}: {cause})"
            )
    except (OSError, ValueError) as error:  # HTTP errors are OSErrors in huggingface_hub
        problem = f"{type(error).__name__}: {error}"
    raise ModelNotFoundError(f"model {repo_id!r}: {tried_locally}, and {where}: {problem}")

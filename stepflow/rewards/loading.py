"""Shared helpers for reward models: weight resolution with one-line load errors, devices, image conversion.

Weights are named the same way everywhere: a Hugging Face repo id (``org/name``), a local directory (a
``save_pretrained`` folder or a folder holding the named file), a local file, or (for files only) an http(s) URL.
Anything that cannot be loaded raises :class:`~stepflow.rewards.errors.RewardLoadError` with one line naming what
was being loaded and the config key that points at a local copy. Torch pickles are only ever read with
``torch.load(..., weights_only=True)`` (:func:`torch_load_weights_only`): a checkpoint cannot run code.

Images reach every reward model the same way: :func:`to_uint8` / :func:`to_pil` round the decoded float image to
uint8 exactly as Flow-GRPO's scorers do, then each reward applies its official preprocessing to the PIL image.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from stepflow.rewards.errors import RewardLoadError, one_line


def _looks_local(spec: str) -> bool:
    return spec.startswith(("/", "./", "../", "~")) or os.path.exists(os.path.expanduser(spec))


def _hint(ident: str, key: str, filename: str | None = None) -> str:
    if _looks_local(ident):
        return f"check the path or set {key}=/path/to/a/local/copy"
    if ident.startswith(("http://", "https://")):
        return f"download it where there is network and set {key}=/local/file"
    what = f"{ident} {filename}" if filename else ident
    return f"run `hf download {what} --local-dir /local/dir` where there is network and set {key}=/local/dir"


@contextlib.contextmanager
def load_guard(what: str, ident: str, key: str, filename: str | None = None) -> Iterator[None]:
    """Turn any failure while loading ``ident`` into a one-line :class:`RewardLoadError`.

    ``what`` says what is loaded ("PickScore model"), ``key`` the config key to override (``reward.model_path``),
    ``filename`` the file inside an HF repo ``ident`` (if any).
    The original exception stays available as ``err.original`` but is not chained (no deep traceback).
    """
    try:
        yield
    except RewardLoadError:
        raise
    except Exception as e:  # noqa: BLE001 - every loader failure becomes the same clear error
        where = f"{ident}/{filename}" if filename else ident
        err = RewardLoadError(f"cannot load {what} from '{where}' ({type(e).__name__}: {one_line(e, 200)}); "
                              f"{_hint(ident, key, filename)}")
        err.original = e
        raise err from None


def check_local(spec: str, what: str, key: str) -> str:
    """A spec that looks like a local path must exist (else the hub would be asked for a nonsense repo id)."""
    spec = str(spec)
    if _looks_local(spec) and not os.path.exists(os.path.expanduser(spec)):
        raise RewardLoadError(f"cannot load {what} from '{spec}': no such file or directory; {_hint(spec, key)}")
    return os.path.expanduser(spec)


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def resolve_file(spec: str, filename: str | None, what: str, key: str) -> str:
    """Return a local path for a weights file.

    spec: a local file; a local directory holding ``filename``; an http(s) URL (downloaded once into
    ``$TORCH_HOME/hub/checkpoints``, refused when ``HF_HUB_OFFLINE=1``); or a Hugging Face repo id, from which
    ``filename`` is fetched with ``hf_hub_download`` (the HF cache; works offline once cached).
    """
    spec = str(spec)
    if spec.startswith(("http://", "https://")):
        name = filename or os.path.basename(spec.split("?")[0])
        with load_guard(what, spec, key):
            dst = Path(torch.hub.get_dir()) / "checkpoints" / name
            if not dst.is_file():
                if _offline():
                    raise OSError("HF_HUB_OFFLINE=1 and the file is not cached at " + str(dst))
                dst.parent.mkdir(parents=True, exist_ok=True)
                torch.hub.download_url_to_file(spec, str(dst), progress=False)
            return str(dst)
    if _looks_local(spec):
        path = check_local(spec, what, key)
        if os.path.isdir(path):
            if not filename:
                raise RewardLoadError(f"cannot load {what}: '{spec}' is a directory and no file name is set")
            path = os.path.join(path, filename)
            if not os.path.isfile(path):
                raise RewardLoadError(f"cannot load {what}: '{path}' does not exist; {_hint(spec, key)}")
        return path
    if not filename:
        raise RewardLoadError(f"cannot load {what}: '{spec}' is neither a local file nor a URL; {_hint(spec, key)}")
    with load_guard(what, spec, key, filename):
        from huggingface_hub import hf_hub_download

        return hf_hub_download(repo_id=spec, filename=filename)


def _refusal(e: Exception) -> str:
    """The part of torch's weights-only refusal that says what the file wanted (one short phrase)."""
    msg = str(e)
    m = re.search(r"Unsupported global: GLOBAL (\S+)", msg)
    if m:
        return f"it pickles {m.group(1)}, which is not a tensor or a plain value"
    m = re.search(r"WeightsUnpickler error:\s*([^\n]+)", msg)  # e.g. "Unsupported operand 149" (STACK_GLOBAL)
    return one_line(m.group(1) if m else msg, 120)


def torch_load_weights_only(path: str, what: str, key: str, safe_globals: Sequence[Any] = ()) -> Any:
    """``torch.load(path, weights_only=True)``, allowing ``safe_globals`` on top of torch's default allowlist
    (tensors, storages, ``OrderedDict``, containers and plain values). A file that pickles anything else is refused
    before any of it runs: a one-line :class:`RewardLoadError` naming the path, what it pickles and ``key``."""
    try:
        with torch.serialization.safe_globals(list(safe_globals)):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise RewardLoadError(
            f"cannot load {what} from '{path}' without running code from it: torch.load(weights_only=True) refused "
            f"it ({_refusal(e)}); if you trust the file, re-save its tensors as a plain state dict or .safetensors "
            f"and set {key}=/path/to/that/file") from None


def load_state_dict(path: str, what: str, key: str, safe_globals: Sequence[Any] = ()) -> dict[str, Tensor]:
    """Load a state dict from ``.safetensors`` or a torch pickle, never running code from the file.

    Pickles always go through :func:`torch_load_weights_only` (``weights_only=True``; there is no switch to turn it
    off: a trusted file that needs more is re-saved once as a plain state dict). Unwraps ``{"state_dict": ...}`` /
    ``{"model": ...}`` and strips a DDP ``module.`` prefix.
    """
    with load_guard(what, path, key):
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            sd = load_file(path)
        else:
            sd = torch_load_weights_only(path, what, key, safe_globals)
        for k in ("state_dict", "model"):
            if isinstance(sd, dict) and k in sd and isinstance(sd[k], dict):
                sd = sd[k]
        if not isinstance(sd, dict):
            raise TypeError(f"expected a state dict, got {type(sd).__name__}")
        if sd and all(k.startswith("module.") for k in sd):
            sd = {k[len("module."):]: v for k, v in sd.items()}
        return sd


def check_keys(missing: list[str], what: str, path: str, key: str, ignore: tuple[str, ...] = ()) -> None:
    """Raise when a checkpoint lacks weights the model needs (a wrong file), ignoring buffers listed in ``ignore``."""
    real = [k for k in missing if not any(k.endswith(s) for s in ignore)]
    if real:
        shown = ", ".join(real[:4]) + (f" (+{len(real) - 4} more)" if len(real) > 4 else "")
        raise RewardLoadError(f"cannot load {what} from '{path}': the checkpoint lacks {shown}; "
                              f"is {key} the right file?")


def pick_device(device: str | torch.device | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def pick_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(table)}")
    return table[dtype]


def to_uint8(images: Tensor) -> np.ndarray:
    """(B, 3, H, W) float in [0, 1] -> (B, H, W, 3) uint8, rounded as Flow-GRPO does before every reward."""
    return (images.detach().float() * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


def to_pil(images: Tensor) -> list[Image.Image]:
    return [Image.fromarray(a) for a in to_uint8(images)]

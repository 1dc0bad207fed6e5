"""Shared helpers for reward models: weight resolution with one-line load errors, devices, image conversion.

Weights are named the same way everywhere: a Hugging Face repo id (``org/name``), a local directory (a
``save_pretrained`` folder or a folder holding the named file), a local file, or (for files only) an http(s) URL.
Anything that cannot be loaded raises :class:`~stepflow.errors.RewardLoadError` with one line naming what
was being loaded and the config key that points at a local copy. Torch pickles are only ever read with
``torch.load(..., weights_only=True)`` (:func:`torch_load_weights_only`): a checkpoint cannot run code.

Images reach every reward model the same way: :func:`to_uint8` / :func:`to_pil` round the decoded float image to
uint8 exactly as Flow-GRPO's scorers do, then each reward applies its official preprocessing to the PIL image.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import pickletools
import re
import warnings
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from stepflow.errors import RewardLoadError, one_line


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


def _short(e: BaseException, limit: int = 120) -> str:
    """The first sentence of an exception's message, on one line (its type when it has none)."""
    msg = " ".join(str(e).split()) or type(e).__name__
    return one_line(msg.split(". ")[0], limit)


def _pickle_problem(fh: io.BufferedIOBase | io.BytesIO) -> str | None:
    """Why the stream does not start with a whole pickle (None when it does). :func:`pickletools.genops` only parses
    the opcodes: nothing is imported, built or run."""
    try:
        for _ in pickletools.genops(fh):
            pass
    except Exception as e:  # noqa: BLE001 - ValueError (unknown opcode, truncated), UnicodeDecodeError, ...
        return _short(e)
    return None


def not_a_torch_file(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be a torch checkpoint at all, found without unpickling anything, or None when it may be
    one (then ``torch.load`` decides). A torch file is a zip archive holding ``<name>/data.pkl`` (``torch.save``) or
    a legacy stream that starts with a pickle; the reason is ``"empty"`` or ``"not a torch file: <short reason>"``
    (random bytes, a truncated or corrupted archive, a pickle cut short)."""
    p = Path(path)
    if p.stat().st_size == 0:
        return "empty"
    with p.open("rb") as fh:
        if fh.read(2) == b"PK":
            fh.seek(0)
            try:
                with zipfile.ZipFile(fh) as z:
                    data = [n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
                    if not data:
                        return "not a torch file: a zip archive without data.pkl, not written by torch.save"
                    with z.open(data[0]) as inner:
                        why = _pickle_problem(io.BytesIO(inner.read()))
            except (zipfile.BadZipFile, OSError, EOFError, RuntimeError) as e:
                return f"not a torch file: a truncated or corrupted zip archive, {_short(e)}"
            return None if why is None else f"not a torch file: its data.pkl is not a whole pickle, {why}"
        fh.seek(0)
        head = fh.read(8)
        fh.seek(0)
        why = _pickle_problem(fh)
    if why is None:
        return None
    if head[:1] == b"\x80":  # PROTO: a binary pickle that does not parse to its end
        return f"not a torch file: a pickle cut short or corrupted, {why}"
    return f"not a torch file: it starts with {head!r}, neither a zip archive nor a pickle"


def torch_load_weights_only(path: str, what: str, key: str, safe_globals: Sequence[Any] = ()) -> Any:
    """``torch.load(path, weights_only=True)``, allowing ``safe_globals`` on top of torch's default allowlist
    (tensors, storages, ``OrderedDict``, containers and plain values). A file that pickles anything else is refused
    before any of it runs: a one-line :class:`RewardLoadError` naming the path, what it pickles and ``key``. A file
    that is no checkpoint at all (empty, random bytes, truncated: :func:`not_a_torch_file`) says so instead."""
    why = not_a_torch_file(path)
    if why is None:
        try:
            with torch.serialization.safe_globals(list(safe_globals)), warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "Detected pickle protocol 4": the refusal says more
                return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            raise RewardLoadError(
                f"cannot load {what} from '{path}' without running code from it: torch.load(weights_only=True) "
                f"refused it ({_refusal(e)}); if you trust the file, re-save its tensors as a plain state dict or "
                f".safetensors and set {key}=/path/to/that/file") from None
        except (EOFError, RuntimeError, ValueError) as e:  # a torch file cut short or corrupted after its header
            why = f"not a torch file: truncated or corrupted, {_short(e)}"
    raise RewardLoadError(f"cannot load {what} from '{path}': it is not a checkpoint ({why}); set {key} to the "
                          f"weights file itself (a .safetensors or torch checkpoint)")


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

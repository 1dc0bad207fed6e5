"""Prompt datasets and the group sampler.

Every iteration draws ``P`` prompts and ``k`` samples of each (a *group*), ``B = P * k`` samples in all. The plan for
an iteration is a pure function of ``(seed, iteration)``, so every rank computes the same global plan and takes its
own contiguous slice: under DDP the copies of one prompt may sit on different ranks, and the group statistics are
computed on the gathered rewards (see :func:`stepflow.core.algorithm.iteration`). Resuming is exact because the plan never
depends on a data-loader position.

Prompt files:

- ``.jsonl``: one JSON object per line with a ``"prompt"`` field (other fields, e.g. GenEval metadata, are kept as ``meta``);
- ``.txt``: one prompt per line (blank lines ignored).

An **edit data set** (``data.source_key``, e.g. ``image``: flow_grpo's counting_edit layout) is a ``.jsonl`` whose
records also name a source image: ``{"prompt": "<instruction>", "image": "<path>", ...}``, the path absolute or
relative to the file's folder (PNG, JPEG, WebP, anything PIL reads). The loader checks that every source image can be
read and stores its absolute path in the record under :data:`SOURCE_KEY`, where an editing
policy (``encode_rows``) and a reward that reads the source (:func:`source_images`) find it.

A path ``pkg://stepflow/<rel>`` resolves inside the installed package.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stepflow.errors import PromptFileError, StepflowError

#: the prompt-record key that holds an edit record's source image (an absolute path, checked readable), set by
#: :func:`load_prompt_file` from the file's own field ``data.source_key``
SOURCE_KEY = "source_image"


def resolve_path(path: str | Path) -> Path:
    """Resolve ``pkg://package/rel/path`` to a file inside the installed package; other paths unchanged."""
    s = str(path)
    if s.startswith("pkg://"):
        pkg, _, rel = s[len("pkg://"):].partition("/")
        return Path(str(resources.files(pkg).joinpath(rel)))
    return Path(s).expanduser()


#: how every prompt-file message ends: what a prompt file may look like
_FORMATS = ".jsonl (one JSON object with a \"prompt\" string per line) or .txt (one prompt per line), UTF-8"


def _read_text(p: Path, field: str) -> str:
    """The file's text (UTF-8, a leading byte-order mark dropped); a file that is not UTF-8 is one line naming
    ``field``, the byte offset and line of the first bad byte."""
    data = p.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        start = e.start + (3 if data.startswith(b"\xef\xbb\xbf") else 0)
        line = data.count(b"\n", 0, start) + 1
        raise PromptFileError(f"{field}: {p} is not UTF-8 text (byte {start}, line {line}: "
                              f"{data[start:start + 1]!r} {e.reason}); re-save it as UTF-8 (e.g. `iconv -f latin1 "
                              f"-t utf-8 in > out`)") from None


def _jsonl_record(line: str, where: str, field: str) -> dict[str, Any]:
    """One ``.jsonl`` line -> its record; one line naming ``field`` and ``path:line`` when it is not one."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise PromptFileError(f"{field}: {where} is not valid JSON ({e.msg}, column {e.colno}); each line of a "
                              f".jsonl prompt file is one JSON object with a \"prompt\" string") from None
    if not isinstance(rec, dict):
        raise PromptFileError(f"{field}: {where} is a JSON {type(rec).__name__}, not an object; each line of a "
                              f".jsonl prompt file is one JSON object with a \"prompt\" string")
    if not isinstance(rec.get("prompt"), str):
        got = "no 'prompt' field" if "prompt" not in rec else f"'prompt' is a {type(rec['prompt']).__name__}"
        raise PromptFileError(f"{field}: {where} has no string 'prompt' field ({got}); give every line "
                              f"{{\"prompt\": \"...\"}}")
    return rec


def load_prompt_file(path: str | Path, field: str = "data.train_file",
                     source_key: str | None = None) -> list[dict[str, Any]]:
    """Read a prompt file into a list of records ``{"prompt": str, ...meta}``.

    Raises :class:`PromptFileError` with a one-line message naming ``field`` and the path when the file is missing,
    a directory, not UTF-8 (with the byte offset), empty, or has a malformed line (with the line number).
    ``source_key``: an edit data set (see the module docstring): every record's ``source_key`` names a readable source
    image, whose absolute path goes to ``record[SOURCE_KEY]``; one line naming the file, the line and the field when
    it does not.
    """
    p = resolve_path(path)
    if p.is_dir():
        raise PromptFileError(f"{field}: {p} is a directory, not a prompt file; set {field}=/path/to/prompts.jsonl "
                              "or .txt")
    if not p.is_file():
        raise PromptFileError(f"{field}: prompt file not found: {p} (set {field}=/path/to/prompts.jsonl or .txt)")
    if p.suffix == ".json":
        raise PromptFileError(f"{field}: {p} is a .json file; stepflow reads {_FORMATS}")
    records: list[dict[str, Any]] = []
    text = _read_text(p, field).replace("\r\n", "\n").replace("\r", "\n")  # universal newlines, as open()
    for n, line in enumerate(text.split("\n"), 1):
        line = line.strip()
        if not line:
            continue
        records.append(_jsonl_record(line, f"{p}:{n}", field) if p.suffix == ".jsonl" else {"prompt": line})
        if source_key:
            _attach_source(records[-1], p, n, field, source_key)
    if not records:
        raise PromptFileError(f"{field}: prompt file is empty: {p}; give {_FORMATS}")
    return records


def _attach_source(rec: dict[str, Any], file: Path, line: int, field: str, key: str) -> None:
    """``rec[SOURCE_KEY]`` = the absolute path of the readable source image that ``rec[key]`` names."""
    where = f"{field}: {file}:{line}"
    if file.suffix != ".jsonl":
        raise PromptFileError(f"{field}: {file} is a .txt prompt file, but data.source_key={key} asks for an edit data "
                              f"set: a .jsonl whose records give {{\"prompt\": \"<instruction>\", \"{key}\": \"<source "
                              f"image path>\"}}; set data.source_key=null for text-to-image prompts")
    value = rec.get(key)
    if not isinstance(value, str) or not value.strip():
        got = "no such field" if key not in rec else f"{type(value).__name__} {value!r}"
        raise PromptFileError(f"{where}: field '{key}' (data.source_key) must be the path of the source image to "
                              f"edit, got {got}; give every record \"{key}\": \"<path>\" (absolute or relative to "
                              f"{file.parent})")
    img = Path(value).expanduser()
    img = img if img.is_absolute() else file.parent / img
    why = unreadable_image(img)
    if why:
        raise PromptFileError(f"{where}: field '{key}': cannot read the source image {img} ({why}); fix the path "
                              f"(absolute or relative to {file.parent}) or the file")
    rec[SOURCE_KEY] = str(img.resolve())


def unreadable_image(path: Path) -> str | None:
    """Why the image file ``path`` cannot be read (missing, a directory, not an image PIL decodes), or None."""
    if not path.exists():
        return "no such file"
    if not path.is_file():
        return "not a file"
    try:
        from PIL import Image

        with Image.open(path) as im:
            im.verify()
    except Exception as e:  # noqa: BLE001 - UnidentifiedImageError, a truncated file, an OSError
        msg = " ".join(str(e).split())[:120]
        return f"{type(e).__name__}: {msg}" if msg else type(e).__name__
    return None


@functools.lru_cache(maxsize=256)
def load_source_image(path: str):
    """The RGB PIL image at ``path`` (an edit's source), cached; one line naming the file when it cannot be read."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            return im.convert("RGB")
    except Exception as e:  # noqa: BLE001
        why = unreadable_image(Path(path)) or f"{type(e).__name__}: {e}"
        raise PromptFileError(f"data.source_key: cannot read the source image {path} ({why}); fix the data set's "
                              "path or the file") from None


def source_images(meta: Sequence[dict[str, Any]] | None, size: Sequence[int], what: str = "reward"
                  ) -> torch.Tensor:
    """The source images of the records ``meta`` (``record[SOURCE_KEY]``, set by :func:`load_prompt_file`) as
    (B, 3, H, W) fp32 in [0, 1], each resized (bicubic) to ``size = (H, W)``: what a reward that reads the source
    (``Reward.reads_source``) receives beside the edited images. A record without a source is one line naming
    ``what``."""
    import numpy as np
    from PIL import Image

    h, w = int(size[0]), int(size[1])
    rows = []
    for m in meta or [None]:
        path = m.get(SOURCE_KEY) if isinstance(m, dict) else None
        if not path:
            raise StepflowError(f"{what} scores an edit against its source image, but the prompts carry none; use "
                                  "an edit data set (data.source_key=image, e.g. data=edit_tiny) or a reward that "
                                  "reads no source")
        img = load_source_image(str(path))
        if img.size != (w, h):
            img = img.resize((w, h), Image.BICUBIC)
        rows.append(torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1))
    return torch.stack(rows)


@dataclass
class IterationPlan:
    """The global sample plan of one iteration (identical on every rank).

    prompts: B prompt strings; meta: B records; group_ids: (B,) long, one id per prompt group (0..P-1);
    init_noise_seeds: (B,) long, the seed of each sample's initial noise x_T (shared within a group when
    ``same_latent``); step_noise_seeds: (B,) long, the seed of each sample's SDE noise ε (one draw per step).
    """

    prompts: list[str]
    meta: list[dict[str, Any]]
    group_ids: torch.Tensor
    step_noise_seeds: torch.Tensor
    init_noise_seeds: torch.Tensor

    def __len__(self) -> int:
        return len(self.prompts)

    def shard(self, rank: int, world_size: int) -> "IterationPlan":
        """This rank's contiguous slice (B must be divisible by world_size)."""
        b = len(self)
        if b % world_size:
            raise ValueError(f"prompts_per_iter * group_size = {b} must be divisible by the number of processes ({world_size})")
        per = b // world_size
        return self.rows(slice(rank * per, (rank + 1) * per))

    def rows(self, sl: slice) -> "IterationPlan":
        """The rows ``sl`` of the plan (their prompts, groups and noise seeds)."""
        return IterationPlan(self.prompts[sl], self.meta[sl], self.group_ids[sl], self.step_noise_seeds[sl],
                             self.init_noise_seeds[sl])


def balance_records(records: list[dict[str, Any]], key: str, field: str = "data.balance_by") -> list[dict[str, Any]]:
    """Repeat each record ``round(n_max / n_v)`` times, ``n_v`` the number of records with its value ``v`` of
    ``key``, so every value carries about the same weight (order kept: repeats follow their record)."""
    missing = [i for i, r in enumerate(records) if key not in r]
    if missing:
        raise PromptFileError(f"{field}: prompt record {missing[0]} has no key {key!r}; set {field}=null or use a "
                              f"prompt file whose records carry {key!r}")
    counts: dict[Any, int] = {}
    for r in records:
        counts[r[key]] = counts.get(r[key], 0) + 1
    n_max = max(counts.values())
    return [r for r in records for _ in range(max(1, round(n_max / counts[r[key]])))]


class PromptPlanner:
    """Draws ``prompts_per_iter`` prompts × ``group_size`` samples per iteration from a prompt list.

    Prompts are drawn without replacement within an epoch over the prompt list (reshuffled each epoch), seeded by
    ``seed``; the plan for iteration ``i`` depends only on ``(seed, i)``. With ``balance_by`` (a record key, e.g.
    ``"category"``) each record is repeated ``round(n_max / n_value)`` times in the epoch list, so every value of
    that key is drawn about equally often (the shapes train file is 74 % color_attr prompts while the GenEval score
    is the mean over six categories).
    """

    def __init__(self, records: list[dict[str, Any]], prompts_per_iter: int, group_size: int, seed: int = 0,
                 same_latent: bool = True, balance_by: str | None = None):
        if prompts_per_iter < 1:
            raise ValueError("prompts_per_iter must be >= 1")
        if group_size < 2:
            raise ValueError("group_size must be >= 2 (group statistics need at least two samples)")
        self.records = balance_records(records, balance_by) if balance_by else records
        self.prompts_per_iter = prompts_per_iter
        self.group_size = group_size
        self.seed = seed
        self.same_latent = same_latent

    def _prompt_indices(self, iteration: int) -> np.ndarray:
        n, p = len(self.records), self.prompts_per_iter
        start = iteration * p
        out = []
        while len(out) < p:
            epoch, offset = divmod(start + len(out), n)
            perm = np.random.default_rng([self.seed, epoch]).permutation(n)
            take = min(p - len(out), n - offset)
            out.extend(perm[offset:offset + take].tolist())
        return np.asarray(out)

    def plan(self, iteration: int) -> IterationPlan:
        idx = self._prompt_indices(iteration)
        k = self.group_size
        recs = [self.records[i] for i in idx for _ in range(k)]
        b = len(recs)
        group_ids = torch.arange(len(idx)).repeat_interleave(k)
        base = (self.seed * 1_000_003 + iteration) * 1_000_003
        step_seeds = torch.arange(b, dtype=torch.long) + base
        init_seeds = (group_ids + base + 10_000_019) if self.same_latent else step_seeds + 7
        return IterationPlan([r["prompt"] for r in recs], recs, group_ids, step_seeds, init_seeds)


def seeded_normal(seeds: torch.Tensor, shape: tuple[int, ...], device: torch.device | str = "cpu") -> torch.Tensor:
    """Standard normal noise ``(len(seeds), *shape)``, row i drawn from a generator seeded by ``seeds[i]``.

    Row-wise seeding makes a sample's noise independent of the batch it sits in (1 process vs DDP, resume).
    """
    rows = []
    for s in seeds.tolist():
        g = torch.Generator().manual_seed(int(s) % (2**63 - 1))
        rows.append(torch.randn(shape, generator=g))
    return torch.stack(rows).to(device)

"""Checkpoints that run code when unpickled, and the check that a loader refuses them without running it.

The one payload (:class:`Payload`) only writes a marker file, so a test can tell whether it ran.
"""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

import pytest
import torch

from stepflow.errors import RewardLoadError


class Payload:
    """What a malicious checkpoint holds: unpickling it calls ``exec``, which here only writes a marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('code from the checkpoint ran')",))


def evil_checkpoint(d: Path) -> tuple[Path, Path]:
    """``d/evil.ckpt``: a Lightning-shaped checkpoint (plain ``pickle``) whose ``state_dict`` and ``global_step`` are
    :class:`Payload`s; returns (its path, the marker file the payload would write)."""
    marker = d / "PWNED"
    path = d / "evil.ckpt"
    with path.open("wb") as fh:
        pickle.dump({"state_dict": Payload(marker), "global_step": Payload(marker), "stepflow": {}}, fh)
    return path, marker


def payload_checkpoint(d, name, obj, legacy_pickle=False):
    """``obj`` (a checkpoint dict) with a :class:`Payload` added, saved by ``torch.save`` (or plain ``pickle``) as
    ``d/name``; returns (its path, the marker file the payload would write)."""
    marker = d / "PAYLOAD_RAN"
    obj = {**obj, "__payload__": Payload(marker)}
    with open(d / name, "wb") as f:
        pickle.dump(obj, f, protocol=4) if legacy_pickle else torch.save(obj, f)
    return str(d / name), marker


def assert_payload_refused(build, path, marker, key):
    """Loading (``build()``) fails with one line naming the path and the config key, and the payload did not run;
    then the control: an unsafe load of the same file *does* run it (the test's payload is live)."""
    with pytest.raises(RewardLoadError) as ei:
        build()
    msg = str(ei.value)
    assert "\n" not in msg and path in msg and key in msg and "weights_only=True" in msg, msg
    assert not marker.exists(), "the checkpoint's code ran"
    with open(path, "rb") as f:
        torch.load(f, weights_only=False) if zipfile.is_zipfile(path) else pickle.load(f)
    assert marker.exists()
    marker.unlink()
    return msg

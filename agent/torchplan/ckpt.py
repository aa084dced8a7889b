"""One checkpoint through Distributed Checkpoint (``torch.distributed.checkpoint``).

A checkpoint folder ``step-<n>`` holds:

- model and optimizer state from ``get_state_dict`` (canonical parameter
  names, whatever wrappers the plan added: DDP, FSDP2, DTensor TP, a pipeline
  stage, ``checkpoint_wrapper``), written by ``dcp.save``: it loads under any
  other plan and world size (``dcp.load`` + ``set_state_dict`` reshard it);
- every rank's RNG state, as a tensor per rank (``rng.<rank>``) in the same
  DCP checkpoint; a rank that did not exist when it was saved keeps its seeded stream;
- ``gearshift.json`` (rank 0): step, loss, data position (samples seen), the
  plan and world size, and the model's fingerprint (family + every parameter's
  name and full shape). This small JSON is our own only because DCP's
  metadata has no place for a fingerprint a loader can check *before* it
  reads tensors (a load of another model must be refused, not half-applied).

Committed atomically the ``agent/worker.py`` way: every rank writes into a
shared temp folder, rank 0 renames it to ``step-<n>`` and writes the manifest
last. ``load_latest`` tries the manifest's checkpoint, then older ones: a
checkpoint of another model or a corrupt one is refused with one line and the
job resumes from the newest good one.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

FORMAT = "gearshift-dcp-v1"
META = "gearshift.json"


class CheckpointRefused(RuntimeError):
    pass


def fingerprint(family: str, model: torch.nn.Module) -> str:
    """Family + every parameter's name and shape, taken before the plan is applied."""
    h = hashlib.sha256(family.encode())
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
    return h.hexdigest()[:16]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def save(par: Any, folder: Path, meta: dict) -> None:
    """Collective: every rank writes its shards into ``folder``; rank 0 adds ``gearshift.json``."""
    msd, osd = get_state_dict(par.top, par.optimizer)
    state = {"model": msd, "optim": osd, f"rng.{_rank()}": torch.get_rng_state()}
    dcp.save(state, checkpoint_id=str(folder))
    if _rank() == 0:
        (Path(folder) / META).write_text(json.dumps({"format": FORMAT, **meta}))


def read_meta(folder: Path, want_fingerprint: str) -> dict:
    """The checkpoint's gearshift.json, or CheckpointRefused (one line)."""
    try:
        meta = json.loads((Path(folder) / META).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointRefused(f"checkpoint {Path(folder).name}: unreadable {META} ({type(exc).__name__})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointRefused(f"checkpoint {Path(folder).name}: format {meta.get('format')!r}, not {FORMAT}")
    if meta.get("fingerprint") != want_fingerprint:
        raise CheckpointRefused(f"checkpoint {Path(folder).name}: another model ({meta.get('model')} "
                                f"fingerprint {meta.get('fingerprint')}, this job's is {want_fingerprint})")
    return meta


def load(par: Any, folder: Path, want_fingerprint: str) -> dict:
    """Collective: restore model, optimizer and this rank's RNG from ``folder``."""
    meta = read_meta(folder, want_fingerprint)
    msd, osd = get_state_dict(par.top, par.optimizer)
    state: dict[str, Any] = {"model": msd, "optim": osd}
    try:
        keys = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
        rng_key = f"rng.{_rank()}"
        if rng_key in keys:
            state[rng_key] = torch.get_rng_state()
        dcp.load(state, checkpoint_id=str(folder))
    except (Exception, CheckpointException) as exc:  # a corrupt or truncated DCP folder (a BaseException)
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        why = (lines[-1] if lines else "")[:300]
        raise CheckpointRefused(f"checkpoint {Path(folder).name}: corrupt ({type(exc).__name__}: {why})") from None
    set_state_dict(par.top, par.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if f"rng.{_rank()}" in state:
        torch.set_rng_state(state[f"rng.{_rank()}"])
    return meta


def candidates(ckpt_dir: Path, manifest: dict | None) -> list[Path]:
    """The manifest's checkpoint first, then older complete ``step-*`` folders, newest first."""
    ckpt_dir = Path(ckpt_dir)
    out: list[Path] = []
    if manifest and manifest.get("format") == FORMAT and manifest.get("path"):
        out.append(ckpt_dir / manifest["path"])
    if ckpt_dir.exists():
        older = sorted((p for p in ckpt_dir.iterdir() if p.is_dir() and p.name.startswith("step-")
                        and ".tmp-" not in p.name and (p / META).exists()), reverse=True)
        out += [p for p in older if p not in out]
    return out


def load_latest(par: Any, ckpt_dir: Path, manifest: dict | None, want_fingerprint: str, log) -> dict | None:
    """Restore from the newest good checkpoint (None: none, start fresh);
    each refused one is reported with ``log(line)``."""
    tried = candidates(ckpt_dir, manifest)
    for folder in tried:
        try:
            return load(par, folder, want_fingerprint)
        except CheckpointRefused as exc:
            log(f"refused {exc}")
    if tried:
        raise CheckpointRefused(f"no loadable checkpoint of this model in {ckpt_dir} ({len(tried)} refused)")
    return None

"""Checkpoints of a training step with ``torch.distributed.checkpoint``, portable across ``ep``.

    step.save("ckpt")     # every rank calls it; each writes its own experts
    step.load("ckpt")     # at any ep that divides num_experts (1, 2, 4, ...), any etp

Layout (keys of the DCP state dict)::

    model/<name>              dense parameters and buffers (replicated; written once)
    model/<name>#<e>          expert tensors split by *global* expert id e
    optim/<name>/<key>[#<e>]  optimizer state, split the same way (scalars such as step: once)
    rng/cpu/<rank>            each rank's RNG state (restored when the rank exists again)
    moecompile.json           step count, world, plan, optimizer hyperparameters, and a
                              CRC-32 per key; written last, so its presence marks a complete save

Rank r at expert-parallel size ep holds experts [r*E/ep, (r+1)*E/ep); it writes and reads
exactly those ``#e`` keys, which is what makes an ep=2 checkpoint load at ep=1 or ep=4.
Under ``parallel.shard_optimizer`` a rank holds a range of each trainable tensor's master and
optimizer state; it writes and reads that range as chunks of the same keys, in the same shapes
(moecompile.checkpoint_shards), so sharded and unsharded runs at any size load each other's
checkpoints, and each tensor's CRC-32 is combined from its ranks' parts. Under ``parallel.etp`` a
rank holds slice q of some experts (moecompile.expert_slices); it writes them as the boxes they
cover in the same whole-expert keys, so a checkpoint loads at any ep and etp.

Crash safety: a save goes to ``<path>.tmp``; only a complete one is renamed over ``<path>``
(the previous checkpoint is moved to ``<path>.prev`` for that instant, and ``load`` falls back
to it if a crash landed between the two renames). Nothing valid is ever deleted first.
Loading checks names, shapes, dtypes, file extents and checksums against the metadata, and
names the tensor and the mismatch in a :class:`CheckpointError`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor

from .checkpoint_shards import boxes, chunk_crcs, chunked, combine, quiet_sharded_tensor, sharded
from .errors import MoecompileError
from .bucket_layout import expert_parameters
from .expert_slices import WIDTH_DIM, whole_boxes, whole_shape
from .grad_sync import Shard

log = logging.getLogger(__name__)
FORMAT = "moecompile-checkpoint-1"
META = "moecompile.json"


class CheckpointError(MoecompileError):
    """A checkpoint is missing, incomplete, corrupt, or does not fit the model being loaded."""


# ---------------------------------------------------------------- the state dict


def _distributed(step: Any) -> bool:
    return step.world is not None and dist.is_available() and dist.is_initialized()


def _rank(step: Any) -> int:
    return step.world.rank if _distributed(step) else 0


def _split(prefix: str, name: str, t: torch.Tensor, shard: Any) -> dict[str, torch.Tensor]:
    if shard is None or t.dim() == 0 or t.shape[0] != shard.hi - shard.lo:
        return {f"{prefix}{name}": t}
    if shard.slices == 1:
        return {f"{prefix}{name}#{shard.lo + i}": t[i] for i in range(t.shape[0])}
    row = tuple(t.shape[1:])  # slices of experts: boxes of views of t, which a load fills in place
    return dict(_expert_entry(prefix, name, shard, i, t[i].view(-1), row, [(0, math.prod(row))], 0)
                for i in range(t.shape[0]))


def _entries(prefix: str, name: str, t: torch.Tensor, part: Shard, experts: Any) -> dict[str, torch.Tensor]:
    """The checkpoint entries of ``t``: what this rank holds of a parameter (all of it, or a range)."""
    if part.whole:
        return _split(prefix, name, t, experts)
    shape, flat = tuple(part.param.shape), t.reshape(-1)
    if experts is None or shape[0] != experts.hi - experts.lo:
        return {f"{prefix}{name}": sharded(flat, shape, part.parts, part.rank)}
    per = math.prod(shape[1:])  # one expert's elements: a range split by expert, each in its own entry
    out = {}
    for i in range(shape[0]):
        parts = [(min(max(lo - i * per, 0), per), min(max(hi - i * per, 0), per)) for lo, hi in part.parts]
        lo, hi = parts[part.rank]
        if lo == hi:
            continue
        key, value = _expert_entry(prefix, name, experts, i, flat[i * per + lo - part.lo : i * per + hi - part.lo],
                                   shape[1:], parts, part.rank)
        out[key] = value
    return out


def _expert_entry(prefix: str, name: str, shard: Any, i: int, values: torch.Tensor, row: tuple[int, ...],
                  parts: list[tuple[int, int]], me: int) -> tuple[str, torch.Tensor]:
    """Local expert row ``i``'s entry ``<name>#<e>`` (whole expert e, global id) of which this rank holds elements
    ``parts[me]`` of the row (flattened in ``values``; every rank's range in ``parts``). Under ``parallel.etp``
    the row is slice q of expert e and is written as the boxes it covers in the whole expert, so the checkpoint
    loads at any etp (torch.distributed.checkpoint reshards boxes)."""
    j, (lo, hi) = shard.lo + i, parts[me]
    if shard.slices == 1 or shard.key not in WIDTH_DIM:  # unsliced, or the output bias slice 0 holds whole
        whole = hi - lo == math.prod(row)
        return f"{prefix}{name}#{j}", values.view(row) if whole else sharded(values, row, parts, me)
    Q, d = shard.slices, WIDTH_DIM[shard.key] - 1
    q, e = divmod(j, shard.num_experts // Q)
    local, everyone = [], []
    for qq in range(Q):  # every slice's boxes describe the whole expert; this rank's are its data
        for k, (a, b) in enumerate(parts):
            for off, size, start in boxes(row, a, b):
                mine = (qq, k) == (q, me)
                box = values[start - lo : start - lo + math.prod(size)].view(size) if mine else None
                for w_off, w_size, s_off in whole_boxes(shard.key, qq, Q, shard.glu, row, off, size):
                    everyone.append((w_off, w_size, qq * len(parts) + k))
                    if mine:
                        local.append((w_off, box.narrow(d, s_off[d] - off[d], w_size[d])))
    return f"{prefix}{name}#{e}", chunked(whole_shape(shard.key, Q, row), local, everyone, values)


def _ensure_optimizer_state(step: Any) -> None:
    """Create the optimizer's lazily built state (a zero-lr step on zero grads changes no weight)."""
    opt = step.optimizer
    params = [p for g in opt.param_groups for p in g["params"]]
    if all(p in opt.state and opt.state[p] for p in params):
        return
    lrs = [g["lr"] for g in opt.param_groups]
    saved_grads = [p.grad for p in params]
    for g in opt.param_groups:
        g["lr"] = 0.0 if not isinstance(g["lr"], torch.Tensor) else g["lr"].clone().zero_()
    for p in params:
        p.grad = torch.zeros_like(p)
    with torch.no_grad():
        before = [p.detach().clone() for p in params]
        opt.step()
        for p, b in zip(params, before):  # weight decay at lr 0 is exact, but make sure
            p.copy_(b)
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr
    for p, grad in zip(params, saved_grads):
        p.grad = grad


def state_dict(step: Any) -> dict[str, torch.Tensor]:
    """This rank's share of the checkpoint, keyed as in the module docstring.

    A trainable parameter is written from what the optimizer updates (fp32 masters of a bf16
    model), by the ranks that update it: under ``parallel.shard_optimizer`` each writes its range.
    """
    experts = expert_parameters(step.module)
    updates = {u.shard.name: u for u in step.updates}
    sd: dict[str, torch.Tensor] = {}
    for name, t in [*step.module.named_parameters(), *step.module.named_buffers()]:
        if name in updates:
            sd.update(_entries("model/", name, updates[name].tensor.detach(), updates[name].shard, experts.get(name)))
        elif name not in step.trainable:
            sd.update(_split("model/", name, t.detach(), experts.get(name)))
    by_tensor = {id(u.tensor): u for u in step.updates}
    for p, state in step.optimizer.state.items():
        u = by_tensor.get(id(p))
        if u is None:
            continue
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                if value.shape == p.shape:
                    sd.update(_entries(f"optim/{u.shard.name}/", key, value, u.shard, experts.get(u.shard.name)))
                else:  # a scalar such as Adam's step
                    sd[f"optim/{u.shard.name}/{key}"] = value
    sd[f"rng/cpu/{_rank(step)}"] = torch.get_rng_state()
    if torch.cuda.is_available() and step.device.type == "cuda":
        sd[f"rng/cuda/{_rank(step)}"] = torch.cuda.get_rng_state(step.device)
    return sd


def _checksums(step: Any, sd: dict[str, torch.Tensor]) -> dict[str, int]:
    """CRC-32 of every tensor in the checkpoint, whichever ranks hold its parts (every rank calls it)."""
    chunks = {k: chunk_crcs(v) for k, v in sd.items()}
    if _distributed(step):
        gathered: list[Any] = [None] * dist.get_world_size(step.world.dp_group)
        dist.all_gather_object(gathered, chunks, group=step.world.dp_group)
        chunks = {}
        for d in gathered:
            for k, v in d.items():
                chunks.setdefault(k, []).extend(v)
    out = {}
    for k, v in chunks.items():
        crc = combine(v)
        if crc is None:
            raise CheckpointError(f"tensor '{k}': its parts on the ranks do not tile it (byte runs "
                                  f"{sorted(set((a, n) for a, n, _ in v))[:4]}); the ranks disagree on the layout")
        out[k] = crc
    return out


def _param_groups(step: Any) -> list[dict]:
    groups = []
    for g in step.optimizer.param_groups:
        entry = {}
        for k, v in g.items():
            if k == "params":
                continue
            if isinstance(v, torch.Tensor):
                v = v.item()
            entry[k] = list(v) if isinstance(v, tuple) else v
        groups.append(entry)
    return groups


# ---------------------------------------------------------------- save


def save(step: Any, path: str | Path) -> Path:
    """Write ``step``'s checkpoint to ``path`` (a directory), atomically; every rank must call it."""
    import torch.distributed.checkpoint as dcp

    final = Path(path)
    tmp, prev = final.with_name(final.name + ".tmp"), final.with_name(final.name + ".prev")
    distributed = _distributed(step)
    group = step.world.dp_group if distributed else None
    rank = _rank(step)
    if rank == 0:
        final.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # an earlier crashed save, never a valid checkpoint
    if distributed:
        dist.barrier(group=group)
    sd = state_dict(step)  # an optimizer that has not stepped yet has no state to write
    with quiet_sharded_tensor():
        dcp.save(sd, checkpoint_id=str(tmp), process_group=group, no_dist=not distributed)
    crcs = _checksums(step, sd)
    if rank == 0:
        world = step.world
        meta = {
            "format": FORMAT, "step": step.step_count,
            "world_size": world.world_size if distributed else 1, "ep": world.ep if distributed else 1,
            "plan": step.plan.to_dict(), "param_groups": _param_groups(step),
            "optimizer": type(step.optimizer).__name__, "crc32": crcs,
        }
        _write_durably(tmp / META, json.dumps(meta, indent=1, sort_keys=True))
        if final.exists():
            shutil.rmtree(prev, ignore_errors=True)
            os.replace(final, prev)
        os.replace(tmp, final)
        shutil.rmtree(prev, ignore_errors=True)
        log.info("saved step %d to %s (%d tensors)", step.step_count, final, len(crcs))
    if distributed:
        dist.barrier(group=group)
    return final


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


# ---------------------------------------------------------------- load


def _resolve(path: Path) -> Path:
    if (path / META).is_file():
        return path
    prev = path.with_name(path.name + ".prev")
    if not path.exists() and (prev / META).is_file():
        log.warning("%s is missing but %s is complete (a save was interrupted between renames); loading it", path, prev)
        return prev
    if path.exists():
        raise CheckpointError(f"{path} is not a complete moecompile checkpoint (no {META}); it may be a save that "
                              "crashed, or not a checkpoint at all")
    raise CheckpointError(f"no checkpoint at {path}")


def read_meta(path: str | Path) -> dict[str, Any]:
    """The ``moecompile.json`` of a checkpoint (step, world, plan, checksums)."""
    path = _resolve(Path(path))
    try:
        meta = json.loads((path / META).read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path / META} is corrupt ({e})") from e
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} has format {meta.get('format')!r}; this moecompile reads {FORMAT!r}")
    return meta


def _check_against_metadata(path: Path, wanted: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        md = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:
        raise CheckpointError(f"{path}: cannot read the DCP metadata ({type(e).__name__}: {e})") from e
    saved = md.state_dict_metadata
    for key, t in wanted.items():
        if key not in saved:
            raise CheckpointError(_missing(key, saved, meta))
        m = saved[key]
        if not isinstance(m, TensorStorageMetadata):
            raise CheckpointError(f"checkpoint entry '{key}' is not a tensor")
        shape, dtype = _shape_dtype(t)
        if tuple(m.size) != shape:
            raise CheckpointError(f"tensor '{key}': the checkpoint has shape {tuple(m.size)}, the model has "
                                  f"{shape}; the model or plan differs from the one that was saved")
        if m.properties.dtype != dtype:
            raise CheckpointError(f"tensor '{key}': the checkpoint has dtype {m.properties.dtype}, the model has "
                                  f"{dtype}; convert the model in the dtype it was trained in")
    sizes: dict[str, int] = {}
    for index, info in md.storage_data.items():
        if index.fqn not in wanted:
            continue
        file = path / info.relative_path
        if info.relative_path not in sizes:
            sizes[info.relative_path] = file.stat().st_size if file.exists() else -1
        if sizes[info.relative_path] < info.offset + info.length:
            have = sizes[info.relative_path]
            raise CheckpointError(
                f"tensor '{index.fqn}' is corrupt: it lies at bytes [{info.offset}, {info.offset + info.length}) of "
                f"{info.relative_path}, which " + ("is missing" if have < 0 else f"has only {have} bytes")
            )


def _shape_dtype(t: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    if isinstance(t, ShardedTensor):
        with quiet_sharded_tensor():
            md = t.metadata()
        return tuple(md.size), md.tensor_properties.dtype
    return tuple(t.shape), t.dtype


def _missing(key: str, saved: Any, meta: dict[str, Any]) -> str:
    if "#" in key:
        base, e = key.rsplit("#", 1)
        have = sorted(int(k.rsplit("#", 1)[1]) for k in saved if k.startswith(base + "#"))
        if have:
            return (f"tensor '{key}' is not in the checkpoint: it holds experts {have[0]}..{have[-1]} of '{base}' "
                    f"({len(have)} experts), the model wants expert {e}; the number of experts differs")
    return (f"tensor '{key}' is not in the checkpoint (saved with plan {meta.get('plan', {}).get('experts', {})}); "
            "the model or plan differs from the one that was saved")


def load(step: Any, path: str | Path) -> None:
    """Restore ``step`` from ``path`` at this step's own layout; every rank must call it."""
    import torch.distributed.checkpoint as dcp

    root = _resolve(Path(path))
    meta = read_meta(root)
    if any(k.startswith("optim/") for k in meta["crc32"]):
        _ensure_optimizer_state(step)
    sd = state_dict(step)
    _drop_unsaved_optimizer_state(step, sd, set(meta["crc32"]))
    rank = _rank(step)
    for k in [k for k in sd if k.startswith("rng/") and k not in meta["crc32"]]:
        log.warning("checkpoint %s has no RNG state for rank %d (saved with %d ranks); keeping this rank's RNG",
                    root, rank, meta["world_size"])
        del sd[k]
    _check_against_metadata(root, sd, meta)
    distributed = _distributed(step)
    try:
        with quiet_sharded_tensor():
            dcp.load(sd, checkpoint_id=str(root), process_group=step.world.dp_group if distributed else None,
                     no_dist=not distributed)
    except Exception as e:
        raise CheckpointError(f"reading {root} failed ({type(e).__name__}: {str(e).strip().splitlines()[-1:]}); "
                              "the checkpoint files are damaged") from e
    for key, crc in _checksums(step, sd).items():
        want = meta["crc32"].get(key)
        if want is not None and crc != want:
            raise CheckpointError(f"tensor '{key}' is corrupt: its bytes have CRC-32 {crc:#010x}, the checkpoint "
                                  f"recorded {want:#010x} when it was written")
    if f"rng/cpu/{rank}" in sd:
        torch.set_rng_state(sd[f"rng/cpu/{rank}"])
    if f"rng/cuda/{rank}" in sd:
        torch.cuda.set_rng_state(sd[f"rng/cuda/{rank}"], step.device)
    step.write_back()  # the parameters follow their masters; sharded ranges reach every rank
    _restore_param_groups(step, meta["param_groups"])
    step.step_count = int(meta["step"])
    log.info("loaded step %d from %s (saved at ep=%d, loaded at ep=%d)", step.step_count, root, meta["ep"],
             step.world.ep if distributed else 1)


def _drop_unsaved_optimizer_state(step: Any, sd: dict[str, torch.Tensor], saved: set[str]) -> None:
    """A parameter with no optimizer state in the checkpoint (it never stepped) gets none here either."""
    names = {id(u.tensor): u.shard.name for u in step.updates}
    for p in list(step.optimizer.state):
        name = names.get(id(p))
        keys = [k for k in sd if k.startswith(f"optim/{name}/")]
        if keys and not any(k in saved for k in keys):
            del step.optimizer.state[p]
            for k in keys:
                del sd[k]


def _restore_param_groups(step: Any, groups: list[dict]) -> None:
    current = step.optimizer.param_groups
    if len(groups) != len(current):
        raise CheckpointError(f"the checkpoint's optimizer has {len(groups)} parameter groups, this one has "
                              f"{len(current)}; build the optimizer the same way")
    for g, saved in zip(current, groups):
        for k, v in saved.items():
            if isinstance(g.get(k), torch.Tensor):
                g[k].fill_(v)
            elif isinstance(g.get(k), tuple):
                g[k] = tuple(v)
            else:
                g[k] = v

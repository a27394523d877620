"""Training state on disk, so a stopped run continues exactly where it was: model and optimizer (saved with
torch.distributed.checkpoint, so each rank writes its own shards and a run may resume at another world size), the
step, each rank's random number generators, and the arguments the run was started with.

A save is built in DIR/.train_state.partial and swapped in by renames, so a kill at any moment leaves the previous
complete state (as train_state, or as .train_state.old if the kill fell between the two renames).
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import torch

from gpt2port.errors import GPT2PortError
from gpt2port.fsio import write_json
from gpt2port.training import saved

STATE = "train_state"


def where(out: Path) -> Path | None:
    """The complete training state under a run directory, if there is one."""
    for name in (STATE, f".{STATE}.old"):
        if (out / name / "meta.json").is_file():
            return out / name
    return None


def _dcp(action, state: dict, where: Path, **kw) -> None:
    # Without a process group DCP warns that it assumes a single process; that is exactly the intent here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        action(state, checkpoint_id=str(where), **kw)


def save(out: Path, rt, model, optimizer, meta: dict) -> None:
    """Every rank calls this; rank 0 arranges the directories. meta: the step and arguments, as JSON."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    partial, final, old = out / f".{STATE}.partial", out / STATE, out / f".{STATE}.old"
    if rt.main:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    rt.barrier()
    msd, osd = get_state_dict(model, optimizer)
    msd, _ = _trained(model, msd)
    _dcp(dcp.save, {"model": msd, "optim": osd}, partial)
    rng = {"cpu": torch.get_rng_state()}
    if rt.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(rt.device)
    torch.save(rng, partial / f"rng-{rt.rank}.pt")
    rt.barrier()
    if rt.main:
        write_json(partial / "meta.json", {"format": saved.FORMAT, "world": rt.world, **meta})
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        partial.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    rt.barrier()


def load(run: saved.SavedRun, rt, model, optimizer) -> None:
    """Put a saved state, checked by saved.read, into the model and optimizer (resharded by DCP if the world size
    changed) and restore this rank's generators (a rank that did not exist in the saved run keeps its fresh seed).
    Ends with the numeric check: every weight loaded is finite."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, optimizer)
    msd, frozen = _trained(model, msd)
    state = {"model": msd, "optim": osd}
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        _dcp(dcp.load, state, run.dir, storage_reader=_reader(run), planner=_planner())
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - a BaseException, holding each rank's traceback
        first = next(iter((getattr(e, "failures", None) or {0: (e,)}).values()))
        first = first[0] if isinstance(first, tuple) else first
        # torch's own text is not relayed: for a shard it cannot unpickle it advises weights_only=False
        raise GPT2PortError(f"{run.dir}: the saved training state does not load ({type(first).__name__} reading "
                            f"its shards: their bytes are not what .metadata describes)") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(strict=not frozen))
    bad = any(not bool(torch.isfinite(getattr(p, "_local_tensor", p)).all()) for p in model.parameters())
    if rt.any(bad):
        raise GPT2PortError(f"{run.dir}: the saved weights are not all finite")
    rng = run.rng.get(rt.rank)
    if rng is not None:
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and rt.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], rt.device)


def _trained(model, msd: dict) -> tuple[dict, bool]:
    """(the model state to save or restore, whether the model has frozen parameters). A LoRA run keeps only what
    it trains: its frozen base, the tied head included, is rebuilt from the checkpoint it started from."""
    frozen = {n.removeprefix("module.") for n, p in model.named_parameters(remove_duplicate=False)
              if not p.requires_grad}  # DDP's names have "module." before them, the state's do not
    return {k: v for k, v in msd.items() if k not in frozen}, bool(frozen)


def _reader(run: saved.SavedRun):
    """DCP's file reader, handed the metadata saved.read checked instead of unpickling the file again."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            if getattr(run.metadata, "storage_meta", None) is None:
                run.metadata.storage_meta = StorageMeta()
            run.metadata.storage_meta.load_id = self.load_id
            return run.metadata

    return Reader(run.dir)


def _planner():
    """DCP's load planner, reading the non-tensor entries (the optimizer's hyperparameters) as weights_only."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return Planner()


def remove(out: Path) -> None:
    for name in (STATE, f".{STATE}.old", f".{STATE}.partial"):
        shutil.rmtree(out / name, ignore_errors=True)

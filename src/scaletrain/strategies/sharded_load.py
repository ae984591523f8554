"""Loading a sharded checkpoint (torch.distributed.checkpoint) into a strategy's state dict.

DCP's load fills the state dict it is given, key by key, and refuses a key the checkpoint
lacks. Every optimizer scaletrain builds records its base learning rate (``initial_lr``,
schedule.mark_base_lr) from the start; a checkpoint written before it did, by a run that never
scheduled its rate, has no such key. ``load_sharded`` leaves that one key out of what it asks
for, and the restored group then takes its rate, which in such a run is the base, as the
base. Any other missing key still fails the load.
"""

from __future__ import annotations

from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from scaletrain.schedule import BASE_LR


def drop_absent_base_lr(state: Any, present: set[str], prefix: str = "") -> None:
    """Remove, in place, every ``initial_lr`` entry of ``state`` whose flattened name (DCP's:
    keys and list indices joined by dots) is not in ``present``."""
    if isinstance(state, dict):
        items: list[tuple[Any, Any]] = list(state.items())
    elif isinstance(state, list):
        items = list(enumerate(state))
    else:
        return
    for key, value in items:
        name = f"{prefix}.{key}" if prefix else str(key)
        base_lr = isinstance(key, str) and (key == BASE_LR or key.endswith("." + BASE_LR))
        if isinstance(state, dict) and base_lr and name not in present:
            del state[key]
        else:
            drop_absent_base_lr(value, present, name)


def load_sharded(state: dict[str, Any], checkpoint_id: str) -> None:
    """dcp.load into ``state``, tolerating a checkpoint without base learning rates."""
    present = set(FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata)
    drop_absent_base_lr(state, present)
    dcp.load(state, checkpoint_id=checkpoint_id)

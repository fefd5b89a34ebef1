"""Layout-independent, atomic checkpoints through ``pyarrow.fs`` (a local path or an object-store URI).

A checkpoint is a directory ``<dir>/step_<NNNNNNNN>/`` holding one shard per pipeline stage
(``stage-<s>.pt``: model parameters and AdamW state keyed by *global* parameter name) and
``manifest.json``, written last through a temporary name. A sharded stage (parallel.fsdp > 1) is
written by each of its shards, each file holding its rows of every tensor
(``stage-<s>-shard-<f>.pt``, whose ``rows`` say ``[start, stop, total]`` of dim 0 per name): no
worker gathers the whole model to save it, and readers reassemble or re-cut the rows, so any
layout (or a plain process) loads any checkpoint. A directory without a manifest is not a
checkpoint: a save killed half-way is invisible, and the previous checkpoint stays the latest.
Every file is checked against the size and sha256 its manifest records before it is loaded, with
``torch.load(weights_only=True)``: a checkpoint is data, not code.

Why not torch.distributed.checkpoint (DCP, evaluated against torch 2.13): its save plans collectively
over one process group, but raytrain saves from whichever live workers hold each slot's state, with
no collective, exactly when groups are broken (a run that gives up saves its survivors'; a background
save outlives the generation it started in, whose groups a repair destroys); and its reader
unpickles ``.metadata`` with plain ``pickle.load``, so a forged checkpoint could run code, where every
raytrain file loads with ``weights_only``. What DCP would bring is here: streaming writes, background
saves, and resharding on load, rows and column boxes alike (raytrain.checkpoint.assemble).

A published checkpoint is immutable: every save writes into a directory that did not exist before,
so a second save of the same step (a resumed run, a save retried after a repair) goes to
``step_<NNNNNNNN>.<n>``. Each manifest carries a sequence number one above every manifest already
in the directory, so "latest" is the checkpoint published last, whatever its step.

Each manifest also names its *lineage*: the chain of runs that wrote it (a fresh run starts one, a run
resumed from the newest checkpoint of one continues it: ``continued_lineage``), and each save's directory
names it from the start (``LINEAGE_FILE``). Pruning deletes only its own lineage's checkpoints and
unfinished saves, so a run never deletes what another run wrote. Manifests written before lineages (none
recorded) stay readable; they belong to no run's lineage.

Modules, one job each: ``storage`` (files through pyarrow.fs), ``format`` (names, versions, the manifest
and its checks), ``writing`` (a save's directory, shards streamed with their checksums, publishing,
pruning), ``listing`` (the published checkpoints of a directory: latest, a lineage's, ``resolve``),
``verification`` (every file checked before it is trusted: ``iter_shards``, ``verify``), ``reading``
(``load_into`` a worker's own tensors, ``merged_state``, ``load_state_dict``), ``assemble`` (pieces of any
layout into any reader's tensors), ``experiment`` (whether a checkpoint is of this run's model and data),
``errors``. None imports torch at import time: the driver and the coordinator read manifests and publish
checkpoints without it. This package re-exports their public names (``checkpoint.latest``, ...).
"""

from raytrain.checkpoint.assemble import Assembler, Boxes, Destination, Wanted, new_tensors, slice_boxes, slices_entry
from raytrain.checkpoint.errors import CheckpointError, CheckpointWriteError
from raytrain.checkpoint.format import (CHECKSUM, FORMAT_VERSION, LINEAGE_FILE, MANIFEST, READABLE_FORMATS,
                                        read_manifest, shard_entries, shard_name, step_dir)
from raytrain.checkpoint.listing import (Published, continued_lineage, latest, latest_of, list_checkpoints,
                                         list_published, resolve)
from raytrain.checkpoint.reading import load_into, load_optimizer_state, load_shards, load_state_dict, merged_state
from raytrain.checkpoint.storage import check_writable, filesystem, join_uri, read_bytes, write_bytes
from raytrain.checkpoint.verification import iter_shards, verify
from raytrain.checkpoint.writing import new_lineage, new_step_dir, prune, publish, save_shard

__all__ = [
    "Assembler", "Boxes", "Destination", "Wanted", "new_tensors", "slice_boxes", "slices_entry",
    "CheckpointError",
    "CheckpointWriteError",
    "CHECKSUM", "FORMAT_VERSION", "LINEAGE_FILE", "MANIFEST", "READABLE_FORMATS", "read_manifest", "shard_entries",
    "shard_name", "step_dir",
    "Published", "continued_lineage", "latest", "latest_of", "list_checkpoints", "list_published", "resolve",
    "load_into", "load_optimizer_state", "load_shards", "load_state_dict", "merged_state",
    "check_writable", "filesystem", "join_uri", "read_bytes", "write_bytes",
    "iter_shards", "verify",
    "new_lineage", "new_step_dir", "prune", "publish", "save_shard",
]

"""The run's data: where samples come from, how they are checked, read, ordered and held out.

Modules, one job each: ``order`` (the global sample order and its division among replicas: what the
coordinator imports, without pyarrow), ``held_out`` (rows kept out of training for eval.every),
``shards`` (data.path resolved to files), ``corpus`` (the built-in corpus and the run's files),
``token_checks`` (a token column checked before any actor starts), ``tokens`` (token datasets),
``text`` (text tokenised and packed), ``token_cache`` (decoded rows memory-mapped per machine),
``datasets`` (``open_dataset``: a worker's view of the samples), ``atomic`` (files published whole),
``identity`` (files by content: the fingerprint the caches are keyed by, the record a checkpoint keeps).

This package re-exports their public names lazily (``raytrain.data.sample_ids``), so importing one module
(``raytrain.data.order``) costs only that module.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "order": ("epoch_order", "sample_ids", "replica_slices", "even_shares", "step_positions", "microbatch_bounds",
              "sample_seeds", "position_epochs", "next_epoch", "HELD_OUT_EPOCH", "NO_RESTART"),
    "held_out": ("held_out_count", "training_rows", "held_out_source", "held_out_ids"),
    "shards": ("Files",),
    "samples": ("DataSource", "SampleSpec", "TensorSpec"),
    "corpus": ("BUILTIN_COLUMN", "builtin_corpus_path", "build_builtin_corpus", "check_cache_dir",
               "resolve_data_path", "data_files", "eval_files"),
    "token_checks": ("SCAN_BATCH_ROWS", "SCAN_BUFFER_BYTES", "check_dataset", "windows"),
    "tokens": ("TokenDataset", "ShardedDataset", "write_token_parquet"),
    "datasets": ("Dataset", "open_dataset", "counted_source", "load_transform"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str):
    """``raytrain.data.<name>``: the public name of the module that defines it, imported on first use."""
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'raytrain.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"raytrain.data.{module}"), name)


def __dir__() -> list[str]:
    return sorted(_MODULE_OF)

"""A sentence-transformers directory's embedding recipe: modules.json and its Pooling module's config.

sentence-transformers saves a model as a Hugging Face checkpoint (config.json, weights, tokenizer) plus
modules.json, the pipeline applied to its last hidden states: a Transformer module (the checkpoint itself), a
Pooling module (1_Pooling/config.json: which of cls / mean / max / mean over sqrt(length) / last token) and,
often, a Normalize module (L2). kvforge runs the Transformer module as its graph; the pooling and normalization
are what `embed`, `kvforge embed` and `/v1/embeddings` apply by default, recorded in the model config
(`embedding`). A module that changes the vectors in a way kvforge does not apply (a Dense projection, weighted
mean pooling, several pooling modes concatenated) is refused by name rather than left out silently.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvforge.errors import KvforgeError
from kvforge.schema import path_problem, read_json

MODULES_FILE = "modules.json"
# 1_Pooling/config.json's keys -> the pooling `EncoderSession.embed` applies
POOLING_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                 "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
                 "pooling_mode_lasttoken": "last"}
UNSUPPORTED_MODES = {"pooling_mode_weightedmean_tokens": "weighted mean"}
_MODULE_KINDS = {"Transformer": "transformer", "Pooling": "pooling", "Normalize": "normalize"}


def read_embedding(directory: Path) -> dict[str, Any] | None:
    """{"pooling", "normalize", "max_seq_length", "source"} from a sentence-transformers directory, or None when
    `directory` has no modules.json. A KvforgeError names a module or mode that changes the vectors and is not
    applied."""
    path = directory / MODULES_FILE
    if not path.is_file():
        return None
    modules = read_json(path, "sentence-transformers module list", kind=list)
    if not all(isinstance(m, dict) and isinstance(m.get("type"), str) for m in modules):
        raise KvforgeError(f"{path} is not a sentence-transformers module list (objects with a 'type')")
    kinds = []
    for m in modules:
        kind = _MODULE_KINDS.get(m["type"].rsplit(".", 1)[-1])
        if kind is None:
            raise KvforgeError(f"{path}: module {m.get('name', m['type'])!r} ({m['type']}) changes the embedding after "
                               f"the encoder and kvforge does not apply it; it applies {sorted(_MODULE_KINDS)}")
        kinds.append((kind, m))
    if [k for k, _ in kinds][:1] != ["transformer"]:
        raise KvforgeError(f"{path}: the first module is not the Transformer (the checkpoint itself): {modules[0]}")
    pooling = "mean"  # sentence-transformers' own default where no Pooling module is listed
    poolings = [m for k, m in kinds if k == "pooling"]
    if len(poolings) > 1:
        raise KvforgeError(f"{path} lists {len(poolings)} Pooling modules; a sentence-transformers model has one")
    if poolings:
        where = str(poolings[0].get("path") or "1_Pooling")
        problem = path_problem(where, directories=True)
        if problem:
            raise KvforgeError(f"{path}: the Pooling module's path {where!r} {problem}")
        cfg_path = directory / where / "config.json"
        cfg = read_json(cfg_path, "sentence-transformers pooling config") if cfg_path.is_file() else {}
        unsupported = [UNSUPPORTED_MODES[k] for k in UNSUPPORTED_MODES if cfg.get(k)]
        if unsupported:
            raise KvforgeError(f"{cfg_path} pools by {unsupported[0]}, which kvforge does not apply; it pools by "
                               f"{sorted(POOLING_MODES.values())}")
        modes = [mode for key, mode in POOLING_MODES.items() if cfg.get(key)]
        if len(modes) > 1:
            raise KvforgeError(f"{cfg_path} concatenates several poolings ({modes}); kvforge applies one of them")
        if modes:
            pooling = modes[0]
    order = [k for k, _ in kinds]
    normalize = "normalize" in order
    if normalize and poolings and order.index("normalize") < order.index("pooling"):
        raise KvforgeError(f"{path}: Normalize comes before Pooling; kvforge normalizes the pooled vector")
    bert = directory / "sentence_bert_config.json"
    max_seq_length = read_json(bert).get("max_seq_length") if bert.is_file() else None
    return {"pooling": pooling, "normalize": normalize, "max_seq_length": max_seq_length, "source": MODULES_FILE}

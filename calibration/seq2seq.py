"""Calibration of an encoder-decoder bundle: both graphs, from text pairs or plain text.

The data is either a .jsonl file of {"source": ..., "target": ...} pairs (each
pair a batch of one: source and target truncated to seq_len), or plain text
(any file `--data` takes), cut into windows of seq_len tokens that serve as
both the source and the teacher-forced target ([decoder start] + the window
minus its last token): the decoder then sees real target-side statistics
without a parallel corpus. The encoder graph is observed on the sources; the
decoder graph on the targets, with the cross-attention K/V the float
encoder computed for each source. Each graph's linear layers get their own
scales; lm_head stays in float (as in decoders) unless asked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from kvforge.bundle import Bundle
from kvforge.errors import KvforgeError
from kvforge.ort_session import make_session
from kvforge.tokenizer import Tokenizer

from .data import jsonl_items, load_calibration_set, read_text_file
from .multi_graph import graph_targets, quantize_graphs
from .recipe import Quantized, Recipe


def read_pairs(path: str | Path) -> list[tuple[str, str]] | None:
    """The (source, target) pairs of a .jsonl file whose lines are {"source", "target"} objects; None for any other
    data (a file whose first item is no such object)."""
    path = Path(path)
    if path.suffix.lower() != ".jsonl" or not path.is_file():
        return None
    pairs = []
    for n, item in jsonl_items(path, read_text_file(path, "calibration data")):
        if not isinstance(item, dict) or "source" not in item:
            if not pairs:
                return None
            _bad(path, n)
        if not isinstance(item.get("source"), str) or not isinstance(item.get("target"), str):
            _bad(path, n)
        pairs.append((item["source"], item["target"]))
    return pairs or None


def _bad(path, n):
    raise KvforgeError(f"{path}:{n}: a line of a pairs file is {{\"source\": \"...\", \"target\": \"...\"}}")


def calibration_items(bundle: Bundle, data, samples: int, seq_len: int, random_data: bool, batch_size: int):
    """(batches of (source ids, source mask, target input ids), a record of the data)."""
    cfg = bundle.model_config
    start = cfg["decoder_start_token_id"]
    pairs = read_pairs(data) if data is not None and not random_data else None
    if pairs is not None:
        if bundle.tokenizer_file is None:
            raise KvforgeError(f"bundle {bundle.path} has no tokenizer to tokenize calibration pairs with")
        tok = Tokenizer.from_file(bundle.tokenizer_file)
        items = []
        for source, target in pairs[:samples]:
            src = np.asarray([tok.encode(source)[:seq_len]], np.int64)
            tgt = [start] + tok.encode(target)[:seq_len - 1]
            if src.shape[1] == 0:
                continue
            items.append((src, np.ones_like(src), np.asarray([tgt], np.int64)))
        if not items:
            raise KvforgeError(f"{data} holds no pair with a non-empty source")
        return items, {"data": str(data), "pairs": len(items), "random_data": False, "seq_len": seq_len}
    cset = load_calibration_set(bundle, data, samples=samples, seq_len=seq_len, random_data=random_data)
    items = []
    for batch in cset.batches(batch_size):
        target = np.concatenate([np.full((len(batch), 1), start, np.int64), batch[:, :-1]], axis=1)
        items.append((batch, np.ones_like(batch), target))
    return items, {"data": cset.source, "data_sha256": cset.sha256, "random_data": cset.random,
                   "samples": int(len(cset.samples)), "seq_len": int(cset.samples.shape[1]), "batch_size": batch_size,
                   "target": "the source windows, teacher-forced"}


def quantize_seq2seq(bundle: Bundle, recipe: Recipe, held_out, progress: Callable) -> Quantized:
    """Both graphs quantized by the recipe (an encoder-decoder fits no accuracy budget: held_out is None)."""
    import onnx

    graphs = bundle.graphs
    bundle.load_graph(external_data=False)  # refuses external data outside the bundle
    models = {role: onnx.load(str(bundle.path / name)) for role, name in graphs.items()}
    float_dtype = np.float16 if bundle.dtype == "float16" else np.float32
    found = graph_targets(models, recipe)
    items, record = calibration_items(bundle, recipe.data, recipe.samples, recipe.seq_len, recipe.random_data,
                                      recipe.batch_size) if recipe.needs_data else (None, {"data": None})
    feeds = dict(zip(("encoder", "decoder"), _feeds(bundle, models["decoder"], float_dtype))) if items else {}
    return quantize_graphs({role: models[role] for role in ("encoder", "decoder")}, graphs, found,
                           {"encoder": items, "decoder": items} if items else None, feeds, recipe, float_dtype,
                           progress, record)


def _feeds(bundle: Bundle, decoder, float_dtype):
    """(encoder feeds, decoder feeds) for a calibration item: the decoder reads the float encoder's cross K/V."""
    cfg = bundle.model_config
    encoder_float = make_session(bundle.path / bundle.graphs["encoder"])
    n, H, D = cfg["n_decoder_layers"], cfg["decoder_heads"], cfg["decoder_head_dim"]
    dec_inputs = [i.name for i in decoder.graph.input]

    def encoder_feeds(item):
        return {"input_ids": item[0], "attention_mask": item[1]}

    def decoder_feeds(item):
        cross = encoder_float.run(None, encoder_feeds(item))[1:]
        empty = np.zeros((item[0].shape[0], H, 0, D), float_dtype)
        feeds = [item[2], item[1]]
        for i in range(n):
            feeds += [empty, empty, cross[2 * i], cross[2 * i + 1]]
        return dict(zip(dec_inputs, feeds))

    return encoder_feeds, decoder_feeds

"""transformers as the end-to-end oracle of an export: from text, through each side's own tokenizer and model.

Export validation compares the graph with kvforge's own Torch reference, fed by kvforge's own tokenizer and
weight reader: a defect both share is invisible to it. Here the source's files (a Hugging Face directory, or a
GGUF file, which transformers reads with `gguf_file=`) are read by transformers: its tokenizer must give the
bundle's tokenizer's ids on held-out text, and its model's outputs on them are the truth the graph's are judged
against, in multiples of transformers' own float32 rounding (its FP32 outputs against its FP64 ones: the
validation's noise rule, export/validate_report.judge_noise). A failure names the end that departs:

- tokenizer: the two tokenizers' ids differ (the text and the first position named);
- weights: kvforge's own Torch reference departs from transformers as the graph does (what was read from the
  checkpoint, or the reference built on it, is not what transformers runs);
- graph: the reference agrees with transformers and the graph does not.

Each kind that can be compared registers its `Oracle` (ORACLES, by kind name, as export/kinds.py's EXPORTS);
the others record why they were not. The check runs where its memory fits the export's own bound (transformers'
model in FP32, one layer at a time in FP64, beside the bundle's size + 2 GiB), and says so in the manifest
(`oracle`) when it does not, as it does without transformers: `kvforge compare --against transformers` runs it
on a written bundle.
"""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path
from typing import Any, Callable, NamedTuple

import numpy as np
import torch

from kvforge.bundle import Bundle
from kvforge.errors import KvforgeError
from kvforge.schema import read_json

from .validate import TOLERANCES
from .validate_report import EPS32, judge_noise

# held-out text of several shapes (prose, numbers, punctuation, non-ASCII, code); no special tokens of its own
TEXTS = (
    "The committee published its report on Tuesday, and the findings surprised almost everyone in the room.",
    "In 1969, 3 astronauts flew 384,400 km; the mission cost about $25.4 billion (roughly 1% of GDP).",
    "Ça marche très bien: naïve café, Größe, 東京, and emoji 🙂 all appear in real text.",
    "def add(a, b):\n    return a + b  # a tiny function\n",
)
ID_ROWS = (5, 12, 23)  # lengths of the seeded token id rows given to both where the bundle has no tokenizer
BOUND_MARGIN_BYTES = 2 << 30  # issue 48's export bound: the written bundle's size + 2 GiB
PROCESS_BYTES = 1 << 30  # what the process holds besides transformers' model (torch, transformers, buffers)
# transformers' GGUF reader dequantizes with numpy intermediates: loading Gemma 3 270M's Q4_K_M file (1.07 GB as
# float32) peaked at 3.15 GB here, its tokenizer alone at 0.97 GB (measured 2026-11-30)
GGUF_LOAD_FACTOR = 3.0


class Oracle(NamedTuple):
    # (transformers, the source's location: {"path", "gguf_file"}, its config.json) -> the model, FP32, eval
    load: Callable[[Any, dict[str, Any], dict[str, Any]], Any]
    # (transformers model, ids) -> {output name: array}
    transformers_outputs: Callable[[Any, list[int]], dict[str, np.ndarray]]
    # (the written bundle, rows of ids) -> per row {output name: array}: its graphs run on ONNX Runtime
    graph_outputs: Callable[[Bundle, list[list[int]]], list[dict[str, np.ndarray]]]
    # (kvforge's FP32 Torch reference, ids) -> {output name: array}
    reference_outputs: Callable[[Any, list[int]], dict[str, np.ndarray]]
    # what the comparison leaves out, recorded with it (None: nothing)
    scope: str | None = None


def _np(t) -> np.ndarray:
    return t.detach().to(torch.float64).numpy()


def _causal_lm(transformers, where, hf_config):
    return transformers.AutoModelForCausalLM.from_pretrained(where["path"], gguf_file=where.get("gguf_file"),
                                                             dtype=torch.float32, attn_implementation="eager",
                                                             experts_implementation="eager").eval()


def _fp32(cls, where):
    return cls.from_pretrained(where["path"], dtype=torch.float32, attn_implementation="eager").eval()


def _auto(class_name: str):
    """A loader through transformers' auto class `class_name` (a Hugging Face directory)."""
    return lambda transformers, where, hf_config: _fp32(getattr(transformers, class_name), where)


def _encoder(transformers, where, hf_config):
    """The class that saved the checkpoint (config.json's architectures[0]), else the base model."""
    arch = (hf_config.get("architectures") or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    return _fp32(cls if cls is not None and hasattr(cls, "from_pretrained") else transformers.AutoModel, where)


def _encoder_outputs(model, ids):
    out = model(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                output_hidden_states=True)
    hidden = getattr(out, "last_hidden_state", None)  # a head's output has only the hidden states
    found = {"last_hidden_state": _np((out.hidden_states[-1] if hidden is None else hidden)[0])}
    if getattr(out, "logits", None) is not None:
        found["logits"] = _np(out.logits[0])
    return found


def _logits(model, ids):
    """A decoder's logits of one row (transformers' model, from input_ids alone)."""
    return {"logits": _np(model(input_ids=torch.tensor([ids])).logits[0])}


def _reference_logits(reference, ids):
    """kvforge's decoder reference's logits of one row."""
    return {"logits": _np(reference(torch.tensor([ids]))[0][0])}


def _encoder_reference(reference, ids):
    out = reference(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), None)
    return {k: _np(v[0]) for k, v in out.items() if v is not None}


def _one_graph_outputs(bundle, rows) -> list[dict[str, np.ndarray]]:
    """The bundle's (decoder) graph on each row of ids, one row a run from an empty cache (ONNX Runtime, as every
    session of the bundle runs it): a decoder's logits of the row; an encoder's per-token outputs and its head's.
    A vision-language decoder graph gets no image: no image features, and multimodal RoPE's offsets (where it
    takes them) zero, so that its three position streams are the plain positions, as transformers computes them
    for a text-only prompt."""
    from kvforge.bundle import FEATURES, OFFSETS
    from kvforge.ort_session import make_session, prefill_feeds

    session = make_session(bundle.graph_file, bundle.session_format)
    inputs = {i.name for i in session.get_inputs()}
    names = [o.name for o in session.get_outputs() if not o.name.startswith("present")]
    out = []
    for ids in rows:
        feeds = prefill_feeds(np.array([ids], np.int64), bundle.text_config, bundle.io, bundle.dtype)
        if FEATURES in inputs:
            feeds[FEATURES] = np.zeros((0, bundle.text_config["dim"]), np.float32)
        if OFFSETS in inputs:
            feeds[OFFSETS] = np.zeros((1, 3, len(ids)), np.int64)
        out.append({n: np.asarray(v[0], np.float64) for n, v in zip(names, session.run(names, feeds))})
    return out


# an encoder-decoder is compared teacher-forced: the target is the start token, then the source's first ids
TARGET_TOKENS = 8


def _target(start: int, ids: list[int]) -> list[int]:
    return [start] + ids[:TARGET_TOKENS - 1]


def _seq2seq_outputs(model, ids):
    out = model(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                decoder_input_ids=torch.tensor([_target(model.config.decoder_start_token_id, ids)]))
    return {"last_hidden_state": _np(out.encoder_last_hidden_state[0]), "logits": _np(out.logits[0])}


def _seq2seq_graph_outputs(bundle, rows) -> list[dict[str, np.ndarray]]:
    """The encoder graph on each source, then the decoder graph teacher-forced on its target from an empty cache,
    reading the cross-attention K/V the encoder graph wrote (the two graphs as the runtime chains them)."""
    from kvforge.ort_session import make_session

    from .seq2seq_export import cross_names

    encoder = make_session(bundle.path / bundle.graphs["encoder"], bundle.session_format)
    decoder = make_session(bundle.path / bundle.graphs["decoder"], bundle.session_format)
    n = len(bundle.io.past)  # the decoder's self-attention cache, a (key, value) pair a layer
    # the decoder's cross-attention inputs are the encoder's outputs of the same layer; its own cache starts empty
    written = dict(zip(sum(cross_names(n, "past_key_values"), []), sum(cross_names(n, "present"), [])))
    empty = {name: np.zeros(shape, np.float32) for name, shape in bundle.io.cache_shapes(1).items()}
    enc_names = [o.name for o in encoder.get_outputs()]
    out = []
    for ids in rows:
        src = np.array([ids], np.int64)
        mask = np.ones_like(src)
        enc = dict(zip(enc_names, encoder.run(enc_names, {"input_ids": src, "attention_mask": mask})))
        feeds = {"input_ids": np.array([_target(bundle.model_config["decoder_start_token_id"], ids)], np.int64),
                 "encoder_attention_mask": mask, **empty, **{name: enc[present] for name, present in written.items()}}
        logits = decoder.run(["logits"], feeds)[0]
        out.append({"last_hidden_state": np.asarray(enc["last_hidden_state"][0], np.float64),
                    "logits": np.asarray(logits[0], np.float64)})
    return out


def _seq2seq_reference(reference, ids):
    src = torch.tensor([ids])
    mask = torch.ones_like(src)
    hidden, _ = reference.encode(src, mask)
    target = torch.tensor([_target(reference.config.decoder_start_token_id, ids)])
    return {"last_hidden_state": _np(hidden[0]), "logits": _np(reference(src, mask, target)[0])}


ORACLES: dict[str, Oracle] = {
    "decoder": Oracle(_causal_lm, _logits, _one_graph_outputs, _reference_logits),
    "encoder": Oracle(_encoder, _encoder_outputs, _one_graph_outputs, _encoder_reference),
    "encoder-decoder": Oracle(_auto("AutoModelForSeq2SeqLM"), _seq2seq_outputs, _seq2seq_graph_outputs,
                              _seq2seq_reference),
    # text-only prompts: the decoder's weights and the tokenizer from the model's own files; the vision graph is
    # judged against kvforge's reference by validation
    "vision-language": Oracle(_auto("AutoModelForImageTextToText"), _logits, _one_graph_outputs, _reference_logits,
                              scope="text-only prompts: the decoder graph; the vision graph is not compared"),
}


FP64_BLOCK_BYTES = 256 << 20  # a linear layer whose weight is larger in FP64 is computed a block of rows at a time


def _blocked_linear(module, x):
    """module(x) in FP64, reading its FP32 weight a block of output rows at a time (a vocabulary projection)."""
    w = module.weight
    rows = max(1, FP64_BLOCK_BYTES // (8 * w.shape[1]))
    x = x.to(torch.float64)
    out = torch.cat([x @ w[i:i + rows].to(torch.float64).T for i in range(0, w.shape[0], rows)], dim=-1)
    return out if module.bias is None else out + module.bias.to(torch.float64)


class float64_modules:
    """Inside it, `model` computes in FP64 while holding its weights in FP32, so that the memory is the FP32 model
    plus one block's FP64 weights where model.double() would add twice the model: the largest modules whose
    parameters, all together, take at most FP64_BLOCK_BYTES in FP64 are made FP64 whole just before they run and
    FP32 again just after (FP32 -> FP64 -> FP32 is exact; whole, because a module may read a child's dtype before
    the child runs, as T5's gated FFN does; a small model is one such module); a larger embedding looks up its
    FP32 rows and casts them (the same values); a larger linear layer (a vocabulary projection) is computed a
    block of rows at a time; a larger module's own parameters are cast around its own forward. Float buffers
    (rotary tables) are FP64 throughout, as model.double() makes them."""

    def __init__(self, model):
        self.model, self.hooks, self.buffers, self.patched = model, [], [], []

    @staticmethod
    def _cast(module, dtype, recurse=False):
        for p in module.parameters(recurse=recurse):
            if p.is_floating_point():
                p.data = p.data.to(dtype)

    def _hook(self, module, recurse: bool):
        self.hooks.append(module.register_forward_pre_hook(lambda m, args: self._cast(m, torch.float64, recurse)))
        self.hooks.append(module.register_forward_hook(lambda m, args, out: self._cast(m, torch.float32, recurse)))

    def _place(self, module):
        whole = sum(p.numel() for p in module.parameters()) * 8
        called = not isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict))  # containers never run
        if called and whole and whole <= FP64_BLOCK_BYTES:
            self._hook(module, recurse=True)
            return
        if isinstance(module, torch.nn.Embedding):  # a vocabulary table: its rows cast (a scale a subclass
            # applies to them, as BART's and Gemma 3's do, is then applied in FP32: within FP32's rounding)
            self.hooks.append(module.register_forward_hook(lambda m, args, out: out.to(torch.float64)))
            return
        if isinstance(module, torch.nn.Linear):  # a vocabulary projection, a block of rows at a time
            module.forward = functools.partial(_blocked_linear, module)
            self.patched.append(module)
            return
        if any(True for _ in module.parameters(recurse=False)):
            self._hook(module, recurse=False)
        for child in module.children():
            self._place(child)

    def __enter__(self):
        self._place(self.model)
        for module in self.model.modules():
            for name, b in module.named_buffers(recurse=False):
                if b.is_floating_point() and b.dtype != torch.float64:
                    self.buffers.append((module, name, b))
                    setattr(module, name, b.to(torch.float64))
        return self

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()
        for module in self.patched:
            del module.forward
        for module, name, b in self.buffers:
            setattr(module, name, b)
        for module in self.model.modules():
            self._cast(module, torch.float32)


def source_location(source) -> dict[str, Any] | None:
    """Where transformers reads `source` from ({"path", "gguf_file"}), or None: not a checkpoint it reads."""
    from kvforge.model_defs.checkpoint import gguf_path, source_kind

    kind = source_kind(source)
    if kind == "hf":
        return {"path": str(Path(source)), "gguf_file": None}
    if kind == "gguf":
        path = gguf_path(source)
        return {"path": str(path.parent), "gguf_file": path.name}
    return None


def skipped(reason: str) -> dict[str, Any]:
    return {"oracle": "transformers", "compared": False, "reason": reason}


def _fits(reference, bundle_bytes: int, where: dict[str, Any]) -> str | None:
    """Why transformers' model would not fit the export's memory bound beside the process, or None: its FP32
    weights (4 bytes a parameter; reading a GGUF file, transformers holds GGUF_LOAD_FACTOR times that; reading a
    Hugging Face checkpoint, the weight files too while it loads) and, at a time, one layer's in FP64
    (float64_modules: the embedding and vocabulary tables are read in FP32)."""
    from kvforge.model_defs.hf import weight_files

    gguf = where.get("gguf_file") is not None
    vocab = reference.config.vocab_size
    fp32 = 4 * sum(p.numel() for p in reference.parameters())
    layer = max((p.numel() for p in reference.parameters() if vocab not in p.shape), default=0)
    # transformers keeps a checkpoint's weight files mapped (a pickle, loaded) until the model is built, beside
    # the float32 copy it makes (a BF16 Qwen2.5-1.5B: 6.0 GiB of float32 and 2.96 GiB of the mapped files at the
    # peak, 6.1 GiB once loaded; measured 2026-11-30)
    files = 0 if gguf else sum(f.stat().st_size for f in weight_files(Path(where["path"])))
    need = max(fp32 * GGUF_LOAD_FACTOR if gguf else fp32 + files, fp32 + 8 * layer + FP64_BLOCK_BYTES)
    room = bundle_bytes + BOUND_MARGIN_BYTES - PROCESS_BYTES
    if need > room:
        how = " to read the GGUF file" if gguf else " with its weight files, mapped while it loads" if files else ""
        return (f"transformers' copy of the model (~{need / 2**30:.1f} GiB{how}) "
                f"would not fit the export's memory bound beside the process ({room / 2**30:.1f} GiB left of the "
                f"bundle's {bundle_bytes / 2**30:.1f} GiB + 2 GiB); run `kvforge compare --against transformers`")
    return None


def check(source, bundle_dir: Path, kind: str, reference, tokenizer, dtype: str,
          enforce_bound: bool = True) -> dict[str, Any]:
    """The oracle record for a written bundle (its manifest in place). Raises a KvforgeError naming the end that
    departs; returns the record when everything agrees, or why nothing was compared. reference: kvforge's FP32
    Torch model of the source, or a function that loads it (read only where the graph departs)."""
    where = source_location(source)
    if where is None:
        return skipped("the source is not a Hugging Face checkpoint or GGUF file (nothing of transformers' to read)")
    oracle = ORACLES.get(kind)
    if oracle is None:
        return skipped(f"the {kind} kind has no transformers comparison yet")
    if dtype != "float32":
        return skipped(f"compared at float32 (a {dtype} graph is judged against kvforge's reference by validation)")
    try:
        import transformers
    except ImportError:
        return skipped("transformers is not installed")
    bundle_bytes = sum(f.stat().st_size for f in Path(bundle_dir).iterdir() if f.is_file())
    too_big = (_fits(reference, bundle_bytes, where)
               if enforce_bound and isinstance(reference, torch.nn.Module) else None)
    if too_big:
        return skipped(too_big)
    with gguf_read_once() if where.get("gguf_file") else contextlib.nullcontext():
        return _compare(transformers, where, oracle, source, bundle_dir, reference, tokenizer)


@contextlib.contextmanager
def gguf_read_once():
    """Inside it, gguf's GGUFReader of one file is made once, over a plain array view of its memory map.

    transformers reads a GGUF file three times for one comparison (the config, the tokenizer, the tensors), each
    time with a new GGUFReader that parses every metadata string: for Gemma 3's 262k-token vocabulary that is
    ~25 s each here, most of the check. The reader is a read-only view of the memory-mapped file, so one serves all
    three; transformers' own code does the rest. The reader is gguf's own class and parsing, with its `data` (the
    np.memmap it slices once per element, then per element again as transformers decodes them) seen as a plain
    ndarray of the same mapping: np.memmap's slicing runs Python code per slice (__getitem__, __array_finalize__),
    half of the parse (Gemma 3: 18.8 s -> 9.1 s, the same fields, tensors and bytes)."""
    import gguf
    import numpy as np

    made, readers = gguf.GGUFReader, {}

    class PlainMapReader(made):
        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, value):
            self._plain = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    def reader(path, mode="r"):
        key = (os.path.realpath(os.fspath(path)), mode)
        if key not in readers:
            readers[key] = PlainMapReader(path, mode)
        return readers[key]

    gguf.GGUFReader = reader  # transformers imports it from gguf inside each function, when called
    try:
        yield
    finally:
        gguf.GGUFReader = made


def _cannot(transformers, what: str, e: Exception) -> dict[str, Any]:
    first = str(e).splitlines()[0][:200] if str(e) else ""
    return skipped(f"transformers {transformers.__version__} cannot load the source's {what}: {type(e).__name__}: {first}")


def _hf_config(where: dict[str, Any]) -> dict[str, Any]:
    path = Path(where["path"]) / "config.json"
    return read_json(path) if where.get("gguf_file") is None and path.is_file() else {}


def _compare(transformers, where, oracle: Oracle, source, bundle_dir, reference, tokenizer) -> dict[str, Any]:
    bundle = Bundle(bundle_dir)
    rows, inputs = [], "text"
    if tokenizer is None:  # a checkpoint without tokenizer files (a random-weight one): the same ids to both
        rng = np.random.default_rng(0)
        vocab = bundle.text_config["vocab_size"]
        rows, inputs = [rng.integers(min(3, vocab - 1), vocab, n).tolist() for n in ID_ROWS], "token ids"
    try:
        theirs = None if tokenizer is None else transformers.AutoTokenizer.from_pretrained(
            where["path"], gguf_file=where.get("gguf_file"))
    except Exception as e:  # noqa: BLE001: transformers' own limits (a GGUF tokenizer it does not convert)
        return _cannot(transformers, "tokenizer", e)
    for text in TEXTS if theirs is not None else ():
        ours, expected = tokenizer.encode(text), list(theirs(text)["input_ids"])
        if ours != expected:
            at = next((i for i, (a, b) in enumerate(zip(ours, expected)) if a != b), min(len(ours), len(expected)))
            raise KvforgeError(f"end-to-end check against transformers: the tokenizer departs: on {text[:40]!r} the "
                               f"bundle's tokenizer gives {ours[max(0, at - 2):at + 3]} at position {at}, transformers' "
                               f"{expected[max(0, at - 2):at + 3]} ({len(ours)} ids against {len(expected)})")
        rows.append(ours)
    # the models see at most the bundle's context (a learned position table ends there): the ids were compared whole
    limit = bundle.io.max_context or bundle.text_config.get("max_seq_len")
    rows = [r[:limit] for r in rows] if limit else rows
    graph = oracle.graph_outputs(bundle, rows)
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # kvforge's own progress is on screen
    try:
        model = oracle.load(transformers, where, _hf_config(where))
    except Exception as e:  # noqa: BLE001: transformers' own limits (a GGUF architecture it does not read, a
        # quantization library it needs) are not the bundle's defect: said, not raised
        return _cannot(transformers, "model", e)
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
    with torch.no_grad():
        fp32 = [oracle.transformers_outputs(model, ids) for ids in rows]
        try:
            with float64_modules(model):
                fp64 = [oracle.transformers_outputs(model, ids) for ids in rows]
        except RuntimeError as e:  # a module larger than FP64_BLOCK_BYTES that reads a child's dtype before
            # calling it (a T5 FFN of that size): transformers' model cannot be run a module at a time in FP64
            return skipped(f"transformers' model cannot run a module at a time in FP64 (its own FP32 rounding is the "
                           f"check's bound): {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
    del model
    names = sorted(set(graph[0]) & set(fp32[0]))
    if not names:
        raise KvforgeError(f"end-to-end check against transformers: no output in common (the graph's "
                           f"{sorted(graph[0])}, transformers' {sorted(fp32[0])})")
    tol = TOLERANCES["float32"]
    judged = [judge_noise(n, g[n], t[n], f[n], tol, EPS32) for g, t, f in zip(graph, fp64, fp32) for n in names]
    worst = max(judged, key=lambda j: j["excess"])
    record = {"oracle": "transformers", "compared": True, "transformers": transformers.__version__, "inputs": inputs,
              "texts": len(rows), "tokens": sum(len(r) for r in rows), "token_ids_equal": theirs is not None,
              "outputs": names, **({"scope": oracle.scope} if oracle.scope else {}),
              "noise": "transformers' FP32 outputs against its FP64 ones", "noise_multiple": tol["noise_multiple"],
              "worst": {k: worst[k] for k in ("output", "metric", "value", "noise", "ratio")}, "passed": True}
    if worst["excess"] <= 1.0:
        return record
    reference = reference() if callable(reference) and not isinstance(reference, torch.nn.Module) else reference
    with torch.no_grad():
        ours = [oracle.reference_outputs(reference, ids) for ids in rows]
    ref_worst = max((judge_noise(n, o[n], t[n], f[n], tol, EPS32) for o, t, f in zip(ours, fp64, fp32) for n in names
                     if n in o), key=lambda j: j["excess"], default=None)
    end = "weights" if ref_worst is not None and ref_worst["excess"] > 1.0 else "graph"
    why = ("kvforge's Torch reference departs from transformers as the graph does: what was read from the "
           "checkpoint, or the model built on it, is not what transformers runs" if end == "weights" else
           "kvforge's Torch reference agrees with transformers and the graph does not")
    raise KvforgeError(f"end-to-end check against transformers: the {end} {'depart' if end == 'weights' else 'departs'}: "
                       f"{worst['output']} {worst['metric']} "
                       f"{worst['value']:.3g} is {worst['ratio']:.1f}x transformers' own FP32 rounding "
                       f"({worst['noise']:.3g}; allowed {tol['noise_multiple']:g}x); {why}")


def against_transformers(bundle_path) -> dict[str, Any]:
    """`kvforge compare --against transformers`: the check export runs, on a written float32 bundle, whatever its
    size (no export memory bound applies here). Raises a KvforgeError naming the end that departs."""
    from kvforge.model_defs import load
    from kvforge.tokenizer import Tokenizer

    bundle = Bundle(bundle_path)
    made = bundle.manifest["lineage"][0]
    # a checkpoint's own weight codes (a GGUF file's) dequantize exactly as transformers reads them: compared
    quantized = bundle.quantization and (bundle.quantization_format != "checkpoint" or bundle.quantization.get("activations"))
    if made.get("stage") != "export" or quantized or bundle.dtype != "float32":
        what = "quantized" if quantized else (bundle.dtype if made.get("stage") == "export" else made.get("stage"))
        raise KvforgeError(f"{bundle.path} is a {what} bundle; --against transformers checks an unquantized float32 "
                           "export (transformers' own FP32 rounding bounds it): compare this one with its reference")
    source = made["input"]["source"]
    tokenizer = Tokenizer.from_file(bundle.tokenizer_file) if bundle.tokenizer_file else None
    return check(source, bundle.path, bundle.kind.name, lambda: load(source).model, tokenizer, bundle.dtype,
                 enforce_bound=False)

"""`compare` for vision-language bundles: the image features, then the decoder on image + text prompts.

Images: the PNG/JPEG/... files of `--data DIR` (up to `samples`; one .txt or .jsonl file beside them is the
text), else synthetic images (kvforge/images.py). Text: that file, `--data FILE`, or the default held-out text;
random tokens with --random-data. Candidate (the bundle on ONNX Runtime, end to end: its own vision graph's
features feed its decoder) and reference (the FP32 Torch model the bundle was made from, on the same
pixel_values) see the same prompts:

- image features: the cosine of each image's features (all its rows as one vector; each tile's, where the
  processing splits images) with the reference's, mean and worst (`image_feature_cosine_mean`, `_min`), and
  their rel L2;
- teacher-forced over prompts of one image's (tile's) tokens followed by a text window: perplexity of the text after
  the image on each side and its change, top-1 agreement, KL, logits max abs / rel L2;
- greedy from `prompts` of those prompts (the image and the window's first tokens): the reference decodes
  `steps` tokens; `greedy_agreement` is how often the candidate, fed the reference's tokens, picks them;
  `greedy_prefix_match` how far the candidate's own greedy decode (on its own cache) follows the reference's.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from kvforge import metrics
from kvforge.bundle import Bundle
from kvforge.calibration.data import eval_ids
from kvforge.errors import KvforgeError
from kvforge.images import image_folder, rope_offsets, same_size_batches, synthetic_images
from kvforge.metrics import VISION_METRICS, check_tolerances
from kvforge.runtime.vision_session import VisionLanguageSession

from .report import DEFAULT_TOLERANCES, Report, precision_of, reference_source

GREEDY_PROMPT_TOKENS = 8
# the image features' worst cosine, per precision (the decoder's bounds are DEFAULT_TOLERANCES')
FEATURE_TOLERANCES: dict[str, dict[str, float]] = {
    "float32": {"image_feature_cosine_min": 0.99999, "image_feature_rel_l2": 1e-4},
    "float16": {"image_feature_cosine_min": 0.9999, "image_feature_rel_l2": 2e-2},
    "bfloat16": {"image_feature_cosine_min": 0.999, "image_feature_rel_l2": 8e-2},
    "int8": {"image_feature_cosine_min": 0.99},
    "fp8": {"image_feature_cosine_min": 0.98},
    "int4": {"image_feature_cosine_min": 0.98},
}


def data_line(r: dict[str, Any]) -> str:
    """What a vision-language report measured on, for people."""
    return (f"{r['images']}, {r['image_count']} images; {r['data']}, {r['tokens']} text tokens after an image; "
            f"greedy: {r['prompts']} image prompts x {r['steps']} steps")


def _inputs(data, samples: int, seed: int) -> tuple[list[Any], str, str | Path | None]:
    """(images, what they are, the text data or None for the default)."""
    if data is not None and Path(data).is_dir():
        files, text = image_folder(data)
        return files[:samples], str(data), text
    return synthetic_images(samples, seed), f"synthetic images (seed {seed})", data


def compare_vision_language(candidate: str | Path, reference: str | Path | None = None, data: str | Path | None = None,
                            backend: str = "auto", steps: int = 16, prompts: int = 2, max_tokens: int = 4096,
                            seq_len: int = 64, samples: int = 8, tolerances: dict[str, float] | None = None,
                            random_data: bool = False, seed: int = 0, progress=None, **backend_options) -> Report:
    """Compare a vision-language bundle with its Torch reference on images and image + text prompts."""
    import torch

    from kvforge.model_defs import load  # torch: the reference
    from kvforge.model_defs.vision import VisionLanguageModel

    progress = progress or (lambda phase, done, total: None)
    started = time.time()
    bundle = Bundle(candidate)
    precision = precision_of(bundle)
    defaults = {k: v for k, v in DEFAULT_TOLERANCES.get(precision, {}).items() if k in VISION_METRICS}
    bounds = {**defaults, **FEATURE_TOLERANCES.get(precision, {}), **(tolerances or {})}
    ref_source = reference_source(bundle, reference, "vision-language model")
    cand = VisionLanguageSession(bundle, backend, **backend_options)
    model = load(ref_source, dtype="float32").model.eval()
    if not isinstance(model, VisionLanguageModel):
        raise KvforgeError(f"the reference {ref_source} is not a vision-language model")
    images, images_name, text = _inputs(data, samples, seed)
    seq_len = max(1, min(seq_len, cand.max_context - cand.image_tokens - 1))
    vocab = cand.vocab_size
    if random_data:
        rng = np.random.default_rng(seed)
        stream, text_name = rng.integers(0, vocab, max_tokens + 1).tolist(), f"random tokens (seed {seed})"
    else:
        stream, text_name = eval_ids(cand.tokenizer, text, max_tokens, vocab)
    # the text's own image tokens (random ones; "<image>" in a text) would take no features: they are left out
    windows = metrics.windows([t for t in stream if t != cand.image_token_id], seq_len)
    if not len(windows):
        raise KvforgeError(f"{text_name} gives fewer than {seq_len} tokens to compare on")

    with cand, torch.inference_mode():
        tiles, _ = cand.processing.process_tiles(images)
        got = [f.astype(np.float32) for f in cand.tile_features(tiles)]
        want = [f for batch in same_size_batches(tiles)
                for f in model.image_features(torch.from_numpy(batch)).float().numpy()]
        progress("image features", 1, 1)
        flat_c = [g.reshape(-1).astype(np.float64) for g in got]
        flat_r = [w.reshape(-1).astype(np.float64) for w in want]
        cosines = np.asarray([(c * r).sum() / max(np.linalg.norm(c) * np.linalg.norm(r), 1e-30)
                              for c, r in zip(flat_c, flat_r)])
        rel_l2 = float(np.linalg.norm(np.concatenate(flat_c) - np.concatenate(flat_r)) /
                       max(np.linalg.norm(np.concatenate(flat_r)), 1e-30))

        def offsets_of(ids: list[int], i: int) -> tuple[np.ndarray | None, int]:
            """Multimodal RoPE's offsets of a prompt holding feature set i's tokens, and the offset after it."""
            if not cand.mrope:
                return None, 0
            table, after = rope_offsets(ids, cand.image_token_id, [cand.processing.token_grid(tiles[i])])
            return table[None], after

        def reference_logits(ids: list[int], features: np.ndarray | None, start: int = 0, past=None, offsets=None):
            """(logits (T, V), the cache) of `ids` at positions start.. after `past` (offsets: multimodal RoPE's)."""
            t = torch.tensor([ids], dtype=torch.int64)
            mask = torch.ones(1, start + t.shape[1], dtype=torch.int64)
            positions = torch.arange(start, start + t.shape[1]).unsqueeze(0)
            rope = None if offsets is None else positions[:, None, :] + torch.as_tensor(offsets)
            logits, present = model(t, None if features is None else torch.from_numpy(features), mask, positions,
                                    past, rope_positions=rope)
            return logits.float().numpy()[0], present

        # teacher-forced: each image's tokens, then a text window; the text positions are scored
        stats = metrics.WindowStats()
        for i in range(len(got)):  # each image's feature set (each tile's, where the processing splits images)
            window = windows[i % len(windows)].tolist()[:max(cand.max_context - len(got[i]), 1)]
            ids = [cand.image_token_id] * len(got[i]) + window
            offsets, _ = offsets_of(ids, i)
            lc = cand.forward(np.asarray([ids], np.int64), got[i], rope_offsets=offsets)[0][0]
            lr = reference_logits(ids, want[i], offsets=offsets)[0]
            scored = slice(len(got[i]) - 1, len(ids) - 1)
            stats.add(lc[scored], lr[scored], np.asarray(window, np.int64))
            progress("teacher-forced", i + 1, len(got))

        # greedy: the reference's tokens, the candidate fed them, and the candidate on its own
        longest = max(len(g) for g in got)
        steps = max(1, min(steps, cand.max_context - longest - GREEDY_PROMPT_TOKENS))
        chosen = np.linspace(0, len(got) - 1, min(prompts, len(got))).astype(int).tolist()
        hits, prefixes = [], []
        for n, i in enumerate(chosen):
            prompt = [cand.image_token_id] * len(got[i]) + windows[i % len(windows)][:GREEDY_PROMPT_TOKENS].tolist()
            offsets, after = offsets_of(prompt, i)
            step = None if offsets is None else np.full((1, 3, 1), after, np.int64)
            logits, past = reference_logits(prompt, want[i], offsets=offsets)
            ref_tokens = [int(logits[-1].argmax())]
            while len(ref_tokens) < steps:
                logits, past = reference_logits(ref_tokens[-1:], None, len(prompt) + len(ref_tokens) - 1, past, step)
                ref_tokens.append(int(logits[-1].argmax()))
            fed_ids = prompt + ref_tokens[:-1]
            fed_offsets = None if offsets is None else \
                np.concatenate([offsets, np.full((1, 3, len(ref_tokens) - 1), after, np.int64)], axis=2)
            fed = cand.forward(np.asarray([fed_ids], np.int64), got[i], rope_offsets=fed_offsets)[0][0]
            hits.append(fed[len(prompt) - 1:].argmax(-1) == np.asarray(ref_tokens))
            logits, cache = cand.forward(np.asarray([prompt], np.int64), got[i], last_logits_only=True,
                                         rope_offsets=offsets)
            own = [int(logits[0, -1].argmax())]
            while len(own) < steps:
                mask = np.ones((1, len(prompt) + len(own)), np.int64)
                logits, cache = cand.forward(np.asarray([own[-1:]], np.int64), None, mask, cache=cache,
                                             last_logits_only=True, rope_offsets=step)
                own.append(int(logits[0, -1].argmax()))
            prefixes.append(next((k for k, (a, b) in enumerate(zip(own, ref_tokens)) if a != b), steps) / steps)
            progress("greedy", n + 1, len(chosen))

    teacher = stats.result()
    result: dict[str, Any] = {
        "kind": "vision-language", "metric_keys": list(VISION_METRICS),
        "candidate": str(candidate), "candidate_backend": cand.backend_name, "precision": precision,
        "reference": ref_source, "reference_backend": "torch", "images": images_name, "image_count": len(images),
        "feature_sets": len(got),
        "data": text_name, "tokens": stats.count, "seq_len": seq_len,
        "image_feature_cosine_mean": float(cosines.mean()), "image_feature_cosine_min": float(cosines.min()),
        "image_feature_rel_l2": rel_l2,
        **{k: teacher[k] for k in ("perplexity_reference", "perplexity_candidate", "perplexity_delta_pct",
                                   "top1_agreement", "kl_divergence_mean", "logits_max_abs", "logits_rel_l2")},
        "greedy_agreement": float(np.concatenate(hits).mean()), "greedy_prefix_match": float(np.mean(prefixes)),
        "steps": steps, "prompts": len(chosen),
    }
    failures = check_tolerances(result, bounds)
    result.update({"tolerances": bounds, "failures": failures, "passed": not failures,
                   "seconds": round(time.time() - started, 2)})
    return Report(result)

"""Decode/prefill speed of kvforge vs ONNX Runtime GenAI vs transformers, on one checkpoint, in one run.

The checkpoint: a Hugging Face Llama directory made locally (hidden 768, 12
layers, 12 heads / 4 KV heads, FFN 2048, vocab 32000, random weights) with a
BPE tokenizer trained locally (the GenAI builder wants one). FP32, batch 1,
prompt 64, 128 new tokens, greedy; medians over runs, contenders interleaved
run by run so a noisy neighbour hits them alike, with a pause before each so
that the previous contender's worker threads (OpenMP spins after its last
parallel region) have gone idle and do not take the cores from the next. The
order changes every run through all its permutations: a run just after
another contender's (whose weights have pushed this one's out of the cache)
is slower, measured here by up to 20% for a prefill, so each contender
follows each other one equally often.

Also measured: this machine's memory read bandwidth (a 1 GiB buffer summed
by both cores) and from it the decode roofline (weight bytes read per token /
bandwidth), and kvforge's decode time per token at 64, 512 and 1024 tokens of
context.

    python3 -m benchmarks.peers.runtime_125m [--runs 6] [--skip genai,transformers]
Needs: pip install onnxruntime-genai (the contender), transformers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import (RESULTS, bandwidth_gbs, decode_rate, interleaved_runs, load_average, machine, utc_time,
                                write_result)

CONFIG = dict(
    hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
    intermediate_size=2048, vocab_size=32000, max_position_embeddings=8192, rms_norm_eps=1e-5,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
)
PROMPT_LEN, NEW_TOKENS = 64, 128


def make_checkpoint(directory: Path) -> dict:
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    model.save_pretrained(directory)
    from kvforge.model_defs.evaluate import heldout_text

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator([heldout_text()], trainers.BpeTrainer(vocab_size=8000, special_tokens=["<unk>", "<s>", "</s>"]))
    tk.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "model_max_length": CONFIG["max_position_embeddings"],
    }))
    params = sum(p.numel() for p in model.parameters())
    embedding = CONFIG["vocab_size"] * CONFIG["hidden_size"]
    return {"parameters": params, "bytes_read_per_token": 4 * (params - embedding)}  # the embedding is gathered, not read


def export_random(fields: dict, directory: Path, name: str):
    """A kvforge model of config `fields` with seeded random weights, checkpointed and exported (validated) under
    `directory`: (the bundle, the Torch model, the export's seconds)."""
    from kvforge.export import export
    from kvforge.model_defs import ModelConfig, save_checkpoint
    from kvforge.model_defs.model import build_model, init_random_weights

    model = init_random_weights(build_model(ModelConfig(**fields)), seed=0)
    save_checkpoint(model, directory / f"{name}-ckpt")
    t = time.time()
    bundle = export(directory / f"{name}-ckpt", directory / name)
    return bundle, model, round(time.time() - t, 1)


class Kvforge:
    name = "kvforge"

    def __init__(self, ckpt: Path, work: Path):
        from kvforge import runtime
        from kvforge.export import export

        bundle = export(ckpt, work / "kvforge-bundle", force=True)
        self.session = runtime.load(bundle.path).activate()

    def run(self, prompt: np.ndarray) -> dict:
        from kvforge.runtime.bench import timed_greedy

        result = timed_greedy(self.session, prompt, NEW_TOKENS)
        return {**result, "tokens": result["tokens"][0]}

    def decode_ms_at(self, context: int, steps: int = 16) -> float:
        s = self.session
        rng = np.random.default_rng(1)
        _, cache = s.forward(rng.integers(0, CONFIG["vocab_size"], (1, context), dtype=np.int64), last_logits_only=True)
        token = np.array([[7]], np.int64)
        times = []
        for i in range(steps):
            mask = np.ones((1, context + i + 1), np.int64)
            t = time.perf_counter()
            _, cache = s.forward(token, mask, cache=cache, last_logits_only=True)
            times.append(time.perf_counter() - t)
        return 1000 * statistics.median(times)


class GenAI:
    name = "onnxruntime-genai"

    def __init__(self, ckpt: Path, work: Path, precision: str = "fp32"):
        import onnxruntime_genai as og

        out = work / f"genai-{precision}"
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(ckpt), "-o", str(out),
                        "-p", precision, "-e", "cpu", "-c", str(work / "genai-cache")], check=True, capture_output=True)
        self.og = og
        self.model = og.Model(str(out))

    def run(self, prompt: np.ndarray) -> dict:
        og = self.og
        params = og.GeneratorParams(self.model)
        total = prompt.shape[1] + NEW_TOKENS
        params.set_search_options(max_length=total, min_length=total, do_sample=False)
        gen = og.Generator(self.model, params)
        t0 = time.perf_counter()
        gen.append_tokens(prompt[0].astype(np.int32).tolist())  # prefill
        t1 = time.perf_counter()
        steps = 0
        while not gen.is_done():
            gen.generate_next_token()  # choose a token, run the model on it
            steps += 1
        t2 = time.perf_counter()
        tokens = list(gen.get_sequence(0))[prompt.shape[1]:]
        return {"prefill_s": t1 - t0, "decode_s": t2 - t1, "decode_steps": steps, "tokens": [int(t) for t in tokens]}


class Transformers:
    name = "transformers-eager"

    def __init__(self, ckpt: Path, work: Path):
        import torch
        import transformers

        torch.set_num_threads(os.cpu_count() or 2)
        self.torch = torch
        self.model = transformers.LlamaForCausalLM.from_pretrained(ckpt, attn_implementation="eager").eval()

    def run(self, prompt: np.ndarray) -> dict:
        torch = self.torch
        ids = torch.from_numpy(prompt)
        kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
        with torch.inference_mode():
            t0 = time.perf_counter()
            self.model.generate(ids, max_new_tokens=1, **kw)
            t1 = time.perf_counter()
            out = self.model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, **kw)
            t2 = time.perf_counter()
        # the long call's decode = its time minus a prefill (measured just before)
        return {"prefill_s": t1 - t0, "decode_s": (t2 - t1) - (t1 - t0), "decode_steps": NEW_TOKENS - 1,
                "tokens": out[0, prompt.shape[1]:].tolist()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=6, help="runs per contender (6: every order of three once)")
    ap.add_argument("--skip", default="", help="comma-separated contenders to skip: genai, transformers")
    ap.add_argument("--out", type=Path, default=RESULTS / "runtime_125m.json")
    args = ap.parse_args()
    load_before = load_average()
    skip = set(filter(None, args.skip.split(",")))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ckpt = work / "llama-125m"
        sizes = make_checkpoint(ckpt)
        contenders = [Kvforge(ckpt, work)]
        if "genai" not in skip:
            contenders.append(GenAI(ckpt, work))
        if "transformers" not in skip:
            contenders.append(Transformers(ckpt, work))
        prompt = np.random.default_rng(0).integers(3, 8000, (1, PROMPT_LEN), dtype=np.int64)
        runs = interleaved_runs({c.name: (lambda c=c: c.run(prompt)) for c in contenders}, args.runs, decode_rate)
        context_ms = {str(n): contenders[0].decode_ms_at(n) for n in (64, 512, 1024)}
        bw = bandwidth_gbs()

    summary = {}
    for name, rs in runs.items():
        summary[name] = {
            "prefill_tokens_per_s": statistics.median(PROMPT_LEN / r["prefill_s"] for r in rs),
            "decode_tokens_per_s": statistics.median(r["decode_steps"] / r["decode_s"] for r in rs),
            "ttft_ms": 1000 * statistics.median(r["prefill_s"] for r in rs),
        }
    kv = summary["kvforge"]
    roofline = bw * 1e9 / sizes["bytes_read_per_token"]
    ratios = {"decode_fraction_of_roofline": kv["decode_tokens_per_s"] / roofline}
    if "onnxruntime-genai" in summary:
        g = summary["onnxruntime-genai"]
        ratios["decode_vs_genai"] = kv["decode_tokens_per_s"] / g["decode_tokens_per_s"]
        ratios["prefill_vs_genai"] = kv["prefill_tokens_per_s"] / g["prefill_tokens_per_s"]
    if "transformers-eager" in summary:
        ratios["decode_vs_transformers"] = kv["decode_tokens_per_s"] / summary["transformers-eager"]["decode_tokens_per_s"]
    tokens_agree = {n: rs[0]["tokens"][:32] == runs["kvforge"][0]["tokens"][:32] for n, rs in runs.items()}
    result = {
        "benchmark": "runtime_125m", "dtype": "float32", "batch": 1, "prompt_len": PROMPT_LEN, "new_tokens": NEW_TOKENS,
        "runs": args.runs, **sizes, "bandwidth_gbs": bw, "roofline_tokens_per_s": roofline,
        "contenders": summary, "ratios": ratios, "greedy_first_32_agree_with_kvforge": tokens_agree,
        "kvforge_decode_ms_per_token_at_context": context_ms,
        "machine": machine(), "load_before": load_before, "time": utc_time(),
    }
    write_result("runtime_125m", result, args.out)
    print(json.dumps({k: v for k, v in result.items() if k not in ("machine",)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

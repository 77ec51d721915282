"""Export and calibration cost against model size: wall time and peak RSS from 135M to 3B parameters (issue 48).

Each shape is a Hugging Face checkpoint written here in the Hub's layout (config.json, BF16 safetensors in shards
of at most --shard-gb with model.safetensors.index.json; random weights, written one tensor at a time so that
making it never holds the model), or a real GGUF file given with --gguf. For each, in a fresh process under
`/usr/bin/time -v`: `kvforge export SOURCE -o BUNDLE [--dtype D]`, then `kvforge calibrate BUNDLE -o OUT
--precision P` for each of --precisions, with default flags (the built-in text) where the bundle has a tokenizer,
else `--random-data` (the random-weight shapes have none). Recorded per step: exit status, wall seconds, peak RSS, the bundle's bytes, the
last line of stderr (a refusal by the memory plan names its figures), and the issue's bounds: export peak <=
bundle + 2 GB, calibration peak <= 1.5 x its input bundle + 2 GB. One step at a time: never two heavy exports at
once. A run adds its rows, dated, to those --out holds (--replace: only this run's).

    python3 -m benchmarks.features.export_scale [--shapes smollm2-135m,llama-3.2-1b] [--dtypes float32,float16]
        [--skip-calibrate] [--precisions int8,fp8,int4] [--bundle-from DIR] [--gguf PATH ...] [--work DIR]
        [--out benchmarks/results/export_scale.json] [--replace]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import RESULTS, load_average, machine, utc_time, write_result

GB = 1 << 30

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


def _shape(arch: str, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int, theta: float,
           **extra) -> dict:
    return dict(architectures=[f"{arch.capitalize()}ForCausalLM"], model_type=arch, hidden_size=hidden,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                intermediate_size=ffn, vocab_size=vocab, tie_word_embeddings=True, rope_theta=theta, **extra)


# the published configurations' shapes (the tokenizer is not part of the cost)
SHAPES = {
    "smollm2-135m": _shape("llama", 576, 30, 9, 3, 1536, 49152, 100000.0),
    "llama-3.2-1b": _shape("llama", 2048, 16, 32, 8, 8192, 128256, 500000.0, head_dim=64, rope_scaling=LLAMA3_ROPE),
    "qwen2.5-1.5b": _shape("qwen2", 1536, 28, 12, 2, 8960, 151936, 1000000.0),
    "llama-3.2-3b": _shape("llama", 3072, 28, 24, 8, 8192, 128256, 500000.0, head_dim=128, rope_scaling=LLAMA3_ROPE),
}
COMMON = dict(max_position_embeddings=2048, rms_norm_eps=1e-5, hidden_act="silu", torch_dtype="bfloat16",
              bos_token_id=1, eos_token_id=2)


def tensors_of(cfg: dict):
    """(name, shape) of a Llama/Qwen2 checkpoint's tensors, in the Hub's names and order."""
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or d // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    bias = cfg["model_type"] == "qwen2"
    yield "model.embed_tokens.weight", (v, d)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (d,)
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            yield p + f"self_attn.{name}.weight", (rows, d)
            if bias:
                yield p + f"self_attn.{name}.bias", (rows,)
        yield p + "self_attn.o_proj.weight", (d, q)
        yield p + "post_attention_layernorm.weight", (d,)
        yield p + "mlp.gate_proj.weight", (f, d)
        yield p + "mlp.up_proj.weight", (f, d)
        yield p + "mlp.down_proj.weight", (d, f)
    yield "model.norm.weight", (d,)
    if not cfg["tie_word_embeddings"]:
        yield "lm_head.weight", (v, d)


def write_checkpoint(directory: Path, cfg: dict, shard_bytes: int) -> int:
    """A random-weight BF16 checkpoint in the Hub's sharded layout; returns its parameter count."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg | COMMON, indent=2))
    gen = torch.Generator().manual_seed(0)
    shards, current, size, params = [], {}, 0, 0
    for name, shape in tensors_of(cfg):
        norm = name.endswith("norm.weight")
        t = torch.ones(shape) if norm else torch.randn(shape, generator=gen) * (0.02 if len(shape) > 1 else 0.01)
        current[name] = t.to(torch.bfloat16)
        size += current[name].numel() * 2
        params += current[name].numel()
        if size >= shard_bytes:
            shards.append(current)
            save_file(current, str(directory / f"shard-{len(shards)}.safetensors"), metadata={"format": "pt"})
            current, size = {}, 0
    if current:
        shards.append(current)
        save_file(current, str(directory / f"shard-{len(shards)}.safetensors"), metadata={"format": "pt"})
    n = len(shards)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, 1):
        final = directory / f"model-{i:05d}-of-{n:05d}.safetensors"
        (directory / f"shard-{i}.safetensors").rename(final)
        for name, t in shard.items():
            weight_map[name] = final.name
            total += t.numel() * 2
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return params


def timed(argv: list[str]) -> dict:
    """argv under /usr/bin/time -v: exit status, wall seconds, peak RSS (GB), stderr's last line."""
    start = time.perf_counter()
    run = subprocess.run(["/usr/bin/time", "-v", *argv], capture_output=True, text=True)
    wall = time.perf_counter() - start
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", run.stderr)
    lines = [ln for ln in run.stderr.splitlines() if ln.strip() and not ln.startswith("\t")
             and "Command being timed" not in ln and "Command exited" not in ln]
    return {"rc": run.returncode, "wall_s": round(wall, 1), "peak_rss_gb": round(int(rss.group(1)) / (1 << 20), 2)
            if rss else None, "last_stderr": lines[-1][:400] if lines else ""}


def size_of(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--gguf", nargs="*", default=[], help="real GGUF files to export as well")
    ap.add_argument("--dtypes", default="float32", help="comma-separated export dtypes, each exported in turn")
    ap.add_argument("--keep-bundles", action="store_true", help="keep each bundle (default: removed once measured)")
    ap.add_argument("--shard-gb", type=float, default=2.0)
    ap.add_argument("--skip-calibrate", action="store_true")
    ap.add_argument("--precisions", default="int8", help="comma-separated calibrations of each float bundle")
    ap.add_argument("--skip-export", action="store_true",
                    help="calibrate the bundles an earlier run kept under --work (--keep-bundles) instead")
    ap.add_argument("--work", default=None, help="where checkpoints and bundles go (default: a new temp dir)")
    ap.add_argument("--out", default=str(RESULTS / "export_scale.json"))
    ap.add_argument("--replace", action="store_true", help="drop the rows --out holds (default: add to them)")
    args = ap.parse_args()
    load_before = load_average()
    work = Path(args.work or tempfile.mkdtemp(prefix="kvforge-scale-"))
    kvforge = [sys.executable, "-m", "kvforge.cli"]
    sources = []
    for shape in filter(None, args.shapes.split(",")):
        directory = work / shape
        params = write_checkpoint(directory, SHAPES[shape], int(args.shard_gb * GB)) \
            if not (directory / "model.safetensors.index.json").is_file() else None
        sources.append((shape, directory, params))
    sources += [(Path(g).name, Path(g), None) for g in args.gguf]
    rows, kept = [], ([] if args.replace else _earlier_rows(args.out))
    for (name, source, params), dtype in [(s, d) for s in sources for d in args.dtypes.split(",")]:
        from kvforge.model_defs.checkpoint import source_parameters

        row = {"model": name, "parameters": params or source_parameters(str(source)), "source_bytes": size_of(source)
               if source.is_dir() else source.stat().st_size, "dtype": dtype}
        bundle = work / f"{name}-{dtype}"
        if args.skip_export:
            row["export"] = {"rc": 0 if (bundle / "kvforge.json").is_file() else None, "note": "kept from an earlier run"}
        else:
            row["export"] = timed([*kvforge, "export", str(source), "-o", str(bundle), "--dtype", dtype, "--force"])
            row["export"]["within_bound"] = None
        row["export"]["bundle_bytes"] = size_of(bundle)
        if row["export"]["rc"] == 0 and not args.skip_export:
            row["export"]["within_bound"] = row["export"]["peak_rss_gb"] <= row["export"]["bundle_bytes"] / GB + 2
        if row["export"]["rc"] == 0 and not args.skip_calibrate:
            text = (bundle / "tokenizer.json").is_file()  # default flags: the built-in text; else random tokens
            for precision in filter(None, args.precisions.split(",")):
                out = work / f"{name}-{dtype}-{precision}"
                step = timed([*kvforge, "calibrate", str(bundle), "-o", str(out), "--precision", precision,
                              *([] if text else ["--random-data"]), "--force"])
                step["data"] = "built-in text" if text else "random tokens"
                step["bundle_bytes"] = size_of(out)
                if step["rc"] == 0:
                    step["within_bound"] = step["peak_rss_gb"] <= 1.5 * row["export"]["bundle_bytes"] / GB + 2
                    step["seconds_per_billion_parameters"] = round(step["wall_s"] / (row["parameters"] / 1e9), 1)
                row[f"calibrate_{precision}"] = step
                shutil.rmtree(out, ignore_errors=True)
        if not args.keep_bundles:
            shutil.rmtree(bundle, ignore_errors=True)
        row["date"] = utc_time()
        print(json.dumps(row), flush=True)
        rows.append(row)
        _write(args.out, rows, kept, load_before)  # after each row: a run stopped part way keeps what it measured


def _write(out: str, rows: list[dict], kept: list[dict], load_before: list[float]) -> None:
    """The file's rows from earlier runs (`kept`), then this run's, each dated."""
    result = {"benchmark": "export_scale", "date": utc_time(), "machine": machine(), "load_before": load_before,
              "bounds": "export peak RSS <= bundle + 2 GiB; calibration peak <= 1.5 x the float bundle + 2 GiB",
              "rows": kept + rows}
    write_result("export_scale", result, out)


def _earlier_rows(out: str) -> list[dict]:
    try:
        return json.loads(Path(out).read_text())["rows"]
    except (OSError, ValueError, KeyError):
        return []


if __name__ == "__main__":
    main()

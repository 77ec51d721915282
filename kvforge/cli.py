"""The `kvforge` command line: each command is a few lines over the Python API.

The commands that build models (models, evaluate, export, lint, build) import their stage inside the command:
model_defs and export import torch (and onnx), which `kvforge --help`, `generate` on an ONNX bundle and `serve`
of a bundle do not need. Calibration, verification, the runtime and serving import neither at module level.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from kvforge import runtime, serving
from kvforge.adapters import list_adapters, lora_spec, remove_adapter
from kvforge.bundle import Bundle
from kvforge.calibration import Recipe
from kvforge.calibration import calibrate as calibrate_bundle
from kvforge.calibration.auto import recipe_summary
from kvforge.errors import KvforgeError
from kvforge.kinds import KINDS, kind_name
from kvforge.manifest import lint_summary, oracle_summary, print_manifest, validation_summary
from kvforge.metrics import parse_tolerances
from kvforge.runtime.encoder_session import POOLINGS
from kvforge.runtime.bench import benchmark, benchmark_speculative
from kvforge.runtime.drafting import DRAFTERS, speculation_options
from kvforge.serving import repository_model, write_repository
from kvforge.verify.check import check as run_check
from kvforge.verify.check import write_check_report
from kvforge.verify.compare import compare as compare_artifacts
from kvforge.verify.compare import write_report
from kvforge.verify.pipeline import DEFAULT_PRECISIONS
from kvforge.verify.pipeline import pipeline as run_pipeline
from kvforge.runtime.chat_loop import run_chat
from kvforge.verify.render import PhaseProgress, print_check, print_compare, print_pipeline


class _Group(click.Group):
    """Turns KvforgeError into one clear line on stderr and exit status 1, never a traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KvforgeError as e:
            click.echo(f"error: {one_line(e)}", err=True)
            sys.exit(1)


def _writable_file(ctx, param, value):
    """A file option kvforge writes (a report, a timing cache): its directory must take a file, checked before any
    work (a read-only filesystem, /proc, a path under a file), so a long run does not end in a traceback."""
    if value is None:
        return value
    import tempfile

    parent = Path(value).resolve().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tempfile.NamedTemporaryFile(prefix=".kvforge-probe-", dir=parent).close()  # created, then removed
    except OSError as e:
        raise click.BadParameter(f"cannot write {value}: {e.strerror or e}", ctx=ctx, param=param) from e
    return value


def one_line(error: Exception) -> str:
    """An error's message on one line: a multi-line one (a heading, then a list of problems) joined with '; '."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    return lines[0] + "".join((" " if prev.endswith(":") else "; ") + line for prev, line in zip(lines, lines[1:]))


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvforge")
def main():
    """kvforge: Torch reference LMs to ONNX with KV cache, quantized and verified.

    SOURCE arguments take a preset name (default: tiny, the built-in trained
    model), a kvforge checkpoint directory, or a Hugging Face checkpoint
    directory (config.json + *.safetensors) of a supported family.
    """


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def models(as_json):
    """List the model presets and the Hugging Face families kvforge imports."""
    from kvforge.model_defs import SUPPORTED_FAMILIES
    from kvforge.model_defs.architectures import all_presets, describe_design, preset_config
    from kvforge.model_defs.checkpoint import TRAINED

    rows = []
    for name, arch in sorted(all_presets().items(), key=lambda item: (KINDS[item[1]].order, item[0])):
        cfg = preset_config(name)
        rows.append({
            "name": name,
            "architecture": arch,
            "weights": "trained" if name in TRAINED else "random",
            "layers x dim": f"{cfg.n_layers} x {cfg.dim}",
            "heads q/kv": f"{cfg.n_heads}/{cfg.n_kv_heads}",
            "vocab": cfg.vocab_size,
            "design": describe_design(cfg),
        })
    if as_json:
        click.echo(json.dumps({"presets": rows, "hf_families": list(SUPPORTED_FAMILIES)}))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="presets")
    for key in rows[0]:
        table.add_column(key)
    for row in rows:
        table.add_row(*(str(v) for v in row.values()))
    console = Console()
    console.print(table)
    console.print(f"Hugging Face families: {', '.join(SUPPORTED_FAMILIES)}")


@main.command("eval")
@click.argument("source", required=False)
@click.option("--data", type=click.Path(dir_okay=False), help="UTF-8 text corpus (default: tiny's held-out text for tiny's tokenizer, else the built-in English prose).")
@click.option("--prompt", default="def fibonacci(n):\n    if n", show_default=True, help="Prompt for a greedy continuation.")
@click.option("--max-new-tokens", default=48, show_default=True, type=click.IntRange(0))
@click.option("--seq-len", default=256, show_default=True, type=click.IntRange(1), help="Perplexity window.")
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(["float32", "float16", "bfloat16"]))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def eval_cmd(source, data, prompt, max_new_tokens, seq_len, dtype, as_json):
    """Perplexity and a greedy continuation on the Torch reference model."""
    from kvforge.model_defs.evaluate import evaluate

    result = evaluate(source, data, prompt, max_new_tokens, seq_len, dtype)
    if as_json:
        click.echo(json.dumps(result))
        return
    click.echo(f"model       {result['source']} ({result['parameters'] / 1e6:.2f}M parameters)")
    click.echo(f"corpus      {result['corpus']}: {result['corpus_tokens']} tokens")
    click.echo(f"perplexity  {result['perplexity']:.3f} (uniform over the vocabulary: {result['uniform_perplexity']})")
    click.echo(f"greedy      {result['prompt'] + result['continuation']!r}")


@main.command()
@click.argument("source", required=False)
@click.option("-o", "--out", required=True, type=click.Path(file_okay=False), help="Bundle directory to write.")
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(["float32", "float16", "bfloat16"]))
@click.option("--opset", default=21, show_default=True, type=int, help="ONNX opset (18..24).")
@click.option("--max-context", type=click.IntRange(2), help="Longest past + new tokens the bundle accepts (default: the model's).")
@click.option("--external-data/--no-external-data", default=None, help="Weights in model.onnx.data (default: only above 2 GB).")
@click.option("--force", is_flag=True, help="Replace OUT if it exists (only once the new bundle is complete).")
@click.option("--dequantize", is_flag=True,
              help="A pre-quantized SOURCE (GGUF, GPTQ, AWQ, compressed-tensors, FP8) as a float bundle, to calibrate; "
                   "by default its codes are kept.")
@click.option("--lora-max-rank", type=click.IntRange(1, 1024),
              help="Give the linear layers LoRA slots: inputs that take adapters up to this rank, chosen per row "
                   "(kvforge lora add; one bundle serves every adapter).")
@click.option("--lora-targets", metavar="q,k,v,o,gate,up,down",
              help="The layers that get slots, by short name (default: those of q,k,v,o,gate,up,down the model has; "
                   "a mixture's routed experts only when named: experts.gate,experts.up,experts.down).")
@click.option("--transformers-check/--no-transformers-check", default=True, show_default=True,
              help="After validation, compare the bundle with transformers from text on the source's own files "
                   "(tokenizer ids, then outputs within transformers' own FP32 rounding); skipped, and said so, "
                   "without transformers or where it would not fit the export's memory bound.")
@click.option("--quiet", is_flag=True, help="No progress display.")
def export(source, out, dtype, opset, max_context, external_data, force, dequantize, lora_max_rank, lora_targets,
           transformers_check, quiet):
    """Export SOURCE to an ONNX bundle with KV cache, validated against the Torch reference."""
    from kvforge.export import export as export_bundle

    targets = [t.strip() for t in lora_targets.split(",") if t.strip()] if lora_targets else None
    with PhaseProgress(enabled=not quiet) as progress:
        bundle = export_bundle(source, out, dtype=dtype, opset=opset, max_context=max_context, external_data=external_data,
                               force=force, dequantize=dequantize, lora_max_rank=lora_max_rank, lora_targets=targets,
                               transformers_check=transformers_check, progress=progress)
    quant = bundle.quantization
    if quant:
        record = quant["checkpoint"]
        dtype = (f"{dtype} with the {record['format']} checkpoint's codes kept in {len(record['kept'])} tensors"
                 + (f" ({len(record['converted'])} converted)" if record["converted"] else ""))
    click.echo(f"wrote {bundle.path} ({bundle.architecture}): {dtype}, opset {opset}; "
               f"validation {validation_summary(bundle.manifest['validation'])}; {lint_summary(bundle.manifest)}; "
               f"{oracle_summary(bundle.manifest.get('oracle'))}")


@main.command()
@click.argument("target", type=click.Path(exists=True))
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def lint(target, as_json):
    """Check a bundle (or .onnx file) against TensorRT's ONNX rules; exit 1 on errors."""
    from kvforge.export import lint as lint_graph
    from kvforge.tensorrt_env import tensorrt_refusal

    bundle = Bundle(target) if Path(target).is_dir() else None
    result = lint_graph(bundle.graph_file if bundle else Path(target))
    if as_json:
        click.echo(json.dumps(result))
    else:
        for f in result["findings"]:
            where = f" [{f['op']} {f['node']}]" if f["node"] else ""
            click.echo(f"{f['severity']}: {f['rule']}{where}: {f['message']}")
        targets = ", ".join(f"{t}: {'ok' if ok else 'no'}" for t, ok in result["targets"].items())
        verdict = "passed" if result["passed"] else "FAILED"
        click.echo(f"lint {verdict}: opset {result['opset']} ({targets}); {result['errors']} errors, {result['warnings']} warnings")
        refusal = tensorrt_refusal(bundle.quantization) if bundle and not result["passed"] else None
        if refusal:  # the errors above follow from a form TensorRT does not take at all
            click.echo(f"note: {refusal}")
    if not result["passed"]:
        sys.exit(1)


@main.command()
@click.argument("bundle", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
def inspect(bundle, as_json):
    """Print a bundle's IO spec, dtypes, opset, sizes, precision, validation and lineage."""

    b = Bundle(bundle)
    m = b.manifest
    if as_json:
        click.echo(json.dumps(m))
        b.verify(full=True)  # a damaged bundle: the manifest is printed, then the error (exit 1)
        return
    from rich.console import Console

    console = Console()
    print_manifest(b.path, m, console)
    b.verify(full=True)  # raises, naming each damaged file or non-finite weight (exit 1)
    console.print("files: intact (sizes and sha256 match the manifest; weights finite)")


@main.command()
@click.argument("bundle", type=click.Path(exists=True, file_okay=False))
@click.option("-o", "--out", required=True, type=click.Path(file_okay=False), help="Bundle directory to write.")
@click.option("--precision", required=True, type=click.Choice(["int8", "fp8", "int4"]))
@click.option("--recipe", type=click.Choice(["auto", "fixed"]),
              help="auto (the default for decoders): smoothing, clipping, layers kept in "
                   "float, INT4 block size and rounding chosen by measurement on held-out text; fixed: "
                   "the options as given (max, no smoothing, block 128, nearest where not given); the default for encoders, "
                   "encoder-decoders and INT4 with no text to measure on. The options below that fix a choice "
                   "(--method, --percentile, --smoothquant, --block-size, --gptq, --accuracy-budget) need --recipe fixed.")
@click.option("--method", type=click.Choice(["max", "percentile", "entropy", "mse"]),
              help="How activation ranges are chosen from the statistics (a fixed recipe; default max).")
@click.option("--percentile", type=float, help="For --method percentile (default 99.99).")
@click.option("--data", type=click.Path(), help="Calibration text: a UTF-8 file, or .jsonl with one text per line; for a vision-language model, a directory of images (PNG, JPEG, ...) with at most one text file.")
@click.option("--samples", default=128, show_default=True, type=click.IntRange(1))
@click.option("--seq-len", default=256, show_default=True, type=click.IntRange(1))
@click.option("--smoothquant", type=click.FloatRange(0, 1), help="SmoothQuant alpha (int8, fp8).")
@click.option("--activations", type=click.Choice(["static", "per-token"]),
              help="INT8/FP8 activation scales: static (one calibrated scale per tensor; TensorRT and ONNX Runtime) "
                   "or per-token (each token's scale computed at run time; ONNX Runtime only). Default: chosen by "
                   "measurement under the automatic recipe (decoders); static for encoder-decoders and "
                   "vision-language models; per-token INT8 for encoders. Pass static for a TensorRT build.")
@click.option("--exclude", multiple=True, help="Regex over layer names (e.g. 'layers\\.0\\.' or 'down_proj') to keep in float; repeatable.")
@click.option("--weights-only", is_flag=True,
              help="int8: weights in blocks along K (llama.cpp's Q8_0 form, default block 32), activations left in "
                   "float; no calibration data. ONNX Runtime runs it exactly, at the float graph's speed.")
@click.option("--block-size", default=None, type=click.IntRange(1),
              help="Block size along K of the weight-only formats (INT4 default 128: TensorRT documents 64 and 128; "
                   "INT8 --weights-only default 32).")
@click.option("--zero-points/--no-zero-points", default=None,
              help="int4: blocks with a float minimum each (asymmetric, llama.cpp Q4_1's and Q4_K's form; ONNX "
                   "Runtime only: the automatic recipe's default) or without (symmetric: TensorRT's form, the fixed "
                   "recipe's default). "
                   "With them, the automatic recipe may also keep its most sensitive layer types as INT8 blocks.")
@click.option("--random-data", is_flag=True, help="Calibrate on random tokens (recorded in the manifest).")
@click.option("--quantize-lm-head/--float-lm-head", default=None,
              help="Quantize the vocabulary projection too, or keep it float. Default: the automatic recipe quantizes "
                   "it where its accuracy target still holds (measured, and reported); a fixed recipe keeps it float.")
@click.option("--batch-size", default=8, show_default=True, type=click.IntRange(1))
@click.option("--kv-cache", type=click.Choice(["fp8"]), help="Quantize the KV cache writes to FP8 E4M3 (with int8 or fp8).")
@click.option("--accuracy-budget", "budget", multiple=True, metavar="METRIC=VALUE",
              help="Keep the most sensitive blocks in float until this holds against the float graph "
                   "(perplexity_delta_pct, top1_agreement, kl_divergence_mean, logits_rel_l2); repeatable.")
@click.option("--budget-data", type=click.Path(dir_okay=False), help="Held-out text for the budget (default: tiny's held-out text for tiny's tokenizer, else the built-in English prose).")
@click.option("--budget-tokens", default=4096, show_default=True, type=click.IntRange(2), help="Tokens the budget is measured on.")
@click.option("--gptq", is_flag=True, default=None, help="Round weights with GPTQ (compensates each rounding error using the calibration "
                                           "activations) instead of to nearest; INT4 then needs calibration data too.")
@click.option("--min-expert-tokens", default=16, show_default=True, type=click.IntRange(0),
              help="A mixture's expert that fewer calibration tokens reach is starved (see --starved-experts).")
@click.option("--starved-experts", default="all-tokens", show_default=True, type=click.Choice(["all-tokens", "float"]),
              help="all-tokens: calibrate a starved expert on every calibration token (statistics only); float: keep it in float.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists (only once the new bundle is complete).")
@click.option("--quiet", is_flag=True, help="No progress display.")
def calibrate(bundle, out, precision, recipe, method, percentile, data, samples, seq_len, smoothquant, activations, exclude,
              weights_only, block_size, zero_points, random_data, quantize_lm_head, batch_size, kv_cache, budget, budget_data, budget_tokens, gptq,
              min_expert_tokens, starved_experts, force, quiet):
    """Quantize a float BUNDLE: INT8 / FP8 W8A8 calibrated on data, or INT4 (or INT8 --weights-only) weight-only, as Q/DQ."""
    with PhaseProgress(enabled=not quiet) as progress:
        options = Recipe(
            precision=precision, method=method, percentile=percentile, data=data, samples=samples, seq_len=seq_len,
            smoothquant=smoothquant, activations=activations, exclude=tuple(exclude), weights_only=weights_only,
            block_size=block_size, zero_points=zero_points, random_data=random_data,
            batch_size=batch_size, quantize_lm_head=quantize_lm_head, kv_cache=kv_cache,
            accuracy_budget=list(budget) or None, budget_data=budget_data, budget_tokens=budget_tokens, gptq=gptq,
            min_expert_tokens=min_expert_tokens, starved_experts=starved_experts, recipe=recipe)
        b = calibrate_bundle(bundle, out, options=options, force=force, progress=progress)
    q, c = b.manifest["precision"]["quantization"], b.manifest["calibration"]
    data_note = f"{c['samples']} x {c['seq_len']} tokens of {c['data']}" if c.get("data") else (
        "no data (weight-only)" if not q["activations"] else "no data (activations scaled at run time)")
    if c.get("image_count"):
        data_note += f" and {c['image_count']} images ({c['images']})"
    click.echo(
        f"wrote {b.path}: {precision} ({q['weights']} weights"
        + (", GPTQ-rounded" if q.get("weight_rounding") == "gptq" else "")
        + (f", {q['activations']} activations" + (f", {q['method']}" if q["method"] else "") if q["activations"] else "")
        + (f", {q['kv_cache']} KV cache" if q.get("kv_cache") else "")
        + f"), {len(q['quantized_layers'])} layers quantized, {len(q['excluded_layers'])} kept in float; {data_note}; "
        f"{lint_summary(b.manifest)}"
    )
    if c.get("recipe"):
        click.echo(recipe_summary(c["recipe"]))
    if c.get("experts"):
        rows = [(moe, e, r) for moe, experts in c["experts"].items() for e, r in experts.items()]
        starved = [f"{moe}.{e} ({r['tokens']} tokens: {r['calibrated']})" for moe, e, r in rows if r["calibrated"] != "routed"]
        click.echo(f"experts: {len(rows)}, calibration tokens per expert {min(r['tokens'] for *_, r in rows)}.."
                   f"{max(r['tokens'] for *_, r in rows)}; starved: {', '.join(starved) or 'none'}")
    fit = c.get("accuracy_budget")
    if fit:
        last, speed = fit["iterations"][-1], fit["speed"]
        click.echo(
            f"accuracy budget {fit['budget']} met with {', '.join(fit['kept_in_float']) or 'nothing'} kept in float "
            f"(perplexity {last['perplexity_delta_pct']:+.3f}%, top-1 {last['top1_agreement']:.4f} vs the float graph); "
            f"decode {speed['result_decode_tokens_per_s']:.1f} tok/s vs {speed['quantized_decode_tokens_per_s']:.1f} fully "
            f"quantized ({speed['change_pct']:+.1f}%) and {speed['float_decode_tokens_per_s']:.1f} float (ONNX Runtime, this machine)"
        )


@main.command()
@click.argument("bundle", type=click.Path(exists=True, file_okay=False))
@click.option("-o", "--out", type=click.Path(file_okay=False), help="Engine bundle directory to write (not needed with --dry-run).")
@click.option("--max-batch", type=click.IntRange(1), help="Largest batch the engine accepts.  [default: 8]")
@click.option("--max-context", type=click.IntRange(2), help="Longest past + new tokens (default: the bundle's max context).")
@click.option("--opt-batch", type=click.IntRange(1), help="Batch the kernels are tuned for.  [default: 1]")
@click.option("--opt-context", type=click.IntRange(1), help="Prompt / context length the kernels are tuned for.  [default: min(256, max context)]")
@click.option("--timing-cache", type=click.Path(dir_okay=False), callback=_writable_file, help="TensorRT timing cache: reused if it exists, updated after the build.")
@click.option("--builder-optimization-level", default=3, show_default=True, type=click.IntRange(0, 5),
              help="TensorRT's kernel search effort (higher: slower build, maybe faster engine).")
@click.option("--hardware-compatibility", default="none", show_default=True,
              type=click.Choice(["none", "ampere_plus", "same_compute_capability"]),
              help="Which GPUs besides this one's kind may run the engine.")
@click.option("--version-compatible", is_flag=True, help="Let later TensorRT versions run the engine (embeds the lean runtime).")
@click.option("--tf32", is_flag=True, help="Allow TF32 in FP32 matmuls (faster; the graph says FP32, so off by default).")
@click.option("--dry-run", is_flag=True, help="Check everything on the CPU and print the build plan; needs no TensorRT.")
@click.option("--json", "as_json", is_flag=True, help="With --dry-run: print the plan as one JSON object.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists (only once the new bundle is complete).")
@click.option("--quiet", is_flag=True, help="No progress display.")
def build(bundle, out, max_batch, max_context, opt_batch, opt_context, timing_cache, builder_optimization_level,
          hardware_compatibility, version_compatible, tf32, dry_run, as_json, force, quiet):
    """Build a TensorRT engine bundle from an ONNX BUNDLE: strongly typed, prefill and decode profiles."""
    from kvforge.export.engine import BuildOptions, build as run, build_plan, plan_text

    options = BuildOptions(builder_optimization_level, hardware_compatibility, version_compatible, tf32, timing_cache)
    if dry_run:
        plan = build_plan(bundle, max_batch, max_context=max_context, opt_batch=opt_batch, opt_context=opt_context,
                          options=options)
        click.echo(json.dumps(plan) if as_json else plan_text(plan))
        return
    if out is None:
        raise click.UsageError("missing option -o / --out (only --dry-run needs none)")
    with PhaseProgress(enabled=not quiet) as progress:
        b = run(bundle, out, max_batch=max_batch, max_context=max_context, opt_batch=opt_batch, opt_context=opt_context,
                options=options, force=force, progress=progress)
    e = b.manifest["engine"]
    lim = e["limits"]
    size = b.manifest["files"]["model.engine"]["bytes"] / 2**20
    tc = e["timing_cache"]
    click.echo(
        f"wrote {b.path}: TensorRT {e['tensorrt_version']} engine ({size:.1f} MB) for {e['gpu']['name']} "
        f"(compute capability {e['gpu']['compute_capability']}), profiles {', '.join(p['name'] for p in e['profiles'])}, "
        f"max batch {lim['max_batch']}, max context {lim['max_context']}; built in {b.manifest['lineage'][-1]['seconds']['build']:.0f} s"
        + (f"; timing cache {tc['path']} {'updated' if tc['loaded_sha256'] else 'created'}" if tc else "")
    )


def _backend_option(f):
    return click.option(
        "--backend", default="auto", show_default=True, type=click.Choice(["auto", "onnxruntime", "tensorrt", "torch"]),
        help="auto: TensorRT for engine bundles, ONNX Runtime for ONNX bundles, Torch for model sources.",
    )(f)


def _accuracy_level_option(f):
    f = click.option(
        "--prefill-accuracy-level", type=click.Choice(["0", "4"]),
        help="The accuracy level of the steps that carry more than one token a row (a prompt, a chunk), where it "
             "differs from --accuracy-level: a second ONNX Runtime session, holding the weights again. With "
             "--accuracy-level 4, 0 prefills on level 0's kernels, faster at many rows (default: --accuracy-level's).",
    )(f)
    return click.option(
        "--accuracy-level", default="0", show_default=True, type=click.Choice(["0", "4"]),
        help="ONNX Runtime's MatMulNBits accuracy level (INT4, per-token INT8 and checkpoint-code bundles): 0 computes the bundle's "
             "function exactly; 4 quantizes the activations to int8 per weight block, as llama.cpp's dot products: "
             "faster, not exact (docs/ort-variant.md).",
    )(f)


def _backend_options(backend: str, accuracy_level: str, prefill_accuracy_level: str | None) -> dict:
    """The backend options --accuracy-level and --prefill-accuracy-level set (none at their defaults, so every
    backend takes them)."""
    options = {} if accuracy_level == "0" else {"accuracy_level": int(accuracy_level)}
    if prefill_accuracy_level is not None and prefill_accuracy_level != accuracy_level:
        options["prefill_accuracy_level"] = int(prefill_accuracy_level)
    if options and backend not in ("auto", "onnxruntime"):
        given = " and ".join(f"--{k.replace('_', '-')}" for k in options)
        what = "is an ONNX Runtime setting" if len(options) == 1 else "are ONNX Runtime settings"
        raise KvforgeError(f"{given} {what}; --backend {backend} does not take {'it' if len(options) == 1 else 'them'}")
    return options


def _sampling_options(f):
    """The generation options generate and chat share (GenerationConfig's)."""
    for option in reversed([
        click.option("--max-new-tokens", default=64, show_default=True, type=click.IntRange(0)),
        _backend_option,
        _accuracy_level_option,
        click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0), help="0 = greedy."),
        click.option("--top-k", default=0, show_default=True, type=click.IntRange(0), help="0 = no limit."),
        click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0, 1, min_open=True)),
        click.option("--repetition-penalty", default=1.0, show_default=True, type=click.FloatRange(0, min_open=True)),
        click.option("--seed", type=click.IntRange(0), help="Seed for sampling (an integer >= 0)."),
    ]):
        f = option(f)
    return f


_DEFAULT_KS = ", ".join(f"{kind.default_k} for {name}" for name, kind in DRAFTERS.items())


def _speculative_options(f):
    """--speculative and its settings (runtime/drafting.py), for generate and bench."""
    for option in reversed([
        click.option("--speculative", metavar="prompt-lookup|quantized|draft:PATH",
                     help="Speculative decoding: draft tokens by prompt lookup, with the bundle's own calibrated "
                          "sibling beside it (quantized), or with another bundle of the same tokenizer; the target "
                          "checks them in one step. The output stays the target's."),
        click.option("--draft-tokens", type=click.IntRange(1, 32), help=f"Tokens drafted per step (default: {_DEFAULT_KS})."),
        click.option("--ngram", default=3, show_default=True, type=click.IntRange(1, 16),
                     help="Prompt lookup: the longest n-gram matched."),
    ]):
        f = option(f)
    return f


def _speculation(speculative, draft_tokens, ngram):
    return speculation_options(speculative, draft_tokens or 0, ngram)


@main.command()
@click.argument("source")
@click.option("--prompt", required=True, help="Prompt text.")
@click.option("--chat", "as_chat", is_flag=True,
              help="Send the prompt as a user message through the model's chat template.")
@_sampling_options
@_speculative_options
@click.option("--adapter", help="A LoRA adapter of the bundle by name (kvforge lora add).")
@click.option("--image", "images", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="An image for a vision-language bundle, one per placeholder (<image>) in the prompt (with --chat: the images open the message); repeatable.")
@click.option("--json", "as_json", is_flag=True, help="After the stream, print one JSON object with tokens and text.")
def generate(source, prompt, as_chat, max_new_tokens, backend, accuracy_level, prefill_accuracy_level, temperature,
             top_k, top_p, repetition_penalty, seed, speculative, draft_tokens, ngram, adapter, images, as_json):
    """Stream a continuation of PROMPT from SOURCE (a bundle, or a model source on Torch)."""

    session = runtime.load(source, backend=backend, **_backend_options(backend, accuracy_level, prefill_accuracy_level))
    options = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                   repetition_penalty=repetition_penalty, seed=seed,
                   speculative=_speculation(speculative, draft_tokens, ngram), adapter=adapter)
    if images:
        if not isinstance(session, runtime.VisionLanguageSession):
            raise KvforgeError(f"{source} is {kind_name(session.architecture)}; --image takes a vision-language "
                               "bundle (LLaVA)")
        options["images"] = list(images)
    # with --chat, the images open the user's message (one image part each) and the prompt follows as text
    message = ([{"type": "image"} for _ in images] + [{"type": "text", "text": prompt}]) if images else prompt
    tokens, text = [], []
    with session:
        events = (session.stream_chat([{"role": "user", "content": message}], **options) if as_chat
                  else session.stream(prompt, **options))
        for event in events:
            tokens.append(event.token)
            text.append(event.text)
            click.echo(event.text, nl=False)
    click.echo()
    if as_json:
        click.echo(json.dumps({"tokens": tokens, "text": "".join(text), "backend": session.backend_name}))


@main.command()
@click.argument("source")
@click.option("--system", help="A system message that opens the conversation (where the template takes one).")
@_sampling_options
def chat(source, system, max_new_tokens, backend, accuracy_level, prefill_accuracy_level, temperature, top_k, top_p,
         repetition_penalty, seed):
    """Talk with SOURCE (a bundle or model source with a chat template): each line you type is a user message,
    the reply streams back. /reset starts over, /exit (or Ctrl-D) quits; Ctrl-C stops a reply, not the chat."""
    session = runtime.load(source, backend=backend, **_backend_options(backend, accuracy_level, prefill_accuracy_level))
    if not getattr(session, "chat", None):
        raise KvforgeError(f"{source} is {kind_name(session.architecture)}; `kvforge chat` talks with a decoder LM")
    options = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                   repetition_penalty=repetition_penalty, seed=seed)
    opening = [{"role": "system", "content": system}] if system else []
    with session:
        session.chat_ids(opening + [{"role": "user", "content": "hello"}])  # no template: refused before the loop
        click.echo(f"chatting with {source} ({session.backend_name}); /reset starts over, /exit quits")
        run_chat(session, opening, options)


@main.command()
@click.argument("bundle", type=click.Path(exists=True, file_okay=False))
@click.option("--text", "texts", multiple=True, required=True, help="A text to embed; repeatable.")
@click.option("--pair", "pairs", multiple=True,
              help="A second text for the --text in the same place (a cross-encoder's query and passage), joined as "
                   "transformers' tokenizer(text, text_pair) joins them; repeatable, one per --text.")
@click.option("--pooling", type=click.Choice(list(POOLINGS)),
              help="mean: the average of the tokens' (a Perceiver: the latents') last hidden states; cls: the first "
                   "token's; max, mean_sqrt_len, last: as sentence-transformers. Default: the checkpoint's own (a "
                   "sentence-transformers directory's Pooling module), else mean.")
@click.option("--normalize/--no-normalize", default=None,
              help="L2-normalize each vector. Default: the checkpoint's own (a sentence-transformers Normalize "
                   "module), else not.")
@click.option("--classify", "with_classes", is_flag=True, help="Also print each text's class (a model with a classification head).")
@click.option("--truncate", is_flag=True, help="Cut texts longer than the model's maximum input (a sentence-transformers "
              "model's max_seq_length) as transformers cuts them, special tokens kept, instead of failing.")
@click.option("--backend", default="auto", show_default=True, type=click.Choice(["auto", "onnxruntime", "torch"]),
              help="auto: ONNX Runtime; torch: the reference model the bundle was exported from.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: the vectors (and classes).")
def embed(bundle, texts, pairs, pooling, normalize, with_classes, truncate, backend, as_json):
    """Print one embedding vector per --text (or --text and --pair) from an encoder BUNDLE (BERT, RoBERTa,
    Perceiver)."""
    if pairs and len(pairs) != len(texts):
        raise KvforgeError(f"--pair is given {len(pairs)} times for {len(texts)} --text: give one --pair per --text")
    rows = list(zip(texts, pairs)) if pairs else list(texts)
    session = runtime.load(bundle, backend=backend)
    if not isinstance(session, runtime.EncoderSession):
        raise KvforgeError(f"{bundle} is {kind_name(session.architecture)}; `kvforge embed` runs encoder bundles "
                           "(BERT, RoBERTa, Perceiver): use `kvforge generate`")
    with session:
        defaults = session.embedding_defaults()
        pooling = defaults["pooling"] if pooling is None else pooling
        normalize = defaults["normalize"] if normalize is None else normalize
        vectors = session.embed(rows, pooling=pooling, normalize=normalize, truncate=truncate)
        classes = session.classify(rows, truncate=truncate) if with_classes else None
    if as_json:
        record = {"pooling": pooling, "normalized": normalize, "defaults_from": defaults["source"], "dim": int(vectors.shape[1]),
                  "vectors": [[round(float(x), 7) for x in v] for v in vectors], "backend": session.backend_name}
        if classes is not None:
            record["classes"] = classes
        click.echo(json.dumps(record))
        return
    for i, (text, v) in enumerate(zip(texts, vectors)):
        head = ", ".join(f"{x:.4f}" for x in v[:8])
        label = f"  class {classes[i]['label']} ({classes[i]['score']:.3f})" if classes else ""
        click.echo(f"{text[:40]!r}: dim {v.shape[0]}, norm {float((v * v).sum()) ** 0.5:.4f}, [{head}{', ...' if v.shape[0] > 8 else ''}]{label}")


_SERVE_OPTIONS = [
    click.option("--model-name", help="Triton's name for the model (default: the bundle directory's name)."),
    click.option("--instances", default=1, show_default=True, type=click.IntRange(1),
                 help="Model instances (processes), each with its own session and batcher."),
    click.option("--max-batch", default=8, show_default=True, type=click.IntRange(1),
                 help="Rows in each instance's continuous batch."),
    click.option("--max-cache-tokens", type=click.IntRange(1),
                 help="Cache tokens one instance's batch may hold (default: max-batch x the context)."),
    click.option("--prefix-cache-tokens", default=runtime.BatchOptions.prefix_cache_tokens, show_default=True,
                 type=click.IntRange(0), help="Tokens of prompt KV kept for reuse by prompts that start alike (0: off)."),
    click.option("--prefix-block", default=runtime.BatchOptions.prefix_block, show_default=True, type=click.IntRange(1),
                 help="Tokens per prefix-cache block (only whole blocks are reused)."),
    click.option("--prefill-chunk", default=runtime.BatchOptions.prefill_chunk, show_default=True, type=click.IntRange(0),
                 help="Tokens fed per batch step, decode tokens included: longer prompts are prefilled in chunks "
                      "between decode steps (0: whole prompts)."),
    click.option("--mixed-steps", is_flag=True, help="Feed a prompt chunk and the decode step in one forward call (ONNX "
                 "Runtime: a second graph that holds the weights again; lower latency while long prompts prefill)."),
    click.option("--speculative", metavar="prompt-lookup|quantized|draft:PATH",
                 help="Speculative decoding for every request that does not ask otherwise (each speculating row "
                      "decodes beside the batch, its drafts checked in one step)."),
    click.option("--draft-tokens", default=0, type=click.IntRange(0, 32),
                 help=f"Tokens drafted per step (0: {_DEFAULT_KS})."),
]


def _batching(bundle, max_batch, max_cache_tokens, prefix_cache_tokens, prefix_block, prefill_chunk, mixed_steps,
              speculative, draft_tokens) -> runtime.BatchOptions:
    """The batcher's options; a draft named by --speculative (or found: quantized) becomes an absolute path, since the
    model's process runs elsewhere (a repository's copy of the bundle)."""
    spec = runtime.parse_speculative(speculative)
    where = DRAFTERS[spec.method].draft(spec, Path(bundle)) if spec is not None else None
    if where is not None:
        speculative = f"draft:{Path(where).resolve()}"
    return runtime.BatchOptions(max_batch=max_batch, max_cache_tokens=max_cache_tokens,
                                prefix_cache_tokens=prefix_cache_tokens, prefix_block=prefix_block,
                                prefill_chunk=prefill_chunk, mixed_steps=mixed_steps, speculative=speculative or "",
                                draft_tokens=draft_tokens)


def _serve_options(f):
    for option in reversed(_SERVE_OPTIONS):
        f = option(f)
    return _backend_option(f)


@main.command()
@click.argument("bundle")
@click.option("-o", "--out", required=True, help="The model repository directory to write.")
@_serve_options
@click.option("--force", is_flag=True, help="Replace a repository kvforge wrote there before.")
@click.option("--openai-port", type=click.IntRange(1, 65535),
              help="The model's process also serves the OpenAI API on this port (key: $KVFORGE_API_KEY where it runs).")
@click.option("--openai-host", default="127.0.0.1", show_default=True, help="The OpenAI API's address (0.0.0.0: every "
              "interface, as in a container).")
def triton(bundle, out, model_name, instances, max_batch, max_cache_tokens, prefix_cache_tokens, prefix_block,
           prefill_chunk, mixed_steps, speculative, draft_tokens, backend, force, openai_port, openai_host):
    """Write a Triton Inference Server model repository that serves BUNDLE (generate extension, streaming)."""

    batching = _batching(bundle, max_batch, max_cache_tokens, prefix_cache_tokens, prefix_block, prefill_chunk,
                         mixed_steps, speculative, draft_tokens)
    repo = write_repository(bundle, out, model_name=model_name, instances=instances, batching=batching,
                            backend=backend, force=force, openai_port=openai_port, openai_host=openai_host)
    click.echo(f"wrote {repo}: model {repository_model(repo)!r} ({instances} instance(s), batch {max_batch}); "
               f"run it with `tritonserver --model-repository {repo}` where kvforge is installed")


@main.command()
@click.argument("source")
@_serve_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every interface).")
@click.option("--http-port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="0: a free port.")
@click.option("--grpc-port", default=8001, show_default=True, type=click.IntRange(0, 65535))
@click.option("--metrics-port", default=8002, show_default=True, type=click.IntRange(0, 65535))
@click.option("--openai-port", default=8080, show_default=True, type=click.IntRange(0, 65535),
              help="The OpenAI-compatible API's port (0: a free port).")
@click.option("--no-openai", is_flag=True, help="Serve Triton's endpoints only.")
@click.option("--api-key", envvar="KVFORGE_API_KEY", help="A key the OpenAI API's clients must send as a Bearer token "
              "(default: $KVFORGE_API_KEY; none: open).")
def serve(source, model_name, instances, max_batch, max_cache_tokens, prefix_cache_tokens, prefix_block, prefill_chunk,
          mixed_steps, speculative, draft_tokens, backend, host, http_port, grpc_port, metrics_port, openai_port,
          no_openai, api_key):
    """Serve SOURCE (a bundle, or a model source exported first) on Triton Inference Server until Ctrl-C/SIGTERM,
    with the OpenAI API beside Triton's endpoints."""

    code = serving.serve(source, model_name, host=host, http_port=http_port, grpc_port=grpc_port,
                         metrics_port=metrics_port, instances=instances,
                         batching=_batching(source, max_batch, max_cache_tokens, prefix_cache_tokens, prefix_block,
                                            prefill_chunk, mixed_steps, speculative, draft_tokens),
                         backend=backend,
                         openai_port=None if no_openai else openai_port, api_key=api_key, echo=click.echo)
    sys.exit(code)


@main.command()
@click.argument("bundle")
@_backend_option
@_accuracy_level_option
@click.option("--batch", default=1, show_default=True, type=click.IntRange(1))
@click.option("--prompt-len", default=64, show_default=True, type=click.IntRange(1))
@click.option("--new-tokens", default=128, show_default=True, type=click.IntRange(1))
@click.option("--runs", default=5, show_default=True, type=click.IntRange(1))
@click.option("--warmup", default=1, show_default=True, type=click.IntRange(0))
@_speculative_options
@click.option("--prompt", help="With --speculative: the prompt text (a chat template's user message where the "
              "bundle has one; default: a request to repeat a paragraph of built-in prose).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on the last line.")
def bench(bundle, backend, accuracy_level, prefill_accuracy_level, batch, prompt_len, new_tokens, runs, warmup,
          speculative, draft_tokens, ngram, prompt, as_json):
    """Prefill and decode speed: medians over runs of tokens/s, time to first token, peak RSS. With --speculative:
    greedy decode tokens/s with and without speculation on one prompt (batch 1), their ratio, the acceptance rate
    and the tokens per step."""

    options = _backend_options(backend, accuracy_level, prefill_accuracy_level)
    with runtime.load(bundle, backend=backend, **options) as session:
        if not isinstance(session, runtime.Session):
            raise KvforgeError(f"{bundle} is {kind_name(session.architecture)}; `kvforge bench` measures a decoder LM's "
                               "prefill and decode steps (time an encoder with kvforge.runtime's embed())")
        if speculative:
            result = benchmark_speculative(session, _bench_prompt(session, prompt), new_tokens, runs, warmup,
                                           _speculation(speculative, draft_tokens, ngram))
        else:
            result = benchmark(session, batch, prompt_len, new_tokens, runs, warmup)
    if speculative and not as_json:
        click.echo(f"{session.backend_name}: {result['prompt_len']}-token prompt, {new_tokens} new tokens, median of "
                   f"{runs}: decode {result['plain_decode_tokens_per_s']:.1f} tok/s plain, "
                   f"{result['speculative_decode_tokens_per_s']:.1f} tok/s speculative ({result['speedup']:.2f}x), "
                   f"acceptance {result['acceptance_rate'] or 0:.2f}, {result['tokens_per_step'] or 0:.2f} tokens/step")
    elif not as_json:
        decode = result["decode_tokens_per_s"]
        click.echo(
            f"{session.backend_name}: batch {batch}, prompt {prompt_len}, {new_tokens} new tokens, median of {runs}: "
            f"prefill {result['prefill_tokens_per_s']:.1f} tok/s, "
            + (f"decode {decode:.1f} tok/s, " if decode is not None else "no decode step, ") +
            f"TTFT {result['ttft_ms']:.1f} ms, peak RSS {result['peak_rss_mb']:.0f} MB"
        )
    click.echo(json.dumps(result))


def _bench_prompt(session, prompt: str | None) -> list[int]:
    if prompt is None:
        from kvforge.texts import builtin_prose

        text = builtin_prose("evaluation")[0][0]
        start = text.index("\n\n", len(text) // 3) + 2  # a paragraph from the middle of the book
        paragraph = text[start:start + 1200]
        prompt = f"Repeat the following text exactly.\n\n{paragraph}"
    if session.tokenizer is not None and session.tokenizer.chat_template:
        return session.chat_ids([{"role": "user", "content": prompt}])
    return session.encode(prompt)


def _wide_console():
    """A console at least 120 columns wide, so that report tables stay readable in CI logs."""
    from rich.console import Console

    return Console(width=max(Console().width, 120))


@main.command()
@click.argument("candidate", type=click.Path(exists=True, file_okay=False))
@click.option("--reference", help="Bundle or model source run on Torch (default: the source CANDIDATE was exported from).")
@click.option("--data", type=click.Path(), help="Held-out text (UTF-8, or JSONL; default: tiny's held-out text for tiny's tokenizer, else the built-in English prose); for a vision-language model, a directory of images with at most one text file.")
@_backend_option
@click.option("--steps", default=32, show_default=True, type=click.IntRange(1), help="Decode steps per prompt.")
@click.option("--prompts", default=4, show_default=True, type=click.IntRange(1), help="Prompts for the decode comparison.")
@click.option("--max-tokens", default=4096, show_default=True, type=click.IntRange(2), help="Corpus tokens for perplexity and logits.")
@click.option("--seq-len", default=256, show_default=True, type=click.IntRange(1), help="Perplexity window.")
@click.option("--tolerance", "tolerances", multiple=True, metavar="METRIC=VALUE",
              help="Override a default bound (floor for agreements/cosines, ceiling for errors); repeatable.")
@click.option("--per-layer", is_flag=True, help="Rank decoder blocks by their contribution to the error.")
@click.option("--random-data", is_flag=True, help="Seeded random tokens instead of text.")
@click.option("--adapter", help="Run CANDIDATE with this LoRA adapter of its own, against the reference with it merged.")
@click.option("--against", type=click.Choice(["reference", "transformers"]), default="reference", show_default=True,
              help="transformers: export's end-to-end check on a float32 bundle made from a Hugging Face directory or "
                   "GGUF file: transformers' tokenizer and model on the same files, from text (exit 1 naming the end "
                   "that departs: tokenizer, weights or graph).")
@click.option("--json", "json_file", type=click.Path(dir_okay=False), callback=_writable_file, help="Write the report here, with -drift.png (and -layers.png) beside it.")
@click.option("--quiet", is_flag=True, help="No progress display.")
def compare(candidate, reference, data, backend, steps, prompts, max_tokens, seq_len, tolerances, per_layer, random_data, adapter,
            against, json_file, quiet):
    """Compare CANDIDATE (a bundle) with the Torch reference (or transformers); exit 1 when a tolerance fails."""
    if against == "transformers":
        from kvforge.export.oracle import against_transformers

        record = against_transformers(candidate)
        if json_file:
            Path(json_file).write_text(json.dumps(record, indent=2) + "\n")
        click.echo(oracle_summary(record))
        if not record["compared"]:
            sys.exit(1)
        return
    with PhaseProgress(enabled=not quiet) as progress:
        report = compare_artifacts(candidate, reference, data=data, backend=backend, steps=steps, prompts=prompts,
                                   max_tokens=max_tokens, seq_len=seq_len, tolerances=parse_tolerances(list(tolerances)),
                                   per_layer=per_layer, random_data=random_data, adapter=adapter, progress=progress)
    console = _wide_console()
    print_compare(report.result, console)
    if json_file:
        for path in write_report(report, json_file):
            console.print(f"wrote {path}")
    if report.passed:
        console.print("[green]passed[/]")
    else:
        console.print(f"[red]FAILED[/]: {'; '.join(report.failures)}")
        sys.exit(1)


@main.command()
@click.argument("spec", type=click.Path(exists=True, dir_okay=False))
@click.option("--update-baseline", is_flag=True, help="Rewrite the spec's baseline from this run (on purpose).")
@click.option("--workdir", type=click.Path(file_okay=False), help="Keep the artifacts here (default: a temporary directory).")
@click.option("--report", "report_file", type=click.Path(dir_okay=False), callback=_writable_file, help="Write the JSON report here, with -drift.png beside it.")
@click.option("--quiet", is_flag=True, help="No progress display.")
def check(spec, update_baseline, workdir, report_file, quiet):
    """Run the accuracy regression check SPEC (TOML); exit 1 on a regression against its baseline."""
    console = _wide_console()
    with PhaseProgress(enabled=not quiet) as progress:
        result = run_check(spec, update_baseline, workdir=workdir, progress=progress,
                           log=(lambda m: None) if quiet else (lambda m: console.print(m, style="dim")))
    print_check(result, spec, console)
    if report_file:
        for path in write_check_report(result, report_file):
            console.print(f"wrote {path}")
    if result.baseline_written:
        console.print(f"wrote the baseline {result.spec.baseline}")
    if result.passed:
        console.print("[green]check passed[/]")
    else:
        console.print(f"[red]check FAILED[/]: {len(result.regressions)} finding(s): "
                      + "; ".join(f"{f.key} {f.metric} {f.note}" for f in result.regressions))
        sys.exit(1)


@main.command()
@click.argument("source", required=False)
@click.option("-o", "--out", "workdir", default="runs/tiny", show_default=True, type=click.Path(file_okay=False),
              help="Work directory for the bundles and the report.")
@click.option("--precision", "precisions", multiple=True, type=click.Choice(["fp32", "fp16", "bf16", "int8", "fp8", "int4"]),
              help="Repeatable (default: fp32 fp16 int8 fp8 int4).")
@click.option("--calibration-data", type=click.Path(dir_okay=False), help="Calibration text (needed for models other than tiny).")
@click.option("--random-data", is_flag=True, help="Calibrate and compare on random tokens (models without data).")
@click.option("--force", is_flag=True, help="Reuse a non-empty work directory, replacing its artifacts.")
@click.option("--quiet", is_flag=True, help="No progress display.")
def pipeline(source, workdir, precisions, calibration_data, random_data, force, quiet):
    """The main job: export, calibrate, build engines (where TensorRT runs), compare all, report."""
    console = _wide_console()
    with PhaseProgress(enabled=not quiet) as progress:
        result = run_pipeline(source, workdir, precisions=precisions or DEFAULT_PRECISIONS,
                              calibration_data=calibration_data, force=force, random_data=random_data, progress=progress,
                              log=(lambda m: None) if quiet else (lambda m: console.print(m, style="dim")))
    print_pipeline(result, source, console)
    if result.engine_skipped:
        console.print(f"TensorRT engine build skipped: {result.engine_skipped}")
    if result.sample:
        console.print(f"sample from {result.sample}", markup=False)
    pictures = sorted(p.name for p in result.workdir.glob("*.png"))
    console.print(f"report: {result.workdir / 'report.json'}" + (f" (+ {', '.join(pictures)})" if pictures else ""))
    if not result.passed:
        sys.exit(1)


@main.group()
def lora():
    """A bundle's LoRA adapters (the bundle exported with --lora-max-rank): add, list, remove."""


@lora.command("add")
@click.argument("bundle", type=click.Path(exists=True, file_okay=False))
@click.argument("adapter", type=click.Path(exists=True, file_okay=False))
@click.option("--name", required=True, help="The adapter's name (what generate --adapter and requests name).")
@click.option("--force", is_flag=True, help="Replace an adapter of that name.")
def lora_add(bundle, adapter, name, force):
    """Check the PEFT adapter ADAPTER (adapter_config.json, adapter_model.safetensors) against BUNDLE's slots and
    store it beside the graph."""
    from kvforge.export.lora import add_adapter  # torch: the adapter is read through the model's weight names

    info = add_adapter(bundle, adapter, name, force=force)
    click.echo(f"added adapter {info.name} (rank {info.rank}, {len(info.slots)} slots) to {bundle}")


@lora.command("list")
@click.argument("bundle", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="One JSON object per adapter.")
def lora_list(bundle, as_json):
    """BUNDLE's adapters."""
    b = Bundle(bundle)
    spec = lora_spec(b)
    adapters = list_adapters(b)
    if as_json:
        for a in adapters:
            click.echo(json.dumps(a.as_dict()))
        return
    click.echo(f"{bundle}: LoRA slots on {', '.join(spec['targets'])} up to rank {spec['max_rank']}; "
               f"{len(adapters)} adapter(s)")
    for a in adapters:
        click.echo(f"  {a.name}: rank {a.rank}, {len(a.slots)} slots" + (f", from {a.source}" if a.source else ""))


@lora.command("remove")
@click.argument("bundle", type=click.Path(exists=True, file_okay=False))
@click.argument("name")
def lora_remove(bundle, name):
    """Remove adapter NAME from BUNDLE."""
    remove_adapter(Bundle(bundle), name)
    click.echo(f"removed adapter {name} from {bundle}")


if __name__ == "__main__":  # pragma: no cover
    main()

"""llama.cpp's side of benchmarks/peers/llamacpp_smollm2.py and quantization_anchor.py: greedy generation on one GGUF
file, timed, through llama-cpp-python. Runs by path (harness.RUNNER) inside the benchmark-only virtual environment
that harness.bench_venv creates: it needs llama_cpp and numpy only, never kvforge nor the benchmarks package.

One run: reset the context, evaluate the prompt's token ids in one batch (prefill) and choose the first token
(argmax of the last row's logits), then 127 (new_tokens - 1) single-token evaluations, each followed by its argmax:
the same split as kvforge's runtime.bench.timed_greedy (prefill_s includes the first token's choice; decode_s the
new_tokens - 1 cached steps after it). Times: wall-clock (time.perf_counter) around those `Llama.eval` calls and
argmaxes, and llama.cpp's own counters (llama_perf_context: t_p_eval_ms, t_eval_ms, reset before each run).

    python benchmarks/peers/llamacpp_run.py MODEL.gguf --ids-file IDS.json [--runs 3] [--new-tokens 128]  # JSON out
    python benchmarks/peers/llamacpp_run.py MODEL.gguf --serve   # JSON requests on stdin, one result a line on stdout
    python benchmarks/peers/llamacpp_run.py F32.gguf --quantize Q4_K_M --out OUT.gguf   # llama.cpp's own quantizer
    python benchmarks/peers/llamacpp_run.py MODEL.gguf --windows WINDOWS.npy --out LOGITS.npy   # all positions' logits

--quantize: llama_model_quantize with its default parameters (no importance matrix; the type's own mix of tensor
types, as `llama-quantize F32.gguf OUT.gguf TYPE` makes it). --windows: each row of the int array (n, T) is a
sequence of its own (the cache reset before it), its first T - 1 ids evaluated in one batch with every position's
logits kept (logits_all); the logits, float32 (n, T - 1, vocab), go to --out (written as it goes: a memory map).

A request is {"ids": [...], "new_tokens": N}; an empty line or EOF ends --serve. Anything llama.cpp prints goes
to stderr: stdout carries JSON only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _private_stdout():
    """A file on the original stdout for JSON; fd 1 itself goes to stderr so that C-level prints cannot mix in."""
    fd = os.dup(1)
    os.dup2(2, 1)
    return os.fdopen(fd, "w", buffering=1)


class Runner:
    def __init__(self, model: str, threads: int, n_ctx: int, flash_attn: bool):
        import llama_cpp
        import numpy as np

        self.np, self.lc = np, llama_cpp
        self.llm = llama_cpp.Llama(model_path=model, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                                   n_batch=n_ctx, flash_attn=flash_attn, logits_all=False, verbose=False)
        self.ctx = self.llm.ctx
        self.n_vocab = self.llm.n_vocab()
        self.info = {
            "llama_cpp_python": llama_cpp.__version__, "model": os.path.basename(model),
            "model_desc": self._desc(), "model_bytes": int(llama_cpp.llama_model_size(self.llm.model)),
            "n_threads": threads, "n_threads_batch": threads, "n_ctx": n_ctx, "n_batch": n_ctx, "flash_attn": flash_attn,
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
        }

    def _desc(self) -> str:
        import ctypes

        buf = ctypes.create_string_buffer(256)
        self.lc.llama_model_desc(self.llm.model, buf, len(buf))
        return buf.value.decode(errors="replace")

    def _argmax(self) -> int:
        row = self.np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, -1), shape=(self.n_vocab,))
        return int(row.argmax())

    def run(self, ids: list[int], new_tokens: int) -> dict:
        llm, lc = self.llm, self.lc
        llm.reset()  # n_tokens = 0: the next eval drops the cache's rows from 0 on
        lc.llama_perf_context_reset(self.ctx)
        t0 = time.perf_counter()
        llm.eval(ids)
        token = self._argmax()
        t1 = time.perf_counter()
        tokens = [token]
        for _ in range(new_tokens - 1):
            llm.eval([token])
            token = self._argmax()
            tokens.append(token)
        t2 = time.perf_counter()
        perf = lc.llama_perf_context(self.ctx)
        return {"prefill_s": t1 - t0, "decode_s": t2 - t1, "decode_steps": new_tokens - 1, "tokens": tokens,
                "llama_perf": {"t_p_eval_ms": perf.t_p_eval_ms, "n_p_eval": perf.n_p_eval,
                               "t_eval_ms": perf.t_eval_ms, "n_eval": perf.n_eval}}


def quantize(src: str, dst: str, kind: str, threads: int) -> dict:
    """`src` quantized to `kind` by llama.cpp's llama_model_quantize (default parameters but the thread count)."""
    import ctypes

    import llama_cpp

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}", None)
    if ftype is None:
        raise SystemExit(f"llama.cpp has no file type {kind!r} (LLAMA_FTYPE_MOSTLY_{kind})")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = ftype, threads
    t0 = time.perf_counter()
    code = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if code != 0:
        raise SystemExit(f"llama_model_quantize({src} -> {dst}, {kind}) returned {code}")
    return {"type": kind, "seconds": time.perf_counter() - t0, "bytes": os.path.getsize(dst),
            "llama_cpp_python": llama_cpp.__version__, "params": "llama_model_quantize_default_params(), nthread set"}


def window_logits(model: str, windows: str, out: str, threads: int) -> dict:
    """Every position's logits for each window (see the module's doc), into the .npy `out`."""
    import llama_cpp
    import numpy as np

    ids = np.load(windows)
    n, t = ids.shape
    llm = llama_cpp.Llama(model_path=model, n_threads=threads, n_threads_batch=threads, n_ctx=t, n_batch=t,
                          logits_all=True, verbose=False)
    logits = np.lib.format.open_memmap(out, mode="w+", dtype=np.float32, shape=(n, t - 1, llm.n_vocab()))
    t0 = time.perf_counter()
    for row in range(n):
        llm.reset()
        llm.eval([int(i) for i in ids[row, :-1]])
        logits[row] = llm.scores[: t - 1]
    logits.flush()
    return {"windows": n, "tokens": n * (t - 1), "seconds": time.perf_counter() - t0, "model": os.path.basename(model),
            "model_bytes": int(llama_cpp.llama_model_size(llm.model)), "n_threads": threads}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--flash-attn", action="store_true", help="llama-cpp-python's default is off")
    ap.add_argument("--serve", action="store_true")
    ap.add_argument("--ids-file", type=str, default=None, help="a JSON list of prompt token ids")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--quantize", type=str, default=None, help="a llama.cpp type: Q8_0, Q4_0, Q4_K_M, ...")
    ap.add_argument("--windows", type=str, default=None, help="an .npy of token windows (n, T)")
    ap.add_argument("--out", type=str, default=None, help="where --quantize or --windows writes")
    args = ap.parse_args()
    if (args.quantize or args.windows) and not args.out:
        ap.error("--quantize and --windows write to --out")
    out = _private_stdout()
    if args.quantize:
        out.write(json.dumps(quantize(args.model, args.out, args.quantize, args.threads)) + "\n")
        return 0
    if args.windows:
        out.write(json.dumps(window_logits(args.model, args.windows, args.out, args.threads)) + "\n")
        return 0
    runner = Runner(args.model, args.threads, args.n_ctx, args.flash_attn)
    if args.serve:
        out.write(json.dumps({"ready": True, "info": runner.info}) + "\n")
        for line in sys.stdin:
            if not line.strip():
                break
            req = json.loads(line)
            out.write(json.dumps(runner.run(req["ids"], req["new_tokens"])) + "\n")
        return 0
    with open(args.ids_file) as f:
        ids = json.load(f)
    runner.run(ids, args.new_tokens)  # warm-up
    runs = [runner.run(ids, args.new_tokens) for _ in range(args.runs)]
    out.write(json.dumps({"info": runner.info, "timing": "wall-clock around Llama.eval + argmax; llama_perf alongside",
                          "runs": runs}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

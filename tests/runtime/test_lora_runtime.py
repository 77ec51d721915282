"""Multi-LoRA through the exported graph: a Llama bundle exported with LoRA slots, PEFT adapters made locally and
added with `kvforge lora add`, run on ONNX Runtime (packed cache and the bundle's own attention) and on Torch,
against PEFT's merged models (the oracle); rows of one batch with different adapters; the slots fed no adapter
against the bundle exported without slots."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from kvforge import runtime
from kvforge.adapters import list_adapters
from kvforge.bundle import Bundle
from kvforge.cli import main
from kvforge.errors import KvforgeError
from kvforge.export import export

from ..conftest import make_hf_model, make_peft_adapter
from ..derived_checks import assert_altered_adapter_is_caught, assert_derived, assert_every_file_hashed

ATOL = 1e-4
HF = dict(vocab_size=4096)  # the test Llama with tiny's tokenizer (4096 tokens), so that text prompts work
RANKS = {"a2": 2, "a4": 4, "a6": 6}  # adapter name -> its rank; the slots' max rank is 8
PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 120, 64], [200, 1, 33, 12, 90], [15, 250, 7]]


def _peft(rank: int, path, seed: int, targets="all-linear"):
    """A PEFT adapter of the llama test model with random A and B, saved at `path`; returns the merged model."""
    return make_peft_adapter(make_hf_model("llama", **HF), path, seed, r=rank, lora_alpha=rank + 3,
                             target_modules=targets)


@pytest.fixture(scope="module")
def lora_bundle(tmp_path_factory):
    """(bundle with slots and three adapters added, merged PEFT models by adapter name, work directory); the same
    checkpoint's bundle without slots is root/plain."""
    import shutil

    from kvforge.model_defs.checkpoint import trained_dir

    root = tmp_path_factory.mktemp("lora")
    make_hf_model("llama", **HF).save_pretrained(root / "hf", safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(trained_dir("tiny") / name, root / "hf" / name)
    export(root / "hf", root / "plain")
    bundle = export(root / "hf", root / "slots", lora_max_rank=8)
    for peer in ("onnxruntime_genai", "optimum"):  # they would not feed the slots: said, not written as runnable
        assert bundle.manifest["ecosystem"][peer]["config"] is None
        assert "LoRA slots" in bundle.manifest["ecosystem"][peer]["reason"]
    merged = {}
    for i, (name, rank) in enumerate(RANKS.items()):
        merged[name] = _peft(rank, root / f"peft-{name}", seed=i)
        result = CliRunner().invoke(main, ["lora", "add", str(bundle.path), str(root / f"peft-{name}"), "--name", name])
        assert result.exit_code == 0, result.output
    return bundle, merged, root


def _logits(session, prompt, adapter=None):
    logits, _ = session.forward(np.asarray([prompt], np.int64), adapters=None if adapter is None else [adapter])
    return logits[0]


@pytest.mark.parametrize("options", [{}, {"attention": "graph"}, {"backend": "torch"}], ids=["packed", "graph", "torch"])
def test_an_adapter_gives_pefts_merged_logits(lora_bundle, options):
    bundle, merged, _ = lora_bundle
    with runtime.load(bundle.path, **options) as session:
        session.forward(np.asarray([PROMPTS[0]], np.int64))
        assert getattr(session.backend, "packed", False) == (options == {})  # the ORT variant's GroupQueryAttention takes the slots too
        for name, model in merged.items():
            expected = model(torch.tensor([PROMPTS[0]])).logits[0].detach().numpy()
            got = _logits(session, PROMPTS[0], name)
            assert np.abs(got - expected).max() < ATOL, name
        base = make_hf_model("llama", **HF)(torch.tensor([PROMPTS[0]])).logits[0].detach().numpy()
        assert np.abs(_logits(session, PROMPTS[0]) - base).max() < ATOL
        assert np.abs(_logits(session, PROMPTS[0], "a4") - base).max() > 100 * ATOL


def test_the_slots_fed_no_adapter_are_the_bundle_without_slots(lora_bundle):
    bundle, _, root = lora_bundle
    with runtime.load(bundle.path) as slots, runtime.load(root / "plain") as plain:
        for prompt in PROMPTS:
            assert np.abs(_logits(slots, prompt) - _logits(plain, prompt)).max() < 1e-5
        assert slots.generate(PROMPTS[1], max_new_tokens=12).tokens == plain.generate(PROMPTS[1], max_new_tokens=12).tokens
        with pytest.raises(KvforgeError, match="has no LoRA slots"):
            plain.generate(PROMPTS[1], max_new_tokens=2, adapter="a2")


def test_a_batch_mixes_adapters_and_equals_each_row_alone(lora_bundle):
    """One forward of four rows (three adapters and none), and the continuous batcher with the four requests at
    once, equal each row run alone."""
    bundle, _, _ = lora_bundle
    adapters = ["a2", "a4", "a6", None]
    with runtime.load(bundle.path) as session:
        alone = [session.generate(p, max_new_tokens=10, ignore_eos=True, adapter=a) for p, a in zip(PROMPTS, adapters)]
        width = max(map(len, PROMPTS))
        ids = np.array([[0] * (width - len(p)) + p for p in PROMPTS], np.int64)
        mask = np.array([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS], np.int64)
        logits, _ = session.forward(ids, mask, adapters=adapters, last_logits_only=True)
        for i, (p, a) in enumerate(zip(PROMPTS, adapters)):
            assert np.abs(logits[i, -1] - _logits(session, p, a)[-1]).max() < ATOL
        with runtime.Batcher(session, max_batch=4) as batcher:
            requests = [batcher.submit(p, max_new_tokens=10, ignore_eos=True, adapter=a) for p, a in zip(PROMPTS, adapters)]
            together = [r.result(timeout=120) for r in requests]
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    assert len({tuple(r.tokens) for r in alone}) == 4  # the adapters made the rows differ


def test_an_adapter_added_replaced_or_removed_while_a_session_runs_is_served_as_the_bundle_has_it(lora_bundle, tmp_path):
    bundle, merged, root = lora_bundle
    with runtime.load(bundle.path) as session:
        expected = session.generate(PROMPTS[2], max_new_tokens=8, ignore_eos=True, adapter="a6").tokens
        with pytest.raises(KvforgeError, match=r"has no adapter 'nope'; it has \['a2', 'a4', 'a6'\]"):
            session.generate(PROMPTS[2], max_new_tokens=2, adapter="nope")
        late = _peft(3, tmp_path / "late", seed=11, targets=["q_proj", "v_proj"])
        add = CliRunner().invoke(main, ["lora", "add", str(bundle.path), str(tmp_path / "late"), "--name", "late"])
        assert add.exit_code == 0, add.output
        first_sha = _recorded(bundle, "late")
        assert first_sha is not None
        expected_late = late(torch.tensor([PROMPTS[3]])).logits[0].detach().numpy()
        assert np.abs(_logits(session, PROMPTS[3], "late") - expected_late).max() < ATOL  # served without a restart
        first_tokens = session.generate(PROMPTS[3], max_new_tokens=6, ignore_eos=True, adapter="late").tokens
        # replaced under the same name: the next request that names it is served the new weights
        newer = _peft(5, tmp_path / "newer", seed=12, targets=["k_proj", "down_proj"])
        force = CliRunner().invoke(main, ["lora", "add", str(bundle.path), str(tmp_path / "newer"), "--name", "late", "--force"])
        assert force.exit_code == 0, force.output
        assert _recorded(bundle, "late") not in (None, first_sha)
        with torch.no_grad():
            ids = list(PROMPTS[3])
            for _ in range(6):
                ids.append(int(newer(torch.tensor([ids])).logits[0, -1].argmax()))
        replaced_tokens = session.generate(PROMPTS[3], max_new_tokens=6, ignore_eos=True, adapter="late").tokens
        assert replaced_tokens == ids[len(PROMPTS[3]):] and replaced_tokens != first_tokens
        expected_newer = newer(torch.tensor([PROMPTS[3]])).logits[0].detach().numpy()
        assert np.abs(_logits(session, PROMPTS[3], "late") - expected_newer).max() < ATOL
        removed = CliRunner().invoke(main, ["lora", "remove", str(bundle.path), "late"])
        assert removed.exit_code == 0 and "late" not in [a.name for a in list_adapters(bundle)]
        assert _recorded(bundle, "late") is None
        with pytest.raises(KvforgeError, match=r"has no adapter 'late'"):  # refused to new requests at once
            session.generate(PROMPTS[3], max_new_tokens=2, adapter="late")
    with runtime.load(bundle.path) as session:
        again = session.generate(PROMPTS[2], max_new_tokens=8, ignore_eos=True, adapter="a6").tokens
    assert again == expected
    listing = CliRunner().invoke(main, ["lora", "list", str(bundle.path), "--json"])
    assert [json.loads(line)["name"] for line in listing.output.splitlines()] == sorted(RANKS)
    assert {json.loads(line)["name"]: json.loads(line)["rank"] for line in listing.output.splitlines()} == RANKS


def _recorded(bundle, name: str) -> str | None:
    """The sha256 the bundle's manifest records for adapter `name`'s weights (None: it lists no such file), after
    checking that the manifest lists and hashes every file of the bundle."""
    now = Bundle(bundle.path)
    assert_every_file_hashed(now)
    return now.manifest["files"].get(f"adapters/{name}/adapter.safetensors", {}).get("sha256")


def test_lora_add_records_each_adapters_files_in_the_manifest(lora_bundle, tmp_path):
    """`kvforge lora add` leaves the manifest listing and hashing the files it wrote (kvforge/adapters.py
    record_adapters), so the full check passes, and catches an adapter altered afterwards (in a copy)."""
    import shutil

    bundle, _, _ = lora_bundle
    for adapter in list_adapters(bundle):  # the manifest's hash is the one adapter.json records
        assert adapter.sha256 is not None and _recorded(bundle, adapter.name) == adapter.sha256
    shutil.copytree(bundle.path, tmp_path / "copy")
    assert_altered_adapter_is_caught(Bundle(tmp_path / "copy"), "a2")


def test_calibrate_keeps_the_adapters_and_hashes_them_with_every_other_file(lora_bundle, tmp_path):
    """`kvforge calibrate` of a bundle with adapters: the calibrated bundle holds them byte for byte, listed and
    hashed with every other file (kvforge/derived.py write_derived), its lineage the float one's plus calibrate;
    the runtime lists and serves them from it with no adapter added again; one altered afterwards fails the full
    check, naming the file."""
    bundle, _, _ = lora_bundle
    result = CliRunner().invoke(main, ["calibrate", str(bundle.path), "-o", str(tmp_path / "int8"), "--precision",
                                       "int8", "--random-data", "--samples", "4", "--seq-len", "32", "--quiet"])
    assert result.exit_code == 0, result.output
    int8 = Bundle(tmp_path / "int8")
    assert int8.quantization_format == "int8"
    assert_derived(bundle, int8, "calibrate")
    assert [(a.name, a.sha256) for a in list_adapters(int8)] == [(a.name, a.sha256) for a in list_adapters(bundle)]
    # served from the calibrated bundle, the adapter moves its logits as it moves the float bundle's (within INT8's
    # error on 4 random samples, about 0.3; no adapter, or another one, is an error of 1 or more)
    with runtime.load(int8.path) as session:
        moved = _logits(session, PROMPTS[0], "a4") - _logits(session, PROMPTS[0])
    with runtime.load(bundle.path) as session:
        float_moved = _logits(session, PROMPTS[0], "a4") - _logits(session, PROMPTS[0])
    error = np.linalg.norm(moved - float_moved) / np.linalg.norm(float_moved)
    assert error < 0.5 and np.abs(float_moved).max() > 100 * ATOL, error
    assert_altered_adapter_is_caught(int8, "a4")


def test_bad_adapters_change_nothing(lora_bundle, tmp_path):
    bundle, _, root = lora_bundle
    _peft(8, tmp_path / "ok", seed=5)
    before = sorted(a.name for a in list_adapters(bundle))
    files = {p: p.stat().st_mtime_ns for p in Bundle(bundle.path).path.iterdir() if p.is_file()}
    for args, message in [
        ([str(bundle.path), str(tmp_path / "ok"), "--name", "a2"], "already has an adapter 'a2'"),
        ([str(root / "plain"), str(tmp_path / "ok"), "--name", "x"], "has no LoRA slots"),
        ([str(bundle.path), str(root / "slots"), "--name", "x"], "has no adapter_config.json"),
        ([str(bundle.path), str(tmp_path / "ok"), "--name", "../x"], "adapter name"),
    ]:
        result = CliRunner().invoke(main, ["lora", "add", *args])
        assert result.exit_code != 0 and message in result.output, (args, result.output)
    assert sorted(a.name for a in list_adapters(bundle)) == before
    assert {p: p.stat().st_mtime_ns for p in Bundle(bundle.path).path.iterdir() if p.is_file()} == files


@pytest.mark.parametrize("precision", ["int8", "fp8", "int4"])
def test_a_quantized_base_with_an_adapter_passes_compare_against_the_reference_with_it_merged(lora_bundle, tmp_path,
                                                                                               precision):
    """The slotted bundle calibrated to INT8, FP8 or INT4 weight-only (the adapters stay float inputs, and the
    calibrated bundle keeps the float one's): `compare` against the Torch reference with the adapter merged into its weights passes INT8's
    tolerances, and for each precision agrees with it as well as the base without the adapter agrees with the plain
    reference; the FP32 bundle
    with the adapter matches the merged reference to FP32's tolerances (the merge computes the adapter another way;
    unmerged, the adapter moves the logits far beyond them: test_an_adapter_gives_pefts_merged_logits)."""
    from kvforge.calibration import calibrate
    from kvforge.verify.compare import compare

    bundle, _, _ = lora_bundle
    int8 = calibrate(bundle.path, tmp_path / precision, precision=precision, random_data=True)
    assert int8.manifest["io"]["extra"]["lora"] == bundle.manifest["io"]["extra"]["lora"]
    # calibrate carried the adapters (none is added again here)
    assert [a.name for a in list_adapters(int8)] == [a.name for a in list_adapters(bundle)]
    options = dict(random_data=True, steps=8, prompts=2, max_tokens=256, seq_len=64)
    quantized = compare(int8.path, adapter="a4", **options)
    if precision == "int8":
        assert quantized.passed, quantized.result["failures"]
    # FP8 and INT4 of this random-weight model miss their own tolerances already without an adapter (its flat
    # logits flip near-ties); what is asked of the adapter is to add no error of its own: the base against
    # the merged reference agrees as well as the base alone against the plain reference
    plain = compare(int8.path, **options)
    assert quantized.result["top1_agreement"] >= plain.result["top1_agreement"] - 0.05, (quantized.result, plain.result)
    float_slots = compare(bundle.path, adapter="a4", **options)
    assert float_slots.passed and float_slots.result["greedy_agreement"] == 1.0, float_slots.result["failures"]
    assert "with adapter a4 merged" in float_slots.result["reference"]
    with pytest.raises(KvforgeError, match="has no adapter 'zz'"):
        compare(bundle.path, adapter="zz", **options)


def test_kvforge_generate_adapter_streams_what_session_generate_gives(lora_bundle):
    bundle, _, _ = lora_bundle
    with runtime.load(bundle.path) as session:
        expected = session.generate("def add(a, b):", max_new_tokens=8, ignore_eos=True, adapter="a4").tokens
        base = session.generate("def add(a, b):", max_new_tokens=8, ignore_eos=True).tokens
    result = CliRunner().invoke(main, ["generate", str(bundle.path), "--prompt", "def add(a, b):", "--max-new-tokens",
                                       "8", "--adapter", "a4", "--json"])
    assert result.exit_code == 0, result.output
    got = json.loads(result.output.strip().splitlines()[-1])["tokens"]
    assert got[:len(expected)] == expected and expected != base


def test_the_openai_api_serves_adapters_as_models_and_lists_one_added_while_it_runs(lora_bundle, tmp_path):
    """GET /v1/models lists `slots:NAME` per adapter; a completion naming one equals Session.generate with it; an
    adapter added while the server runs is listed and served; an unknown one is a 404 (official openai client)."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from kvforge.serving.kinds import Service
    from kvforge.serving.openai_app import OpenAIServer

    bundle, _, _ = lora_bundle
    prompt = "def add(a, b):"
    with runtime.load(bundle.path) as session:
        expected = {a: session.generate(prompt, max_new_tokens=8, adapter=a).text for a in (None, "a2", "a6")}
        service = Service(session, bundle.kind, runtime.BatchOptions(max_batch=4))
        server = OpenAIServer(lambda: service, "slots").start()
        try:
            client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
            assert [m.id for m in client.models.list().data] == ["slots", "slots:a2", "slots:a4", "slots:a6"]
            for adapter, text in expected.items():
                model = "slots" if adapter is None else f"slots:{adapter}"
                out = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
                assert out.choices[0].text == text, adapter
            _peft(2, tmp_path / "new", seed=21)
            assert CliRunner().invoke(main, ["lora", "add", str(bundle.path), str(tmp_path / "new"), "--name", "new"]).exit_code == 0
            assert "slots:new" in [m.id for m in client.models.list().data]
            with_new = client.completions.create(model="slots:new", prompt=prompt, max_tokens=8, temperature=0)
            assert with_new.choices[0].text == session.generate(prompt, max_new_tokens=8, adapter="new").text
            with pytest.raises(openai.NotFoundError, match="slots:gone"):
                client.completions.create(model="slots:gone", prompt=prompt, max_tokens=4)
        finally:
            server.stop()
            service.close()
            CliRunner().invoke(main, ["lora", "remove", str(bundle.path), "new"])


def test_the_engine_plan_gains_the_lora_inputs_with_profiles_over_their_width(lora_bundle):
    """`kvforge build --dry-run` (no TensorRT here): both profiles size lora_mask and every slot's A and B from one
    column (no adapter) up to every row its own adapter at the max rank, and shape inference passes at every
    corner."""
    bundle, _, _ = lora_bundle
    result = CliRunner().invoke(main, ["build", str(bundle.path), "--dry-run", "--json", "--max-batch", "4",
                                       "--max-context", "64", "--opt-context", "16"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    slot = next(iter(bundle.manifest["io"]["extra"]["lora"]["slots"]))
    fan_in = bundle.manifest["io"]["extra"]["lora"]["slots"][slot][0]
    for profile in plan["profiles"]:
        assert profile["shapes"]["lora_mask"] == {"min": [1, 1], "opt": [1, 8], "max": [4, 32]}
        assert profile["shapes"][f"lora.{slot}.a"] == {"min": [fan_in, 1], "opt": [fan_in, 8], "max": [fan_in, 32]}
    assert plan["shape_check"]["points"] == 6 and plan["lint"]["passed"]


@pytest.mark.slow  # a Qwen2-MoE structure with adapter slots no other test traces (21 s); the default tier keeps
# adapters through the exported graph on the dense designs above
def test_a_mixtures_experts_take_adapters_through_the_exported_graph(tmp_path):
    """Qwen2-MoE exported with slots on its routed experts (opt-in) and its shared expert: a PEFT adapter of the
    fused experts (target_parameters), added with `kvforge lora add`, gives PEFT's merged logits on ONNX Runtime
    for the row that takes it, while the other row's tokens (routed through the same experts) stay the base's."""
    import shutil

    from kvforge.model_defs.checkpoint import trained_dir


    make_hf_model("qwen2_moe", vocab_size=4096).save_pretrained(tmp_path / "hf", safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(trained_dir("tiny") / name, tmp_path / "hf" / name)
    merged = make_peft_adapter(make_hf_model("qwen2_moe", vocab_size=4096), tmp_path / "peft", seed=4, r=3,
                               lora_alpha=6, target_modules=["q_proj", "down_proj"],
                               target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    base = make_hf_model("qwen2_moe", vocab_size=4096).eval()
    bundle = export(tmp_path / "hf", tmp_path / "bundle", lora_max_rank=4,
                    lora_targets=["q", "v", "down", "experts.gate", "experts.up", "experts.down"])
    assert bundle.manifest["io"]["extra"]["lora"]["targets"] == ["down", "experts.down", "experts.gate", "experts.up",
                                                                 "q", "v"]
    add = CliRunner().invoke(main, ["lora", "add", str(bundle.path), str(tmp_path / "peft"), "--name", "moe"])
    assert add.exit_code == 0, add.output
    prompts = np.asarray([PROMPTS[0][:5], PROMPTS[2]], np.int64)
    with runtime.load(bundle.path) as session, torch.no_grad():
        logits, _ = session.forward(prompts, adapters=["moe", None])
        expected = merged(torch.from_numpy(prompts[:1])).logits[0].numpy()
        plain = base(torch.from_numpy(prompts[1:])).logits[0].numpy()
    assert np.abs(logits[0] - expected).max() < ATOL
    assert np.abs(logits[1] - plain).max() < ATOL
    assert np.abs(expected - base(torch.from_numpy(prompts[:1])).logits[0].detach().numpy()).max() > 100 * ATOL


def test_kvforge_serve_on_triton_takes_adapters_by_input_and_by_openai_model_name(lora_bundle):
    """The real Triton server (kvforge serve's repository) over the slotted bundle: the generate endpoint's
    `adapter` input and the OpenAI front in its process (`slots:NAME`) each give Session.generate's text with
    that adapter; an unknown adapter is a 400 naming it."""
    import urllib.error
    import urllib.request

    openai = pytest.importorskip("openai")
    serving = pytest.importorskip("kvforge.serving")
    from kvforge.errors import MissingDependencyError
    from kvforge.serving.server import free_port

    try:
        serving.triton_distribution()
    except MissingDependencyError as e:
        pytest.skip(f"needs the serve extra: {e}")
    bundle, _, root = lora_bundle
    prompt = "def add(a, b):"
    with runtime.load(bundle.path) as session:
        expected = {a: session.generate(prompt, max_new_tokens=6, adapter=a).text for a in (None, "a4", "a6")}
    assert len(set(expected.values())) == 3  # each adapter changes the text, so each answer shows which one ran
    port = free_port()
    repo = serving.write_repository(bundle.path, root / "repo", model_name="slots", openai_port=port)
    with serving.TritonServer(repo, http_port=0, grpc_port=0, metrics_port=0) as server:
        def generate(body):
            req = urllib.request.Request(server.url("/v2/models/slots/generate"), data=json.dumps(body).encode())
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())
        for adapter, text in expected.items():
            body = {"text_input": prompt, "max_tokens": 6, **({"adapter": adapter} if adapter else {})}
            status, answer = generate(body)
            assert status == 200 and answer["text_output"] == text, (adapter, answer)
        status, answer = generate({"text_input": prompt, "max_tokens": 2, "adapter": "nope"})
        assert status == 400 and "has no adapter 'nope'" in answer["error"]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["slots", "slots:a2", "slots:a4", "slots:a6"]
        for adapter in ("a4", "a6"):
            out = client.completions.create(model=f"slots:{adapter}", prompt=prompt, max_tokens=6, temperature=0)
            assert out.choices[0].text == expected[adapter]
